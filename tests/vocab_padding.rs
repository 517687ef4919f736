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
