//! The mixture-of-experts MLP (docs/moe.md): a replicated router chooses `k` of `E` routed
//! experts per token, the tokens travel to the expert-parallel (EP) rank holding their expert
//! by an all-to-all ([`Comm::all_to_all_v`]), each expert (a dense MLP of `moe_ffn_hidden`,
//! TP-sharded like [`ParallelMlp`]) runs on the rows it received, the outputs travel back and
//! are summed with the router's weights, plus the shared experts (gated by a sigmoid when the
//! model says so). The load-balancing loss is computed here and its gradient added in the
//! backward.
//!
//! Like the dense MLP, the layer produces this TP rank's PARTIAL output (the block sums it over
//! TP, or reduce-scatters it under sequence parallelism) and a partial input gradient (summed
//! by the block). Its input is every token of the TP group (gathered under SP), so every TP
//! rank routes the same way; each TP rank exchanges tokens with its own EP peers (same TP
//! coordinate) and computes its slice of each expert. Router and gate input gradients are
//! added on TP rank 0 only, and the router's weight gradient, which needs the combined (TP-
//! summed) expert outputs, gets their dot products summed over TP by the caller's `tp_sum`.
//!
//! Routed experts are registered in a layout of their own (`expert_layout`), which the stage
//! appends after its dense parameters: their gradients are summed over the expert-DP group,
//! not the DP group ([`MoeMlp::expert_base`] is where they start in the flat buffers).
//!
//! Runs on any [`Backend`] (`run.rs`): the router's, the experts' and the gate's GEMMs are the
//! backend's, the tokens move between rows with its `gather_rows` / `scatter_add_rows` and
//! between EP ranks with the EP group's [`Collective::all_to_all_v`] on its buffers. What
//! depends on the routing stays on the host: the router's scores, top-k and backward (`route`),
//! the row plan, and a few numbers per token (the combine weights' and the gate's gradients).
//! Must not decide layouts or build groups: the EP and CP communicators come in
//! [`MoeWorkspace`].

pub mod route;
mod run;

use std::ops::Range;

use tessera_planner::model::Moe;

use super::mlp::ParallelMlp;
use super::{BlockConfig, LayerError, TpShard};
use crate::backend::{Backend, Collective, Storage};
use crate::comm::Comm;
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

pub use route::{RouterSpec, Routing};

/// A host communicator, as the CP group is held (its load-balancing statistics are host
/// vectors).
pub type HostComm = Box<dyn Comm + Send>;

/// The EP group on the backend's buffers (the token all-to-all).
pub type EpComm<B> = Box<dyn Collective<B>>;

/// Which of a layer's routed experts a rank holds: EP rank `rank` of `size` holds experts
/// `rank · E/size .. (rank + 1) · E/size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpShard {
    pub rank: usize,
    pub size: usize,
}

impl EpShard {
    pub const SINGLE: EpShard = EpShard { rank: 0, size: 1 };
}

/// The MoE MLP of one layer on one rank.
#[derive(Debug, Clone)]
pub struct MoeMlp {
    pub spec: RouterSpec,
    pub aux_coef: f64,
    /// Hidden size.
    pub c: usize,
    /// `(E, C)`, replicated.
    pub router: ParamRef,
    /// `(E)`, the score bias (only chooses; no gradient).
    pub score_bias: Option<ParamRef>,
    /// `(1, C)`, the shared experts' sigmoid gate.
    pub gate: Option<ParamRef>,
    pub shared: Vec<ParallelMlp>,
    /// This rank's routed experts, `first_expert ..`, their references relative to
    /// [`expert_base`](Self::expert_base).
    pub experts: Vec<ParallelMlp>,
    pub first_expert: usize,
    pub ep: EpShard,
    /// Where the stage's expert layout starts in the flat buffers.
    pub expert_base: usize,
    pub tp: TpShard,
    /// The weight of one micro-batch's load-balancing loss in the step's loss: one over the
    /// micro-batches of the global batch (the executor sets it; 0: the loss is not trained).
    pub aux_scale: f64,
    /// The router, gate and experts are a frozen base's (adapter fine-tuning): the backward
    /// computes the input gradient only.
    pub frozen: bool,
}

/// The communicators and the load-balancing loss sum of a stage's MoE layers.
pub struct MoeWorkspace<B: Backend> {
    /// The EP group; `None`: one rank, whose exchanges are the identity and are skipped.
    pub ep: Option<EpComm<B>>,
    /// The CP group, over which the load-balancing statistics are summed (`None`: CP 1).
    pub cp: Option<HostComm>,
    /// Σ of the load-balancing losses of the forwards since the last [`take_aux`](Self::take_aux).
    aux_sum: f64,
    /// Whether this rank counts the losses (one rank of each micro-batch's CP group does).
    pub count_aux: bool,
}

impl<B: Backend> std::fmt::Debug for MoeWorkspace<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeWorkspace")
            .field("ep", &self.ep_rank())
            .field("cp", &self.cp.as_ref().map(|c| (c.rank(), c.size())))
            .field("aux_sum", &self.aux_sum)
            .finish()
    }
}

