//! The launch environment of one rank, as torchrun, Slurm or `tessera launch` set it.
//!
//! - torchrun (and `tessera launch`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`.
//! - Slurm (`srun`, one task per rank): `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, and
//!   `SLURM_NTASKS_PER_NODE` or `SLURM_TASKS_PER_NODE` with `SLURM_NODEID` for the ranks on this
//!   node. Slurm sets no master address: export `MASTER_ADDR` / `MASTER_PORT` in the batch
//!   script. When both are present, torchrun's variables win (torchrun inside an allocation).
//! - Tessera: `TESSERA_JOB_TOKEN` (else `slurm-$SLURM_JOB_ID`, else torchrun's
//!   `TORCHELASTIC_RUN_ID` unless it is the default "none"), `TESSERA_RENDEZVOUS` (`tcp`, the
//!   default, or `file:<path>`), `TESSERA_RENDEZVOUS_TIMEOUT` (seconds, default 300),
//!   `TESSERA_RENDEZVOUS_BIND` (an address for rank 0 to bind instead of `MASTER_ADDR`).
//!
//! Everything reads through a `var` function, so tests inject maps and never touch the process
//! environment. This module must not open sockets or files.

use std::path::PathBuf;
use std::time::Duration;

use super::rendezvous::{Config, Transport};

/// Which launcher's variables were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `RANK` / `WORLD_SIZE` (torchrun, `tessera launch`, or set by hand).
    Torchrun,
    /// `SLURM_PROCID` / `SLURM_NTASKS`.
    Slurm,
}

/// One rank's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub source: Source,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub job_token: Option<String>,
}

/// A launch variable that is missing, malformed, or contradicts another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("{var} is not set ({why})\n  fix: {fix}")]
    Missing {
        var: &'static str,
        why: String,
        fix: String,
    },
    #[error("{var}={value:?} is not {expected}")]
    Invalid {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("inconsistent launch environment: {what}")]
    Inconsistent { what: String },
}

type Var<'a> = &'a dyn Fn(&str) -> Option<String>;

