//! `tessera launch` on loopback with the CPU backend: one `tessera run` process per rank, a TCP
//! (or shared-file) rendezvous, rank 0 training, and the failure paths — a rank that dies
//! before the rendezvous stops the others, a rank 0 that fails after it is reported as the
//! cause, bad input is refused before anything starts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("TESSERA_JOB_TOKEN")
        .args(args)
        .output()
        .expect("tessera runs")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-launch-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny model as DP `dp` × TP `tp` on `dp·tp` CPU devices.
fn plan(dir: &Path, dp: u32, tp: u32) -> String {
    let out = dir.join("plan.json");
    let devices = (dp * tp).to_string();
    let (dp, tp) = (dp.to_string(), tp.to_string());
    let o = tessera(&[
        "plan",
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        &devices,
        "--dp",
        &dp,
        "--pp",
        "1",
        "--tp",
        &tp,
        "--no-sp",
        "--micro-batch",
        "2",
        "--zero",
        "1",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out.to_str().unwrap().to_string()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn two_rank_processes_meet_and_rank_0_trains() {
    let dir = temp_dir("ok");
    let plan = plan(&dir, 2, 1);
    let metrics = dir.join("m.jsonl");
    let o = tessera(&[
        "launch",
        &plan,
        "--",
        "--steps",
        "3",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("[rank 0] rank 0 of 2: all ranks joined"),
        "{out}"
    );
    assert!(out.contains("[rank 1] rank 1 of 2: joined rank 0"), "{out}");
    assert!(out.contains("[rank 0] loss "), "{out}");
    assert!(out.contains("[rank 1] rank 1: rank 0 finished"), "{out}");
    assert!(out.contains("all 2 rank process(es) finished"), "{out}");
    let lines = std::fs::read_to_string(&metrics).unwrap();
    assert_eq!(
        lines.lines().count(),
        3,
        "rank 0 wrote one metrics line per step"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_shared_file_rendezvous_works_too() {
    let dir = temp_dir("file");
    let plan = plan(&dir, 2, 1);
    let rdzv = format!("file:{}", dir.join("rdzv").display());
    let o = tessera(&["launch", &plan, "--rendezvous", &rdzv, "--", "--steps", "1"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("[rank 1] rank 1: rank 0 finished"), "{out}");
    assert!(
        !dir.join("rdzv").exists(),
        "rank 0 removes the rendezvous file once everyone read it"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_that_dies_before_the_rendezvous_stops_the_others() {
    let dir = temp_dir("fail");
    let plan = plan(&dir, 2, 2);
    let start = Instant::now();
    // Without the supervisor, rank 0 would wait 300 s for rank 2, and ranks 1 and 3 for rank 0.
    let o = tessera(&["launch", &plan, "--", "--steps", "2", "--fail-rank", "2"]);
    let (out, err) = text(&o);
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "the other ranks were not stopped"
    );
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    assert!(
        err.contains("error: rank 2 failed (exit status: 2); stopped ranks 0, 1, 3"),
        "{err}"
    );
    assert!(err.contains("--- rank 2 stderr (last lines) ---"), "{err}");
    assert!(err.contains("injected failure (--fail-rank 2)"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn rank_0_failing_after_the_rendezvous_is_the_reported_cause() {
    let dir = temp_dir("root");
    let plan = plan(&dir, 2, 1);
    let o = tessera(&[
        "launch",
        &plan,
        "--",
        "--steps",
        "1",
        "--data",
        "/nonexistent/data.txt",
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}\n{err}");
    // Rank 1 exits because rank 0 told it the run failed; the report names rank 0's error.
    assert!(
        err.contains("[rank 1] error: rank 1: stopped because rank 0 failed"),
        "{err}"
    );
    assert!(err.contains("error: rank 0 failed"), "{err}");
    assert!(err.contains("cannot load the training data"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_is_refused_before_any_rank_starts() {
    let o = tessera(&["launch", "/nonexistent/plan.json"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!out.contains("launching"), "{out}");
    let dir = temp_dir("bad");
    let plan = plan(&dir, 2, 1);
    let o = tessera(&["launch", &plan, "--nproc", "3"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the plan has 2 ranks") && err.contains("fix: use --nproc 2"),
        "{err}"
    );
    let o = tessera(&["launch", &plan, "--nnodes", "2", "--node-rank", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--master-addr is needed"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_process_checks_its_launch_environment() {
    let dir = temp_dir("env");
    let plan = plan(&dir, 2, 1);
    // Launched by hand with a world size that is not the plan's.
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["run", &plan, "--steps", "1"])
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("the plan has 2 ranks, this launch 3"), "{err}");
    // The right world size but no job token.
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("TESSERA_JOB_TOKEN")
        .args(["run", &plan, "--steps", "1"])
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("TESSERA_JOB_TOKEN is not set"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
