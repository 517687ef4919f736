//! SIGINT and SIGTERM, handled in one place for every command that must end cleanly.
//!
//! The first signal asks the run to stop after the step in progress ([`Stop::request`]: every
//! rank stops at the same step boundary); the command then flushes its streams, closes its
//! trace, and exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), as shells
//! expect. A second signal exits at once: the metrics stream is flushed a whole line per step,
//! so even then no line is torn. Checkpoints will add their save to the same path: after
//! `exec::train` returns, before [`Interrupts::exit_code`] is returned.

use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use anyhow::Context;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tessera_runtime::exec::Stop;

/// The handler of SIGINT and SIGTERM for the rest of the process.
pub struct Interrupts {
    received: Arc<AtomicI32>,
}

impl Interrupts {
    /// Installs the handler for a training run: a signal requests `stop`; a second one exits
    /// at once.
    pub fn for_run(stop: Arc<Stop>) -> anyhow::Result<Interrupts> {
        Interrupts::install(move |sig| {
            let steps = stop.request();
            eprintln!(
                "\n{}: stopping after step {steps} (the steps in progress finish on every rank); send it again to stop at once",
                Interrupts::name(sig)
            );
        })
    }

    /// Installs the handler: the first signal calls `on_first`; a second one exits at once.
    pub fn install(on_first: impl Fn(i32) + Send + 'static) -> anyhow::Result<Interrupts> {
        let received = Arc::new(AtomicI32::new(0));
        let mut signals =
            Signals::new([SIGINT, SIGTERM]).context("cannot install the signal handler")?;
        let seen = received.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    if seen
                        .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                    {
                        on_first(sig);
                    } else {
                        eprintln!("\n{}: stopping now", Interrupts::name(sig));
                        std::process::exit(128 + sig);
                    }
                }
            })
            .context("cannot start the signal thread")?;
        Ok(Interrupts { received })
    }

    /// The first signal received (0 until then), shared with whoever must act on it.
    pub fn flag(&self) -> Arc<AtomicI32> {
        self.received.clone()
    }

    /// The first signal received, if any.
    pub fn received(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
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
            _ => "signal",
        }
    }
}
