//! Every `tessera run` flag is honoured or refused before the first step (issue 36, "flags
//! accepted and ignored"): `--val-data` without `--eval-every` is refused; a `--seed` a resume
//! does not use is said; `--init-from` given a Tessera checkpoint points at `--resume`, and
//! names, before training, the config.json dropout it applies and the settings it does not.

mod common;

use common::*;

#[test]
fn val_data_without_eval_every_is_refused() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "2",
        "--val-data",
        "examples/data/parallelism.txt",
    ]);
    refused(&r, &["--val-data", "--eval-every", "fix:"]);
    assert!(!r.stdout.contains("loss"), "{}", r.stdout);
}

#[test]
fn a_seed_that_a_resume_does_not_use_is_said() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let step4 = s(&ck.join("step-4"));
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "6",
        "--resume",
        &step4,
        "--seed",
        "5",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("--seed 5: not used on resume") && r.stderr.contains("weights 1234"),
        "{}",
        r.stderr
    );
    // The checkpoint's own seed: nothing to say.
    let r = run(&["run", &s(&plan), "--steps", "6", "--resume", &step4]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stderr.contains("--seed"), "{}", r.stderr);
}

#[test]
fn init_from_a_checkpoint_points_at_resume_and_names_the_settings_it_sets_aside() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let r = run(&["run", &s(&plan), "--steps", "2", "--init-from", &s(&ck)]);
    refused(
        &r,
        &[
            "--init-from",
            "Tessera checkpoint",
            "--resume",
            "checkpoint export",
        ],
    );

    let hf = dir.path("hf");
    let r = run(&["checkpoint", "export", &s(&ck), "--to", "hf", "-o", &s(&hf)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    edit_json(&hf.join("config.json"), |v| {
        v["attn_pdrop"] = 0.1.into();
        v["resid_pdrop"] = 0.1.into();
        v["embd_pdrop"] = 0.0.into();
        v["summary_first_dropout"] = 0.1.into();
    });
    let r = run(&["run", &s(&plan), "--steps", "2", "--init-from", &s(&hf)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // The config's rates are applied site by site, and the run says so.
    let line = r
        .stdout
        .lines()
        .chain(r.stderr.lines())
        .find(|l| l.contains("dropout from"))
        .unwrap_or_else(|| panic!("no line names the dropout applied:\n{}", r.stderr));
    assert!(
        line.contains("embedding 0 (embd_pdrop)")
            && line.contains("attention 0.1 (attn_pdrop)")
            && line.contains("residual 0.1 (resid_pdrop)")
            && line.contains("in place of the plan's training.dropout 0"),
        "{line}"
    );
    // A key the causal LM does not read is set aside, said on its own line.
    let line = r
        .stderr
        .lines()
        .find(|l| l.contains("does not apply"))
        .unwrap_or_else(|| panic!("no line names the settings set aside:\n{}", r.stderr));
    assert!(
        line.contains("summary_first_dropout 0.1") && !line.contains("pdrop"),
        "{line}"
    );
    // Said before the first step.
    assert!(r.stdout.contains("loss"), "{}", r.stdout);
}

/// Under `tessera launch`, what rank 0 would refuse about `--save-dir`, `--resume` and
/// `--init-from` is refused before any rank process starts.
#[test]
fn launch_refuses_checkpoint_flags_before_any_rank_starts() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let missing = s(&dir.path("missing"));
    for (extra, parts) in [
        (
            vec!["--save-dir", ck.to_str().unwrap()],
            vec!["--save-dir", "2 checkpoints", "--overwrite"],
        ),
        (
            vec!["--resume", missing.as_str()],
            vec!["--resume", "no such"],
        ),
        (
            vec!["--init-from", ck.to_str().unwrap()],
            vec!["--init-from", "Tessera checkpoint", "--resume"],
        ),
        (
            vec!["--save-dir", "/proc/self/ck"],
            vec!["--save-dir", "cannot write"],
        ),
    ] {
        let mut args = vec!["launch", plan.to_str().unwrap(), "--nproc", "8", "--"];
        args.extend(["--steps", "2"]);
        args.extend(extra.iter().copied());
        let r = run(&args);
        refused(&r, &parts);
        assert!(
            !r.stdout.contains("[rank"),
            "{extra:?}: a rank started:\n{}",
            r.stdout
        );
    }
}

/// A tokenizer.json edited since the data was prepared with it is named as changed (its
/// SHA-256 now and as recorded), not as another tokenizer under the same path.
#[test]
fn a_changed_tokenizer_file_is_named_as_changed() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let tok = dir.path("tok.json");
    let json = |extra: &str| {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"hello":1,"world":2{extra}}},"unk_token":"[UNK]"}}}}"#
        )
    };
    std::fs::write(&tok, json("")).unwrap();
    let text = dir.path("t.txt");
    std::fs::write(&text, "hello world ".repeat(400)).unwrap();
    let prepared = dir.path("p");
    let r = run(&[
        "data",
        "prepare",
        &s(&text),
        "-o",
        &s(&prepared),
        "--tokenizer",
        &s(&tok),
        "--val-fraction",
        "0",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    std::fs::write(&tok, json(r#","again":3"#)).unwrap();
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "1",
        "--data",
        &s(&prepared),
        "--tokenizer",
        &s(&tok),
    ]);
    refused(
        &r,
        &["--tokenizer", "has changed since", "SHA-256", "recorded"],
    );
}
