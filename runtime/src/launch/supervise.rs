//! The supervisor behind `tessera launch`: starts one child process per local rank, forwards
//! their output line by line with a `[rank r]` prefix, and when one exits with an error stops
//! the others and reports that rank's error with the tail of its stderr.
//!
//! Which rank's error explains the failure: the first one that exited on its own with a
//! failure, preferring a real error over [`EXIT_PEER_FAILED`] (a rank that only stopped because
//! rank 0 reported a failure); ranks this supervisor stopped never explain it. After a
//! peer-failed exit the others get a short grace period to exit with the real cause.
//!
//! This module must not know what the children run.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::EXIT_PEER_FAILED;

/// One child to start.
#[derive(Debug, Clone)]
pub struct RankProcess {
    pub rank: usize,
    /// Variables added to the inherited environment.
    pub env: Vec<(String, String)>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Spec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub ranks: Vec<RankProcess>,
    /// Lines of each stream kept for the report.
    pub tail_lines: usize,
    /// Forward children's output to this process's stdout / stderr.
    pub echo: bool,
    /// After a peer-failed exit, how long the others may take to exit with the real cause.
    pub grace: Duration,
    /// A signal number the launcher received (0 until then). Once it is set, the supervisor
    /// sends that signal to every rank still running, once, and waits for them all to end as
    /// they choose (`tessera run` finishes its step and exits 128 + the signal); no rank is
    /// killed for having exited with an error after it.
    pub forward: Option<Arc<AtomicI32>>,
}

/// Sends `sig` to a child process.
#[cfg(unix)]
fn signal_child(child: &Child, sig: i32) {
    // SAFETY: kill(2) on the pid of a child this process started and has not yet reaped.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// Elsewhere the children see the console's interrupt themselves.
#[cfg(not(unix))]
fn signal_child(_child: &Child, _sig: i32) {}

/// How one rank ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    pub rank: usize,
    /// `exit status: 0`, `signal: 9 (SIGKILL)`, …
    pub status: String,
    pub code: Option<i32>,
    /// Stopped by this supervisor because another rank failed.
    pub stopped: bool,
    pub stdout_tail: String,
    pub stderr_tail: String,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        rank: usize,
        program: String,
        source: std::io::Error,
    },
    #[error("rank {} failed ({}){}\n--- rank {} stderr (last lines) ---\n{}", .failed.rank, .failed.status, stopped_text(.stopped), .failed.rank, .failed.stderr_tail.trim_end())]
    RankFailed {
        failed: Box<RankReport>,
        stopped: Vec<usize>,
        all: Vec<RankReport>,
    },
}

fn stopped_text(stopped: &[usize]) -> String {
    if stopped.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = stopped.iter().map(|r| r.to_string()).collect();
        format!(
            "; stopped rank{} {}",
            if stopped.len() > 1 { "s" } else { "" },
            list.join(", ")
        )
    }
}

type Tail = Arc<Mutex<VecDeque<String>>>;

/// Copies `from` line by line into `tail` (bounded) and, if `echo`, to `to` with a prefix.
fn pump(
    from: impl Read + Send + 'static,
    prefix: String,
    tail: Tail,
    keep: usize,
    echo: Option<Box<dyn Write + Send>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut echo = echo;
        for line in BufReader::new(from).split(b'\n') {
            let Ok(line) = line else { break };
            let line = String::from_utf8_lossy(&line).into_owned();
            if let Some(w) = echo.as_mut() {
                writeln!(w, "{prefix}{line}").ok();
            }
            let mut t = tail.lock().expect("tail lock");
            t.push_back(line);
            while t.len() > keep {
                t.pop_front();
            }
        }
    })
}

struct Running {
    rank: usize,
    child: Child,
    exit: Option<(Instant, ExitStatus)>,
    stopped: bool,
    out: Tail,
    err: Tail,
}

fn failed(s: &ExitStatus) -> bool {
    !s.success()
}

