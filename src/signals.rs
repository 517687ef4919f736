//! SIGINT and SIGTERM, handled in one place for every command that must end cleanly.
//!
//! **Requests, not signals.** What counts is the number of *requests* to stop, and one request
//! can arrive as two signals: Ctrl-C sends SIGINT to every process of the terminal's foreground
//! group, and a job controller (Slurm's `scancel`, a cgroup kill, torchrun) signals every
//! process of a job, while the launcher above a rank passes on what it received. So a signal
//! from this process's parent that arrives within [`COPY_WINDOW`] of the same signal from
//! elsewhere is a copy of that request, not a second one, whichever of the two comes first
//! (the sender is read from the signal's `siginfo`; each signal pairs with at most one copy).
//! Two signals from the same origin — two Ctrl-Cs, or a launcher passing on two — are two
//! requests.
//!
//! **One path per process group.** `tessera launch` starts its rank processes in process groups
//! of their own (runtime `launch::supervise`), so the terminal's signals reach the launcher only;
//! it passes each request on exactly once, and the ranks die with it (`PR_SET_PDEATHSIG`).
//! Deduplicating by origin is what keeps the ranks right where they share a signal with the
//! launcher anyway (a job controller).
//!
//! **What a request does.** For `tessera run` ([`Interrupts::for_run`]), installed before any
//! output is opened:
//! - before the run begins (reading the plan, the rendezvous, loading data, waiting for a
//!   FIFO's reader), the first request exits at once: nothing has been written yet;
//! - once the run is armed ([`Interrupts::arm`], just before the first step, outputs open), the
//!   first request asks the run to stop after the step in progress ([`Stop::request`]: every
//!   rank stops at the same step boundary); the command then flushes its streams, closes its
//!   trace, and exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as shells
//!   expect;
//! - a second request exits at once. Before it does, the closers registered with
//!   [`Interrupts::on_exit`] run (the trace is written as closed JSON, saying why it stopped;
//!   it holds no ops, since the ranks hand theirs over only when the run returns), and file
//!   operations inside [`uninterrupted`] are let finish, so no output is left torn and no
//!   temporary file behind. Both waits are bounded ([`EXIT_GRACE`]): a stuck reader cannot
//!   keep the process alive.
//!
//! For `tessera launch` ([`Interrupts::for_launcher`]): before its ranks start, a request exits
//! at once; after, every request is passed on to every rank still running (the first: they
//! finish their step; the second: they stop at once), and a third kills them and exits.
//! Checkpoints will add their save to the run's path: after `exec::train` returns, before
//! [`Interrupts::exit_code`] is returned.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithRawSiginfo;
use signal_hook::iterator::SignalsInfo;
use tessera_runtime::exec::Stop;
use tessera_runtime::launch::supervise::Forward;

/// How close a parent's copy of a signal follows (or precedes) the original.
pub const COPY_WINDOW: Duration = Duration::from_secs(3);

/// The longest an exit at once waits for a file operation to finish and for the closers.
pub const EXIT_GRACE: Duration = Duration::from_secs(3);

/// Held around file operations that an exit at once must not cut in half (see
/// [`uninterrupted`]).
static QUIET: Mutex<()> = Mutex::new(());

/// Runs `f` (a file operation: a probe file, an atomic replace) so that an exit at once waits
/// for it to finish, up to [`EXIT_GRACE`]. Not reentrant; closers must not call it.
pub fn uninterrupted<T>(f: impl FnOnce() -> T) -> T {
    let _quiet = QUIET.lock().unwrap_or_else(|e| e.into_inner());
    f()
}

/// Locks `m`, waiting no later than `deadline`.
pub fn lock_until<T>(m: &Mutex<T>, deadline: Instant) -> Option<MutexGuard<'_, T>> {
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

/// Where a signal came from, as far as telling copies apart needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `kill` by this process's parent (a launcher passing a signal on).
    Parent,
    /// Anyone else: the terminal (the kernel), a user's `kill`, a job controller.
    Other,
}

#[derive(Debug)]
struct Seen {
    sig: i32,
    origin: Origin,
    at: Instant,
    paired: bool,
}

/// The recent signals, to tell a copy from a new request.
#[derive(Debug, Default)]
pub struct Copies {
    seen: Vec<Seen>,
}

impl Copies {
    /// Whether `sig` from `origin`, arriving `at`, is a copy of a signal already counted: the
    /// same signal from the other origin within [`COPY_WINDOW`], not yet paired. A signal that
    /// is not a copy is remembered as a request.
    pub fn is_copy(&mut self, sig: i32, origin: Origin, at: Instant) -> bool {
        self.seen
            .retain(|s| at.saturating_duration_since(s.at) < COPY_WINDOW);
        if let Some(s) = self
            .seen
            .iter_mut()
            .find(|s| !s.paired && s.sig == sig && s.origin != origin)
        {
            s.paired = true;
            return true;
        }
        self.seen.push(Seen {
            sig,
            origin,
            at,
            paired: false,
        });
        false
    }
}

