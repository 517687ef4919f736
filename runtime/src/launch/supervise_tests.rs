//! The supervisor on real child processes: this test binary re-runs itself as the children
//! (the ignored `child` test below, driven by `TESSERA_TEST_MODE`), which rendezvous over TCP
//! on loopback, fail, hang or exit as told.

use super::*;
use crate::launch::env::LaunchEnv;
use crate::launch::rendezvous::rendezvous;

/// What a child does, from its environment. Ignored in normal runs (it returns at once without
/// `TESSERA_TEST_MODE`); the tests below run it as a separate process.
#[test]
#[ignore = "child process of the supervisor tests"]
fn child() {
    let Ok(mode) = std::env::var("TESSERA_TEST_MODE") else {
        return;
    };
    let env = LaunchEnv::from_env().unwrap().expect("launch variables");
    if let Some(secs) = std::env::var("TESSERA_TEST_DELAY")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        std::thread::sleep(Duration::from_secs(secs));
    }
    let code = match mode.as_str() {
        "rendezvous" => {
            let cfg = env.rendezvous_config(&|k| std::env::var(k).ok()).unwrap();
            match rendezvous(&cfg, || Ok(format!("ids of {}", cfg.token).into_bytes())) {
                Ok(j) => {
                    println!("blob {}", String::from_utf8_lossy(&j.blob));
                    if j.session.is_root() {
                        j.session.finish(Ok(())).unwrap();
                    } else {
                        j.session.wait().unwrap();
                    }
                    0
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    2
                }
            }
        }
        "fail" => {
            eprintln!("boom from rank {}", env.rank);
            1
        }
        "peer-failed" => i32::from(EXIT_PEER_FAILED),
        "hang" => {
            std::thread::sleep(Duration::from_secs(120));
            0
        }
        other => panic!("unknown mode {other}"),
    };
    std::process::exit(code);
}

fn spec(modes: &[&str], port: u16) -> Spec {
    let token = crate::launch::new_token();
    Spec {
        program: std::env::current_exe().unwrap(),
        args: [
            "--ignored",
            "--exact",
            "launch::supervise::tests::child",
            "--nocapture",
            "--test-threads=1",
        ]
        .iter()
        .map(Into::into)
        .collect(),
        ranks: modes
            .iter()
            .enumerate()
            .map(|(r, m)| RankProcess {
                rank: r,
                env: [
                    ("TESSERA_TEST_MODE", m.to_string()),
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", modes.len().to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.to_string()),
                    ("TESSERA_JOB_TOKEN", token.clone()),
                    ("TESSERA_RENDEZVOUS_TIMEOUT", "60".into()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            })
            .collect(),
        tail_lines: 20,
        echo: false,
        forward: None,
        grace: Duration::from_secs(2),
    }
}

fn port() -> u16 {
    crate::launch::free_port("127.0.0.1").unwrap()
}

#[test]
fn separate_processes_rendezvous_over_tcp() {
    let s = spec(&["rendezvous"; 3], port());
    let token = s.ranks[0]
        .env
        .iter()
        .find(|(k, _)| k == "TESSERA_JOB_TOKEN")
        .unwrap()
        .1
        .clone();
    let reports = run(&s).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reports.len(), 3);
    for r in reports {
        assert_eq!(r.code, Some(0));
        assert!(
            r.stdout_tail.contains(&format!("blob ids of {token}")),
            "rank {}: {}",
            r.rank,
            r.stdout_tail
        );
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_explains_the_run() {
    // Rank 1 fails before the rendezvous: rank 0 waits for it and rank 2 waits for rank 0,
    // both for up to 60 s, unless the supervisor stops them.
    let start = Instant::now();
    let e = run(&spec(&["rendezvous", "fail", "rendezvous"], port())).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the others were not stopped"
    );
    let LaunchError::RankFailed {
        failed, stopped, ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(failed.rank, 1);
    assert_eq!(failed.code, Some(1));
    assert!(failed.stderr_tail.contains("boom from rank 1"));
    assert_eq!(stopped, &vec![0, 2]);
    let text = e.to_string();
    assert!(
        text.starts_with("rank 1 failed (exit status: 1); stopped ranks 0, 2"),
        "{text}"
    );
    assert!(text.contains("boom from rank 1"), "{text}");
}

#[test]
fn a_real_error_explains_the_run_before_a_peer_failed_exit() {
    // Rank 2 exits at once saying "my peer failed"; rank 0 fails for real a moment later
    // (inside the grace period); rank 1 hangs until stopped.
    let mut s = spec(&["fail", "hang", "peer-failed"], port());
    s.ranks[0]
        .env
        .push(("TESSERA_TEST_DELAY".into(), "1".into()));
    // Long enough for rank 0 to start and fail even on a loaded machine; the run still ends as
    // soon as rank 0's real error arrives.
    s.grace = Duration::from_secs(20);
    s.ranks.swap(0, 2); // start rank 2 first
    let e = run(&s).unwrap_err();
    let LaunchError::RankFailed {
        failed, stopped, ..
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(failed.rank, 0, "{e}");
    assert_eq!(stopped, &vec![1]);
}

#[test]
fn a_program_that_cannot_start_is_an_error() {
    let mut s = spec(&["hang", "hang"], port());
    s.program = "/nonexistent/tessera".into();
    assert!(matches!(run(&s), Err(LaunchError::Spawn { rank: 0, .. })));
}
