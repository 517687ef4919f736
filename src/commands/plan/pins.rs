//! The pins of `tessera plan` that cannot take effect, refused before the search with the flag
//! named, the conflict and the fix: a pin is either what the written plan runs or an error,
//! never accepted and ignored. What depends on the layout the search picks (a chunk split, a
//! DP group inside a node) is refused by the search itself (`search::pins`), under the same
//! rules that `Plan::load` applies to a plan's `parallel` section.

use tessera_planner::schedule::ScheduleKind;
use tessera_planner::search::{self, divisors, Pins};
use tessera_planner::{Cluster, Model, Recompute};

use super::{cli_error, Format, PlanArgs};

/// The pins given, as their flags (for an error that names them).
pub(super) fn pinned_flags(args: &PlanArgs) -> Vec<&'static str> {
    let p = args.pins();
    [
        ("--tp", p.tp.is_some()),
        ("--pp", p.pp.is_some()),
        ("--cp", p.cp.is_some()),
        ("--cp-comm", p.cp_comm.is_some()),
        ("--ep", p.ep.is_some()),
        ("--dp", p.dp.is_some()),
        ("--micro-batch", p.micro_batch.is_some()),
        ("--zero", p.zero.is_some()),
        ("--hybrid-shard", p.hybrid == Some(true)),
        ("--no-hybrid-shard", p.hybrid == Some(false)),
        ("--recompute", p.recompute.is_some()),
        ("--recompute-every", p.recompute_every.is_some()),
        ("--sp", p.sp == Some(true)),
        ("--no-sp", p.sp == Some(false)),
        ("--schedule", p.schedule.is_some()),
        ("--virtual-stages", p.virtual_stages.is_some()),
        ("--offload", p.offload.is_some()),
        ("--offload-to", p.offload_to.is_some()),
        ("--offload-activations", p.offload_activations.is_some()),
        ("--first-stage-layers", p.stage_layers.first.is_some()),
        ("--last-stage-layers", p.stage_layers.last.is_some()),
    ]
    .into_iter()
    .filter(|(_, given)| *given)
    .map(|(flag, _)| flag)
    .collect()
}

fn refuse(flag: &str, problem: String, fix: String) -> anyhow::Result<()> {
    Err(cli_error(flag, problem, fix))
}

/// Refuses a pin that no layout could honour, or that would change nothing in the plan.
pub(super) fn check(args: &PlanArgs, model: &Model, cluster: &Cluster) -> anyhow::Result<()> {
    let p = args.pins();
    if args.top == 0 {
        return refuse(
            "--top",
            "must be at least 1, found 0: the chosen layout is always printed".into(),
            "pass --top 1 or more".into(),
        );
    }
    if args.force && args.output.is_none() && args.format != Format::Json {
        return refuse(
            "--force",
            "--force writes the plan of a pinned layout that does not fit, and no plan is written: there is no -o/--output and the format is the table".into(),
            "add -o plan.json (or --format json), or drop --force".into(),
        );
    }
    check_recompute(&p, model)?;
    check_schedule(&p)?;
    check_cp_comm(&p, model, cluster)?;
    if p.sp == Some(true) && p.tp == Some(1) {
        return refuse(
            "--sp",
            "sequence parallelism splits the sequence over the TP ranks, and --tp 1 has one: it would change nothing".into(),
            "pin --tp 2 or more with --sp, or drop --sp (or pass --no-sp)".into(),
        );
    }
    if p.hybrid == Some(true) {
        check_hybrid(&p, cluster)?;
    }
    Ok(())
}

