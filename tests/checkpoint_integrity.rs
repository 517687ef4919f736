//! A checkpoint is checked against itself (issue 36, "wrong results"): a hand-edited index
//! whose model disagrees with the tensors, or whose step or learning rate disagrees with the
//! rest of the index or the shards, is refused by every command that reads it (`inspect`,
//! `export`, `sample`, `run --resume`), naming the field, instead of being trusted.

mod common;

use std::path::Path;

use common::*;

/// Every command that reads `ck` refuses it with each of `parts` in the message.
fn all_refuse(dir: &Scratch, plan: &Path, ck: &Path, parts: &[&str]) {
    let c = s(ck);
    let out = s(&dir.path("hf-out"));
    for args in [
        vec!["checkpoint", "inspect", &c],
        vec!["checkpoint", "export", &c, "--to", "hf", "-o", &out],
        vec!["sample", &c, "--prompt", "Pipeline", "--tokens", "4"],
        vec!["run", &s(plan), "--steps", "12", "--resume", &c],
    ] {
        let r = run(&args);
        refused(&r, parts);
        assert!(
            !r.stdout.contains("loss"),
            "{args:?} trained:\n{}",
            r.stdout
        );
    }
    assert!(!dir.path("hf-out").exists(), "export wrote nothing");
}

#[test]
fn an_index_that_disagrees_with_itself_or_its_tensors_is_refused_everywhere() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let step8 = ck.join("step-8");
    let index = step8.join("index.json");
    let original = std::fs::read(&index).unwrap();
    let restore = || std::fs::write(&index, &original).unwrap();

    // The step alone.
    edit_json(&index, |v| v["step"] = 6.into());
    all_refuse(
        &dir,
        &plan,
        &step8,
        &["index.json", "`step` is 6", "data.next_step"],
    );
    restore();
    // The step and every position with it, the learning rate too: the shards were written at
    // step 8. The rate at step 6 of the recorded schedule (warm-up 5, cosine from 3e-3 to 3e-4
    // at step 8): 3e-4 + (3e-3 - 3e-4) (1 + cos(pi (6 - 5) / (8 - 5))) / 2.
    let lr6 = (3e-4 + (3e-3 - 3e-4) * (1.0 + (std::f64::consts::PI / 3.0).cos()) / 2.0) as f32;
    edit_json(&index, |v| {
        assert_eq!(v["lr"]["warmup_steps"], 5);
        assert_eq!(v["lr"]["total_steps"], 8);
        v["lr"]["next_lr"] = lr6.into();
        v["step"] = 6.into();
        v["data"]["next_step"] = 6.into();
        v["lr"]["next_step"] = 6.into();
        v["optimizer"]["updates"] = 6.into();
    });
    all_refuse(&dir, &plan, &step8, &["written at step 8", "`step` is 6"]);
    restore();
    // The learning rate the next step would use.
    edit_json(&index, |v| v["lr"]["next_lr"] = 0.5.into());
    all_refuse(&dir, &plan, &step8, &["lr.next_lr", "0.5"]);
    restore();
    // The model's sizes: a layer fewer, a narrower MLP.
    edit_json(&index, |v| v["model"]["layers"] = 3.into());
    all_refuse(&dir, &plan, &step8, &["`model` (layers 3", "h.3."]);
    restore();
    edit_json(&index, |v| v["model"]["ffn_hidden"] = 128.into());
    all_refuse(&dir, &plan, &step8, &["ffn_hidden 128", "[256, 64]"]);
    restore();
    let r = run(&["checkpoint", "inspect", &s(&step8)]);
    assert_eq!(r.code, Some(0), "the restored index reads: {}", r.stderr);
}
