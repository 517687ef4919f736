//! Knobs that must take effect: a layout whose value of a knob would run exactly as another
//! value does (hybrid sharding without ZeRO, or of a DP group inside one node), or whose
//! charged recompute differs from what the runtime recomputes, is refused here, so that a pin
//! is either what the plan runs or an error, never accepted and ignored. [`Layout::check`]
//! says whether a layout can be built at all; this says whether each of its knobs means what
//! it says. The search applies it to every layout (the unpinned space never breaks it), and
//! `Plan::load` to a plan's `parallel` section.

use crate::layout::{Layout, Recompute, Rejection};
use crate::model::Model;
use crate::spec::Cluster;

/// Rule names (the search groups rejections by them).
pub const HYBRID_WITHOUT_ZERO: &str = "hybrid sharding needs ZeRO stage 1, 2 or 3";
pub const HYBRID_IN_ONE_NODE: &str = "hybrid sharding needs a DP group that spans nodes";
pub const CP_COMM_WITHOUT_CP: &str = "a CP exchange needs CP > 1";
pub const OFFLOAD_TARGET_WITHOUT_OFFLOAD: &str = "an offload target needs offloaded states";
pub const OFFLOAD_NEEDS_ZERO: &str =
    "offload needs ZeRO: optimizer offload stage 1 or more, params or NVMe offload stage 3";
pub const OFFLOAD_ON_CPU: &str = "offload needs a device apart from the host";
pub const OFFLOAD_WITHOUT_HOST: &str = "offload needs the cluster's [host] tier";
pub const OFFLOAD_WITH_ADAPTERS: &str = "offload of model states is not planned for LoRA or QLoRA";
pub const RECOMPUTE_EVERY_SPLIT: &str =
    "recompute of every N-th layer needs every model chunk to hold a multiple of N layers";

/// Every rule of [`effective`].
pub const RULES: [&str; 10] = [
    OFFLOAD_ON_CPU,
    OFFLOAD_WITH_ADAPTERS,
    OFFLOAD_WITHOUT_HOST,
    OFFLOAD_TARGET_WITHOUT_OFFLOAD,
    OFFLOAD_NEEDS_ZERO,
    HYBRID_WITHOUT_ZERO,
    CP_COMM_WITHOUT_CP,
    HYBRID_IN_ONE_NODE,
    RECOMPUTE_EVERY_SPLIT,
    STAGE_LAYERS,
];

/// Whether every knob of `layout` takes effect (see the module documentation); the broken
/// rule otherwise. `layout` is assumed to pass [`Layout::check`].
pub fn effective(layout: &Layout, model: &Model, cluster: &Cluster) -> Result<(), Rejection> {
    let l = layout;
    offload(l, model, cluster)?;
    if l.cp <= 1 && l.cp_comm != crate::layout::CpComm::P2p {
        return Err(Rejection::new(
            CP_COMM_WITHOUT_CP,
            format!(
                "the CP exchange {} all-gathers K and V over the CP group, and CP {} has one rank: it would run exactly as without it",
                l.cp_comm.name(),
                l.cp
            ),
        )
        .with_fix("pin --cp 2 or more with --cp-comm, or drop --cp-comm"));
    }
    if l.sharding.hybrid {
        if l.sharding.zero_stage == 0 {
            return Err(Rejection::new(
                HYBRID_WITHOUT_ZERO,
                "hybrid sharding shards the ZeRO states inside a node and replicates them across nodes, and ZeRO stage 0 shards nothing: it would run exactly as without it".into(),
            ));
        }
        let shard = l.shard_degree(cluster);
        if shard >= l.dp {
            return Err(Rejection::new(
                HYBRID_IN_ONE_NODE,
                format!(
                    "hybrid sharding shards inside a node and replicates across nodes, and with DP {} at TP {} the whole DP group fits in one node of {} devices ({} DP ranks to a node): it would shard exactly as without it",
                    l.dp,
                    l.tp,
                    cluster.gpus_per_node,
                    cluster.gpus_per_node.max(1).div_ceil(l.tp.max(1))
                ),
            ));
        }
    }
    if l.recompute == Recompute::Full && l.recompute_every > 1 {
        let n = l.recompute_every;
        let layers = model.architecture.layers;
        if unit(model, l).is_none() {
            let why = if n > layers {
                format!(
                    "{n} is more than the model's {layers} layers: no layer would be recomputed"
                )
            } else if !layers.is_multiple_of(n) {
                format!(
                    "the model's {layers} layers are not a multiple of {n}: the runtime would recompute {} layers where the plan charges {layers}/{n}",
                    layers / n
                )
            } else {
                let chunks = l.chunks().unwrap_or(u64::MAX);
                format!(
                    "the {layers} layers make at most {} chunks of a multiple of {n} layers, fewer than the {chunks} model chunks (PP {} × virtual stages {})",
                    layers / n,
                    l.pp,
                    l.virtual_stages
                )
            };
            return Err(Rejection::new(
                RECOMPUTE_EVERY_SPLIT,
                format!(
                    "full recompute of every {n}th layer recomputes layers {n}, {}, … of the whole model, and the plan charges 1/{n} of every layer: the two agree only when every model chunk holds a multiple of {n} layers, and {why}",
                    n.saturating_mul(2)
                ),
            ));
        }
    }
    Ok(())
}