/// `--cp-comm` chooses how CP exchanges keys and values, so it must come with CP > 1: pinned
/// (`--cp 2` or more), or, with `--cp` free, a search that tries only CP > 1 (it does, under a
/// pinned exchange) and has such a degree to try.
fn check_cp_comm(p: &Pins, model: &Model, cluster: &Cluster) -> anyhow::Result<()> {
    let Some(comm) = p.cp_comm else {
        return Ok(());
    };
    let flag = format!("--cp-comm {}", comm.name().replace('_', "-"));
    let what = format!("{flag} chooses how context parallelism exchanges keys and values");
    match p.cp {
        Some(1) => refuse(
            "--cp-comm",
            format!("{what}, and --cp 1 has no context parallelism (CP 1 has one rank): it would change nothing"),
            "pin --cp 2 or more with --cp-comm, or drop --cp-comm".into(),
        ),
        Some(_) => Ok(()),
        None if search::searched_cps(model, cluster, p).is_empty() => {
            let s = model.training.seq_len;
            refuse(
                "--cp-comm",
                format!(
                    "{what}, and --cp is not pinned: the search tries CP only where each rank keeps at least {} tokens and 2 × CP splits the sequence, which seq_len {s} on {} devices does not allow, so every plan would have CP 1 and ignore it",
                    search::CP_MIN_TOKENS,
                    cluster.devices
                ),
                "pin --cp 2 or more (dividing the devices, with 2 × CP dividing seq_len) with --cp-comm, or drop --cp-comm".into(),
            )
        }
        None => Ok(()),
    }
}

