//! A checkpoint folder has one owner and is never silently changed (issue 36, "a checkpoint
//! folder lost"): a run that would write into a `--save-dir` holding checkpoints it does not
//! continue is refused unless `--overwrite`; `--keep` prunes only the run's own lineage; a
//! missing or dangling `latest` is said; a lock keeps a second run out; no output may lie
//! inside a checkpoint folder the run reads or writes; an unwritable `--save-dir` is refused
//! before the first step; a resume that saves nothing says so.

mod common;

use std::path::Path;

use common::*;

/// The folder's entries, sorted (the lock file left out).
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".tessera-lock")
        .collect();
    v.sort();
    v
}

#[test]
fn a_save_dir_holding_checkpoints_the_run_does_not_continue_is_refused_untouched() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let before = entries(&ck);
    let kept = Inputs::of(&[&ck.join("latest"), &ck.join("step-8/index.json")]);
    // A fresh run.
    let r = run(&["run", &s(&plan), "--steps", "2", "--save-dir", &s(&ck)]);
    refused(
        &r,
        &[
            "--save-dir",
            "2 checkpoints",
            "step-8",
            "--resume",
            "--overwrite",
        ],
    );
    assert!(!r.stdout.contains("loss"), "no step ran:\n{}", r.stdout);
    // A run resuming a checkpoint of another folder.
    let other = dir.path("other");
    std::fs::create_dir(&other).unwrap();
    let copy = other.join("step-4");
    std::fs::create_dir(&copy).unwrap();
    for e in std::fs::read_dir(ck.join("step-4")).unwrap().flatten() {
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "6",
        "--resume",
        &s(&copy),
        "--save-dir",
        &s(&ck),
    ]);
    refused(&r, &["--save-dir", "which is not one of them"]);
    assert_eq!(entries(&ck), before);
    kept.unchanged();
}

#[test]
fn overwrite_writes_and_keep_prunes_only_the_runs_own_checkpoints() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let theirs = Inputs::of(&[&ck.join("step-8/index.json"), &ck.join("step-4/index.json")]);
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "3",
        "--save-dir",
        &s(&ck),
        "--save-every",
        "1",
        "--keep",
        "1",
        "--overwrite",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(entries(&ck), ["latest", "step-3", "step-4", "step-8"]);
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-3"
    );
    theirs.unchanged();
    // Resuming the other lineage's newest and keeping 1 prunes that lineage's older step-4
    // only; this run's step-3 stays.
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "9",
        "--resume",
        &s(&ck.join("step-8")),
        "--save-dir",
        &s(&ck),
        "--keep",
        "1",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(entries(&ck), ["latest", "step-3", "step-9"]);
}

#[test]
fn resume_auto_says_what_it_found_when_latest_is_missing_or_dangling() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let resume = |steps: &str| {
        run(&[
            "run",
            &s(&plan),
            "--steps",
            steps,
            "--resume",
            "auto",
            "--save-dir",
            &s(&ck),
        ])
    };
    std::fs::write(ck.join("latest"), "step-99\n").unwrap();
    let r = resume("9");
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("`latest` names \"step-99\", which is not a complete checkpoint")
            && r.stderr
                .contains("resuming the newest complete checkpoint there, step-8"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.contains("after step 8"), "{}", r.stdout);
    std::fs::remove_file(ck.join("latest")).unwrap();
    let r = resume("10");
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("there is no `latest` pointer") && r.stderr.contains("step-9"),
        "{}",
        r.stderr
    );
    // A pointer to nothing, and no checkpoint beside it: refused, not a fresh start.
    let empty = dir.path("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("latest"), "step-5\n").unwrap();
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "2",
        "--resume",
        "auto",
        "--save-dir",
        &s(&empty),
    ]);
    refused(&r, &["--resume auto", "no complete checkpoint", "latest"]);
    assert_eq!(entries(&empty), ["latest"]);
}

#[test]
fn a_second_run_on_a_save_dir_in_use_is_refused_naming_its_owner() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let ck = dir.path("ck");
    std::fs::create_dir(&ck).unwrap();
    let lock = ck.join(".tessera-lock");
    std::fs::write(&lock, "pid 4242 (tessera run other.json)\n").unwrap();
    let held = std::fs::File::open(&lock).unwrap();
    held.lock().unwrap();
    let r = run(&["run", &s(&plan), "--steps", "2", "--save-dir", &s(&ck)]);
    refused(
        &r,
        &[
            "--save-dir",
            "another run is writing",
            "pid 4242",
            "another --save-dir",
        ],
    );
    assert!(!r.stdout.contains("loss"), "no step ran:\n{}", r.stdout);
    drop(held);
    let r = run(&["run", &s(&plan), "--steps", "2", "--save-dir", &s(&ck)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

#[test]
fn no_output_may_lie_inside_a_checkpoint_folder_the_run_reads_or_writes() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let before = entries(&ck);
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "10",
        "--resume",
        "auto",
        "--save-dir",
        &s(&ck),
        "--trace",
        &s(&ck.join("trace.json")),
    ]);
    refused(&r, &["--trace", "inside --save-dir", "writes"]);
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "10",
        "--resume",
        &s(&ck.join("step-8")),
        "--metrics",
        &s(&ck.join("step-8/m.jsonl")),
    ]);
    refused(&r, &["--metrics", "inside --resume", "reads"]);
    assert_eq!(entries(&ck), before);
    assert!(!ck.join("step-8/m.jsonl").exists());
}

#[test]
fn an_unwritable_save_dir_is_refused_before_the_first_step() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    // /proc/self exists and is a folder, and nobody (root included) may create files in it.
    let r = run(&["run", &s(&plan), "--steps", "2", "--save-dir", "/proc/self"]);
    refused(&r, &["--save-dir /proc/self", "cannot write", "fix:"]);
    assert!(!r.stdout.contains("loss"), "no step ran:\n{}", r.stdout);
}

#[test]
fn a_resume_without_a_save_dir_says_that_nothing_will_be_kept() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, _) = train_8_saving_at_4(&dir, &plan);
    let r = run(&["run", &s(&plan), "--steps", "9", "--resume", &s(&ck)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("no --save-dir") && r.stderr.contains("not kept"),
        "{}",
        r.stderr
    );
}