/// The origin of a delivered signal: `kill(2)` by `parent`, or anything else.
fn origin(info: &libc::siginfo_t, parent: libc::pid_t) -> Origin {
    // SI_USER (kill), SI_QUEUE and SI_TKILL are 0 or below and carry the sender's pid; the
    // kernel's own signals (the terminal's Ctrl-C: SI_KERNEL) carry none.
    // SAFETY: si_pid is the sender's pid for the codes tested first.
    if info.si_code <= 0 && unsafe { info.si_pid() } == parent && parent > 1 {
        Origin::Parent
    } else {
        Origin::Other
    }
}

type Closer = Box<dyn FnOnce(i32) + Send>;

enum Role {
    /// `tessera run`: the run's stop, once armed.
    Run { stop: Mutex<Option<Arc<Stop>>> },
    /// `tessera launch`: where the supervisor picks up the requests to pass on.
    Launcher {
        forward: Arc<Forward>,
        armed: AtomicBool,
    },
}

struct Shared {
    role: Role,
    /// The first request's signal (0 until then).
    first: AtomicI32,
    requests: AtomicUsize,
    closers: Mutex<Vec<Closer>>,
    /// What the process waits for before the run begins, for the message of an exit then.
    waiting: Mutex<Option<String>>,
}

/// The handler of SIGINT and SIGTERM for the rest of the process.
pub struct Interrupts {
    shared: Arc<Shared>,
}

impl Interrupts {
    /// Installs the handler for `tessera run` (see the module docs): exit at once until
    /// [`Interrupts::arm`], then stop after the step on the first request and exit at once on
    /// the second.
    pub fn for_run() -> anyhow::Result<Interrupts> {
        Interrupts::install(Role::Run {
            stop: Mutex::new(None),
        })
    }

    /// Installs the handler for `tessera launch`: requests go to `forward` once
    /// [`Interrupts::arm_forwarding`] is called (exit at once before), a third exits.
    pub fn for_launcher(forward: Arc<Forward>) -> anyhow::Result<Interrupts> {
        Interrupts::install(Role::Launcher {
            forward,
            armed: AtomicBool::new(false),
        })
    }

    fn install(role: Role) -> anyhow::Result<Interrupts> {
        let shared = Arc::new(Shared {
            role,
            first: AtomicI32::new(0),
            requests: AtomicUsize::new(0),
            closers: Mutex::new(Vec::new()),
            waiting: Mutex::new(None),
        });
        let mut signals = SignalsInfo::<WithRawSiginfo>::new([SIGINT, SIGTERM])
            .context("cannot install the signal handler")?;
        // SAFETY: getppid(2) cannot fail.
        let parent = unsafe { libc::getppid() };
        let s = shared.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut copies = Copies::default();
                for info in signals.forever() {
                    let sig = info.si_signo;
                    if copies.is_copy(sig, origin(&info, parent), Instant::now()) {
                        continue;
                    }
                    s.request(sig);
                }
            })
            .context("cannot start the signal thread")?;
        Ok(Interrupts { shared })
    }

    /// The run begins: from now on a first request stops it after the step in progress.
    pub fn arm(&self, stop: Arc<Stop>) {
        if let Role::Run { stop: slot } = &self.shared.role {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(stop.clone());
        }
        // A request that came before is honoured now: no step runs.
        if self.received().is_some() {
            stop.request();
        }
    }

    /// The ranks are about to start: from now on requests are passed on to them.
    pub fn arm_forwarding(&self) {
        if let Role::Launcher { armed, .. } = &self.shared.role {
            armed.store(true, Ordering::SeqCst);
        }
    }

    /// Registers a closer that an exit at once runs first (in another thread, for at most
    /// [`EXIT_GRACE`]), with the signal; it must not call [`uninterrupted`].
    pub fn on_exit(&self, closer: impl FnOnce(i32) + Send + 'static) {
        self.shared
            .closers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(closer));
    }

    /// Says what the process is waiting for (or `None` once it is not), for the message of a
    /// request that ends the wait.
    pub fn waiting_for(&self, what: Option<String>) {
        *self
            .shared
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = what;
    }

    /// The first request's signal, shared with whoever must act on it.
    pub fn received(&self) -> Option<i32> {
        match self.shared.first.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// The exit code after a signal: 128 + its number.
    pub fn exit_code(sig: i32) -> ExitCode {
        ExitCode::from((128 + sig) as u8)
    }

    pub fn name(sig: i32) -> &'static str {
        match sig {
            SIGINT => "SIGINT",
            SIGTERM => "SIGTERM",
            libc::SIGKILL => "SIGKILL",
            _ => "signal",
        }
    }
}

