//! Real data across layouts: text tokenized by `tessera data prepare --tokenizer gpt2` into
//! llm.c shards (with a validation split), trained with `--eval-every` by a GPT-2-vocabulary
//! tiny model on 1 rank and on three parallel layouts. Every layout's training losses and
//! validation losses must equal the single rank's within the runtime's parity tolerance
//! (1e-5 relative, runtime/tests/parity.rs): the eval sequences and the global batch are the
//! same whatever the layout.

mod common;

use common::{bin, root, Scratch};
use std::path::Path;

/// One step's (loss, val_loss) from a `--metrics` file.
fn losses(path: &Path) -> Vec<(f64, Option<f64>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["loss"].as_f64().unwrap(), v["val_loss"].as_f64())
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs()
}

#[test]
fn train_and_val_losses_of_prepared_gpt2_shards_match_the_single_rank() {
    let s = Scratch::new();
    let data = s.path("shards");
    let docs: Vec<_> = [
        "README.md",
        "docs/checkpoints.md",
        "docs/cuda.md",
        "docs/plan.md",
    ]
    .iter()
    .map(|d| root().join(d))
    .collect();
    let out = bin()
        .args(["data", "prepare"])
        .args(&docs)
        .arg("-o")
        .arg(&data)
        .args(["--tokenizer", "gpt2", "--val-fraction", "0.2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "prepare: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let model = root().join("tests/fixtures/tiny-gpt2-vocab.toml");
    let cluster = root().join("specs/clusters/cpu-8.toml");
    // (devices, dp, pp, tp, micro-batch, zero): the reference first.
    let layouts = [
        ("1", "1", "1", "1", "2", "0"),
        ("2", "2", "1", "1", "1", "1"),
        ("4", "1", "2", "2", "1", "0"),
        ("4", "2", "2", "1", "1", "1"),
    ];
    let mut runs = Vec::new();
    for (i, (devices, dp, pp, tp, mb, zero)) in layouts.iter().enumerate() {
        let plan = s.path(&format!("plan-{i}.json"));
        let out = bin()
            .args(["plan"])
            .arg(&model)
            .arg(&cluster)
            .args(["--devices", devices, "--dp", dp, "--pp", pp, "--tp", tp])
            .args(["--micro-batch", mb, "--zero", zero, "--no-sp"])
            .args(["--recompute", "none", "--schedule", "1f1b", "-o"])
            .arg(&plan)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "plan {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let metrics = s.path(&format!("metrics-{i}.jsonl"));
        let out = bin()
            .arg("run")
            .arg(&plan)
            .args(["--steps", "4", "--eval-every", "2", "--data"])
            .arg(&data)
            .arg("--metrics")
            .arg(&metrics)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "run {i}: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("validation loss"),
            "run {i} reports its validation loss: {stdout}"
        );
        runs.push(losses(&metrics));
    }
    let reference = &runs[0];
    assert_eq!(reference.len(), 4, "one line per step");
    let evals: Vec<usize> = (0..4).filter(|&i| reference[i].1.is_some()).collect();
    assert_eq!(evals, vec![1, 3], "evaluated after steps 2 and 4");
    let first_val = reference[1].1.unwrap();
    // A GPT-2-vocabulary model starts near ln(50257) = 10.8 nats.
    assert!(
        (9.0..12.0).contains(&first_val),
        "val loss {first_val} is near ln(50257)"
    );
    for (i, run) in runs.iter().enumerate().skip(1) {
        for (step, (a, b)) in run.iter().zip(reference).enumerate() {
            assert!(
                close(a.0, b.0),
                "layout {i} step {step}: train loss {} vs {}",
                a.0,
                b.0
            );
            match (a.1, b.1) {
                (Some(x), Some(y)) => {
                    assert!(close(x, y), "layout {i} step {step}: val loss {x} vs {y}")
                }
                (None, None) => {}
                other => panic!("layout {i} step {step}: val loss {other:?}"),
            }
        }
    }
}

#[test]
fn eval_without_validation_data_or_with_too_little_is_refused() {
    let s = Scratch::new();
    let plan = s.path("plan.json");
    let out = bin()
        .args([
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
        ])
        .args(["--devices", "1", "--dp", "1", "--pp", "1", "--tp", "1"])
        .args(["--micro-batch", "2", "--zero", "0", "--no-sp", "-o"])
        .arg(&plan)
        .output()
        .unwrap();
    assert!(out.status.success());
    // No validation data at all.
    let out = bin()
        .arg("run")
        .arg(&plan)
        .args(["--steps", "2", "--eval-every", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--eval-every") && err.contains("--val-data"),
        "{err}"
    );
    // Less than one global batch (16 sequences of 64 + 1 bytes) of validation text.
    let short = s.path("short-val.txt");
    std::fs::write(&short, "x".repeat(500)).unwrap();
    let out = bin()
        .arg("run")
        .arg(&plan)
        .args(["--steps", "2", "--eval-every", "1", "--val-data"])
        .arg(&short)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("short-val.txt"), "names the file: {err}");
    assert!(!err.contains("panicked"), "{err}");
}