fn get(var: Var<'_>, name: &str) -> Option<String> {
    var(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn number(var: Var<'_>, name: &'static str) -> Result<Option<usize>, EnvError> {
    get(var, name)
        .map(|v| {
            v.parse::<usize>().map_err(|_| EnvError::Invalid {
                var: name,
                value: v,
                expected: "a non-negative integer",
            })
        })
        .transpose()
}

fn required(var: Var<'_>, name: &'static str, why: &str, fix: &str) -> Result<usize, EnvError> {
    number(var, name)?.ok_or_else(|| EnvError::Missing {
        var: name,
        why: why.into(),
        fix: fix.into(),
    })
}

/// Expands Slurm's task-count lists: `"2(x3),1"` → `[2, 2, 2, 1]`.
pub fn expand_tasks_per_node(text: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        match part.split_once("(x") {
            Some((n, rest)) => {
                let times: usize = rest.strip_suffix(')')?.parse().ok()?;
                out.extend(std::iter::repeat_n(n.parse::<usize>().ok()?, times));
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Which rendezvous: the value of `tessera launch --rendezvous` and of `TESSERA_RENDEZVOUS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousKind {
    /// `tcp`: rank 0 listens on `MASTER_ADDR:MASTER_PORT`.
    Tcp,
    /// `file:<path>`: a file on a filesystem every rank sees.
    File(PathBuf),
}

impl RendezvousKind {
    /// What a valid value looks like, for messages.
    pub const EXPECTED: &'static str = "`tcp` or `file:<path on a shared filesystem>`";

    /// `tcp` or `file:<path>` with a path (surrounding blanks ignored); `None` for anything else.
    pub fn parse(text: &str) -> Option<RendezvousKind> {
        match text.trim() {
            "tcp" => Some(RendezvousKind::Tcp),
            other => other
                .strip_prefix("file:")
                .filter(|p| !p.is_empty())
                .map(|p| RendezvousKind::File(PathBuf::from(p))),
        }
    }
}

/// `TESSERA_RENDEZVOUS_TIMEOUT`: seconds, default 300.
pub fn rendezvous_timeout(var: Var<'_>) -> Result<Duration, EnvError> {
    match get(var, "TESSERA_RENDEZVOUS_TIMEOUT") {
        None => Ok(Duration::from_secs(300)),
        Some(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0 && s.is_finite() && *s < 1e9)
            .map(Duration::from_secs_f64)
            .ok_or(EnvError::Invalid {
                var: "TESSERA_RENDEZVOUS_TIMEOUT",
                value: v,
                expected: "a positive number of seconds (below 10^9)",
            }),
    }
}

impl LaunchEnv {
    /// From the process environment; `None` when no launcher variable is set (one process).
    pub fn from_env() -> Result<Option<Self>, EnvError> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// From variables read through `var`.
    pub fn from_vars(var: Var<'_>) -> Result<Option<Self>, EnvError> {
        let torchrun = get(var, "RANK").is_some() || get(var, "WORLD_SIZE").is_some();
        let slurm = get(var, "SLURM_PROCID").is_some();
        let (source, rank, world, local_rank, local_world) = if torchrun {
            let fix = "set RANK and WORLD_SIZE together (torchrun and `tessera launch` set both)";
            let rank = required(var, "RANK", "WORLD_SIZE is", fix)?;
            let world = required(var, "WORLD_SIZE", "RANK is", fix)?;
            let (lr, lw) = match (number(var, "LOCAL_RANK")?, number(var, "LOCAL_WORLD_SIZE")?) {
                (Some(lr), Some(lw)) => (lr, lw),
                // Neither: one node holds every rank.
                (None, None) => (rank, world),
                (Some(_), None) | (None, Some(_)) => {
                    let (missing, present) = if number(var, "LOCAL_RANK")?.is_some() {
                        ("LOCAL_WORLD_SIZE", "LOCAL_RANK")
                    } else {
                        ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
                    };
                    return Err(EnvError::Missing {
                        var: missing,
                        why: format!("{present} is"),
                        fix: "set both or neither (neither means every rank runs on this node)"
                            .into(),
                    });
                }
            };
            (Source::Torchrun, rank, world, lr, lw)
        } else if slurm {
            let fix =
                "run under srun with one task per rank (srun --ntasks-per-node=<GPUs per node>)";
            let rank = required(var, "SLURM_PROCID", "", fix)?;
            let world = required(var, "SLURM_NTASKS", "SLURM_PROCID is", fix)?;
            let lr = required(var, "SLURM_LOCALID", "SLURM_PROCID is", fix)?;
            let lw = match number(var, "SLURM_NTASKS_PER_NODE") {
                Ok(Some(n)) => n,
                // "2(x3)" in SLURM_NTASKS_PER_NODE, or absent: the per-node list.
                Ok(None) | Err(_) => {
                    let list = get(var, "SLURM_NTASKS_PER_NODE")
                        .or_else(|| get(var, "SLURM_TASKS_PER_NODE"));
                    let Some(list) = list else {
                        return Err(EnvError::Missing {
                            var: "SLURM_TASKS_PER_NODE",
                            why: "SLURM_PROCID is".into(),
                            fix: fix.into(),
                        });
                    };
                    let counts = expand_tasks_per_node(&list).ok_or(EnvError::Invalid {
                        var: "SLURM_TASKS_PER_NODE",
                        value: list.clone(),
                        expected: "a Slurm task list such as 4(x2),2",
                    })?;
                    let node = number(var, "SLURM_NODEID")?.unwrap_or(0);
                    *counts.get(node).ok_or_else(|| EnvError::Inconsistent {
                        what: format!(
                            "SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={list} lists {} nodes",
                            counts.len()
                        ),
                    })?
                }
            };
            (Source::Slurm, rank, world, lr, lw)
        } else {
            return Ok(None);
        };
        let bad = |what: String| Err(EnvError::Inconsistent { what });
        if world == 0 {
            return bad("the world size is 0".into());
        }
        if rank >= world {
            return bad(format!("rank {rank} is not below the world size {world}"));
        }
        if local_world == 0 || local_world > world {
            return bad(format!(
                "{local_world} ranks on this node, {world} in the world"
            ));
        }
        if local_rank >= local_world {
            return bad(format!(
                "local rank {local_rank} is not below the ranks on this node ({local_world})"
            ));
        }
        let master_port = get(var, "MASTER_PORT")
            .map(|v| {
                v.parse::<u16>().map_err(|_| EnvError::Invalid {
                    var: "MASTER_PORT",
                    value: v,
                    expected: "a TCP port (0-65535)",
                })
            })
            .transpose()?;
        let job_token = get(var, "TESSERA_JOB_TOKEN")
            .or_else(|| get(var, "SLURM_JOB_ID").map(|id| format!("slurm-{id}")))
            .or_else(|| get(var, "TORCHELASTIC_RUN_ID").filter(|id| id != "none"));
        Ok(Some(LaunchEnv {
            source,
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            master_addr: get(var, "MASTER_ADDR"),
            master_port,
            job_token,
        }))
    }

    /// The rendezvous this rank must take part in, from the variables above.
    pub fn rendezvous_config(&self, var: Var<'_>) -> Result<Config, EnvError> {
        let token = self.job_token.clone().ok_or_else(|| EnvError::Missing {
            var: "TESSERA_JOB_TOKEN",
            why: "a multi-process run needs a job token to keep jobs from joining each other".into(),
            fix: "export TESSERA_JOB_TOKEN=<the same random string on every rank> (`tessera launch` sets it)".into(),
        })?;
        let timeout = rendezvous_timeout(var)?;
        let kind = match get(var, "TESSERA_RENDEZVOUS") {
            None => RendezvousKind::Tcp,
            Some(v) => RendezvousKind::parse(&v).ok_or(EnvError::Invalid {
                var: "TESSERA_RENDEZVOUS",
                value: v.clone(),
                expected: RendezvousKind::EXPECTED,
            })?,
        };
        let transport = match kind {
            RendezvousKind::Tcp => {
                let fix = "export MASTER_ADDR=<rank 0's host> MASTER_PORT=<a free port> on every rank (under Slurm: MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))";
                let host = self.master_addr.clone().ok_or_else(|| EnvError::Missing {
                    var: "MASTER_ADDR",
                    why: "the TCP rendezvous needs rank 0's address".into(),
                    fix: fix.into(),
                })?;
                let port = self.master_port.ok_or_else(|| EnvError::Missing {
                    var: "MASTER_PORT",
                    why: "the TCP rendezvous needs rank 0's port".into(),
                    fix: fix.into(),
                })?;
                if port == 0 && self.world_size > 1 {
                    return Err(EnvError::Invalid {
                        var: "MASTER_PORT",
                        value: "0".into(),
                        expected: "a fixed port the other ranks can connect to",
                    });
                }
                Transport::Tcp {
                    host,
                    port,
                    bind: get(var, "TESSERA_RENDEZVOUS_BIND"),
                }
            }
            RendezvousKind::File(path) => Transport::File { path },
        };
        Ok(Config {
            token,
            rank: self.rank,
            world: self.world_size,
            timeout,
            transport,
        })
    }
}

#[cfg(test)]
#[path = "env_tests.rs"]
mod tests;