impl<B: Backend> MoeWorkspace<B> {
    pub fn new(ep: Option<EpComm<B>>, cp: Option<HostComm>) -> Self {
        let count_aux = cp.as_ref().is_none_or(|c| c.rank() == 0);
        Self {
            ep,
            cp,
            aux_sum: 0.0,
            count_aux,
        }
    }

    /// One rank, no peers: the single-rank model.
    pub fn single() -> Self {
        Self::new(None, None)
    }

    /// `(rank, size)` in the EP group.
    fn ep_rank(&self) -> (usize, usize) {
        self.ep.as_ref().map_or((0, 1), |c| (c.rank(), c.size()))
    }

    /// Adds one forward's load-balancing loss (counted once per micro-batch).
    pub fn record_aux(&mut self, aux: f64) {
        if self.count_aux {
            self.aux_sum += aux;
        }
    }

    /// The losses recorded since the last call, cleared.
    pub fn take_aux(&mut self) -> f64 {
        std::mem::take(&mut self.aux_sum)
    }
}

/// What one micro-batch's MoE forward keeps for its backward: the routing and the row plan on
/// the host, the experts' tensors on the backend (buffers grown to the largest routing seen,
/// used up to this call's rows).
#[derive(Debug, Clone)]
pub struct MoeSaved<B: Backend> {
    pub routing: Routing,
    /// The kept slots (`t·k + j`) in send order: by expert, then slot.
    order: Vec<usize>,
    /// Each slot's row in `order` (`usize::MAX`: dropped).
    pos: Vec<usize>,
    /// Rows sent to / received from each EP rank.
    send_rows: Vec<usize>,
    recv_rows: Vec<usize>,
    /// Expert-major row `i` (local expert, then source rank, then row) is received row
    /// `perm[i]`.
    perm: Vec<usize>,
    /// The inverse of `perm`: received row `r` is expert-major row `unperm[r]`.
    unperm: Vec<usize>,
    /// Each local expert's expert-major rows.
    expert_rows: Vec<Range<usize>>,
    /// `(rows, C)`, `(rows, h_width)`, `(rows, f_local)`: the experts' inputs and activations.
    xin: Option<B::Buf>,
    h: Option<B::Buf>,
    a: Option<B::Buf>,
    /// `(order.len(), C)`: the experts' partial outputs of this rank's slots, back home.
    y_back: Option<B::Buf>,
    shared_h: Vec<Option<B::Buf>>,
    shared_a: Vec<Option<B::Buf>>,
    /// `(n, C)` the shared experts' partial output (on the backend); `(n)` their gate.
    sh: Option<B::Buf>,
    gate: Vec<f32>,
    /// `(E)` the micro-batch's slots per expert (summed over CP) and its tokens.
    counts: Vec<f32>,
    tokens: usize,
    /// This forward's load-balancing loss.
    pub aux: f64,
}

impl<B: Backend> Default for MoeSaved<B> {
    fn default() -> Self {
        Self {
            routing: Routing::default(),
            order: Vec::new(),
            pos: Vec::new(),
            send_rows: Vec::new(),
            recv_rows: Vec::new(),
            perm: Vec::new(),
            unperm: Vec::new(),
            expert_rows: Vec::new(),
            xin: None,
            h: None,
            a: None,
            y_back: None,
            shared_h: Vec::new(),
            shared_a: Vec::new(),
            sh: None,
            gate: Vec::new(),
            counts: Vec::new(),
            tokens: 0,
            aux: 0.0,
        }
    }
}

