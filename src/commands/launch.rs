//! `tessera launch plan.json [--nproc N] [-- run args…]`: one `tessera run` process per local
//! rank, with the torchrun variables set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and a job token; if one rank fails, the
//! others are stopped and that rank's error is reported (exit code 1).
//!
//! One node: everything defaults (loopback, a free port, a fresh token). Several nodes: run it
//! once per node with `--nnodes`, `--node-rank`, `--master-addr`, `--master-port` and the same
//! `TESSERA_JOB_TOKEN` exported on every node.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tessera_planner::plan::Plan;
use tessera_runtime::launch::supervise::{self, LaunchError, RankProcess, Spec};
use tessera_runtime::launch::{free_port, new_token};

use crate::signals::Interrupts;

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
    /// Address of node 0 that rank 0 binds and the others connect to (one node: 127.0.0.1).
    #[arg(long)]
    master_addr: Option<String>,
    /// Rendezvous port on node 0 (one node: a free port).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,
    /// `tcp` (default) or `file:<path on a filesystem every node sees>`.
    #[arg(long, default_value = "tcp")]
    rendezvous: String,
    /// Arguments for each `tessera run` (after `--`), e.g. `-- --steps 20 --metrics m.jsonl`.
    #[arg(last = true)]
    run_args: Vec<OsString>,
}

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let plan = Plan::load(&args.plan)?;
    let world = plan.parallel.world;
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} is not one of the {} nodes (0..{})",
            args.node_rank,
            args.nnodes,
            args.nnodes
        );
    }
    let nproc = match args.nproc {
        Some(n) => n,
        None if world.is_multiple_of(args.nnodes) => world / args.nnodes,
        None => bail!(
            "{}: {world} ranks do not split evenly over {} nodes\n  fix: give --nproc",
            args.plan.display(),
            args.nnodes
        ),
    };
    if nproc.checked_mul(args.nnodes) != Some(world) {
        bail!(
            "{}: the plan has {world} ranks, and {} node(s) × {nproc} processes make {}\n  fix: use --nproc {}",
            args.plan.display(),
            args.nnodes,
            args.nnodes.saturating_mul(nproc),
            world / args.nnodes
        );
    }
    let multi = args.nnodes > 1;
    let addr = match (&args.master_addr, multi) {
        (Some(a), _) => a.clone(),
        (None, false) => "127.0.0.1".to_string(),
        (None, true) => bail!("--master-addr is needed with several nodes: an address of node 0 that every node reaches"),
    };
    let port = match (args.master_port, multi) {
        (Some(p), _) => p,
        (None, false) => free_port(&addr).with_context(|| format!("finding a free port on {addr}"))?,
        (None, true) => bail!("--master-port is needed with several nodes: the same free port of node 0 on every node"),
    };
    let token = match (std::env::var("TESSERA_JOB_TOKEN").ok().filter(|t| !t.is_empty()), multi) {
        (Some(t), _) => t,
        (None, false) => new_token(),
        (None, true) => bail!("TESSERA_JOB_TOKEN must be set, to the same value on every node (e.g. export TESSERA_JOB_TOKEN=$(openssl rand -hex 16) once, and pass it to every node)"),
    };
    let program = std::env::current_exe().context("locating the tessera executable")?;
    let mut run_args: Vec<OsString> = vec!["run".into(), args.plan.clone().into_os_string()];
    run_args.extend(args.run_args.iter().cloned());
    let ranks = (0..nproc)
        .map(|local| {
            let rank = args.node_rank * nproc + local;
            let env = vec![
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", local.to_string()),
                ("LOCAL_WORLD_SIZE", nproc.to_string()),
                ("MASTER_ADDR", addr.clone()),
                ("MASTER_PORT", port.to_string()),
                ("TESSERA_JOB_TOKEN", token.clone()),
                ("TESSERA_RENDEZVOUS", args.rendezvous.clone()),
            ];
            RankProcess {
                rank: rank as usize,
                env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            }
        })
        .collect();
    println!(
        "launching {nproc} rank process(es) of {world} on node {} of {} (rendezvous {} at {addr}:{port})",
        args.node_rank, args.nnodes, args.rendezvous
    );
    let interrupts = Interrupts::install(|sig| {
        eprintln!(
            "\n{}: passing it on to the rank processes, which finish their step and stop; send it again to stop at once",
            Interrupts::name(sig)
        );
    })?;
    let spec = Spec {
        program,
        args: run_args,
        ranks,
        tail_lines: 20,
        echo: true,
        grace: Duration::from_secs(2),
        forward: Some(interrupts.flag()),
    };
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