fn check_recompute(p: &Pins, model: &Model) -> anyhow::Result<()> {
    let Some(n) = p.recompute_every else {
        return Ok(());
    };
    let recompute = p.recompute.unwrap_or(Recompute::None);
    if recompute != Recompute::Full {
        return refuse(
            "--recompute-every",
            format!(
                "--recompute-every {n} chooses the layers that full recompute re-runs, and the recompute is {}: it would change nothing",
                recompute.name()
            ),
            format!("pass --recompute full --recompute-every {n}, or drop --recompute-every"),
        );
    }
    let layers = model.architecture.layers;
    // The runtime recomputes layers N, 2N, … of the whole model; the plan charges 1/N of each
    // layer. They agree only when every model chunk holds a multiple of N layers.
    let listed = divisors::listed(layers);
    let rule = format!(
        "the runtime recomputes layers {n}, {}, … of the whole model and the plan charges 1/{n} of every layer, which agree only when every model chunk holds a multiple of {n} layers",
        n.saturating_mul(2)
    );
    if n > layers || !layers.is_multiple_of(n) {
        let why = if n > layers {
            format!("{n} is more than the model's {layers} layers (none would be recomputed)")
        } else {
            format!(
                "the model's {layers} layers are not a multiple of {n} ({} would be recomputed, {layers}/{n} charged)",
                layers / n
            )
        };
        return refuse(
            "--recompute-every",
            format!("--recompute-every {n}: {why}; {rule}"),
            format!("pass --recompute-every as a divisor of the {layers} layers: {listed}"),
        );
    }
    let interleaved = p.schedule == Some(ScheduleKind::Interleaved);
    let fixed = p.schedule.and_then(ScheduleKind::fixed_virtual_stages);
    let v = p
        .virtual_stages
        .unwrap_or(fixed.map_or(if interleaved { 2 } else { 1 }, |v| v as u64));
    if let Some(pp) = p.pp {
        let chunks = pp.saturating_mul(v);
        if layers / n < chunks {
            return refuse(
                "--recompute-every",
                format!(
                    "--recompute-every {n} with --pp {pp}{}: {chunks} model chunks cannot each hold a multiple of {n} of the {layers} layers; {rule}",
                    if v > 1 { format!(" × {v} virtual stages") } else { String::new() }
                ),
                format!(
                    "pass --recompute-every {} (the divisors of the {layers} layers that leave a multiple for each of the {chunks} chunks), or a smaller --pp",
                    divisors::up_to(&divisors::factorize(layers), layers / chunks.max(1))
                        .iter()
                        .take(12)
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            );
        }
    }
    Ok(())
}

fn check_schedule(p: &Pins) -> anyhow::Result<()> {
    let interleaved = p.schedule == Some(ScheduleKind::Interleaved);
    // zb-v and dualpipe run exactly two chunks (the one-chunk schedules keep the message
    // below, which points to interleaving).
    let fixed = p
        .schedule
        .and_then(|k| k.fixed_virtual_stages().map(|v| (k, v as u64)))
        .filter(|&(_, v)| v > 1);
    if let (Some(v), Some((kind, want))) = (p.virtual_stages, fixed) {
        if v != want {
            return refuse(
                "--virtual-stages",
                format!(
                    "--schedule {} runs exactly {want} model chunk{} per stage, and --virtual-stages is {v}",
                    kind.name(),
                    if want == 1 { "" } else { "s" }
                ),
                format!("pass --virtual-stages {want}, or drop --virtual-stages"),
            );
        }
        return Ok(());
    }
    if let Some(v) = p.virtual_stages {
        if let Some(s) = p.schedule.filter(|_| v > 1 && !interleaved) {
            return refuse(
                "--virtual-stages",
                format!(
                    "--virtual-stages {v} splits each stage into model chunks, which only the interleaved schedule runs, and the schedule is --schedule {}",
                    s.name()
                ),
                format!("pass --schedule interleaved --virtual-stages {v}, or drop --virtual-stages"),
            );
        }
        if v == 1 && interleaved {
            return refuse(
                "--virtual-stages",
                "--schedule interleaved runs 2 or more model chunks per stage, and --virtual-stages is 1".into(),
                "pass --virtual-stages 2 or more (or leave it out to search them), or another --schedule".into(),
            );
        }
        if v > 1 && p.pp == Some(1) {
            return refuse(
                "--virtual-stages",
                format!("--virtual-stages {v} interleaves model chunks over pipeline stages, and --pp 1 has one stage"),
                "pin --pp 2 or more, or drop --virtual-stages".into(),
            );
        }
    }
    if interleaved && p.pp == Some(1) {
        return refuse(
            "--schedule",
            "--schedule interleaved interleaves model chunks over pipeline stages, and --pp 1 has one stage".into(),
            "pin --pp 2 or more, or --schedule 1f1b (or gpipe)".into(),
        );
    }
    Ok(())
}

fn check_hybrid(p: &Pins, cluster: &Cluster) -> anyhow::Result<()> {
    if p.zero == Some(0) {
        return refuse(
            "--hybrid-shard",
            "hybrid sharding shards the ZeRO states inside a node and replicates them across nodes, and --zero 0 shards nothing: it would change nothing".into(),
            "pin --zero 1, 2 or 3 with --hybrid-shard, or drop --hybrid-shard".into(),
        );
    }
    let gpn = cluster.gpus_per_node.max(1);
    if cluster.devices <= gpn {
        return refuse(
            "--hybrid-shard",
            format!(
                "hybrid sharding shards inside a node and replicates across nodes, and the plan's {} devices are one node ({} × {} per node): every DP group lies inside it and would shard exactly as without --hybrid-shard",
                cluster.devices, cluster.name, cluster.gpus_per_node
            ),
            "drop --hybrid-shard (or pass --no-hybrid-shard), or plan for more than one node with --nodes".into(),
        );
    }
    if let (Some(dp), Some(tp)) = (p.dp, p.tp) {
        // The DP group of rank 0 is ranks 0, TP, …, (DP − 1)·TP (mesh order tp-dp-pp).
        if gpn.div_ceil(tp.max(1)) >= dp {
            return refuse(
                "--hybrid-shard",
                format!(
                    "hybrid sharding replicates across nodes, and the DP group of --dp {dp} at --tp {tp} (ranks 0, {tp}, …, {}) lies inside one node of {gpn} devices: it would shard exactly as without it",
                    (dp - 1).saturating_mul(tp)
                ),
                "drop --hybrid-shard, or pin a DP group that spans nodes (--dp × --tp above the devices per node)".into(),
            );
        }
    }
    Ok(())
}