impl MoeMlp {
    /// Registers `{prefix}.router`, `{prefix}.router_score_bias`, `{prefix}.shared_expert_gate`
    /// and `{prefix}.shared_experts.{s}.*` in `layout`, and this rank's routed experts
    /// `{prefix}.experts.{e}.*` (global expert index) in `expert_layout`.
    pub fn new(
        layout: &mut ParamLayout,
        expert_layout: &mut ParamLayout,
        prefix: &str,
        cfg: &BlockConfig,
        moe: &Moe,
        tp: TpShard,
        ep: EpShard,
    ) -> Result<Self, LayerError> {
        let us = |v: u64, what: &str| {
            usize::try_from(v)
                .map_err(|_| LayerError::Config(format!("{what} = {v} does not fit in memory")))
        };
        let (e, k) = (
            us(moe.experts, "experts")?,
            us(moe.experts_per_token, "experts_per_token")?,
        );
        let groups = us(moe.expert_groups, "expert_groups")?.max(1);
        if e < 2 || k == 0 || k > e || !e.is_multiple_of(groups) || ep.size == 0 {
            return Err(LayerError::Config(format!(
                "MoE layer {prefix}: {e} experts, top-{k}, {groups} groups do not make a router"
            )));
        }
        if !e.is_multiple_of(ep.size) {
            return Err(LayerError::Config(format!(
                "EP {} does not divide the {e} experts of {prefix}; pick an EP that divides them",
                ep.size
            )));
        }
        let c = cfg.hidden;
        let (std, pstd) = (cfg.init_std, cfg.proj_init_std);
        let spec = |name: String, shape: Vec<usize>, decay: bool, init: Init| ParamSpec {
            name,
            global_shape: shape,
            shard: Shard::Replicated,
            decay,
            init,
        };
        let router = layout.add(spec(
            format!("{prefix}.router.weight"),
            vec![e, c],
            true,
            Init::Normal { std },
        ))?;
        let score_bias = match moe.router_score_bias {
            true => Some(layout.add(spec(
                format!("{prefix}.router.score_bias"),
                vec![e],
                false,
                Init::Const(0.0),
            ))?),
            false => None,
        };
        let shared_n = us(moe.shared_experts, "shared_experts")?;
        let gate = match moe.shared_expert_gate && shared_n > 0 {
            true => Some(layout.add(spec(
                format!("{prefix}.shared_expert_gate.weight"),
                vec![1, c],
                true,
                Init::Normal { std },
            ))?),
            false => None,
        };
        let mlp = |l: &mut ParamLayout, name: String, f: u64| {
            ParallelMlp::new(
                l,
                &name,
                c,
                us(f, "expert width")?,
                cfg.activation,
                cfg.bias,
                tp,
                std,
                pstd,
            )
        };
        let shared = (0..shared_n)
            .map(|s| {
                mlp(
                    layout,
                    format!("{prefix}.shared_experts.{s}"),
                    moe.shared_expert_ffn_hidden,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let per = e / ep.size;
        let first_expert = ep.rank * per;
        let experts = (first_expert..first_expert + per)
            .map(|x| {
                mlp(
                    expert_layout,
                    format!("{prefix}.experts.{x}"),
                    moe.moe_ffn_hidden,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            spec: RouterSpec {
                experts: e,
                top_k: k,
                scoring: moe.router_scoring,
                normalize: moe.normalize_top_k,
                scaling: moe.routed_scaling_factor as f32,
                groups,
                groups_per_token: us(moe.expert_groups_per_token, "expert_groups_per_token")?
                    .clamp(1, groups),
                capacity_factor: moe.capacity_factor,
            },
            aux_coef: moe.router_aux_loss_coef,
            c,
            router,
            score_bias,
            gate,
            shared,
            experts,
            first_expert,
            ep,
            expert_base: 0,
            tp,
            aux_scale: 0.0,
            frozen: layout.freezing(),
        })
    }

    fn local(&self) -> usize {
        self.experts.len()
    }

    /// Whether this rank adds the replicated paths' input gradients and biases.
    fn lead(&self) -> bool {
        self.tp.rank == 0
    }

    /// The send order, the per-rank row counts and the expert-major permutation of the
    /// received rows, from `s.routing` (one all-gather of the per-expert counts over EP).
    fn dispatch_plan<B: Backend>(
        &self,
        be: &B,
        s: &mut MoeSaved<B>,
        ws: &MoeWorkspace<B>,
    ) -> Result<(), LayerError> {
        let (e, k, ep) = (self.spec.experts, self.spec.top_k, self.ep.size);
        let per = e / ep;
        let r = &s.routing;
        let mut order: Vec<usize> = (0..r.n * k).filter(|&slot| r.kept[slot]).collect();
        // Stable: by expert, then slot.
        order.sort_by_key(|&slot| r.experts[slot]);
        let mut pos = vec![usize::MAX; r.n * k];
        for (row, &slot) in order.iter().enumerate() {
            pos[slot] = row;
        }
        let mut mine = vec![0.0f32; e];
        for &slot in &order {
            mine[r.experts[slot]] += 1.0;
        }
        let all = match &ws.ep {
            None => mine.clone(),
            Some(comm) => {
                let input = be.upload(Storage::F32, &mine)?;
                let mut all = be.alloc(Storage::F32, ep * e)?;
                comm.all_gather(B::view(&input), B::view_mut(&mut all))?;
                be.download(B::view(&all))?
            }
        };
        let count = |src: usize, x: usize| all[src * e + x] as usize;
        s.send_rows = (0..ep)
            .map(|d| (d * per..(d + 1) * per).map(|x| mine[x] as usize).sum())
            .collect();
        let local = self.first_expert..self.first_expert + self.local();
        s.recv_rows = (0..ep)
            .map(|src| local.clone().map(|x| count(src, x)).sum())
            .collect();
        let recv_start: Vec<usize> = s
            .recv_rows
            .iter()
            .scan(0, |at, &n| {
                let st = *at;
                *at += n;
                Some(st)
            })
            .collect();
        s.perm.clear();
        s.expert_rows.clear();
        for x in local.clone() {
            let start = s.perm.len();
            for (src, &first) in recv_start.iter().enumerate() {
                let before: usize = (local.start..x).map(|y| count(src, y)).sum();
                let at = first + before;
                s.perm.extend(at..at + count(src, x));
            }
            s.expert_rows.push(start..s.perm.len());
        }
        s.unperm = vec![0; s.perm.len()];
        for (i, &r) in s.perm.iter().enumerate() {
            s.unperm[r] = i;
        }
        s.order = order;
        s.pos = pos;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
