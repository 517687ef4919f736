//! `tessera launch plan.json [--nproc N] [-- run args…]`: one `tessera run` process per local
//! rank, with the torchrun variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, and for the TCP rendezvous `MASTER_ADDR`, `MASTER_PORT`) and a job
//! token; if one rank fails, the others are stopped and that rank's error is reported (exit
//! code 1).
//!
//! One node: everything defaults (loopback, a free port, a fresh token). Several nodes: run it
//! once per node with `--nnodes`, `--node-rank`, `--master-addr`, `--master-port` and the same
//! `TESSERA_JOB_TOKEN` exported on every node.
//!
//! Every argument is checked before any rank starts, and a bad one gets one message naming the
//! flag, the value and the fix (exit 2): the counts, the rendezvous (`tcp`, or `file:` in an
//! existing folder, not left over from an earlier run), the master address (an address of this
//! machine on node 0, where rank 0 listens) and port (free there), the flags the chosen
//! rendezvous would ignore, the environment the ranks will read (`TESSERA_RENDEZVOUS_TIMEOUT`,
//! `TESSERA_RENDEZVOUS_BIND`, …), and the arguments after `--`, as `tessera run` checks them.
//!
//! Signals (`crate::signals`): the rank processes run in process groups of their own, so a
//! Ctrl-C reaches this launcher only; it passes each one on once (the first: the ranks finish
//! their step; the second: they stop at once), a third kills them, and they die with it.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use tessera_planner::plan::Plan;
use tessera_runtime::launch::env::{EnvError, LaunchEnv, RendezvousKind};
use tessera_runtime::launch::new_token;
use tessera_runtime::launch::supervise::{self, Forward, LaunchError, RankProcess, Spec};

use crate::signals::{uninterrupted, Interrupts};

#[derive(Args)]
pub struct LaunchArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Rank processes on this node (default: the plan's ranks divided by --nnodes).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    nproc: Option<u64>,
    /// Nodes taking part; run `tessera launch` once on each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    nnodes: u64,
    /// This node's index, 0..nnodes (node 0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    node_rank: u64,
    /// TCP rendezvous: the address of node 0 that rank 0 binds and the others connect to (one
    /// node: 127.0.0.1).
    #[arg(long)]
    master_addr: Option<String>,
    /// TCP rendezvous: the port on node 0 (one node: a free port).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// `tcp` (default) or `file:<path on a filesystem every node sees>`.
    #[arg(long, default_value = "tcp")]
    rendezvous: String,
    /// Arguments for each `tessera run` (after `--`), e.g. `-- --steps 20 --metrics m.jsonl`.
    #[arg(last = true)]
    run_args: Vec<OsString>,
}

/// Where the ranks meet, checked.
enum Meeting {
    Tcp { addr: String, port: u16 },
    File(PathBuf),
}

/// Whether an address looks like `host:port`.
fn has_port(addr: &str) -> bool {
    addr.parse::<SocketAddr>().is_ok()
        || addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.contains(':') && port.parse::<u16>().is_ok())
}

/// Checks an address's form: not empty, no blanks, no port.
fn check_address(flag: &str, addr: &str) -> anyhow::Result<()> {
    if addr.trim().is_empty() || addr.chars().any(char::is_whitespace) {
        bail!(
            "{flag} {addr:?}: not an address\n  fix: pass the IP address or host name of node 0 (127.0.0.1 on one node)"
        );
    }
    if has_port(addr) {
        bail!(
            "{flag} {addr}: give the address alone; the port goes to --master-port\n  fix: --master-addr {} --master-port {}",
            addr.rsplit_once(':').map_or(addr, |(h, _)| h.trim_start_matches('[').trim_end_matches(']')),
            addr.rsplit_once(':').map_or("29500", |(_, p)| p)
        );
    }
    Ok(())
}

/// Node 0 hosts rank 0, which listens on `bind` (the master address, or
/// `TESSERA_RENDEZVOUS_BIND`) at `port` (0: any): checks that it can, now. The listener is
/// closed again at once; another process could take the port before rank 0 binds it, and
/// rank 0 then fails with a clear error.
fn check_listen(bind: &str, bind_flag: &str, port: Option<u16>) -> anyhow::Result<u16> {
    let addrs: Vec<SocketAddr> = match (bind, port.unwrap_or(0)).to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => bail!(
            "{bind_flag} {bind}: cannot resolve it ({e})\n  fix: pass an IP address of this machine, or a host name it resolves"
        ),
    };
    match TcpListener::bind(&addrs[..]).and_then(|l| l.local_addr()) {
        Ok(a) => Ok(a.port()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let port = port.unwrap_or(0);
            bail!(
                "--master-port {port}: in use on {bind} (rank 0 listens there)\n  fix: choose a free port{}",
                if port == 0 { "" } else { ", or leave --master-port out on one node to get one" }
            )
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => bail!(
            "{bind_flag} {bind}: not an address of this machine ({e}); node 0 runs rank 0, which listens on it\n  fix: pass an address of this machine (127.0.0.1 on one node){}",
            if bind_flag == "--master-addr" {
                ", or set TESSERA_RENDEZVOUS_BIND to a local address for rank 0 to listen on"
            } else {
                ""
            }
        ),
        Err(e) => bail!(
            "{bind_flag} {bind}{}: rank 0 could not listen there: {e}\n  fix: choose another address or port (ports below 1024 need privileges)",
            port.map_or(String::new(), |p| format!(" --master-port {p}"))
        ),
    }
}

