//! GPT-2's 50257-token vocabulary under TP: padded as Megatron-LM pads it (to a multiple of
//! 128 × TP), never a reason to refuse a TP degree. The expected sizes are worked by hand:
//! 50257 / 256 = 196.3 → 197 × 256 = 50432; / 512 = 98.2 → 99 × 512 = 50688;
//! / 1024 = 49.1 → 50 × 1024 = 51200; / 2048 = 24.5 → 25 × 2048 = 51200.

use std::path::Path;
use std::process::Command;

fn plan(model: &str, tp: u64) -> serde_json::Value {
    let tp = tp.to_string();
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args([
            "plan",
            model,
            "specs/clusters/dgx-a100-80g.toml",
            "--nodes",
            "2",
        ])
        .args(["--tp", &tp, "--format", "json"])
        .output()
        .expect("the tessera binary runs");
    assert!(
        o.status.success(),
        "{model} TP {tp}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("--format json prints JSON")
}

#[test]
fn gpt2_vocabulary_plans_with_tp_2_4_8_16() {
    // GPT-2 124M has 12 heads (TP 2, 4); GPT-3 2.7B, with GPT-2's vocabulary, has 32 (TP 8, 16).
    for (model, tp, padded) in [
        ("specs/models/gpt2-124m.toml", 2, 50432),
        ("specs/models/gpt2-124m.toml", 4, 50688),
        ("specs/models/gpt3-2.7b.toml", 8, 51200),
        ("specs/models/gpt3-2.7b.toml", 16, 51200),
    ] {
        let p = plan(model, tp);
        // The parameter count stays the published, unpadded one (GPT-2 124M: 124,439,808).
        if model.contains("gpt2-124m") {
            assert_eq!(p["job"]["parameters"], 124_439_808u64);
        }
        assert_eq!(p["parallel"]["tp"], tp, "{model}");
        assert_eq!(p["feasible"], true, "{model} TP {tp}");
        let v = &p["parallel"]["vocab"];
        assert_eq!(v["model"], 50257, "{model} TP {tp}");
        assert_eq!(v["padded"], padded, "{model} TP {tp}");
        assert_eq!(v["multiple"], 128 * tp, "{model} TP {tp}");
        let reason = v["reason"].as_str().unwrap();
        assert!(
            reason.contains(&format!("padded to {padded}")),
            "{model} TP {tp}: {reason}"
        );
    }
}

/// A tiny plan (TP 2) written to `dir`, as JSON.
fn tiny_plan(dir: &Path) -> (std::path::PathBuf, serde_json::Value) {
    let out = dir.join("plan.json");
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args([
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
        ])
        .args([
            "--tp",
            "2",
            "--pp",
            "1",
            "--dp",
            "4",
            "-o",
            out.to_str().unwrap(),
        ])
        .output()
        .expect("the tessera binary runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (out, v)
}

/// `tessera validate` refuses the plan; its stderr.
fn validate_refuses(plan: &Path) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args(["validate", plan.to_str().unwrap()])
        .output()
        .expect("the tessera binary runs");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn a_refused_vocabulary_section_names_the_field_and_both_values() {
    let dir = tempfile::tempdir().unwrap();
    let (plan, v) = tiny_plan(dir.path());
    assert_eq!(v["parallel"]["vocab"]["padded"], 256);
    assert_eq!(v["parallel"]["vocab"]["multiple"], 2);
    // The padded size edited: the plan says 512, the model and TP 2 give 256.
    let mut edited = v.clone();
    edited["parallel"]["vocab"]["padded"] = 512.into();
    std::fs::write(&plan, serde_json::to_string_pretty(&edited).unwrap()).unwrap();
    let err = validate_refuses(&plan);
    for want in [
        "`parallel.vocab.padded`",
        "512",
        "256",
        "make_vocab_size_divisible_by 1",
        "TP 2",
        "fix:",
    ] {
        assert!(err.contains(want), "no {want} in:\n{err}");
    }
    // The model's make_vocab_size_divisible_by edited to 128: the padded size is still 256
    // (256 is a multiple of 128 × 2), the multiple is not: the message must not read "256
    // padded to 256" on both sides.
    let mut edited = v.clone();
    edited["job"]["model"]["architecture"]["vocab_divisible_by"] = 128.into();
    std::fs::write(&plan, serde_json::to_string_pretty(&edited).unwrap()).unwrap();
    let err = validate_refuses(&plan);
    for want in [
        "`parallel.vocab.multiple`",
        "says 2",
        "256",
        "make_vocab_size_divisible_by 128",
        "fix:",
    ] {
        assert!(err.contains(want), "no {want} in:\n{err}");
    }
}
