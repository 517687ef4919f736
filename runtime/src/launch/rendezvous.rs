//! Rendezvous: rank 0 hands a blob (the NCCL unique ids; any bytes on the CPU path) to every
//! other rank, after checking that each belongs to this job and agrees on the world size; then
//! the ranks stay connected so rank 0 can tell the others how the run ended.
//!
//! Two transports:
//! - **TCP** on `MASTER_ADDR:MASTER_PORT`. Rank 0 binds exactly that address (or the one in
//!   `TESSERA_RENDEZVOUS_BIND`), never every interface by default. Peers connect with retries
//!   until the timeout, say hello (magic, version, rank, world size, job token) and wait; rank 0
//!   rejects a hello with the wrong token, world size or rank, telling that peer why, and keeps
//!   waiting for the right ones. When all world − 1 peers are in, each gets the blob.
//! - **File** on a shared filesystem. Rank 0 writes `<path>` atomically (temporary file, then
//!   rename) with the token's digest, the world size, a fresh nonce and the blob; peers poll
//!   for it and answer with `<path>.ack.<rank>`; rank 0 polls for the answers, then removes
//!   the file (so a later run never reads a stale one: rank 0 refuses to start while one
//!   exists). The outcome is `<path>.done`.
//!
//! The token keeps jobs from joining each other by accident (same port, same file). It is not
//! authentication: whoever can reach the port and knows the token can join, so bind a private
//! interface. Frames are size-checked (at most [`MAX_FRAME`] bytes) before allocation.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Largest frame accepted (the blob of NCCL ids of a large mesh is a few hundred KiB).
pub const MAX_FRAME: usize = 16 << 20;
const MAGIC: &[u8; 4] = b"TSRV";
const VERSION: u8 = 1;
const HELLO: u8 = 1;
const ACCEPT: u8 = 2;
const REJECT: u8 = 3;
const DONE: u8 = 4;

/// How to meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// Rank 0 listens on `host:port` (or `bind:port`); the others connect to `host:port`.
    Tcp {
        host: String,
        port: u16,
        bind: Option<String>,
    },
    /// A file on a filesystem every rank sees.
    File { path: PathBuf },
}

/// One rank's side of the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub token: String,
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    pub transport: Transport,
}

/// Why the rendezvous failed. Every message names what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank 0 cannot listen on {addr}: {source}\n  fix: {fix}")]
    Bind {
        addr: String,
        source: std::io::Error,
        fix: String,
    },
    #[error("cannot resolve the rendezvous host {host:?}: {why}")]
    Resolve { host: String, why: String },
    #[error("rank {rank}: no rendezvous at {addr} after {secs:.0} s ({attempts} attempts; last error: {last})\n  fix: start rank 0, check MASTER_ADDR / MASTER_PORT, or raise TESSERA_RENDEZVOUS_TIMEOUT")]
    Connect {
        rank: usize,
        addr: String,
        attempts: u32,
        secs: f64,
        last: String,
    },
    #[error("rank 0: {have} of {need} ranks joined in {secs:.0} s; missing ranks {missing:?}{}", rejected_text(.rejected))]
    Timeout {
        have: usize,
        need: usize,
        secs: f64,
        missing: Vec<usize>,
        rejected: Vec<String>,
    },
    #[error("rank {rank}: rank 0 rejected this rank: {reason}")]
    Rejected { rank: usize, reason: String },
    #[error("rank {rank}: {what}")]
    Protocol { rank: usize, what: String },
    #[error("rank {rank}: {what}: {source}")]
    Io {
        rank: usize,
        what: String,
        source: std::io::Error,
    },
    #[error("rank 0 reported that the run failed: {message}")]
    RootFailed { message: String },
    #[error("rank {rank}: rank 0 went away before reporting how the run ended (it crashed or was stopped)")]
    RootGone { rank: usize },
    #[error("{0}")]
    Config(String),
}

fn rejected_text(r: &[String]) -> String {
    if r.is_empty() {
        String::new()
    } else {
        format!("; rejected: {}", r.join("; "))
    }
}