/// The file rendezvous at `path`: its folder exists and is writable, and on node 0 the file
/// is not left over from an earlier run.
fn check_rendezvous_file(spec: &str, path: &Path, node_rank: u64) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => bail!(
            "--rendezvous {spec}: {} is a folder\n  fix: name a file in it, such as --rendezvous file:{}",
            path.display(),
            path.join("rdzv").display()
        ),
        Ok(_) if node_rank == 0 => bail!(
            "--rendezvous {spec}: {} exists already (another job is using it, or an earlier run crashed and left it); rank 0 would refuse to start\n  fix: use a path unique to this run, or delete the file if no job is using it",
            path.display()
        ),
        _ => {}
    }
    if !dir.is_dir() {
        bail!(
            "--rendezvous {spec}: the folder {} does not exist\n  fix: create it, on a filesystem every node sees, or name a file in an existing folder",
            dir.display()
        );
    }
    uninterrupted(|| crate::files::probe_dir(dir))
    .map_err(|e| {
        anyhow!(
            "--rendezvous {spec}: cannot write in {}: {e}\n  fix: choose a folder every node can write to",
            dir.display()
        )
    })
}

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    // First: a signal during the checks ends the launcher at once; once the ranks run, each
    // signal is passed on to them.
    let forward = Arc::new(Forward::new());
    let interrupts = Interrupts::for_launcher(forward.clone())?;
    let plan = Plan::load(&args.plan)?;
    let world = plan.parallel.world;
    let shown = args.plan.display();
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} is not one of the {} nodes (0..{})\n  fix: pass this node's index, from 0 to {} (node 0 hosts rank 0)",
            args.node_rank,
            args.nnodes,
            args.nnodes,
            args.nnodes - 1
        );
    }
    let nproc = match args.nproc {
        Some(n) => n,
        None if world.is_multiple_of(args.nnodes) => world / args.nnodes,
        None => bail!(
            "--nnodes {}: the {world} ranks of {shown} do not split evenly over {} nodes\n  fix: use a number of nodes that divides {world}",
            args.nnodes,
            args.nnodes
        ),
    };
    if nproc.checked_mul(args.nnodes) != Some(world) {
        bail!(
            "--nproc {nproc}: the plan has {world} ranks, and {} node(s) × {nproc} processes make {}\n  fix: {}",
            args.nnodes,
            args.nnodes.saturating_mul(nproc),
            if world.is_multiple_of(args.nnodes) {
                format!("use --nproc {}", world / args.nnodes)
            } else {
                format!("use a number of nodes that divides {world}")
            }
        );
    }
    let multi = args.nnodes > 1;
    let spec = args.rendezvous.trim();
    let Some(kind) = RendezvousKind::parse(spec) else {
        bail!(
            "--rendezvous {}: not {}\n  fix: --rendezvous tcp (the default: rank 0 listens on --master-addr:--master-port), or --rendezvous file:/shared/folder/rdzv (a file every node sees)",
            if spec.is_empty() || spec != args.rendezvous {
                format!("{:?}", args.rendezvous)
            } else {
                spec.to_string()
            },
            RendezvousKind::EXPECTED
        );
    };
    let meeting = match kind {
        RendezvousKind::File(path) => {
            for (flag, value) in [
                ("--master-addr", args.master_addr.clone()),
                ("--master-port", args.master_port.map(|p| p.to_string())),
            ] {
                if let Some(v) = value {
                    bail!(
                        "{flag} {v}: the file rendezvous (--rendezvous {spec}) does not use it: the ranks meet in the file\n  fix: drop {flag}, or use --rendezvous tcp"
                    );
                }
            }
            check_rendezvous_file(spec, &path, args.node_rank)?;
            Meeting::File(path)
        }
        RendezvousKind::Tcp => {
            let addr = match (&args.master_addr, multi) {
                (Some(a), _) => a.clone(),
                (None, false) => "127.0.0.1".to_string(),
                (None, true) => bail!("--master-addr is needed with several nodes (--nnodes {}): an address of node 0 that every node reaches\n  fix: pass --master-addr <node 0's address> on every node", args.nnodes),
            };
            check_address("--master-addr", &addr)?;
            if args.master_port.is_none() && multi {
                bail!("--master-port is needed with several nodes (--nnodes {}): the same free port of node 0 on every node\n  fix: pass --master-port <a free port of node 0, such as 29500> on every node", args.nnodes);
            }
            let bind = std::env::var("TESSERA_RENDEZVOUS_BIND")
                .ok()
                .map(|b| b.trim().to_string())
                .filter(|b| !b.is_empty());
            let port = if args.node_rank == 0 {
                // Rank 0 listens here: the address must be this machine's and the port free.
                if let Some(b) = &bind {
                    check_address("TESSERA_RENDEZVOUS_BIND", b)?;
                    if let Err(e) = (addr.as_str(), 0).to_socket_addrs() {
                        bail!("--master-addr {addr}: cannot resolve it ({e})\n  fix: pass an IP address or a host name every node resolves");
                    }
                }
                let (host, flag) = match &bind {
                    Some(b) => (b.as_str(), "TESSERA_RENDEZVOUS_BIND"),
                    None => (addr.as_str(), "--master-addr"),
                };
                let free = check_listen(host, flag, args.master_port)?;
                args.master_port.unwrap_or(free)
            } else {
                args.master_port.expect("checked above: several nodes")
            };
            Meeting::Tcp { addr, port }
        }
    };
    let token = match (std::env::var("TESSERA_JOB_TOKEN").ok().filter(|t| !t.is_empty()), multi) {
        (Some(t), _) => t,
        (None, false) => new_token(),
        (None, true) => bail!("TESSERA_JOB_TOKEN must be set, to the same value on every node\n  fix: export TESSERA_JOB_TOKEN=$(openssl rand -hex 16) once, and pass it to every node"),
    };
    let program = std::env::current_exe().context("locating the tessera executable")?;
    let mut run_args: Vec<OsString> = vec!["run".into(), args.plan.clone().into_os_string()];
    run_args.extend(args.run_args.iter().cloned());
    let ranks: Vec<RankProcess> = (0..nproc)
        .map(|local| {
            let rank = args.node_rank * nproc + local;
            let mut env = vec![
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", local.to_string()),
                ("LOCAL_WORLD_SIZE", nproc.to_string()),
                ("TESSERA_JOB_TOKEN", token.clone()),
                ("TESSERA_RENDEZVOUS", spec.to_string()),
            ];
            if let Meeting::Tcp { addr, port } = &meeting {
                env.push(("MASTER_ADDR", addr.clone()));
                env.push(("MASTER_PORT", port.to_string()));
            }
            RankProcess {
                rank: rank as usize,
                env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            }
        })
        .collect();
    // The environment every rank will read (its variables over this process's): checked as
    // the ranks check it.
    let first = &ranks[0].env;
    let var = |k: &str| {
        first
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(k).ok())
    };
    let checked = LaunchEnv::from_vars(&var).and_then(|env| match env {
        Some(env) => env.rendezvous_config(&var).map(drop),
        None => Ok(()),
    });
    if let Err(e) = checked {
        let fix = match &e {
            EnvError::Missing { .. } => String::new(),
            EnvError::Invalid { var, .. } => format!(
                "\n  fix: unset {var} in the environment you launch from, or correct it"
            ),
            EnvError::Inconsistent { .. } => "\n  fix: unset the launch variables (RANK, WORLD_SIZE, LOCAL_RANK, …) in the environment you launch from: tessera launch sets them".into(),
        };
        bail!("the rank processes would refuse their launch environment: {e}{fix}");
    }
    crate::commands::run::check_launched(
        &args.plan,
        &plan,
        &args.run_args,
        world as usize,
        args.node_rank == 0,
    )?;
    match &meeting {
        Meeting::Tcp { addr, port } => println!(
            "launching {nproc} rank process(es) of {world} on node {} of {} (rendezvous tcp at {addr}:{port})",
            args.node_rank, args.nnodes
        ),
        Meeting::File(path) => println!(
            "launching {nproc} rank process(es) of {world} on node {} of {} (rendezvous in the file {})",
            args.node_rank,
            args.nnodes,
            path.display()
        ),
    }
    let spec = Spec {
        program,
        args: run_args,
        ranks,
        tail_lines: 20,
        echo: true,
        grace: Duration::from_secs(2),
        forward: Some(forward),
    };
    interrupts.arm_forwarding();
    let result = supervise::run(&spec);
    if let Some(sig) = interrupts.received() {
        eprintln!("stopped by {}", Interrupts::name(sig));
        return Ok(Interrupts::exit_code(sig));
    }
    match result {
        Ok(reports) => {
            println!("all {} rank process(es) finished", reports.len());
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ LaunchError::RankFailed { .. }) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(1))
        }
        Err(e) => Err(e.into()),
    }
}
