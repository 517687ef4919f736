//! The supervisor behind `tessera launch`: starts one child process per local rank, forwards
//! their output line by line with a `[rank r]` prefix, and when one exits with an error stops
//! the others and reports that rank's error with the tail of its stderr.
//!
//! Which rank's error explains the failure: the first one that exited on its own with a
//! failure, preferring a real error over [`EXIT_PEER_FAILED`] (a rank that only stopped because
//! rank 0 reported a failure) and over a rank that was stopped by SIGINT or SIGTERM; ranks this
//! supervisor stopped never explain it. After a peer-failed exit the others get a short grace
//! period to exit with the real cause, and after a rank was stopped by SIGINT or SIGTERM (exit
//! 130 or 143, or killed by it) they get the same grace: a job controller signals every process
//! of a job at once, so the launcher's own copy is likely on its way, and then the others are
//! left to stop as the signal asks rather than killed.
//!
//! Signals: on Linux every rank runs in a process group of its own, so a terminal's Ctrl-C (sent
//! to the foreground group) reaches the launcher only, and the launcher passes each signal it
//! got on exactly once ([`Spec::forward`]): one request arrives once, and a second Ctrl-C still
//! reaches the ranks as a second request. Each rank is also tied to the launcher's life
//! (`PR_SET_PDEATHSIG`: SIGKILL when the thread that started it ends, which [`run`] outlives
//! only once every rank has ended), so no rank outlives a launcher that was killed. Elsewhere
//! the ranks share the launcher's group and tell the copies apart by their sender.
//!
//! This module must not know what the children run.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
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
    /// After a peer-failed exit, how long the others may take to exit with the real cause; after
    /// a rank was stopped by SIGINT or SIGTERM, how long the launcher may take to get the same
    /// signal and pass it on.
    pub grace: Duration,
    /// The signals the launcher received. The supervisor sends each one, once, to every rank
    /// still running, and waits for them all to end as they choose (`tessera run` finishes its
    /// step and exits 128 + the signal, or stops at once on a second); no rank is killed for
    /// having exited with an error after the first.
    pub forward: Option<Arc<Forward>>,
}

/// The signals a launcher received, in order, for the supervisor to pass on.
#[derive(Debug, Default)]
pub struct Forward {
    signals: Mutex<Vec<i32>>,
}

impl Forward {
    pub fn new() -> Forward {
        Forward::default()
    }

    /// Adds a signal to pass on (a signal handler's thread calls it).
    pub fn push(&self, sig: i32) {
        self.lock().push(sig);
    }

    /// The signals received after the first `done`.
    pub fn since(&self, done: usize) -> Vec<i32> {
        self.lock()
            .get(done..)
            .map(<[i32]>::to_vec)
            .unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<i32>> {
        self.signals.lock().unwrap_or_else(|e| e.into_inner())
    }
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

/// Puts the child in a process group of its own and has the kernel kill it when the calling
/// thread ends (the module docs say why).
#[cfg(target_os = "linux")]
fn detach_from_terminal_but_not_from_us(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure makes only async-signal-safe calls (prctl,
    // getppid) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have ended before the prctl: then nobody would send the signal.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn detach_from_terminal_but_not_from_us(_cmd: &mut Command) {}

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

/// Whether a rank ended because it was asked to stop: 128 + SIGINT or SIGTERM (a handler that
/// stopped), or killed by one of them.
fn stopped_by_request(s: &ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        let asked = [libc::SIGINT, libc::SIGTERM];
        s.code()
            .is_some_and(|c| asked.iter().any(|sig| c == 128 + sig))
            || s.signal().is_some_and(|sig| asked.contains(&sig))
    }
    #[cfg(not(unix))]
    {
        let _ = s;
        false
    }
}

/// A failure that explains itself: not a peer-failed exit, nor a stop that was asked for.
fn real_failure(s: &ExitStatus) -> bool {
    s.code() != Some(i32::from(EXIT_PEER_FAILED)) && !stopped_by_request(s)
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
        detach_from_terminal_but_not_from_us(&mut cmd);
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
    let mut forwarded = 0;
    loop {
        if let Some(f) = &spec.forward {
            for sig in f.since(forwarded) {
                forwarded += 1;
                for r in running.iter_mut().filter(|r| r.exit.is_none()) {
                    signal_child(&r.child, sig);
                }
            }
        }
        for r in running.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                let now = Instant::now();
                r.exit = Some((now, status));
                if failed(&status) && !r.stopped {
                    let real = real_failure(&status);
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
        if let Some((when, real)) = first_failure.filter(|_| forwarded == 0) {
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
    // The explanation: earliest own failure, real errors before peer-failed exits and stops.
    let mut own: Vec<(&Running, &RankReport)> = running
        .iter()
        .zip(&reports)
        .filter(|(r, rep)| !r.stopped && rep.code != Some(0))
        .collect();
    if own.is_empty() {
        return Ok(reports);
    }
    own.sort_by_key(|(r, _)| {
        let (when, status) = r.exit.expect("exited");
        (!real_failure(&status), when)
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
