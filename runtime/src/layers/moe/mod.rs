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
//! Runs on host f32 slices (the CPU backend); the executor refuses MoE plans elsewhere. Must
//! not decide layouts or build groups: the EP and CP communicators come in [`MoeWorkspace`].

pub mod route;

use std::ops::Range;

use tessera_planner::model::Moe;

use super::mlp::ParallelMlp;
use super::{BlockConfig, LayerError, TpShard};
use crate::backend::cpu::kernels as cpu;
use crate::backend::Cpu;
use crate::comm::{Comm, LocalComm};
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

pub use route::{RouterSpec, Routing};

/// A host communicator, as the EP and CP groups are held.
pub type HostComm = Box<dyn Comm + Send>;

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
pub struct MoeWorkspace {
    /// The EP group (one rank without expert parallelism).
    pub ep: HostComm,
    /// The CP group, over which the load-balancing statistics are summed (`None`: CP 1).
    pub cp: Option<HostComm>,
    /// Σ of the load-balancing losses of the forwards since the last [`take_aux`](Self::take_aux).
    aux_sum: f64,
    /// Whether this rank counts the losses (one rank of each micro-batch's CP group does).
    pub count_aux: bool,
}

impl std::fmt::Debug for MoeWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeWorkspace")
            .field("ep", &(self.ep.rank(), self.ep.size()))
            .field("cp", &self.cp.as_ref().map(|c| (c.rank(), c.size())))
            .field("aux_sum", &self.aux_sum)
            .finish()
    }
}