/// The offload rules: offload needs a device that is not the host, a cluster that states its
/// host tier (and NVMe for `nvme`), and the ZeRO stage its mechanism is built on — DeepSpeed's
/// `offload_optimizer` on stages 1 to 3 and `offload_param` and NVMe on stage 3 only
/// (ZeRO-Infinity), FSDP's `CPUOffload` on full sharding.
fn offload(l: &Layout, model: &Model, cluster: &Cluster) -> Result<(), Rejection> {
    let o = l.offload;
    if !o.any() {
        if o.to != crate::layout::OffloadTier::Cpu {
            return Err(Rejection::new(
                OFFLOAD_TARGET_WITHOUT_OFFLOAD,
                format!("offload to {} moves the offloaded states, and the offload is none: it would run exactly as without it", o.to.name()),
            )
            .with_fix("pin --offload optimizer or params with --offload-to, or drop --offload-to"));
        }
        return Ok(());
    }
    if cluster.device.kind == crate::spec::DeviceKind::Cpu {
        return Err(Rejection::new(
            OFFLOAD_ON_CPU,
            "on the CPU backend the device's memory is the host's: offload would move the states to where they already are".into(),
        )
        .with_fix("drop --offload and --offload-activations"));
    }
    if o.optimizer() && model.training.method.adapters() {
        return Err(Rejection::new(
            OFFLOAD_WITH_ADAPTERS,
            "a LoRA or QLoRA job's optimizer states are its adapters' (a fraction of a percent of the model) and its frozen base has none: the planner does not model moving them or the base to the host".into(),
        )
        .with_fix("drop --offload (ZeRO-3 shards the frozen base), or fine-tune with --method full"));
    }
    let h = &cluster.host;
    if !h.stated() || (o.nvme() && h.nvme_gib <= 0.0) {
        let what = if h.stated() {
            "[host] nvme_gib and nvme_gbps"
        } else {
            "a [host] table"
        };
        return Err(Rejection::new(
            OFFLOAD_WITHOUT_HOST,
            format!("the cluster spec {} has no {what}: the planner cannot size or cost the tier the states would go to", cluster.name),
        )
        .with_fix("add [host] to the cluster spec (memory_gib, link_gbps, nvme_gbps, nvme_gib, adamw_gparams_per_s; specs/README.md), or measure it with tessera calibrate --host"));
    }
    let z = l.sharding.zero_stage;
    let need = match (o.states, o.nvme()) {
        (_, true) | (crate::layout::OffloadStates::Params, _) => 3,
        (crate::layout::OffloadStates::Optimizer, _) => 1,
        (crate::layout::OffloadStates::None, _) => 0,
    };
    if z < need {
        return Err(Rejection::new(
            OFFLOAD_NEEDS_ZERO,
            format!(
                "{} offload{} moves each rank's ZeRO shard, and needs ZeRO stage {need} or more (DeepSpeed's offload_optimizer runs on stages 1-3, offload_param and NVMe on stage 3 only; FSDP's CPUOffload shards fully); the layout has ZeRO-{z}",
                o.states.name(),
                if o.nvme() { " to NVMe" } else { "" }
            ),
        )
        .with_fix(format!("pin --zero {need}, or another offload")));
    }
    Ok(())
}

/// The layers a split moves in whole groups of: N under full recompute of every N-th layer
/// where the layers split into whole groups of N, at least one per model chunk (each chunk
/// then recomputes exactly 1/N of its layers, as charged); `None` where they cannot, 1
/// otherwise.
pub fn unit(model: &Model, layout: &Layout) -> Option<u64> {
    let n = layout.recompute_every;
    if layout.recompute != Recompute::Full || n <= 1 {
        return Some(1);
    }
    let layers = model.architecture.layers;
    let chunks = layout.chunks()?;
    (layers.is_multiple_of(n) && layers / n >= chunks).then_some(n)
}

