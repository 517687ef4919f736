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
    // A token file cut mid-token: the launcher only checks that it exists, rank 0 reads it
    // after the rendezvous.
    let data = dir.join("cut.bin");
    std::fs::write(&data, b"abc").unwrap();
    let o = tessera(&[
        "launch",
        &plan,
        "--",
        "--steps",
        "1",
        "--data",
        data.to_str().unwrap(),
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

/// `tessera launch ARGS` with `env` set, under a deadline: (exit code, stdout, stderr).
fn launch_within(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("TESSERA_JOB_TOKEN")
        .env_remove("TESSERA_RENDEZVOUS_TIMEOUT")
        .env_remove("TESSERA_RENDEZVOUS_BIND")
        .arg("launch")
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("tessera runs");
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            child.wait().ok();
            panic!("tessera launch {args:?} did not answer within 60 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = child.wait_with_output().unwrap();
    let (out, err) = text(&o);
    (o.status.code(), out, err)
}

/// Launch arguments, the environment, and what the refusal must name.
type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, Vec<&'a str>);

#[test]
fn every_launch_argument_is_checked_before_any_rank_starts() {
    let dir = temp_dir("args");
    let plan = plan(&dir, 2, 1);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let stale = dir.join("stale-rdzv");
    std::fs::write(&stale, "an earlier run's").unwrap();
    let stale = format!("file:{}", stale.display());
    let no_folder = format!("file:{}", dir.join("no-such-folder").join("rdzv").display());
    let file = format!("file:{}", dir.join("rdzv").display());
    // (arguments, environment, what the message must name)
    let cases: Vec<Case> = vec![
        (
            vec!["--rendezvous", "bogus"],
            vec![],
            vec!["--rendezvous", "bogus", "tcp", "file:"],
        ),
        (
            vec!["--rendezvous", "file:"],
            vec![],
            vec!["--rendezvous", "file:"],
        ),
        (
            vec!["--rendezvous", "TCP "],
            vec![],
            vec!["--rendezvous", "TCP"],
        ),
        (
            vec!["--rendezvous", &no_folder],
            vec![],
            vec!["--rendezvous", "no-such-folder"],
        ),
        (
            vec!["--rendezvous", &stale],
            vec![],
            vec!["--rendezvous", "stale-rdzv", "exists"],
        ),
        (
            vec!["--rendezvous", &file, "--master-port", "29500"],
            vec![],
            vec!["--master-port", "--rendezvous"],
        ),
        (
            vec!["--rendezvous", &file, "--master-addr", "127.0.0.1"],
            vec![],
            vec!["--master-addr", "--rendezvous"],
        ),
        (vec!["--master-addr", ""], vec![], vec!["--master-addr"]),
        (
            vec!["--master-addr", "192.0.2.1"],
            vec![],
            vec!["--master-addr", "192.0.2.1"],
        ),
        (
            vec!["--master-addr", "no-such-host.invalid"],
            vec![],
            vec!["--master-addr", "no-such-host.invalid"],
        ),
        (
            vec!["--master-addr", "127.0.0.1:29500"],
            vec![],
            vec!["--master-addr", "--master-port"],
        ),
        (
            vec!["--master-port", &port],
            vec![],
            vec!["--master-port", &port, "in use"],
        ),
        (
            vec![
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "29500",
            ],
            vec![],
            vec!["--node-rank", "2"],
        ),
        (vec!["--nproc", "3"], vec![], vec!["--nproc", "3"]),
        (
            vec![],
            vec![("TESSERA_RENDEZVOUS_TIMEOUT", "soon")],
            vec!["TESSERA_RENDEZVOUS_TIMEOUT", "soon"],
        ),
        (
            vec![],
            vec![("TESSERA_RENDEZVOUS_BIND", "192.0.2.1")],
            vec!["TESSERA_RENDEZVOUS_BIND", "192.0.2.1"],
        ),
        // What follows `--` is checked as `tessera run` would check it.
        (vec!["--", "--steps", "0"], vec![], vec!["--steps"]),
        (vec!["--", "--no-such-flag"], vec![], vec!["--no-such-flag"]),
        (
            vec!["--", "--collectives", "nccl"],
            vec![],
            vec!["--collectives", "CPU"],
        ),
        (
            vec!["--", "--backend", "cuda"],
            vec![],
            vec!["--backend cuda"],
        ),
        (
            vec!["--", "--data", "/nonexistent/data.txt"],
            vec![],
            vec!["--data", "/nonexistent/data.txt"],
        ),
        (
            vec!["--", "--fail-rank", "7"],
            vec![],
            vec!["--fail-rank", "7"],
        ),
    ];
    for (args, env, parts) in cases {
        let mut all = vec![plan.as_str()];
        all.extend(&args);
        let start = Instant::now();
        let (code, out, err) = launch_within(&all, &env);
        assert_eq!(code, Some(2), "{args:?} {env:?}:\n{out}\n{err}");
        assert!(
            !out.contains("launching") && !out.contains("[rank"),
            "{args:?}: a rank started:\n{out}"
        );
        assert!(!err.contains("[rank"), "{args:?}: a rank started:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.contains("fix:") || err.contains("Usage:"),
            "{args:?}: no fix:\n{err}"
        );
        for p in parts {
            assert!(
                err.contains(p),
                "{args:?} {env:?}: the message lacks `{p}`:\n{err}"
            );
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{args:?}: slow");
    }
    assert!(!dir.join("rdzv").exists());
    drop(taken);
    std::fs::remove_dir_all(&dir).ok();
}