impl MoeWorkspace {
    pub fn new(ep: HostComm, cp: Option<HostComm>) -> Self {
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
        let one = LocalComm::group(1).pop().expect("a group of one");
        Self::new(Box::new(one), None)
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

/// What one micro-batch's MoE forward keeps for its backward (host vectors; sizes vary with
/// the routing).
#[derive(Debug, Clone, Default)]
pub struct MoeSaved {
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
    /// Each local expert's expert-major rows.
    expert_rows: Vec<Range<usize>>,
    /// `(rows, C)`, `(rows, h_width)`, `(rows, f_local)`: the experts' inputs and activations.
    xin: Vec<f32>,
    h: Vec<f32>,
    a: Vec<f32>,
    /// `(order.len(), C)`: the experts' partial outputs of this rank's slots, back home.
    y_back: Vec<f32>,
    shared_h: Vec<Vec<f32>>,
    shared_a: Vec<Vec<f32>>,
    /// `(n, C)` the shared experts' partial output; `(n)` their gate.
    sh: Vec<f32>,
    gate: Vec<f32>,
    /// `(E)` the micro-batch's slots per expert (summed over CP) and its tokens.
    counts: Vec<f32>,
    tokens: usize,
    /// This forward's load-balancing loss.
    pub aux: f64,
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

    /// The forward of `x (n, C)` (every token of the TP group), keeping in `s` what the
    /// backward needs; with `out`, writes this TP rank's partial output `(n, C)`.
    pub fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        s: &mut MoeSaved,
        out: Option<&mut [f32]>,
        ws: &mut MoeWorkspace,
    ) -> Result<(), LayerError> {
        let (c, e, k) = (self.c, self.spec.experts, self.spec.top_k);
        let n = x.len() / c;
        if ws.ep.size() != self.ep.size || ws.ep.rank() != self.ep.rank {
            return Err(LayerError::Config(format!(
                "MoE layer built for EP rank {} of {}, run on rank {} of {}",
                self.ep.rank,
                self.ep.size,
                ws.ep.rank(),
                ws.ep.size()
            )));
        }
        let mut logits = vec![0.0f32; n * e];
        cpu::matmul_bt(&mut logits, x, self.router.of(p), n, c, e, false);
        let bias = self.score_bias.map(|b| b.of(p));
        s.routing = self.spec.route(&logits, bias);
        // The load-balancing statistics of the whole micro-batch.
        let mut stats = [s.routing.counts.clone(), s.routing.prob_sums.clone()].concat();
        let mut tokens = n;
        if let Some(cp) = &ws.cp {
            cp.all_reduce_sum(&mut stats)?;
            tokens *= cp.size();
        }
        s.aux = self
            .spec
            .aux_loss(self.aux_coef, &stats[..e], &stats[e..], tokens);
        s.counts = stats[..e].to_vec();
        s.tokens = tokens;
        self.dispatch_plan(s, ws)?;
        // Dispatch: rows in `order`, to the EP rank holding each expert.
        let mut send = vec![0.0f32; s.order.len() * c];
        for (row, &slot) in s.order.iter().enumerate() {
            let t = slot / k;
            send[row * c..(row + 1) * c].copy_from_slice(&x[t * c..(t + 1) * c]);
        }
        let recv = self.exchange(ws, &send, &s.send_rows, &s.recv_rows)?;
        let rows = s.perm.len();
        s.xin = vec![0.0; rows * c];
        for (i, &r) in s.perm.iter().enumerate() {
            s.xin[i * c..(i + 1) * c].copy_from_slice(&recv[r * c..(r + 1) * c]);
        }
        // The experts.
        let (hw, fl) = self
            .experts
            .first()
            .map_or((0, 0), |m| (m.h_width(), m.f_local));
        s.h = vec![0.0; rows * hw];
        s.a = vec![0.0; rows * fl];
        let mut y = vec![0.0f32; rows * c];
        let pe = &p[self.expert_base..];
        for (mlp, r) in self.experts.iter().zip(&s.expert_rows) {
            if r.is_empty() {
                continue;
            }
            let xe = &s.xin[r.start * c..r.end * c];
            let (he, ae) = (
                &mut s.h[r.start * hw..r.end * hw],
                &mut s.a[r.start * fl..r.end * fl],
            );
            mlp.forward_hidden(&Cpu, pe, xe, &mut *he, &mut *ae)?;
            let ye = &mut y[r.start * c..r.end * c];
            mlp.proj.forward_partial(&Cpu, pe, ae, &mut *ye)?;
            if self.lead() {
                mlp.proj.add_bias(&Cpu, pe, ye)?;
            }
        }
        // Combine: back to the received order, home, then weighted per token.
        let mut back = vec![0.0f32; rows * c];
        for (i, &r) in s.perm.iter().enumerate() {
            back[r * c..(r + 1) * c].copy_from_slice(&y[i * c..(i + 1) * c]);
        }
        s.y_back = self.exchange(ws, &back, &s.recv_rows, &s.send_rows)?;
        // Shared experts.
        s.sh = vec![0.0; n * c];
        s.shared_h.clear();
        s.shared_a.clear();
        for mlp in &self.shared {
            let mut h = vec![0.0; n * mlp.h_width()];
            let mut a = vec![0.0; n * mlp.f_local];
            mlp.forward_hidden(&Cpu, p, x, &mut h, &mut a)?;
            let mut ys = vec![0.0; n * c];
            mlp.proj.forward_partial(&Cpu, p, &a, &mut ys)?;
            if self.lead() {
                mlp.proj.add_bias(&Cpu, p, &mut ys)?;
            }
            s.sh.iter_mut().zip(&ys).for_each(|(o, v)| *o += v);
            s.shared_h.push(h);
            s.shared_a.push(a);
        }
        s.gate = match self.gate {
            Some(g) => {
                let mut z = vec![0.0f32; n];
                cpu::matmul_bt(&mut z, x, g.of(p), n, c, 1, false);
                z.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect()
            }
            None => Vec::new(),
        };
        let Some(out) = out else {
            return Ok(());
        };
        out.fill(0.0);
        for t in 0..n {
            let o = &mut out[t * c..(t + 1) * c];
            for j in 0..k {
                let slot = t * k + j;
                let row = s.pos[slot];
                if row == usize::MAX {
                    continue;
                }
                let w = s.routing.weights[slot];
                let yb = &s.y_back[row * c..(row + 1) * c];
                o.iter_mut().zip(yb).for_each(|(o, v)| *o += w * v);
            }
            if !self.shared.is_empty() {
                let g = s.gate.get(t).copied().unwrap_or(1.0);
                let sh = &s.sh[t * c..(t + 1) * c];
                o.iter_mut().zip(sh).for_each(|(o, v)| *o += g * v);
            }
        }
        Ok(())
    }

    /// The send order, the per-rank row counts and the expert-major permutation of the
    /// received rows, from `s.routing` (one all-gather of the per-expert counts over EP).
    fn dispatch_plan(&self, s: &mut MoeSaved, ws: &MoeWorkspace) -> Result<(), LayerError> {
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
        let mut all = vec![0.0f32; ep * e];
        ws.ep.all_gather(&mine, &mut all)?;
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
        s.order = order;
        s.pos = pos;
        Ok(())
    }

    /// Rows of `c` floats: `send_rows[p]` of `data` to EP rank `p`, `recv_rows[p]` back from it.
    fn exchange(
        &self,
        ws: &MoeWorkspace,
        data: &[f32],
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<Vec<f32>, LayerError> {
        let c = self.c;
        let sc: Vec<usize> = send_rows.iter().map(|r| r * c).collect();
        let rc: Vec<usize> = recv_rows.iter().map(|r| r * c).collect();
        let mut out = vec![0.0f32; rc.iter().sum()];
        ws.ep.all_to_all_v(data, &sc, &mut out, &rc)?;
        Ok(out)
    }

    /// Given `dout (n, C)`, overwrites `dx (n, C)` with this TP rank's partial input gradient and
    /// accumulates parameter gradients into `g`; `tp_sum` sums a host vector over the TP group.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        x: &[f32],
        s: &MoeSaved,
        dout: &[f32],
        dx: &mut [f32],
        ws: &mut MoeWorkspace,
        tp_sum: &mut dyn FnMut(&mut [f32]) -> Result<(), LayerError>,
    ) -> Result<(), LayerError> {
        let (c, e, k) = (self.c, self.spec.experts, self.spec.top_k);
        let n = x.len() / c;
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        // The combine weights' and the gate's gradients need the TP-summed outputs.
        let gated = self.gate.is_some();
        let mut d = vec![0.0f32; n * k + if gated { n } else { 0 }];
        for t in 0..n {
            let dt = &dout[t * c..(t + 1) * c];
            for j in 0..k {
                let row = s.pos[t * k + j];
                if row != usize::MAX {
                    d[t * k + j] = dot(dt, &s.y_back[row * c..(row + 1) * c]);
                }
            }
            if gated {
                d[n * k + t] = dot(dt, &s.sh[t * c..(t + 1) * c]);
            }
        }
        tp_sum(&mut d)?;
        let (dweights, dgate) = d.split_at(n * k);
        // The experts' output gradients go where their rows came from.
        let mut dy = vec![0.0f32; s.order.len() * c];
        for (row, &slot) in s.order.iter().enumerate() {
            let (t, w) = (slot / k, s.routing.weights[slot]);
            let o = &mut dy[row * c..(row + 1) * c];
            o.iter_mut()
                .zip(&dout[t * c..(t + 1) * c])
                .for_each(|(o, v)| *o = w * v);
        }
        let recv = self.exchange(ws, &dy, &s.send_rows, &s.recv_rows)?;
        let rows = s.perm.len();
        let mut dye = vec![0.0f32; rows * c];
        for (i, &r) in s.perm.iter().enumerate() {
            dye[i * c..(i + 1) * c].copy_from_slice(&recv[r * c..(r + 1) * c]);
        }
        let (hw, fl) = self
            .experts
            .first()
            .map_or((0, 0), |m| (m.h_width(), m.f_local));
        let mut dxe = vec![0.0f32; rows * c];
        // Frozen experts sit past the gradient buffer, and their linears write no gradient.
        let pe = &p[self.expert_base..];
        let ge: &mut [f32] = match self.frozen {
            true => &mut [],
            false => g.split_at_mut(self.expert_base).1,
        };
        for (mlp, r) in self.experts.iter().zip(&s.expert_rows) {
            if r.is_empty() {
                continue;
            }
            let ne = r.len();
            let (mut dh, mut da) = (vec![0.0f32; ne * hw], vec![0.0f32; ne * fl]);
            mlp.backward_partial(
                &Cpu,
                pe,
                &mut *ge,
                &s.xin[r.start * c..r.end * c],
                &s.h[r.start * hw..r.end * hw],
                &s.a[r.start * fl..r.end * fl],
                &dye[r.start * c..r.end * c],
                &mut dxe[r.start * c..r.end * c],
                &mut dh,
                &mut da,
            )?;
        }
        let mut back = vec![0.0f32; rows * c];
        for (i, &r) in s.perm.iter().enumerate() {
            back[r * c..(r + 1) * c].copy_from_slice(&dxe[i * c..(i + 1) * c]);
        }
        let dx_back = self.exchange(ws, &back, &s.recv_rows, &s.send_rows)?;
        dx.fill(0.0);
        for t in 0..n {
            let o = &mut dx[t * c..(t + 1) * c];
            for j in 0..k {
                let row = s.pos[t * k + j];
                if row != usize::MAX {
                    let v = &dx_back[row * c..(row + 1) * c];
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += v);
                }
            }
        }
        // Shared experts (and their gate).
        if !self.shared.is_empty() {
            let mut dsh = dout.to_vec();
            if gated {
                for (t, row) in dsh.chunks_exact_mut(c).enumerate() {
                    row.iter_mut().for_each(|v| *v *= s.gate[t]);
                }
            }
            let mut dxs = vec![0.0f32; n * c];
            for (i, mlp) in self.shared.iter().enumerate() {
                let mut dh = vec![0.0f32; n * mlp.h_width()];
                let mut da = vec![0.0f32; n * mlp.f_local];
                mlp.backward_partial(
                    &Cpu,
                    p,
                    &mut *g,
                    x,
                    &s.shared_h[i],
                    &s.shared_a[i],
                    &dsh,
                    &mut dxs,
                    &mut dh,
                    &mut da,
                )?;
                dx.iter_mut().zip(&dxs).for_each(|(o, v)| *o += v);
            }
        }
        if let Some(gw) = self.gate {
            let dz: Vec<f32> = (0..n)
                .map(|t| dgate[t] * s.gate[t] * (1.0 - s.gate[t]))
                .collect();
            if !self.frozen {
                cpu::matmul_at(gw.of_mut(g), &dz, x, 1, n, c, true);
            }
            if self.lead() {
                cpu::matmul(dx, &dz, gw.of(p), n, 1, c, true);
            }
        }
        // The router: the combine weights and the load-balancing loss.
        let dprob: Option<Vec<f32>> = (self.aux_coef > 0.0 && self.aux_scale > 0.0).then(|| {
            let (kk, t) = (k as f64, s.tokens as f64);
            let w = self.aux_scale * self.aux_coef * e as f64 / (kk * t * t);
            s.counts
                .iter()
                .map(|&cnt| (w * f64::from(cnt)) as f32)
                .collect()
        });
        let mut dlogits = vec![0.0f32; n * e];
        self.spec
            .backward(&s.routing, dweights, dprob.as_deref(), &mut dlogits);
        if !self.frozen {
            cpu::matmul_at(self.router.of_mut(g), &dlogits, x, e, n, c, true);
        }
        if self.lead() {
            cpu::matmul(dx, &dlogits, self.router.of(p), n, e, c, true);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