/// Why a split (layers per virtual stage, pipeline order) recomputes other layers than the
/// plan charges: the first chunk whose layer count is not a multiple of N, under full
/// recompute of every N-th layer.
pub fn split_recomputes_as_charged(layout: &Layout, split: &[u64]) -> Result<(), String> {
    let n = layout.recompute_every;
    if layout.recompute != Recompute::Full || n <= 1 {
        return Ok(());
    }
    match split.iter().position(|c| !c.is_multiple_of(n)) {
        None => Ok(()),
        Some(i) => {
            let first: u64 = split[..i].iter().sum();
            let recomputed = (first + split[i]) / n - first / n;
            Err(format!(
                "full recompute of every {n}th layer with model chunks of {split:?} layers: chunk {i} (layers {}..{}) holds {} layers, of which the runtime recomputes {recomputed} (layers N, 2N, … of the whole model) where the plan charges {}/{n}; every chunk must hold a multiple of {n} layers",
                first,
                first + split[i],
                split[i],
                split[i]
            ))
        }
    }
}

/// The rule name of pinned end-stage layer counts that cannot be built.
pub const STAGE_LAYERS: &str = "pinned first/last stage layers cannot be split";

/// Layers per pipeline stage under pinned end stages: the first and last stages as pinned,
/// the middle stages (or the unpinned end with them) sharing the rest evenly, the later
/// stages taking the remainder. Interleaved, every stage holds at least one layer per chunk,
/// except that an end stage may be one short (its end chunk holding only the embedding or
/// the head); otherwise at least one layer.
pub fn stage_layers(
    model: &Model,
    layout: &Layout,
    ends: super::StageLayers,
) -> Result<Vec<u64>, Rejection> {
    let layers = model.architecture.layers;
    let (pp, v) = (layout.pp, layout.virtual_stages.max(1));
    let flags = match (ends.first, ends.last) {
        (Some(f), Some(l)) => format!("--first-stage-layers {f} --last-stage-layers {l}"),
        (Some(f), None) => format!("--first-stage-layers {f}"),
        (None, Some(l)) => format!("--last-stage-layers {l}"),
        (None, None) => String::new(),
    };
    let fail = |detail: String, fix: String| {
        Err(Rejection::new(STAGE_LAYERS, format!("{flags}: {detail}")).with_fix(fix))
    };
    if pp < 2 {
        return fail(
            format!("PP {pp} has no first and last stage to pin"),
            "pin --pp 2 or more, or drop the stage pins".into(),
        );
    }
    let end_least = if v > 1 { v - 1 } else { 1 };
    for (name, n) in [("first", ends.first), ("last", ends.last)] {
        if let Some(n) = n.filter(|n| *n < end_least) {
            return fail(
                format!("the {name} stage holds {n} layers, fewer than its {v} chunks allow (at least {end_least}: one per chunk, its end chunk may hold only the {})", if name == "first" { "embedding" } else { "head" }),
                format!("pin --{name}-stage-layers {end_least} or more, or fewer virtual stages"),
            );
        }
    }
    let pinned: u64 = ends
        .first
        .unwrap_or(0)
        .saturating_add(ends.last.unwrap_or(0));
    let shared = pp - u64::from(ends.first.is_some()) - u64::from(ends.last.is_some());
    let Some(rest) = layers.checked_sub(pinned) else {
        return fail(
            format!("the end stages take {pinned} layers, more than the model's {layers}"),
            format!("pin fewer layers on the end stages (together at most {layers})"),
        );
    };
    let mut per = vec![0u64; pp as usize];
    match rest.checked_div(shared) {
        None if rest != 0 => {
            return fail(
                format!("PP {pp} has no middle stage, and the end stages hold {pinned} of the {layers} layers"),
                format!("pin end stages that add up to {layers}, or pin only one of them"),
            );
        }
        None => {}
        Some(base) => {
            let extra = rest % shared;
            let least = if v > 1 { v } else { 1 };
            if base < least {
                return fail(
                format!(
                    "the {rest} layers left for the other {shared} stages give {base} to some of them, fewer than {least} (one per chunk, PP {pp} × virtual stages {v})"
                ),
                format!(
                    "pin fewer layers on the end stages (at most {} together), or fewer virtual stages",
                    layers.saturating_sub(shared * least)
                ),
            );
            }
            let first_shared = u64::from(ends.first.is_some());
            for i in 0..shared {
                per[(first_shared + i) as usize] = base + u64::from(i >= shared - extra);
            }
        }
    }
    if let Some(f) = ends.first {
        per[0] = f;
    }
    if let Some(l) = ends.last {
        per[pp as usize - 1] = l;
    }
    if let Err(why) = split_recomputes_as_charged(layout, &layout.chunk_split(&per)) {
        return fail(why, "pin end stages whose chunks hold multiples of the recompute interval, or drop --recompute-every".into());
    }
    Ok(per)
}
