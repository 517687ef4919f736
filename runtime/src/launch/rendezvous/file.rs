//! The shared-file rendezvous (see the parent module): rank 0 writes `<path>` atomically with
//! the token's digest, the world size, a nonce and the blob; peers answer with
//! `<path>.ack.<rank>`; rank 0 removes the file once everyone answered (and refuses to start
//! while one exists, so no run reads a stale one); the outcome goes to `<path>.done`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{token_digest, Config, Joined, RendezvousError, Session, SessionKind};

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Writes `text` to `path` atomically: a temporary file in the same folder, then a rename.
pub(super) fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        std::fs::remove_file(&tmp).ok();
    })
}

pub(super) fn fields(text: &str) -> BTreeMap<&str, &str> {
    text.lines().filter_map(|l| l.split_once(' ')).collect()
}

fn ack_path(path: &Path, rank: usize) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{name}.ack.{rank}"))
}

pub(super) fn done_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{name}.done"))
}

pub(super) fn file_root(
    cfg: &Config,
    path: &Path,
    blob: &[u8],
) -> Result<SessionKind, RendezvousError> {
    let io = |what: String| {
        move |e| RendezvousError::Io {
            rank: 0,
            what,
            source: e,
        }
    };
    // Rank 0 removes the file once every rank has read it: one still there is another job's
    // live rendezvous or a crashed run's, and peers may already have read it.
    if path.exists() {
        return Err(RendezvousError::Config(format!(
            "the rendezvous file {} already exists (another job is using it, or an earlier run crashed)\n  fix: use a path unique to this run, or delete the file if no job is using it",
            path.display()
        )));
    }
    let nonce = crate::launch::new_token();
    std::fs::remove_file(done_path(path)).ok();
    for r in 1..cfg.world {
        std::fs::remove_file(ack_path(path, r)).ok();
    }
    let text = format!(
        "tessera-rendezvous 1\ntoken {:016x}\nworld {}\nnonce {nonce}\nblob {}\n",
        token_digest(&cfg.token),
        cfg.world,
        hex(blob)
    );
    write_atomic(path, &text).map_err(io(format!("writing {}", path.display())))?;
    let start = Instant::now();
    let mut joined = vec![false; cfg.world];
    joined[0] = true;
    let mut rejected: BTreeMap<usize, String> = BTreeMap::new();
    let digest = format!("{:016x}", token_digest(&cfg.token));
    while joined.iter().any(|j| !j) {
        for (r, j) in joined.iter_mut().enumerate().skip(1).filter(|(_, j)| !**j) {
            let Ok(text) = std::fs::read_to_string(ack_path(path, r)) else {
                continue;
            };
            let f = fields(&text);
            if f.get("nonce") != Some(&nonce.as_str()) {
                continue; // an answer to an earlier rendezvous at this path
            }
            if f.get("token") != Some(&digest.as_str()) {
                rejected.insert(r, format!("rank {r} answered with another job's token"));
            } else if f.get("world").and_then(|w| w.parse().ok()) != Some(cfg.world) {
                rejected.insert(
                    r,
                    format!(
                        "rank {r} says the world has {} ranks",
                        f.get("world").unwrap_or(&"?")
                    ),
                );
            } else {
                *j = true;
            }
        }
        if start.elapsed() > cfg.timeout {
            std::fs::remove_file(path).ok();
            return Err(RendezvousError::Timeout {
                have: joined.iter().filter(|j| **j).count(),
                need: cfg.world,
                secs: start.elapsed().as_secs_f64(),
                missing: (0..cfg.world).filter(|&r| !joined[r]).collect(),
                rejected: rejected.into_values().collect(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every rank has the blob: remove the file so no later run reads it.
    std::fs::remove_file(path).ok();
    for r in 1..cfg.world {
        std::fs::remove_file(ack_path(path, r)).ok();
    }
    Ok(SessionKind::FileRoot {
        path: path.to_path_buf(),
        nonce,
    })
}

pub(super) fn file_peer(cfg: &Config, path: &Path) -> Result<Joined, RendezvousError> {
    let rank = cfg.rank;
    let start = Instant::now();
    let digest = format!("{:016x}", token_digest(&cfg.token));
    let mut foreign = false;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let f = fields(&text);
            if f.get("token") == Some(&digest.as_str()) {
                let world = f.get("world").and_then(|w| w.parse::<usize>().ok());
                if world != Some(cfg.world) {
                    return Err(RendezvousError::Rejected {
                        rank,
                        reason: format!(
                            "{} says the world has {} ranks, this rank says {}",
                            path.display(),
                            f.get("world").unwrap_or(&"?"),
                            cfg.world
                        ),
                    });
                }
                let (Some(nonce), Some(blob)) =
                    (f.get("nonce"), f.get("blob").and_then(|b| unhex(b)))
                else {
                    return Err(RendezvousError::Protocol {
                        rank,
                        what: format!("{} is damaged", path.display()),
                    });
                };
                let ack = format!("tessera-rendezvous-ack 1\ntoken {digest}\nworld {}\nrank {rank}\nnonce {nonce}\n", cfg.world);
                write_atomic(&ack_path(path, rank), &ack).map_err(|e| RendezvousError::Io {
                    rank,
                    what: "writing the answer".into(),
                    source: e,
                })?;
                let session = SessionKind::FilePeer {
                    path: path.to_path_buf(),
                    nonce: nonce.to_string(),
                };
                return Ok(Joined {
                    blob,
                    session: Session { kind: session },
                });
            }
            foreign = true;
        }
        if start.elapsed() > cfg.timeout {
            let what = if foreign {
                format!("{} holds another job's rendezvous (token differs) and this job's rank 0 did not replace it within {:.0} s", path.display(), cfg.timeout.as_secs_f64())
            } else {
                format!("{} did not appear within {:.0} s: is rank 0 running, and is the path on a filesystem every rank sees?", path.display(), cfg.timeout.as_secs_f64())
            };
            return Err(RendezvousError::Protocol { rank, what });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
