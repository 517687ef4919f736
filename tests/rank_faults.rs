//! Issue 24 item 6, rank faults under `run` and `launch`: a rank whose step returns an error, a
//! rank whose thread panics (both injected by `tessera run`'s hidden test hook
//! `--fault RANK:STEP:error|panic`), and under `tessera launch` a rank process killed with
//! SIGKILL. In each case every rank stops within 10 s of the fault, the process exits non-zero,
//! the message names the failing rank and its cause, and the last complete checkpoint of
//! `--save-dir` (saved after every step) still opens. Every run is a child with a deadline: a
//! hang fails the test, it never hangs it.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use tessera_runtime::checkpoint::Checkpoint;

/// Every rank must have stopped this long after the fault.
const WITHIN: Duration = Duration::from_secs(10);

/// The tiny model on `dp·tp·pp` CPU ranks, ZeRO-`zero`.
fn plan(dir: &Scratch, (dp, tp, pp): (u32, u32, u32), zero: u8) -> PathBuf {
    let out = dir.path(&format!("plan-{dp}-{tp}-{pp}-{zero}.json"));
    let n = |v: u32| v.to_string();
    let r = run(&[
        "plan",
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        &n(dp * tp * pp),
        "--dp",
        &n(dp),
        "--tp",
        &n(tp),
        "--pp",
        &n(pp),
        "--no-sp",
        "--micro-batch",
        "2",
        "--schedule",
        "1f1b",
        "--zero",
        &zero.to_string(),
        "-o",
        &s(&out),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    out
}

/// The checkpoint `dir` resolves to opens, checked shard by shard; returns its step.
fn opens(dir: &Path) -> usize {
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let r = run(&["checkpoint", "inspect", &s(dir)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    ck.step()
}

/// Runs `plan` with `--fault`, saving after every step; checks the outcome and returns stderr.
fn faulted_run(dir: &Scratch, plan: &Path, fault: &str) -> String {
    let save = dir.path(&format!("ck-{}", fault.replace(':', "-")));
    let args = [
        "run",
        &s(plan),
        "--steps",
        "50",
        "--save-dir",
        &s(&save),
        "--save-every",
        "1",
        "--fault",
        fault,
    ];
    // The fault comes at step 3, well under a second in: the whole run must end within the
    // bound. The deadline beyond it only turns a hang into a failure.
    let r = run_within(&args, WITHIN * 3);
    assert!(r.took < WITHIN, "{fault}: took {:?}\n{}", r.took, r.stderr);
    assert_ne!(r.code, Some(0), "{fault}: {}", r.stderr);
    assert!(
        r.code.is_some(),
        "{fault}: killed by a signal\n{}",
        r.stderr
    );
    let step = opens(&save);
    assert!(
        (2..=3).contains(&step),
        "{fault}: the last complete checkpoint is of step {step}"
    );
    r.stderr
}

/// The run's own report: its last line, `error: …`.
fn last_line(err: &str) -> &str {
    err.trim_end().lines().last().unwrap_or_default()
}

#[test]
fn a_rank_whose_step_fails_stops_every_rank_and_is_named() {
    let dir = Scratch::new();
    // DP × PP (peers wait in send/recv and the DP sum) and DP × TP × PP with ZeRO-3 (peers
    // wait inside a layer's TP collective, whose error wraps the peer's disappearance).
    for (shape, zero, rank) in [((2, 1, 2), 1, 3), ((2, 2, 2), 3, 5), ((2, 2, 2), 1, 2)] {
        let plan = plan(&dir, shape, zero);
        let fault = format!("{rank}:3:error");
        let err = faulted_run(&dir, &plan, &fault);
        assert_eq!(
            last_line(&err),
            format!("error: rank {rank} failed: step 3: injected error (test hook --fault)"),
            "{shape:?}: {err}"
        );
    }
}

#[test]
fn a_rank_whose_thread_panics_stops_every_rank_and_is_named() {
    let dir = Scratch::new();
    for (shape, zero, rank) in [((2, 1, 2), 1, 0), ((2, 2, 2), 3, 6), ((2, 2, 2), 1, 7)] {
        let plan = plan(&dir, shape, zero);
        let fault = format!("{rank}:3:panic");
        let err = faulted_run(&dir, &plan, &fault);
        assert_eq!(
            last_line(&err),
            format!(
                "error: rank {rank} failed: its thread panicked: step 3: injected panic (test hook --fault {fault})"
            ),
            "{shape:?}: {err}"
        );
        // The panic's own line names the rank's thread too.
        assert!(err.contains(&format!("thread 'rank {rank}'")), "{err}");
    }
}

#[test]
fn the_fault_hook_is_refused_for_a_rank_the_plan_does_not_have() {
    let dir = Scratch::new();
    let plan = plan(&dir, (2, 1, 1), 1);
    let r = run(&["run", &s(&plan), "--steps", "1", "--fault", "2:0:error"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("--fault 2:0:error: this plan has ranks 0..2"),
        "{}",
        r.stderr
    );
    let r = run(&["run", &s(&plan), "--steps", "1", "--fault", "1:0:boom"]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(
        r.stderr.contains("RANK:STEP:error or RANK:STEP:panic"),
        "{}",
        r.stderr
    );
}

#[cfg(target_os = "linux")]
mod launched {
    use std::io::Read;
    use std::process::{Child, Stdio};
    use std::thread::JoinHandle;

    use super::*;

    /// A `tessera launch` in flight; killed (with its ranks: they die with it) if the test
    /// fails before it ends.
    struct Launch {
        child: Child,
        out: Option<JoinHandle<String>>,
        err: Option<JoinHandle<String>>,
    }

    impl Drop for Launch {
        fn drop(&mut self) {
            if let Ok(None) = self.child.try_wait() {
                self.child.kill().ok();
                self.child.wait().ok();
            }
        }
    }

    impl Launch {
        fn start(args: &[&str]) -> Launch {
            let mut child = bin()
                .env_remove("TESSERA_JOB_TOKEN")
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("the tessera binary runs");
            let drain = |mut r: Box<dyn Read + Send>| {
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    r.read_to_end(&mut buf).ok();
                    String::from_utf8_lossy(&buf).into_owned()
                })
            };
            let out = drain(Box::new(child.stdout.take().unwrap()));
            let err = drain(Box::new(child.stderr.take().unwrap()));
            Launch {
                child,
                out: Some(out),
                err: Some(err),
            }
        }

        /// The pid of the rank process with `RANK=rank` (a child of the launcher).
        fn rank_pid(&self, rank: usize) -> Option<i32> {
            let launcher = self.child.id().to_string();
            let want = format!("RANK={rank}");
            std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
                let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                // pid (comm) state ppid …: the comm may hold spaces, so split after its ')'.
                let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
                if ppid != launcher {
                    return None;
                }
                let env = std::fs::read(e.path().join("environ")).ok()?;
                env.split(|&b| b == 0)
                    .any(|kv| kv == want.as_bytes())
                    .then_some(pid)
            })
        }

        /// Waits up to `limit` for the launcher to end: its exit code and output.
        fn wait(mut self, limit: Duration) -> (Option<i32>, String, String) {
            let start = Instant::now();
            let status = loop {
                if let Some(status) = self.child.try_wait().unwrap() {
                    break status;
                }
                assert!(
                    start.elapsed() < limit,
                    "the launch did not end within {limit:?} of the fault"
                );
                std::thread::sleep(Duration::from_millis(10));
            };
            let out = self.out.take().unwrap().join().unwrap();
            let err = self.err.take().unwrap().join().unwrap();
            (status.code(), out, err)
        }
    }

    /// Waits until `cond` holds, for at most `limit`.
    fn until(limit: Duration, what: &str, cond: impl Fn() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < limit, "waited {limit:?} for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `tessera launch` of a 2-rank plan, training "forever" and saving after every step; once
    /// two checkpoints exist, rank `victim`'s process is killed with SIGKILL.
    fn kill_a_rank(victim: usize) {
        let dir = Scratch::new();
        let plan = plan(&dir, (2, 1, 1), 1);
        let save = dir.path("ck");
        let launch = Launch::start(&[
            "launch",
            &s(&plan),
            "--",
            "--steps",
            "1000000",
            "--save-dir",
            &s(&save),
            "--save-every",
            "1",
            "--keep",
            "3",
        ]);
        // `latest` moves after the step's directory is renamed into place: it is what a reader
        // opens.
        until(Duration::from_secs(60), "a second checkpoint", || {
            std::fs::read_to_string(save.join("latest"))
                .is_ok_and(|l| !l.trim().is_empty() && l.trim() != "step-1")
        });
        let pid = launch.rank_pid(victim).expect("the rank's process");
        // SAFETY: kill(2) of a process this test's launcher started and is still running.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let (code, out, err) = launch.wait(WITHIN);
        assert_eq!(code, Some(1), "{out}\n{err}");
        assert!(
            err.contains(&format!(
                "error: rank {victim} failed (signal: 9 (SIGKILL))"
            )),
            "{err}"
        );
        // Saved after every step, possibly cut mid-save: the newest complete one opens.
        let step = opens(&save);
        assert!(
            step >= 2,
            "{step}: {:?}",
            std::fs::read_dir(&save)
                .unwrap()
                .flatten()
                .map(|e| e.file_name())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_killed_rank_0_process_stops_the_launch_and_is_named() {
        kill_a_rank(0);
    }

    #[test]
    fn a_killed_waiting_rank_process_stops_the_launch_and_is_named() {
        kill_a_rank(1);
    }

    #[test]
    fn a_rank_thread_failing_under_launch_is_named_through_rank_0() {
        for kind in ["error", "panic"] {
            let dir = Scratch::new();
            let plan = plan(&dir, (2, 1, 1), 1);
            let save = dir.path("ck");
            let fault = format!("1:3:{kind}");
            let start = Instant::now();
            let launch = Launch::start(&[
                "launch",
                &s(&plan),
                "--",
                "--steps",
                "1000000",
                "--save-dir",
                &s(&save),
                "--save-every",
                "1",
                "--fault",
                &fault,
            ]);
            let (code, out, err) = launch.wait(WITHIN * 3);
            assert!(
                start.elapsed() < WITHIN,
                "{kind}: took {:?}",
                start.elapsed()
            );
            assert_eq!(code, Some(1), "{out}\n{err}");
            // Rank 0's process trains every rank: it reports the failing thread's rank.
            assert!(
                err.contains("error: rank 0 failed (exit status: 2)"),
                "{err}"
            );
            let cause = match kind {
                "error" => "rank 1 failed: step 3: injected error".to_string(),
                _ => format!("rank 1 failed: its thread panicked: step 3: injected panic (test hook --fault {fault})"),
            };
            assert!(err.contains(&cause), "{err}");
            assert!((2..=3).contains(&opens(&save)));
        }
    }
}
