//! One rank process of a `tessera run` under a launcher (`tessera launch`, torchrun, Slurm) on
//! the CPU backend: the processes meet (`tessera_runtime::launch::rendezvous`), agree that they
//! run the same plan file, and then rank 0 trains every rank as a thread of its process while
//! the others wait for its outcome and exit with it (docs/cuda.md, "Launching"). Kept out of
//! `commands::run`, which parses the flags and prints, as the coordination it is.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context};
use tessera_planner::plan::Plan;
use tessera_runtime::launch::env::LaunchEnv;
use tessera_runtime::launch::rendezvous::{rendezvous, RendezvousError};
use tessera_runtime::launch::EXIT_PEER_FAILED;

use crate::signals::Interrupts;

/// One rank process of a launched CPU run: rendezvous, check the plan, then rank 0 trains
/// (`train`) and the others wait for its outcome.
pub fn rank_process(
    plan_file: &Path,
    plan: &Plan,
    env: &LaunchEnv,
    fail_rank: Option<usize>,
    interrupts: &Interrupts,
    train: impl FnOnce() -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    let (rank, world) = (env.rank, env.world_size);
    if world as u64 != plan.parallel.world {
        bail!(
            "{}: the plan has {} ranks, this launch {world} (WORLD_SIZE)\n  fix: launch {} processes (`tessera launch {} --nproc {}`)",
            plan_file.display(),
            plan.parallel.world,
            plan.parallel.world,
            plan_file.display(),
            plan.parallel.world
        );
    }
    if fail_rank == Some(rank) {
        bail!("rank {rank}: injected failure (--fail-rank {rank}), before the rendezvous");
    }
    let cfg = env
        .rendezvous_config(&|k| std::env::var(k).ok())
        .with_context(|| format!("rank {rank}: cannot start the rendezvous"))?;
    let bytes = std::fs::read(plan_file)
        .with_context(|| format!("{}: cannot read the plan", plan_file.display()))?;
    let digest = format!("plan {:016x}", tessera_runtime::rng::fnv1a64(&bytes));
    let joined = rendezvous(&cfg, || Ok(digest.clone().into_bytes()))
        .with_context(|| format!("rank {rank}: rendezvous"))?;
    if joined.blob != digest.as_bytes() {
        bail!(
            "rank {rank}: {} is not the plan rank 0 runs ({} here, {} there)\n  fix: give every rank the same plan file",
            plan_file.display(),
            digest,
            String::from_utf8_lossy(&joined.blob)
        );
    }
    if joined.session.is_root() {
        println!(
            "rank 0 of {world}: all ranks joined and run the same plan; the CPU backend trains all {world} ranks as threads of this process"
        );
        let result = train();
        let outcome = match &result {
            Ok(code) if *code == ExitCode::SUCCESS => Ok(()),
            Ok(_) => Err("rank 0 exited with an error".to_string()),
            Err(e) => Err(format!("{e:#}")),
        };
        if let Err(e) = joined.session.finish(outcome) {
            eprintln!("warning: could not tell the other ranks how the run ended: {e}");
        }
        return result;
    }
    println!(
        "rank {rank} of {world}: joined rank 0 (same plan); the CPU backend trains every rank as a thread of rank 0's process: waiting for it"
    );
    interrupts.waiting_for(Some(format!(
        "rank {rank} was waiting for rank 0, which trains every rank"
    )));
    match joined.session.wait() {
        Ok(()) => {
            println!("rank {rank}: rank 0 finished");
            Ok(ExitCode::SUCCESS)
        }
        Err(RendezvousError::RootFailed { message }) => {
            eprintln!("error: rank {rank}: stopped because rank 0 failed: {message}");
            Ok(ExitCode::from(EXIT_PEER_FAILED))
        }
        // Rank 0 died without a word (killed, crashed): this rank's stop is the consequence,
        // so it exits as a peer's failure and the launcher names rank 0's exit as the cause.
        Err(e @ RendezvousError::RootGone { .. }) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(EXIT_PEER_FAILED))
        }
        Err(e) => Err(e.into()),
    }
}
