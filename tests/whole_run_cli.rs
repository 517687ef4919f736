//! The whole run on the command line (issue 40): `plan --tokens`/`--steps` prints and writes the
//! budget, interruptions and cadence; `run` takes its steps from the budget; `run --save-every
//! auto` saves at the plan's interval, and is refused where the cluster spec lacks the tables.

mod common;

use common::{plan_file, refused, run, s, Scratch, README_TINY_LAYOUT};

/// cpu-8 with `[reliability]`, `[storage]` and `[cost]` tables whose values make the tiny
/// model's recommended interval a few steps: a save of its 2.78 MiB at 5.83 GB/s is about
/// 0.5 ms, the job's 8 ranks are interrupted every 0.0025 × 3600 / 8 = 1.1 s, and Daly's
/// interval is then a few predicted steps of 0.016 s.
fn cluster_with_tables(dir: &Scratch) -> String {
    let text = std::fs::read_to_string(common::root().join("specs/clusters/cpu-8.toml")).unwrap()
        + "\n[reliability]\ngpu_mtbf_hours = 0.0025\nrestart_minutes = 0\n\n[storage]\nwrite_gbps = 5.83\n\n[cost]\nusd_per_gpu_hour = 2.5\n";
    let path = dir.path("cpu-8-tables.toml");
    std::fs::write(&path, text).unwrap();
    s(&path)
}

fn tiny_args(cluster: &str) -> Vec<&str> {
    let mut a = vec![README_TINY_LAYOUT[0], cluster];
    a.extend_from_slice(&README_TINY_LAYOUT[2..]);
    a
}

#[test]
fn save_every_auto_saves_at_the_plans_interval_over_the_budgets_steps() {
    let dir = Scratch::new();
    let cluster = cluster_with_tables(&dir);
    let mut args = tiny_args(&cluster);
    args.extend(["--steps", "7"]);
    let plan = plan_file(&dir, "plan.json", &args);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let p = &json["predicted"];
    // tiny's global batch 16 × sequence 64 = 1024 tokens per step: 7 steps are 7168 tokens.
    assert_eq!(json["job"]["model"]["training"]["tokens"], 7168);
    assert_eq!(p["whole_run"]["steps"], 7);
    let every = p["checkpoint"]["save_every"].as_u64().expect("a cadence");
    assert!(
        (2..7).contains(&every),
        "the test's tables should give an interval of a few steps, got {every}"
    );
    assert!(p["whole_run"]["cost_usd"].as_f64().unwrap() > 0.0);
    // No --steps: the budget's 7.
    let ck = dir.path("ck");
    let r = run(&[
        "run",
        &s(&plan),
        "--save-dir",
        &s(&ck),
        "--save-every",
        "auto",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let mut saved: Vec<u64> = std::fs::read_dir(&ck)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_prefix("step-").map(|n| n.parse().unwrap())
        })
        .collect();
    saved.sort();
    let mut want: Vec<u64> = (1..=7).filter(|s| s % every == 0).collect();
    if want.last() != Some(&7) {
        want.push(7);
    }
    assert_eq!(saved, want, "saves every {every} steps and after the last");
}

#[test]
fn plan_prints_the_whole_run_and_refuses_two_budgets() {
    let dir = Scratch::new();
    let cluster = cluster_with_tables(&dir);
    let mut args = vec!["plan"];
    args.extend(tiny_args(&cluster));
    args.extend(["--tokens", "2M"]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // 2,000,000 / 1024 = 1953.125: 1,954 steps.
    for part in [
        "whole run: 2M tokens = 1,954 steps of 1,024 tokens",
        "interruptions: one every",
        "checkpoint: a save writes",
        "goodput",
        "at $2.5/GPU-hour",
    ] {
        assert!(r.stdout.contains(part), "no `{part}` in:\n{}", r.stdout);
    }
    args.extend(["--steps", "10"]);
    refused(&run(&args), &["--steps", "--tokens and --steps both set"]);
}

#[test]
fn save_every_auto_names_the_missing_table() {
    let dir = Scratch::new();
    let plan = common::tiny_plan(&dir);
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "2",
        "--save-dir",
        &s(&dir.path("ck")),
        "--save-every",
        "auto",
    ]);
    refused(
        &r,
        &["--save-every auto", "[reliability] and [storage]", "cpu-8"],
    );
    assert!(
        !dir.path("ck").exists(),
        "nothing written before the refusal"
    );
    let r = run(&["run", &s(&plan), "--save-dir", "x", "--save-every", "often"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("nor `auto`"), "{}", r.stderr);
}

#[test]
fn calibrate_storage_writes_the_measured_table_that_plan_reads() {
    let dir = Scratch::new();
    let out = dir.path("measured.toml");
    let folder = dir.path("ckpt-fs");
    std::fs::create_dir(&folder).unwrap();
    let r = run(&[
        "calibrate",
        "--storage",
        &s(&folder),
        "specs/clusters/dgx-h100-80g.toml",
        "-o",
        &s(&out),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let text = std::fs::read_to_string(&out).unwrap();
    let headers = text.lines().filter(|l| l.starts_with("[storage]")).count();
    assert_eq!(headers, 1, "one table: {text}");
    assert!(
        !text.contains("write_gbps = 0.98"),
        "the preset's value replaced"
    );
    // The probe files are gone, and the spec plans, with a cadence from the measured rate.
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);
    let plan = plan_file(
        &dir,
        "p.json",
        &["specs/models/gpt2-124m.toml", &s(&out), "--devices", "8"],
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert!(json["predicted"]["checkpoint"]["save_s"].as_f64().unwrap() > 0.0);
    let r = run(&[
        "calibrate",
        "--storage",
        &s(&dir.path("missing")),
        "specs/clusters/dgx-h100-80g.toml",
    ]);
    refused(&r, &["--storage", "the write measurement failed"]);
}

/// The batch law through the budget: GPT-2 124M with 10B tokens. By hand, DeepSeek LLM's
/// M = 72·12·768² + 12·12·768·1024 = 622,854,144 FLOPs per token (the code counts each layer's
/// biases and norms too, 0.12% more), C = M·D = 6.229e18 FLOPs, inside the fitted 1e17..2e19:
/// B_opt = 0.2920·C^0.3271 = 410,229 tokens, η_opt = 0.3118·C^−0.125 = 1.395e-3. The spec's
/// 512 × 1024 = 524,288 tokens per step is inside [B_opt/2, 2·B_opt].
#[test]
fn the_budget_gives_the_batch_laws_values() {
    let r = run(&[
        "plan",
        "specs/models/gpt2-124m.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--devices",
        "8",
        "--tokens",
        "10B",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let line = r
        .stdout
        .lines()
        .find(|l| l.starts_with("batch-size law"))
        .unwrap_or_else(|| panic!("no law line:\n{}", r.stdout));
    let number_after = |key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches(',')
            .parse()
            .unwrap()
    };
    let b = number_after("B_opt ");
    assert!((b / 410_229.0 - 1.0).abs() < 0.005, "B_opt {b} in {line}");
    let lr = number_after("peak learning rate ");
    assert!((lr / 1.395e-3 - 1.0).abs() < 0.01, "lr {lr} in {line}");
    assert!(
        r.stdout.contains("C is within the fitted range"),
        "{}",
        r.stdout
    );
    assert!(
        !r.stdout.contains("warning: the global batch"),
        "{}",
        r.stdout
    );
}
