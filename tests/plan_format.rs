//! plan.json: the committed JSON Schema matches the Rust types, and plans round-trip.
//!
//! Regenerate the schema with `TESSERA_UPDATE_SCHEMA=1 cargo test --test plan_format`.

use std::path::Path;
use std::process::Command;

use tessera_planner::plan::{Plan, FORMAT};
use tessera_planner::source::Source;

#[test]
fn committed_schema_matches_the_types() {
    let schema = serde_json::to_string_pretty(&schemars::schema_for!(Plan)).unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/plan.schema.json");
    if std::env::var_os("TESSERA_UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &schema).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == schema,
        "docs/plan.schema.json is stale: regenerate it with TESSERA_UPDATE_SCHEMA=1 cargo test --test plan_format"
    );
}

#[test]
fn plan_round_trips_through_json() {
    let dir = std::env::temp_dir().join(format!("tessera-roundtrip-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let status = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "plan",
            "specs/models/gpt3-175b.toml",
            "specs/clusters/dgx-a100-80g.toml",
            "--nodes",
            "128",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    let plan = Plan::parse(&Source::from_text(&out, text.clone())).unwrap();
    assert_eq!(plan.format, FORMAT);
    assert_eq!(plan.parallel.dp * plan.parallel.tp * plan.parallel.pp, 1024);
    assert_eq!(
        plan.to_json(),
        text,
        "serialising a parsed plan gives the same document"
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["job"]["parameters"], 174_615_846_912u64);
    let peak = v["predicted"]["memory"]["peak_bytes"].as_u64().unwrap();
    let max_stage = v["predicted"]["memory"]["per_stage"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["total_bytes"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(
        peak, max_stage,
        "peak_bytes is the largest per-GPU total over all stages"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn json_output_is_the_same_document_as_the_file() {
    let dir = std::env::temp_dir().join(format!("tessera-same-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let run = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--format",
            "json",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success());
    assert_eq!(
        String::from_utf8(run.stdout).unwrap(),
        std::fs::read_to_string(&out).unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A pipeline whose head is heavy (Llama 3 8B: the 128K-vocabulary output layer costs about two
/// transformer layers) gets fewer layers on its last stage; the uneven plan reads back, and a
/// plan whose chunks leave a gap is refused.
#[test]
fn uneven_stage_split_round_trips_and_gaps_are_refused() {
    let dir = std::env::temp_dir().join(format!("tessera-uneven-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("plan.json");
    let run = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "plan",
            "specs/models/llama3-8b.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--tp",
            "2",
            "--pp",
            "4",
            "--dp",
            "1",
            "--schedule",
            "1f1b",
            "--format",
            "json",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    let plan = Plan::parse(&Source::from_text(&out, text.clone())).unwrap();
    let layers: Vec<u64> = plan
        .stages
        .iter()
        .map(|s| s.chunks[0].layers[1] - s.chunks[0].layers[0])
        .collect();
    assert_eq!(layers.iter().sum::<u64>(), 32);
    assert!(
        layers[3] < layers[0],
        "the head's stage should hold fewer layers: {layers:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let step = v["predicted"]["step_time_s"].as_f64().unwrap();
    let sum: f64 = v["predicted"]["breakdown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["seconds"].as_f64().unwrap())
        .sum();
    assert!(
        (sum - step).abs() <= 1e-9 * step,
        "terms {sum} vs step {step}"
    );
    // Open a gap between stage 0 and stage 1.
    let mut damaged = v.clone();
    let start = damaged["stages"][1]["chunks"][0]["layers"][0]
        .as_u64()
        .unwrap();
    damaged["stages"][1]["chunks"][0]["layers"][0] = (start + 1).into();
    let text = serde_json::to_string_pretty(&damaged).unwrap();
    let err = Plan::parse(&Source::from_text(&out, text)).unwrap_err();
    assert_eq!(err.field, "stages", "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
