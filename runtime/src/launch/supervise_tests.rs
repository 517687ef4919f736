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
        "signals" => count_signals(),
        // As `tessera run` ends after a SIGTERM it handled.
        "stopped" => 143,
        "briefly" => {
            std::thread::sleep(Duration::from_secs(1));
            0
        }
        other => panic!("unknown mode {other}"),
    };
    std::process::exit(code);
}

/// A child that counts the SIGTERMs it gets: says its process group, writes the file named by
/// `TESSERA_TEST_READY` once its handler is in place, prints `got N` at each one, and exits 0
/// at the second (1 if they do not come within 60 s).
#[cfg(unix)]
fn count_signals() -> i32 {
    use std::sync::atomic::AtomicUsize;
    static GOT: AtomicUsize = AtomicUsize::new(0);
    extern "C" fn on_term(_: libc::c_int) {
        GOT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    // SAFETY: the handler only increments an atomic; getpgid/getpid cannot fail here.
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
        println!("group {} pid {}", libc::getpgid(0), libc::getpid());
    }
    std::fs::write(std::env::var("TESSERA_TEST_READY").unwrap(), "").unwrap();
    let (start, mut seen) = (Instant::now(), 0);
    while start.elapsed() < Duration::from_secs(60) {
        let got = GOT.load(std::sync::atomic::Ordering::SeqCst);
        if got != seen {
            seen = got;
            println!("got {got}");
        }
        if got >= 2 {
            // A third (a copy) would show up within this while.
            std::thread::sleep(Duration::from_millis(300));
            println!("got {}", GOT.load(std::sync::atomic::Ordering::SeqCst));
            return 0;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    1
}

#[cfg(not(unix))]
fn count_signals() -> i32 {
    0
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

#[cfg(target_os = "linux")]
#[test]
fn each_signal_is_passed_on_once_to_ranks_in_groups_of_their_own() {
    let dir = std::env::temp_dir().join(format!("tessera-supervise-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = spec(&["signals", "signals"], port());
    let ready: Vec<std::path::PathBuf> = (0..2).map(|r| dir.join(format!("ready.{r}"))).collect();
    for (r, p) in s.ranks.iter_mut().zip(&ready) {
        r.env
            .push(("TESSERA_TEST_READY".into(), p.display().to_string()));
    }
    let forward = Arc::new(Forward::new());
    s.forward = Some(forward.clone());
    let pusher = std::thread::spawn(move || {
        let start = Instant::now();
        while !ready.iter().all(|p| p.exists()) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "children not ready"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        forward.push(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(300));
        forward.push(libc::SIGTERM);
    });
    let reports = run(&s).unwrap_or_else(|e| panic!("{e}"));
    pusher.join().unwrap();
    // SAFETY: getpgid(0) cannot fail.
    let ours = unsafe { libc::getpgid(0) };
    for r in reports {
        let out = &r.stdout_tail;
        assert!(
            out.contains("got 2") && !out.contains("got 3"),
            "rank {}: {out}",
            r.rank
        );
        // libtest may print its "test … child ..." on the same line first.
        let line = out
            .lines()
            .find_map(|l| l.split_once("group ").map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("rank {}: {out}", r.rank));
        let f: Vec<&str> = std::iter::once("group")
            .chain(line.split_whitespace())
            .collect();
        assert_eq!(
            f[1], f[3],
            "rank {} leads a group of its own: {line}",
            r.rank
        );
        assert_ne!(f[1], ours.to_string(), "not the supervisor's group");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_stopped_by_a_signal_does_not_get_the_others_killed_at_once() {
    // A job controller signals every process: rank 0 is stopped (143) a moment before the
    // launcher gets its own copy. Rank 1 is left to end as it chooses within the grace period.
    let mut s = spec(&["stopped", "briefly"], port());
    s.grace = Duration::from_secs(20);
    let start = Instant::now();
    let e = run(&s).unwrap_err();
    let LaunchError::RankFailed {
        failed,
        stopped,
        all,
    } = &e
    else {
        panic!("{e}")
    };
    assert!(stopped.is_empty(), "{e}");
    assert_eq!(failed.rank, 0);
    assert_eq!(all[1].code, Some(0), "{e}");
    assert!(start.elapsed() < Duration::from_secs(15));
}
