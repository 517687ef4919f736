//! `tessera run --save-dir/--save-every/--keep/--resume`: the checkpoint flags end to end on the
//! release binary (the format, atomicity and resharding are tested in
//! runtime/tests/checkpoint.rs).

mod common;

use common::*;

/// The README's job for 8 steps, saving after step 4; resuming step 4 on the same plan gives
/// the straight run's steps 5-8 to the bit, and on one rank within the parity tolerance.
#[test]
fn a_run_resumes_from_its_checkpoint_on_the_same_or_another_plan() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, straight) = train_8_saving_at_4(&dir, &plan);
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-8"
    );
    let step4 = s(&ck.join("step-4"));
    let b = dir.path("b.jsonl");
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "8",
        "--resume",
        &step4,
        "--metrics",
        &s(&b),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("resuming from"), "{}", r.stdout);
    let resumed = metrics_losses(&b);
    assert_eq!(
        resumed,
        straight[4..],
        "a resume on the same plan is bit-identical"
    );
    // One rank: the state resharded from DP 2 × PP 2 × TP 2.
    let one = dir.path("one.json");
    let r = run(&[
        "plan",
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "-o",
        &s(&one),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let c = dir.path("c.jsonl");
    let r = run(&[
        "run",
        &s(&one),
        "--steps",
        "8",
        "--resume",
        &step4,
        "--metrics",
        &s(&c),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for ((sa, la), (sc, lc)) in straight[4..].iter().zip(metrics_losses(&c)) {
        assert_eq!(*sa, sc);
        assert!(
            (la - lc).abs() <= 1e-5 * la.abs(),
            "step {sa}: {la} vs {lc}"
        );
    }
}

#[test]
fn checkpoint_flags_that_cannot_work_are_refused_before_any_output() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let ck = dir.path("ck");
    let m = dir.path("m.jsonl");
    let r = run(&["run", &s(&plan), "--steps", "2", "--save-dir", &s(&ck)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // auto without a save directory.
    let r = run(&["run", &s(&plan), "--resume", "auto", "--metrics", &s(&m)]);
    refused(&r, &["--resume auto", "--save-dir"]);
    // A checkpoint at or past --steps would train nothing.
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "2",
        "--resume",
        &s(&ck),
        "--metrics",
        &s(&m),
    ]);
    refused(&r, &["--steps is 2", "greater than 2"]);
    // A damaged index is named.
    std::fs::write(ck.join("step-2").join("index.json"), "{").unwrap();
    let r = run(&[
        "run",
        &s(&plan),
        "--steps",
        "4",
        "--resume",
        &s(&ck),
        "--metrics",
        &s(&m),
    ]);
    refused(&r, &["index.json", "--resume"]);
    // --save-every without --save-dir.
    let r = run(&["run", &s(&plan), "--save-every", "2"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(!m.exists(), "a refused run opened its metrics");
}

/// Starts `tessera ARGS`, signals it with `sig` once `metrics` has `lines` lines, and returns
/// its exit code and stderr.
#[cfg(unix)]
fn run_until(
    args: &[&str],
    metrics: &std::path::Path,
    lines: usize,
    sig: i32,
) -> (Option<i32>, String) {
    use std::time::{Duration, Instant};
    let child = bin()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(metrics)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < lines
    {
        assert!(start.elapsed() < Duration::from_secs(60), "no steps ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, sig) };
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Preemption: SIGTERM (SIGINT) with --save-dir finishes the step in progress, saves it, and
/// exits 143 (130); resuming that checkpoint continues the interrupted run bit for bit (the
/// same --steps, so the same learning-rate schedule, as a requeued job would pass).
#[cfg(unix)]
#[test]
fn a_signal_saves_the_last_step_and_the_run_resumes_from_it() {
    for (sig, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let dir = Scratch::new();
        let plan = s(&tiny_plan(&dir));
        let (ck, m, a, b) = (
            s(&dir.path("ck")),
            dir.path("m.jsonl"),
            dir.path("a.jsonl"),
            dir.path("b.jsonl"),
        );
        let steps = "1000000";
        let (got, stderr) = run_until(
            &[
                "run",
                &plan,
                "--steps",
                steps,
                "--save-dir",
                &ck,
                "--metrics",
                &s(&m),
            ],
            &m,
            3,
            sig,
        );
        assert_eq!(got, Some(code), "{stderr}");
        let last = metrics_losses(&m).last().unwrap().0;
        let latest = std::path::Path::new(&ck).join("latest");
        assert_eq!(
            std::fs::read_to_string(latest).unwrap().trim(),
            format!("step-{}", last + 1),
            "the checkpoint holds every step the metrics record"
        );
        // A run that was never stopped, and the resumed run, each stopped a few steps later.
        let want = last as usize + 4;
        let (got, stderr) = run_until(
            &["run", &plan, "--steps", steps, "--metrics", &s(&a)],
            &a,
            want,
            sig,
        );
        assert_eq!(got, Some(code), "{stderr}");
        let (got, stderr) = run_until(
            &[
                "run",
                &plan,
                "--steps",
                steps,
                "--resume",
                &ck,
                "--metrics",
                &s(&b),
            ],
            &b,
            3,
            sig,
        );
        assert_eq!(got, Some(code), "{stderr}");
        let (straight, resumed) = (metrics_losses(&a), metrics_losses(&b));
        let from = last as usize + 1;
        let n = resumed.len().min(straight.len() - from);
        assert!(n >= 3, "{n} steps to compare");
        assert_eq!(resumed[..n], straight[from..from + n]);
    }
}