/// A stable 64-bit digest of the token (FNV-1a): what travels and what files hold.
pub fn token_digest(token: &str) -> u64 {
    crate::rng::fnv1a64(token.as_bytes())
}

/// After the blob arrived: the connections that carry the run's outcome.
#[derive(Debug)]
pub struct Session {
    kind: SessionKind,
}

#[derive(Debug)]
enum SessionKind {
    Single,
    TcpRoot(Vec<(usize, TcpStream)>),
    TcpPeer { rank: usize, stream: TcpStream },
    FileRoot { path: PathBuf, nonce: String },
    FilePeer { path: PathBuf, nonce: String },
}

/// What the rendezvous gave this rank.
#[derive(Debug)]
pub struct Joined {
    pub blob: Vec<u8>,
    pub session: Session,
}

/// Meets the other ranks. `root_blob` is called on rank 0 only, to make the blob.
pub fn rendezvous(
    cfg: &Config,
    root_blob: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Joined, RendezvousError> {
    if cfg.world == 0 || cfg.rank >= cfg.world {
        return Err(RendezvousError::Config(format!(
            "rank {} of a world of {}",
            cfg.rank, cfg.world
        )));
    }
    if cfg.token.is_empty() {
        return Err(RendezvousError::Config("empty job token".into()));
    }
    if cfg.rank == 0 {
        let blob = root_blob().map_err(RendezvousError::Config)?;
        if blob.len() > MAX_FRAME - 8 {
            return Err(RendezvousError::Config(format!(
                "blob of {} bytes exceeds {MAX_FRAME}",
                blob.len()
            )));
        }
        if cfg.world == 1 {
            return Ok(Joined {
                blob,
                session: Session {
                    kind: SessionKind::Single,
                },
            });
        }
        let kind = match &cfg.transport {
            Transport::Tcp { host, port, bind } => {
                tcp_root(cfg, bind.as_deref().unwrap_or(host), *port, &blob)?
            }
            Transport::File { path } => file_root(cfg, path, &blob)?,
        };
        return Ok(Joined {
            blob,
            session: Session { kind },
        });
    }
    match &cfg.transport {
        Transport::Tcp { host, port, .. } => tcp_peer(cfg, host, *port),
        Transport::File { path } => file_peer(cfg, path),
    }
}

mod file;

use file::{done_path, fields, file_peer, file_root, hex, unhex, write_atomic};

// ---------- TCP ----------

fn write_frame(s: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut payload = vec![0; len];
    s.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn hello(cfg: &Config) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(MAGIC);
    p.push(VERSION);
    p.extend_from_slice(&(cfg.rank as u32).to_be_bytes());
    p.extend_from_slice(&(cfg.world as u32).to_be_bytes());
    p.extend_from_slice(&token_digest(&cfg.token).to_be_bytes());
    p
}

/// (rank, world, token digest) from a hello payload.
fn parse_hello(p: &[u8]) -> Result<(usize, usize, u64), String> {
    if p.len() != 21 || &p[..4] != MAGIC {
        return Err("not a tessera rendezvous hello (another program on this port?)".into());
    }
    if p[4] != VERSION {
        return Err(format!(
            "protocol version {} (this tessera speaks {VERSION})",
            p[4]
        ));
    }
    let u = |i: usize| u32::from_be_bytes(p[i..i + 4].try_into().expect("4 bytes")) as usize;
    Ok((
        u(5),
        u(9),
        u64::from_be_bytes(p[13..21].try_into().expect("8 bytes")),
    ))
}

fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, RendezvousError> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Resolve {
            host: host.into(),
            why: e.to_string(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(RendezvousError::Resolve {
            host: host.into(),
            why: "no address".into(),
        });
    }
    Ok(addrs)
}

/// Rank 0: listens on `host:port` — exactly that address — until every peer has said hello.
fn tcp_root(
    cfg: &Config,
    host: &str,
    port: u16,
    blob: &[u8],
) -> Result<SessionKind, RendezvousError> {
    let addrs = resolve(host, port)?;
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| RendezvousError::Bind {
        addr: format!("{host}:{port}"),
        source: e,
        fix: "MASTER_ADDR must be an address of rank 0's own machine and MASTER_PORT a free port (set TESSERA_RENDEZVOUS_BIND to listen on another local address)".into(),
    })?;
    let io = |what: &str| {
        let what = what.to_string();
        move |e| RendezvousError::Io {
            rank: 0,
            what,
            source: e,
        }
    };
    listener.set_nonblocking(true).map_err(io("listener"))?;
    let start = Instant::now();
    let mut peers: BTreeMap<usize, TcpStream> = BTreeMap::new();
    let mut rejected = Vec::new();
    let digest = token_digest(&cfg.token);
    while peers.len() + 1 < cfg.world {
        let elapsed = start.elapsed();
        if elapsed > cfg.timeout {
            return Err(RendezvousError::Timeout {
                have: peers.len() + 1,
                need: cfg.world,
                secs: elapsed.as_secs_f64(),
                missing: (1..cfg.world).filter(|r| !peers.contains_key(r)).collect(),
                rejected,
            });
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(io("accept")(e)),
        };
        s.set_nonblocking(false).map_err(io("socket"))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(io("socket"))?;
        s.set_nodelay(true).ok();
        let verdict = match read_frame(&mut s) {
            Ok((HELLO, p)) => parse_hello(&p).and_then(|(rank, world, token)| {
                if token != digest {
                    Err(format!("wrong job token (rank {rank} from {from} belongs to another job, or TESSERA_JOB_TOKEN differs)"))
                } else if world != cfg.world {
                    Err(format!("rank {rank} from {from} says the world has {world} ranks, rank 0 says {}", cfg.world))
                } else if rank == 0 || rank >= cfg.world {
                    Err(format!("rank {rank} from {from} is not a peer rank (1..{})", cfg.world))
                } else if peers.contains_key(&rank) {
                    Err(format!("rank {rank} joined twice (again from {from})"))
                } else {
                    Ok(rank)
                }
            }),
            Ok((k, _)) => Err(format!("unexpected frame {k} from {from}")),
            Err(e) => Err(format!("no hello from {from}: {e}")),
        };
        match verdict {
            Ok(rank) => {
                s.set_read_timeout(None).map_err(io("socket"))?;
                peers.insert(rank, s);
            }
            Err(reason) => {
                write_frame(&mut s, REJECT, reason.as_bytes()).ok();
                rejected.push(reason);
            }
        }
    }
    let mut out = Vec::new();
    for (rank, mut s) in peers {
        write_frame(&mut s, ACCEPT, blob)
            .map_err(io(&format!("sending the blob to rank {rank}")))?;
        out.push((rank, s));
    }
    Ok(SessionKind::TcpRoot(out))
}

