//! `tessera doctor` on the machine the tests run on. CI has no GPU (and its test build has no
//! CUDA backend): the command must say so and exit 0. On a GPU machine it exits 0 when ready
//! and 1 when something is missing; either way it prints one row per check.

mod common;

use common::*;

#[test]
fn doctor_reports_and_without_a_gpu_exits_0() {
    let r = run(&["doctor"]);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    assert!(
        r.stdout.contains("check") && r.stdout.contains("status"),
        "{}",
        r.stdout
    );
    if r.stdout.contains("no GPU on this machine") {
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        // Every check that failed says how to fix it.
        for line in r.stdout.lines().filter(|l| l.contains(" missing ")) {
            assert!(
                r.stdout.contains("fix:"),
                "a missing check without a fix: {line}"
            );
        }
    } else {
        assert!(r.code == Some(0) || r.code == Some(1), "{}", r.stderr);
    }
}