impl Shared {
    /// One request (copies already dropped).
    fn request(&self, sig: i32) {
        let n = self.requests.fetch_add(1, Ordering::SeqCst) + 1;
        self.first
            .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
            .ok();
        let name = Interrupts::name(sig);
        match &self.role {
            Role::Run { stop } => {
                let stop = stop.lock().unwrap_or_else(|e| e.into_inner()).clone();
                match (n, stop) {
                    (1, Some(stop)) => {
                        let steps = stop.request();
                        eprintln!(
                            "\n{name}: stopping after step {steps} (the steps in progress finish on every rank); send it again to stop at once"
                        );
                    }
                    (1, None) => {
                        let waiting = self
                            .waiting
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .clone();
                        let why = waiting.unwrap_or_else(|| "before the first step".into());
                        self.exit_now(sig, &format!("{name}: stopping now ({why})"));
                    }
                    _ => self.exit_now(
                        sig,
                        &format!("{name}: stopping now, without finishing the step in progress"),
                    ),
                }
            }
            Role::Launcher { forward, armed } => {
                if !armed.load(Ordering::SeqCst) {
                    self.exit_now(
                        sig,
                        &format!("{name}: stopping now (no rank process had started)"),
                    );
                }
                match n {
                    1 => {
                        forward.push(sig);
                        eprintln!(
                            "\n{name}: passing it on to the rank processes, which finish their step and stop; send it again to stop them at once"
                        );
                    }
                    2 => {
                        forward.push(sig);
                        eprintln!(
                            "\n{name}: passing it on again: the rank processes stop at once; a third signal kills them"
                        );
                    }
                    _ => {
                        forward.push(libc::SIGKILL);
                        // The supervisor passes SIGKILL on within a few milliseconds; the
                        // ranks also die with this process (PR_SET_PDEATHSIG, on Linux).
                        std::thread::sleep(Duration::from_millis(200));
                        self.exit_now(
                            sig,
                            &format!("{name}: stopping now; the rank processes are killed"),
                        );
                    }
                }
            }
        }
    }

    /// Exits with 128 + `sig` after the file operation in progress and the closers, each
    /// given until [`EXIT_GRACE`] has passed.
    fn exit_now(&self, sig: i32, message: &str) -> ! {
        eprintln!("\n{message}");
        let deadline = Instant::now() + EXIT_GRACE;
        let _quiet = lock_until(&QUIET, deadline);
        let closers = std::mem::take(&mut *self.closers.lock().unwrap_or_else(|e| e.into_inner()));
        if !closers.is_empty() {
            let (tx, rx) = mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name("closers".into())
                .spawn(move || {
                    for c in closers {
                        c(sig);
                    }
                    tx.send(()).ok();
                });
            if spawned.is_ok() {
                rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .ok();
            }
        }
        std::process::exit(128 + sig)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launchers_copy_of_a_terminal_signal_is_not_a_second_request() {
        let t = Instant::now();
        let mut c = Copies::default();
        assert!(!c.is_copy(SIGINT, Origin::Other, t));
        assert!(c.is_copy(SIGINT, Origin::Parent, t + Duration::from_millis(15)));
        // The copy may also come first.
        let mut c = Copies::default();
        assert!(!c.is_copy(SIGTERM, Origin::Parent, t));
        assert!(c.is_copy(SIGTERM, Origin::Other, t + Duration::from_millis(1)));
    }

    #[test]
    fn two_signals_from_one_origin_are_two_requests() {
        let t = Instant::now();
        for origin in [Origin::Parent, Origin::Other] {
            let mut c = Copies::default();
            assert!(!c.is_copy(SIGINT, origin, t));
            assert!(!c.is_copy(SIGINT, origin, t + Duration::from_millis(10)));
        }
    }

    #[test]
    fn each_signal_pairs_with_one_copy_only() {
        // Two Ctrl-Cs through a terminal that also reaches the launcher: four signals, two
        // requests.
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut c = Copies::default();
        let requests = [
            (Origin::Other, 0),
            (Origin::Parent, 10),
            (Origin::Other, 300),
            (Origin::Parent, 310),
        ]
        .iter()
        .filter(|(o, at)| !c.is_copy(SIGINT, *o, t + ms(*at)))
        .count();
        assert_eq!(requests, 2);
    }

    #[test]
    fn a_different_signal_or_a_late_one_is_a_new_request() {
        let t = Instant::now();
        let mut c = Copies::default();
        assert!(!c.is_copy(SIGINT, Origin::Other, t));
        assert!(!c.is_copy(SIGTERM, Origin::Parent, t));
        let mut c = Copies::default();
        assert!(!c.is_copy(SIGINT, Origin::Other, t));
        assert!(!c.is_copy(SIGINT, Origin::Parent, t + COPY_WINDOW));
    }
}
