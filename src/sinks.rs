//! Outputs that stay open while a command works: `tessera run`'s `--metrics` as a line stream
//! and `--trace` as closed Chrome-trace JSON, opened just before the first step and closed on
//! every way the run ends (the module comment of `commands::run` has the rule). Built on
//! `crate::files` (how a file is written) and `crate::signals` (when the process may stop).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use tessera_runtime::exec::trace::chrome_trace_stopped;
use tessera_runtime::exec::{chrome_trace, TraceEvent};

use crate::files::{write_output, LineStream};
use crate::signals::{lock_until, Interrupts, EXIT_GRACE};

/// Where the trace goes when the run ends.
enum TraceSink {
    /// A regular (or new) file, replaced atomically, or `-` (stdout): written at the end.
    Replace(PathBuf),
    /// A FIFO or a device, opened before the first step and written in place.
    InPlace(PathBuf, File),
}

/// The run's outputs, open from just before the first step until the process ends. The lock
/// is what an exit at once waits for (within [`EXIT_GRACE`]): a metrics line or the trace
/// being written is finished first.
pub struct Outputs {
    open: Mutex<Open>,
}

struct Open {
    metrics: Option<LineStream>,
    trace: Option<TraceSink>,
}

fn cannot_write(path: &Path, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!(
        "{}: cannot write: {e}\n  fix: check that the folder exists, is writable and has free space",
        path.display()
    )
}

/// Whether `path` names a FIFO (after every link).
fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// Whether `path` names something that is written in place: a FIFO or a device.
fn is_special(path: &Path) -> bool {
    path.as_os_str() != "-" && std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Opens the FIFO `path` for writing. open(2) would block until a reader opens it, and a
/// signal could not end that wait; so it opens without blocking, retrying every 50 ms while
/// there is no reader (ENXIO), and says once what it waits for. A signal meanwhile exits at
/// once (`crate::signals`: the run has not begun). Writes then block as on any file.
fn open_fifo(flag: &str, path: &Path, interrupts: &Interrupts) -> anyhow::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let mut said = false;
    loop {
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path);
        match opened {
            Ok(f) => {
                let fd = f.as_raw_fd();
                // SAFETY: fcntl(2) on a descriptor this function owns.
                let cleared = unsafe {
                    let flags = libc::fcntl(fd, libc::F_GETFL);
                    flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
                };
                if !cleared {
                    return Err(cannot_write(path, std::io::Error::last_os_error()));
                }
                if said {
                    interrupts.waiting_for(None);
                    eprintln!("{flag} {}: a reader opened it", path.display());
                }
                return Ok(f);
            }
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                if let Some(sig) = interrupts.received() {
                    bail!(
                        "{}: stopped while waiting for a reader of the FIFO {flag} {}",
                        Interrupts::name(sig),
                        path.display()
                    );
                }
                if !said {
                    said = true;
                    interrupts.waiting_for(Some(format!(
                        "before the first step, waiting for a reader of the FIFO {flag} {}; nothing was written",
                        path.display()
                    )));
                    eprintln!(
                        "{flag} {}: a FIFO with no reader yet; waiting for one to open it (Ctrl-C stops)",
                        path.display()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(cannot_write(path, e)),
        }
    }
}

impl Outputs {
    /// Opens `--metrics` and, when it is a FIFO or a device, `--trace` (a regular trace file is
    /// replaced atomically at the end).
    pub fn open(
        metrics: Option<&Path>,
        trace: Option<&Path>,
        interrupts: &Interrupts,
    ) -> anyhow::Result<Outputs> {
        let metrics = match metrics {
            None => None,
            Some(p) if is_fifo(p) => Some(LineStream::from_file(
                p,
                open_fifo("--metrics", p, interrupts)?,
            )),
            Some(p) => Some(LineStream::open(p)?),
        };
        let trace = match trace {
            None => None,
            Some(p) if is_fifo(p) => Some(TraceSink::InPlace(
                p.to_path_buf(),
                open_fifo("--trace", p, interrupts)?,
            )),
            Some(p) if is_special(p) => Some(TraceSink::InPlace(
                p.to_path_buf(),
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| cannot_write(p, e))?,
            )),
            Some(p) => Some(TraceSink::Replace(p.to_path_buf())),
        };
        Ok(Outputs {
            open: Mutex::new(Open { metrics, trace }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes one metrics line, whole, if metrics are asked for.
    pub fn line(&self, text: &str) -> anyhow::Result<()> {
        match self.lock().metrics.as_mut() {
            Some(m) => m.line(text),
            None => Ok(()),
        }
    }

    /// Writes and closes the trace, once: the whole document, or with `why` it stopped early.
    /// Returns the path written, if a trace was asked for and not written yet.
    pub fn close_trace(
        &self,
        events: &[TraceEvent],
        why: Option<&str>,
    ) -> anyhow::Result<Option<PathBuf>> {
        let sink = self.lock().trace.take();
        write_trace(sink, events, why)
    }

    /// An exit at once (a second signal): closes the trace without the ops of the steps in
    /// progress, waiting for a line or trace being written, within [`EXIT_GRACE`].
    pub fn close_at_once(&self, sig: i32) {
        let Some(mut open) = lock_until(&self.open, Instant::now() + EXIT_GRACE) else {
            return;
        };
        let sink = open.trace.take();
        drop(open);
        let why = format!(
            "stopped at once by a second {}: the ops of the run were not collected",
            Interrupts::name(sig)
        );
        match write_trace(sink, &[], Some(&why)) {
            Ok(Some(path)) => {
                eprintln!("wrote {} (closed, without the ops: {why})", path.display())
            }
            Ok(None) => {}
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
}

fn write_trace(
    sink: Option<TraceSink>,
    events: &[TraceEvent],
    why: Option<&str>,
) -> anyhow::Result<Option<PathBuf>> {
    let Some(sink) = sink else {
        return Ok(None);
    };
    let doc = match why {
        None => chrome_trace(events),
        Some(why) => chrome_trace_stopped(events, why),
    };
    match sink {
        TraceSink::Replace(path) => {
            write_output(&path, doc.as_bytes())?;
            Ok(Some(path))
        }
        TraceSink::InPlace(path, mut f) => {
            f.write_all(doc.as_bytes())
                .and_then(|()| f.flush())
                .map_err(|e| cannot_write(&path, e))?;
            Ok(Some(path))
        }
    }
}
