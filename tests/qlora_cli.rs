//! `tessera plan … --method qlora` then `tessera run`: QLoRA trains on the CPU backend, TP 2,
//! saves and resumes; a QLoRA checkpoint is not exported as a Hugging Face model
//! (runtime/tests/qlora_parity.rs checks the numbers).

mod common;

use std::process::Output;

fn tessera(args: &[&str]) -> Output {
    common::bin().args(args).output().expect("tessera runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_qlora_plan_of_the_tiny_model_trains_saves_and_resumes() {
    let s = common::Scratch::new();
    let (plan, ck, hf) = (s.path("qlora.json"), s.path("ck"), s.path("hf"));
    let p = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let out = tessera(&[
        "plan",
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "2",
        "--tp",
        "2",
        "--method",
        "qlora",
        "-o",
        &p(&plan),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("frozen_weights_nf4"), "{}", text(&out));
    let run = tessera(&["run", &p(&plan), "--steps", "3", "--save-dir", &p(&ck)]);
    let t = text(&run);
    assert_eq!(run.status.code(), Some(0), "{t}");
    assert!(t.contains("loss ") && t.contains("over 3 steps"), "{t}");
    let resumed = tessera(&["run", &p(&plan), "--steps", "5", "--resume", &p(&ck)]);
    let t = text(&resumed);
    assert_eq!(resumed.status.code(), Some(0), "{t}");
    assert!(
        t.contains("resuming from") && t.contains("over 2 steps"),
        "{t}"
    );
    let (ck_s, hf_s) = (p(&ck), p(&hf));
    for merge in [&[][..], &["--merge"][..]] {
        let mut args = vec!["checkpoint", "export", &ck_s, "--to", "hf", "-o", &hf_s];
        args.extend_from_slice(merge);
        let export = tessera(&args);
        let t = text(&export);
        assert_eq!(export.status.code(), Some(2), "{t}");
        assert!(
            t.contains("NF4") && t.contains("--to peft") && !t.contains("panicked"),
            "{t}"
        );
        assert!(!hf.exists(), "nothing is written");
    }
    // The adapters are what a QLoRA run makes: PEFT applies them to the 4-bit base.
    let peft = s.path("peft");
    let export = tessera(&[
        "checkpoint",
        "export",
        &p(&ck),
        "--to",
        "peft",
        "-o",
        &p(&peft),
    ]);
    assert_eq!(export.status.code(), Some(0), "{}", text(&export));
    assert!(peft.join("adapter_model.safetensors").is_file());
    assert!(peft.join("adapter_config.json").is_file());
}
