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

/// A stand-in libcuda.so that lacks `cuInit` (cudarc panics on a missing symbol): `tessera
/// doctor` names the file, the symbol and the fix on one line, and does not panic. Needs the
/// CUDA backend (`--features cuda`) and a C compiler; skips with the reason otherwise.
#[cfg(feature = "cuda")]
#[test]
fn doctor_names_a_driver_library_without_cu_init() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("stub.c");
    std::fs::write(
        &src,
        "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n",
    )
    .unwrap();
    let lib = dir.path().join("libcuda.so");
    let cc = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output();
    match cc {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "skipped: cc could not build the stand-in: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            return;
        }
        Err(e) => {
            eprintln!("skipped: no C compiler (cc) to build a stand-in libcuda.so: {e}");
            return;
        }
    }
    let o = bin()
        .arg("doctor")
        .env("LD_LIBRARY_PATH", dir.path())
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    let all = format!("{out}{err}");
    assert!(!all.contains("panicked"), "{all}");
    assert!(!all.contains("backtrace"), "{all}");
    assert!(
        o.status.code() == Some(0) || o.status.code() == Some(1),
        "{all}"
    );
    let line = all
        .lines()
        .find(|l| l.contains("cuInit"))
        .unwrap_or_else(|| panic!("no line names cuInit:\n{all}"));
    assert!(line.contains(lib.to_str().unwrap()), "{line}");
    assert!(line.contains("fix:"), "{line}");
}