/// Starts every rank and waits for all of them. `Ok` with every rank's report when all exit 0.
pub fn run(spec: &Spec) -> Result<Vec<RankReport>, LaunchError> {
    let mut running: Vec<Running> = Vec::new();
    let mut pumps = Vec::new();
    for rp in &spec.ranks {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &rp.env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                for r in &mut running {
                    r.child.kill().ok();
                    r.child.wait().ok();
                }
                return Err(LaunchError::Spawn {
                    rank: rp.rank,
                    program: spec.program.display().to_string(),
                    source,
                });
            }
        };
        let (out, err): (Tail, Tail) = (Default::default(), Default::default());
        let prefix = format!("[rank {}] ", rp.rank);
        let echo_out: Option<Box<dyn Write + Send>> =
            spec.echo.then(|| Box::new(std::io::stdout()) as _);
        let echo_err: Option<Box<dyn Write + Send>> =
            spec.echo.then(|| Box::new(std::io::stderr()) as _);
        pumps.push(pump(
            child.stdout.take().expect("piped"),
            prefix.clone(),
            out.clone(),
            spec.tail_lines,
            echo_out,
        ));
        pumps.push(pump(
            child.stderr.take().expect("piped"),
            prefix,
            err.clone(),
            spec.tail_lines,
            echo_err,
        ));
        running.push(Running {
            rank: rp.rank,
            child,
            exit: None,
            stopped: false,
            out,
            err,
        });
    }
    let mut first_failure: Option<(Instant, bool)> = None; // (when, a real error)
    let mut stopping = false;
    let mut forwarded = false;
    loop {
        let sig = spec
            .forward
            .as_ref()
            .map_or(0, |f| f.load(Ordering::SeqCst));
        if sig != 0 && !forwarded {
            forwarded = true;
            for r in running.iter_mut().filter(|r| r.exit.is_none()) {
                signal_child(&r.child, sig);
            }
        }
        for r in running.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                let now = Instant::now();
                r.exit = Some((now, status));
                if failed(&status) && !r.stopped {
                    let real = status.code() != Some(i32::from(EXIT_PEER_FAILED));
                    match first_failure {
                        None => first_failure = Some((now, real)),
                        Some((t, false)) if real => first_failure = Some((t, true)),
                        _ => {}
                    }
                }
            }
        }
        if running.iter().all(|r| r.exit.is_some()) {
            break;
        }
        if let Some((when, real)) = first_failure.filter(|_| !forwarded) {
            if !stopping && (real || when.elapsed() >= spec.grace) {
                stopping = true;
                for r in running.iter_mut().filter(|r| r.exit.is_none()) {
                    r.stopped = true;
                    r.child.kill().ok();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in pumps {
        p.join().ok();
    }
    let text = |t: &Tail| {
        t.lock()
            .expect("tail lock")
            .iter()
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    };
    let reports: Vec<RankReport> = running
        .iter()
        .map(|r| {
            let status = r.exit.expect("every child exited").1;
            RankReport {
                rank: r.rank,
                status: status.to_string(),
                code: status.code(),
                stopped: r.stopped,
                stdout_tail: text(&r.out),
                stderr_tail: text(&r.err),
            }
        })
        .collect();
    // The explanation: earliest own failure, real errors before peer-failed exits.
    let mut own: Vec<(&Running, &RankReport)> = running
        .iter()
        .zip(&reports)
        .filter(|(r, rep)| !r.stopped && rep.code != Some(0))
        .collect();
    if own.is_empty() {
        return Ok(reports);
    }
    own.sort_by_key(|(r, rep)| {
        (
            rep.code == Some(i32::from(EXIT_PEER_FAILED)),
            r.exit.expect("exited").0,
        )
    });
    let failed = Box::new(own[0].1.clone());
    let stopped = reports
        .iter()
        .filter(|r| r.stopped)
        .map(|r| r.rank)
        .collect();
    Err(LaunchError::RankFailed {
        failed,
        stopped,
        all: reports,
    })
}

#[cfg(test)]
#[path = "supervise_tests.rs"]
mod tests;