/// A peer: connects (retrying until the timeout), says hello, waits for the blob.
fn tcp_peer(cfg: &Config, host: &str, port: u16) -> Result<Joined, RendezvousError> {
    let rank = cfg.rank;
    let start = Instant::now();
    let (mut attempts, mut wait) = (0u32, Duration::from_millis(20));
    let mut stream = loop {
        attempts += 1;
        let last = match resolve(host, port) {
            Ok(addrs) => {
                let mut last = String::new();
                let mut got = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                        Ok(s) => {
                            got = Some(s);
                            break;
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                match got {
                    Some(s) => break s,
                    None => last,
                }
            }
            // DNS may not be up yet either: retry like a refused connection.
            Err(e) => e.to_string(),
        };
        if start.elapsed() + wait > cfg.timeout {
            return Err(RendezvousError::Connect {
                rank,
                addr: format!("{host}:{port}"),
                attempts,
                secs: start.elapsed().as_secs_f64(),
                last,
            });
        }
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(1));
    };
    let io = |what: &'static str| {
        move |e| RendezvousError::Io {
            rank,
            what: what.into(),
            source: e,
        }
    };
    stream.set_nodelay(true).ok();
    write_frame(&mut stream, HELLO, &hello(cfg)).map_err(io("sending hello to rank 0"))?;
    // Rank 0 answers when every rank has joined: wait as long as it would.
    let left = cfg
        .timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_secs(1));
    stream
        .set_read_timeout(Some(left + Duration::from_secs(5)))
        .map_err(io("socket"))?;
    match read_frame(&mut stream) {
        Ok((ACCEPT, blob)) => {
            stream.set_read_timeout(None).map_err(io("socket"))?;
            Ok(Joined { blob, session: Session { kind: SessionKind::TcpPeer { rank, stream } } })
        }
        Ok((REJECT, why)) => Err(RendezvousError::Rejected { rank, reason: String::from_utf8_lossy(&why).into_owned() }),
        Ok((k, _)) => Err(RendezvousError::Protocol { rank, what: format!("unexpected frame {k} from rank 0") }),
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Err(RendezvousError::RootGone { rank }),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Err(RendezvousError::Protocol {
            rank,
            what: format!("rank 0 accepted the connection but sent no blob within {:.0} s (not all ranks joined?)", cfg.timeout.as_secs_f64()),
        }),
        Err(e) => Err(io("waiting for the blob")(e)),
    }
}

