//! The words of the step-time breakdown: what each communication term is and on which links.

use super::comm::{self, Links};
use crate::layout::{Layout, Recompute};
use crate::model::{AttentionImpl, Model};

fn link_words(l: &comm::GroupLink) -> String {
    if l.crosses_nodes() {
        format!(
            "across {} nodes at {:.0} GB/s per rank",
            l.nodes,
            l.bandwidth / 1e9
        )
    } else {
        format!("inside a node at {:.0} GB/s per rank", l.bandwidth / 1e9)
    }
}

pub(super) fn recompute_reason(
    layout: &Layout,
    keep: crate::memory::activations::Keep,
    attention: AttentionImpl,
) -> String {
    use crate::memory::activations::Keep;
    match (layout.recompute, attention) {
        (Recompute::None, _) => "no activation recompute".into(),
        (Recompute::Selective, _) if keep == Keep::OpSac => "per-op selective checkpointing (torchtitan's op SAC) re-runs every second matmul and the element-wise kernels in the backward".into(),
        (Recompute::Selective, AttentionImpl::Flash) => "selective recompute re-runs the attention kernel's forward in the backward (the framework's selective is the attention core's: under flash attention it saves no memory)".into(),
        (Recompute::Selective, AttentionImpl::Eager) => "selective recompute re-runs the attention core in the backward".into(),
        (Recompute::Full, _) if layout.recompute_every > 1 => format!(
            "full recompute of every {}th layer re-runs its forward in the backward",
            layout.recompute_every
        ),
        (Recompute::Full, _) => "full recompute re-runs each layer's forward in the backward".into(),
    }
}

pub(super) fn cp_reason(layout: &Layout, links: &Links) -> String {
    if layout.cp_comm == crate::layout::CpComm::AllGather {
        return format!(
            "K and V all-gathered over CP {} before each layer's attention (and again in the backward, with their gradients reduce-scattered), {}, not overlapped",
            layout.cp,
            link_words(&links.cp)
        );
    }
    format!(
        "ring attention: K and V passed around CP {} in {} steps per layer and micro-batch (with their gradients in the backward), {}, beyond what each step's attention block hides",
        layout.cp,
        layout.cp.saturating_sub(1),
        link_words(&links.cp)
    )
}

pub(super) fn ep_reason(model: &Model, layout: &Layout, links: &Links) -> String {
    let Some(m) = &model.architecture.moe else {
        return "no mixture-of-experts layers".into();
    };
    let e = &links.ep;
    let span = if e.nodes > 1 {
        format!(
            "across {} nodes ({} of the group in a node over the intra-node link, the rest through each rank's NIC at {:.0} GB/s)",
            e.nodes,
            e.per_node,
            e.nic / 1e9
        )
    } else {
        format!("inside a node at {:.0} GB/s per rank", e.intra / 1e9)
    };
    format!(
        "all-to-all token dispatch and combine of each MoE layer over EP {} ({} experts per rank, top-{} routing{}), in forward and backward, {span}, not overlapped",
        layout.ep,
        m.experts / layout.ep.max(1),
        m.experts_per_token,
        match m.capacity_factor {
            Some(c) => format!(", capacity factor {c}"),
            None => String::new(),
        }
    )
}

pub(super) fn tp_reason(layout: &Layout, links: &Links, sp: bool, overlap: bool) -> String {
    if layout.tp == 1 {
        return "no tensor parallelism".into();
    }
    let what = if sp {
        "2 all-gathers + 2 reduce-scatters (sequence parallel)"
    } else {
        "2 all-reduces"
    };
    let extra = if layout.recompute == Recompute::Full {
        ", again in the recomputed forward"
    } else {
        ""
    };
    let hidden = if overlap && sp {
        "; each cut into TP steps overlapped with the GEMM it feeds or follows (tp_comm_overlap): the steps the GEMMs cannot cover, at least one per collective, and the split GEMMs' extra time in compute"
    } else {
        ""
    };
    format!(
        "{what} of the layer's activations per layer in forward and in backward{extra}, over TP {} {}{hidden}",
        layout.tp,
        link_words(&links.tp)
    )
}

pub(super) fn dp_reason(layout: &Layout, links: &Links) -> String {
    if layout.dp == 1 && layout.cp == 1 {
        return "no data parallelism".into();
    }
    let what = match (layout.sharding.zero_stage, layout.sharding.hybrid) {
        (0, _) => "gradient all-reduce",
        (1 | 2, false) => "gradient reduce-scatter + parameter all-gather (ZeRO)",
        (1 | 2, true) => "gradient reduce-scatter in the node + all-reduce across nodes + parameter all-gather (hybrid ZeRO)",
        (_, false) => "ZeRO-3 per-micro-batch parameter all-gathers and gradient reduce-scatters",
        (_, true) => "hybrid ZeRO-3 in-node gathers and scatters + cross-node gradient all-reduce",
    };
    let over = if layout.cp > 1 {
        format!("DP {} × CP {}", layout.dp, layout.cp)
    } else {
        format!("DP {}", layout.dp)
    };
    format!("{what} over {over} {}", link_words(&links.dp))
}
