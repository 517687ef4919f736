//! `tessera run`: the README's main job, its outputs, and the plans it must refuse.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::README_TINY_LAYOUT;

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .expect("tessera runs")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-run-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn plan_tiny(dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join("plan.json");
    let mut args = vec![
        "plan",
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-o", out.to_str().unwrap()]);
    let o = tessera(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

#[test]
fn the_readme_job_trains_on_8_cpu_ranks_and_the_loss_falls() {
    let dir = temp_dir("readme");
    let plan = plan_tiny(
        &dir,
        &[
            "--no-sp",
            "--micro-batch",
            "2",
            "--schedule",
            "1f1b",
            "--zero",
            "1",
        ],
    );
    let metrics = dir.join("m.jsonl");
    let trace = dir.join("trace.json");
    let o = tessera(&[
        "run",
        plan.to_str().unwrap(),
        "--steps",
        "20",
        "--metrics",
        metrics.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("on 8 CPU ranks"), "{stdout}");
    assert!(
        stdout.contains("measured MiB"),
        "memory per rank is reported: {stdout}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 20, "one JSON line per step");
    for key in ["step", "loss", "step_time_s", "tokens_per_s"] {
        assert!(lines[0].get(key).is_some(), "metrics carry {key}");
    }
    let first = lines[0]["loss"].as_f64().unwrap();
    let last = lines[19]["loss"].as_f64().unwrap();
    // A uniform guess over 256 bytes costs ln 256 = 5.545; the model must learn well below it.
    assert!(
        first > 5.0 && last < first - 1.0,
        "loss falls clearly: {first} → {last}"
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let ranks: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks.len(), 8, "a track per rank");
    assert!(
        events.iter().any(|e| e["name"] == "F0.0"),
        "forward ops are named by micro-batch and chunk"
    );
    // The planner's predicted timeline is in the same format, one track per pipeline stage,
    // with the same op names as one step of the measured one.
    let predicted = dir.join("predicted.json");
    let mut args = vec!["plan"];
    args.extend_from_slice(README_TINY_LAYOUT);
    args.extend(["--trace", predicted.to_str().unwrap()]);
    let o = tessera(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&predicted).unwrap()).unwrap();
    let names = |evs: &[serde_json::Value], track: u64| -> Vec<String> {
        evs.iter()
            .filter(|e| {
                e["ph"] == "X"
                    && e["tid"] == track
                    && e["args"]["step"] == 0
                    && e["cat"] != "optimizer"
            })
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect()
    };
    let pe = p["traceEvents"].as_array().unwrap();
    assert!(!names(pe, 0).is_empty());
    assert_eq!(
        names(pe, 0),
        names(events, 0),
        "stage 0 predicted = rank 0 executed, op for op"
    );
    assert_eq!(
        names(pe, 1),
        names(events, 4),
        "stage 1 predicted = rank 4 (stage 1) executed"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_gpu_plan_is_refused_with_what_it_needs() {
    let dir = temp_dir("gpu");
    let plan = dir.join("gpu.json");
    let o = tessera(&[
        "plan",
        "specs/models/gpt2-124m.toml",
        "specs/clusters/dgx-a100-80g.toml",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let o = tessera(&["run", plan.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("CUDA") && err.contains("fix:") && err.contains("A100"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sequence_parallel_plans_run_and_missing_data_is_refused() {
    let dir = temp_dir("refuse");
    let plan = plan_tiny(&dir, &["--sp", "--micro-batch", "2", "--schedule", "1f1b"]);
    let o = tessera(&["run", plan.to_str().unwrap(), "--steps", "2"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("over 2 steps"), "{out}");
    let plan = plan_tiny(
        &dir,
        &["--no-sp", "--micro-batch", "2", "--schedule", "1f1b"],
    );
    let o = tessera(&["run", plan.to_str().unwrap(), "--data", "no/such/file.txt"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no/such/file.txt"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `tessera run ARGS` from the folder `cwd` (the binary's own path, not the repository).
fn tessera_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(cwd)
        .args(args)
        .output()
        .expect("tessera runs")
}

#[test]
fn the_default_data_does_not_depend_on_the_working_directory() {
    let dir = temp_dir("default-data");
    let plan = plan_tiny(&dir, &["--no-sp", "--micro-batch", "2"]);
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let o = tessera_in(&elsewhere, &["run", plan.to_str().unwrap(), "--steps", "2"]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(!err.contains("the path passed to --data"), "{err}");
    assert!(
        out.contains("examples/data/parallelism.txt") && out.contains("--data"),
        "{out}"
    );
    assert!(out.contains("over 2 steps"), "{out}");
    // The same losses as the file itself, named with --data.
    let o2 = tessera(&[
        "run",
        plan.to_str().unwrap(),
        "--steps",
        "2",
        "--data",
        "examples/data/parallelism.txt",
    ]);
    let out2 = String::from_utf8_lossy(&o2.stdout);
    let loss = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("loss "))
            .map(str::to_string)
    };
    assert_eq!(loss(&out), loss(&out2), "{out2}");
    // A --data that does not exist still names the path it was given.
    let o = tessera_in(
        &elsewhere,
        &["run", plan.to_str().unwrap(), "--data", "missing.txt"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("missing.txt") && err.contains("--data"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn flags_the_chosen_backend_would_ignore_are_refused() {
    let dir = temp_dir("ignored-flags");
    let plan = plan_tiny(&dir, &["--no-sp", "--micro-batch", "2"]);
    let p = plan.to_str().unwrap();
    for value in ["nccl", "staged", "auto"] {
        let o = tessera(&["run", p, "--steps", "1", "--collectives", value]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--collectives {value}: {err}");
        for part in ["--collectives", value, "CPU", "fix:"] {
            assert!(
                err.contains(part),
                "--collectives {value}: lacks {part}: {err}"
            );
        }
    }
    // The CPU backend on a plan for GPUs: said, not silently swapped for CUDA.
    let gpu = dir.join("gpu.json");
    let o = tessera(&[
        "plan",
        "specs/models/gpt2-124m.toml",
        "specs/clusters/dgx-a100-80g.toml",
        "-o",
        gpu.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let o = tessera(&["run", gpu.to_str().unwrap(), "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--backend cpu") && err.contains("fix:"),
        "{err}"
    );
    // The launcher's test hook outside a launcher.
    let o = tessera(&["run", p, "--steps", "1", "--fail-rank", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--fail-rank"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