// ---------- the run's outcome ----------

impl Session {
    /// Rank 0: tells every peer how the run ended (`Err(message)` for a failure). Peers that
    /// are already gone are skipped.
    pub fn finish(self, outcome: Result<(), String>) -> Result<(), RendezvousError> {
        let payload: Vec<u8> = match &outcome {
            Ok(()) => vec![1],
            Err(m) => std::iter::once(0)
                .chain(m.bytes().take(MAX_FRAME / 2))
                .collect(),
        };
        match self.kind {
            SessionKind::TcpRoot(peers) => {
                for (_, mut s) in peers {
                    write_frame(&mut s, DONE, &payload).ok();
                }
                Ok(())
            }
            SessionKind::FileRoot { path, nonce } => {
                let text = format!(
                    "nonce {nonce}\nok {}\nmessage {}\n",
                    u8::from(outcome.is_ok()),
                    hex(&payload[1..])
                );
                write_atomic(&done_path(&path), &text).map_err(|e| RendezvousError::Io {
                    rank: 0,
                    what: "writing the outcome".into(),
                    source: e,
                })
            }
            _ => Ok(()),
        }
    }

    /// A peer: waits (without a time limit) until rank 0 reports the outcome.
    pub fn wait(self) -> Result<(), RendezvousError> {
        match self.kind {
            SessionKind::TcpPeer { rank, mut stream } => match read_frame(&mut stream) {
                Ok((DONE, p)) if p.first() == Some(&1) => Ok(()),
                Ok((DONE, p)) => Err(RendezvousError::RootFailed {
                    message: String::from_utf8_lossy(p.get(1..).unwrap_or_default()).into_owned(),
                }),
                Ok((k, _)) => Err(RendezvousError::Protocol {
                    rank,
                    what: format!("unexpected frame {k} from rank 0"),
                }),
                Err(_) => Err(RendezvousError::RootGone { rank }),
            },
            SessionKind::FilePeer { path, nonce } => loop {
                if let Ok(text) = std::fs::read_to_string(done_path(&path)) {
                    let f = fields(&text);
                    if f.get("nonce") == Some(&nonce.as_str()) {
                        return match f.get("ok") {
                            Some(&"1") => Ok(()),
                            _ => Err(RendezvousError::RootFailed {
                                message: f
                                    .get("message")
                                    .and_then(|m| unhex(m))
                                    .map(|m| String::from_utf8_lossy(&m).into_owned())
                                    .unwrap_or_default(),
                            }),
                        };
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            },
            _ => Ok(()),
        }
    }

    /// Whether this rank is rank 0's side (or alone).
    pub fn is_root(&self) -> bool {
        matches!(
            self.kind,
            SessionKind::Single | SessionKind::TcpRoot(_) | SessionKind::FileRoot { .. }
        )
    }
}

#[cfg(test)]
#[path = "rendezvous_tests.rs"]
mod tests;
