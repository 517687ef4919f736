//! LoRA adapters on a frozen base (Hu et al. 2021; Hugging Face PEFT's `LoraLayer`):
//! `y = base(x) + s · B(A(x))` with `A (r, in)`, `B (out, r)` and `s = alpha / r`.
//!
//! An adapter is two ordinary trainable tensors, `{linear}.lora_A.weight` and
//! `{linear}.lora_B.weight` (PEFT's names under the runtime's linear name), registered with
//! [`ParamLayout::add_trainable`] while the base sits in the layout's frozen region. `A` is
//! initialised as PEFT does (`kaiming_uniform_(a=√5)`: `U(-1/√in, 1/√in)`, here from the counter
//! RNG by global element index), `B` at zero, so training starts from the base model.
//!
//! Tensor parallelism follows the base linear (NeMo's rule):
//! - column-parallel (q/k/v, fc/up): `A` replicated, `B` split by output rows as `W` is. The
//!   rank-r intermediate `u = x·Aᵀ` is whole on every rank; `dA = Σ_tp duᵀ·x` is a partial sum
//!   per rank, summed over TP at the end of the step ([`Adapter::tp_summed`]).
//! - row-parallel (o, down/proj): `A` split by input columns as `W` is, `B` replicated. NeMo
//!   all-reduces the intermediate `u = Σ_tp x_t·A_tᵀ` before `B`; since `B` is replicated,
//!   `(Σ_t u_t)·Bᵀ = Σ_t (u_t·Bᵀ)`, so each rank adds `s·u_t·Bᵀ` to its partial output and the
//!   base's own TP reduction (all-reduce, or reduce-scatter under sequence parallelism) sums
//!   the intermediate with it: no extra collective. `dB = Σ_t s·dyᵀ·u_t` is summed over TP at
//!   the end of the step; `du = s·dy·B` is whole (`dy` is), so `dA_t` and `dx_t` are exact.
//!
//! The intermediate is not kept between forward and backward: the backward recomputes it from
//! the linear's input, which the base keeps anyway. The adapter runs on the backend's GEMMs
//! (the base linear's own, with transposes and accumulation) and allocates its `(N, r)`
//! temporaries per call, in activation storage: bf16 on a GPU, where `r` is small next to the
//! base's widths.
//!
//! LoRA dropout (PEFT's `lora_dropout`) drops the adapter's input only, before `A`: the base
//! sees the undropped `x`. The dropped copy is not kept either: forward and backward each make
//! it from `x` and the mask (`super::dropout`, drawn by global row and input feature), a
//! per-call `(N, x_width)` temporary like the intermediate.

use tessera_planner::finetune::{Lora, Target};

use std::ops::Range;

use crate::backend::{Backend, Storage};
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

use super::dropout::{self, Site};
use super::tp::TpShard;
use super::LayerError;

/// What the plan asks of the adapters (`job.model.lora`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSettings {
    pub rank: usize,
    /// `alpha / rank`.
    pub scaling: f32,
    pub targets: Vec<Target>,
    /// PEFT's `lora_dropout`.
    pub dropout: f32,
}

impl LoraSettings {
    pub fn from_plan(l: &Lora) -> Result<Self, LayerError> {
        let rank = usize::try_from(l.rank)
            .ok()
            .filter(|&r| r > 0)
            .ok_or_else(|| LayerError::Config(format!("LoRA rank {} is not usable", l.rank)))?;
        Ok(Self {
            rank,
            scaling: l.scaling() as f32,
            targets: l.targets.clone(),
            dropout: l.dropout as f32,
        })
    }

    pub fn targets(&self, t: Target) -> bool {
        self.targets.contains(&t)
    }
}

/// One linear's adapter on this rank: `A_local (r, x_width)`, `B_local (y_width, r)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    pub a: ParamRef,
    pub b: ParamRef,
    pub rank: usize,
    pub scaling: f32,
    /// Row width of the linear's input on this rank (`in`, or `in / t` row-parallel).
    pub x_width: usize,
    /// Row width of the linear's output on this rank (`out / t` column-parallel, or `out`).
    pub y_width: usize,
    /// Column-parallel (`A` replicated) or row-parallel (`B` replicated).
    pub column: bool,
    /// Where this adapter's outputs start in a row of the linear's local output, and that
    /// row's width: an adapter on one part of a fused projection (Llama's `q_proj` on the
    /// runtime's fused q/k/v) adds to its part's columns only. `0` and `y_width` otherwise.
    pub y_offset: usize,
    pub y_stride: usize,
    /// Dropout on the input (`{name}.lora_dropout`; its features are `A`'s columns).
    pub dropout: Site,
}

fn spec(name: String, shape: Vec<usize>, shard: Shard, init: Init) -> ParamSpec {
    ParamSpec {
        name,
        global_shape: shape,
        shard,
        decay: true,
        init,
    }
}

fn a_init(in_features: usize) -> Init {
    Init::Uniform {
        bound: 1.0 / (in_features as f32).sqrt(),
    }
}

impl Adapter {
    /// The adapter of a column-parallel linear `name` (`in` → the `parts`' outputs, fused when
    /// several): `A (r, in)` replicated; `B (out, r)` split by rows. A fused linear of equal
    /// parts (GPT-2's `c_attn`) gets one `B` of global shape `(parts, out_part, r)` split on
    /// its middle dimension, so each rank's rows are `[q_local | k_local | v_local]` as the
    /// base's output is, and the global tensor flattens to PEFT's `(3·out_part, r)`.
    pub fn column(
        layout: &mut ParamLayout,
        name: &str,
        in_features: usize,
        parts: &[usize],
        s: &LoraSettings,
        tp: TpShard,
    ) -> Result<Self, LayerError> {
        let r = s.rank;
        let a = layout.add_trainable(spec(
            format!("{name}.lora_A.weight"),
            vec![r, in_features],
            Shard::Replicated,
            a_init(in_features),
        ))?;
        let (shape, shard) = match parts {
            [o] => (vec![*o, r], tp.shard(0)),
            [o, rest @ ..] if rest.iter().all(|x| x == o) => {
                (vec![parts.len(), *o, r], tp.shard(1))
            }
            _ => {
                return Err(LayerError::Config(format!(
                    "{name}: one adapter over fused projections of unequal widths {parts:?} (grouped-query attention) is not supported"
                )))
            }
        };
        let b = layout.add_trainable(spec(
            format!("{name}.lora_B.weight"),
            shape,
            shard,
            Init::Const(0.0),
        ))?;
        let out: usize = parts.iter().sum();
        Ok(Self {
            a,
            b,
            rank: r,
            scaling: s.scaling,
            x_width: in_features,
            y_width: out / tp.size,
            column: true,
            y_offset: 0,
            y_stride: out / tp.size,
            dropout: Site::new(
                &format!("{name}.lora_dropout"),
                s.dropout,
                0,
                in_features,
                in_features,
            ),
        })
    }

    /// The adapter of part `part` of a fused column-parallel linear whose parts (named under
    /// `prefix`, e.g. `h.3.attn`) have global widths `parts`: PEFT's adapter on the unfused
    /// module (`q_proj`), `A (r, in)` replicated and `B (out_part, r)` split by rows, adding
    /// to the part's columns of each rank's `[part_0 local | part_1 local | …]` output row.
    pub fn column_part(
        layout: &mut ParamLayout,
        name: &str,
        in_features: usize,
        parts: &[usize],
        part: usize,
        s: &LoraSettings,
        tp: TpShard,
    ) -> Result<Self, LayerError> {
        let mut a = Self::column(layout, name, in_features, &parts[part..=part], s, tp)?;
        a.y_offset = parts[..part].iter().sum::<usize>() / tp.size;
        a.y_stride = parts.iter().sum::<usize>() / tp.size;
        Ok(a)
    }

    /// The adapter of a row-parallel linear `name`: `A (r, in)` split by input columns,
    /// `B (out, r)` replicated.
    pub fn row(
        layout: &mut ParamLayout,
        name: &str,
        in_features: usize,
        out_features: usize,
        s: &LoraSettings,
        tp: TpShard,
    ) -> Result<Self, LayerError> {
        let r = s.rank;
        let a = layout.add_trainable(spec(
            format!("{name}.lora_A.weight"),
            vec![r, in_features],
            tp.shard(1),
            a_init(in_features),
        ))?;
        let b = layout.add_trainable(spec(
            format!("{name}.lora_B.weight"),
            vec![out_features, r],
            Shard::Replicated,
            Init::Const(0.0),
        ))?;
        Ok(Self {
            a,
            b,
            rank: r,
            scaling: s.scaling,
            x_width: in_features / tp.size,
            y_width: out_features,
            column: false,
            y_offset: 0,
            y_stride: out_features,
            dropout: Site::new(
                &format!("{name}.lora_dropout"),
                s.dropout,
                tp.rank * (in_features / tp.size),
                in_features / tp.size,
                in_features,
            ),
        })
    }

    /// The tensor replicated over TP whose gradient is a per-rank partial sum (column: `A`;
    /// row: `B`): the executor sums it over TP before the DP sync.
    pub fn tp_summed(&self) -> ParamRef {
        if self.column {
            self.a
        } else {
            self.b
        }
    }

    /// `u = s · x·Aᵀ (N, r)`, a new buffer.
    fn intermediate<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
    ) -> Result<B::Buf, LayerError> {
        let (n, k, r) = (B::len(x) / self.x_width, self.x_width, self.rank);
        let mut u = be.alloc(Storage::Bf16, n * r)?;
        be.matmul_bt(B::view_mut(&mut u), x, self.a.view::<B>(p), n, k, r, false)?;
        be.scale(B::view_mut(&mut u), self.scaling)?;
        Ok(u)
    }

    /// Whether the adapter covers only some columns of the linear's output rows.
    fn strided(&self) -> bool {
        self.y_stride != self.y_width
    }

    /// The range of row `i`'s columns this adapter covers in `y (N, y_stride)`.
    fn row_columns(&self, i: usize) -> Range<usize> {
        let at = i * self.y_stride + self.y_offset;
        at..at + self.y_width
    }

    /// This adapter's columns of `y (N, y_stride)`, as a new `(N, y_width)` buffer. One copy
    /// per row: the strided case is per-module targets on a fused projection only (Llama's
    /// `q_proj` on the runtime's fused q/k/v), whose rows are few and short next to its GEMMs.
    fn columns<B: Backend>(&self, be: &B, y: B::Ref<'_>) -> Result<B::Buf, LayerError> {
        let (n, w) = (B::len(y) / self.y_stride, self.y_width);
        let mut out = be.alloc(Storage::Bf16, n * w)?;
        for i in 0..n {
            let row = B::sub_mut(B::view_mut(&mut out), i * w..(i + 1) * w);
            be.copy(row, B::sub(y, self.row_columns(i)))?;
        }
        Ok(out)
    }

    /// `y (N, y_stride)[:, y_offset..][..y_width] += part (N, y_width)`, row by row as
    /// [`Self::columns`] reads them.
    fn add_columns<B: Backend>(
        &self,
        be: &B,
        mut y: B::Mut<'_>,
        part: B::Ref<'_>,
    ) -> Result<(), LayerError> {
        let w = self.y_width;
        for i in 0..B::len(part) / w {
            let row = B::sub_mut(B::rb(&mut y), self.row_columns(i));
            be.add_assign(row, B::sub(part, i * w..(i + 1) * w))?;
        }
        Ok(())
    }

    /// PEFT's `lora_dropout(x)` for the armed micro-batch (`x` holds all its rows) as a new
    /// buffer, or `None` without dropout. The mask is drawn on the host, so dropout needs host
    /// memory (the device backend refuses plans with dropout before they run).
    fn dropped<B: Backend>(&self, be: &B, x: B::Ref<'_>) -> Result<Option<B::Buf>, LayerError> {
        let Some(mask) = self.dropout.mask() else {
            return Ok(None);
        };
        let mut d = be.alloc(Storage::Bf16, B::len(x))?;
        be.copy(B::view_mut(&mut d), x)?;
        mask.apply(dropout::host_mut::<B>(B::view_mut(&mut d))?, 0);
        Ok(Some(d))
    }

    /// `y (N, y_stride)[:, y_offset..][..y_width] += s · (x·Aᵀ)·Bᵀ`.
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        y: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let dropped = self.dropped(be, x)?;
        let x = match &dropped {
            Some(d) => B::view(d),
            None => B::rr(&x),
        };
        let u = self.intermediate(be, p, x)?;
        let (n, r, m) = (B::len(x) / self.x_width, self.rank, self.y_width);
        let (u, b) = (B::view(&u), self.b.view::<B>(p));
        if !self.strided() {
            be.matmul_bt(y, u, b, n, r, m, true)?;
            return Ok(());
        }
        let mut part = be.alloc(Storage::Bf16, n * m)?;
        be.matmul_bt(B::view_mut(&mut part), u, b, n, r, m, false)?;
        self.add_columns(be, y, B::view(&part))
    }

    /// `dB += s·dyᵀ·u`, `du = s·dy·B`, `dA += duᵀ·x`, `dx += du·A` (the base wrote `dx`), with
    /// `dy` this adapter's columns of the output gradient; with dropout, `x` is the dropped
    /// copy and `dx += (du·A) ⊙ mask`.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let part = match self.strided() {
            true => Some(self.columns(be, dy)?),
            false => None,
        };
        let dy = match &part {
            Some(d) => B::view(d),
            None => B::rr(&dy),
        };
        let (n, k, r, m) = (
            B::len(x) / self.x_width,
            self.x_width,
            self.rank,
            self.y_width,
        );
        let dropped = self.dropped(be, x)?;
        let x = match &dropped {
            Some(d) => B::view(d),
            None => B::rr(&x),
        };
        let u = self.intermediate(be, p, x)?;
        let (a, b) = (self.a.view::<B>(p), self.b.view::<B>(p));
        be.matmul_at(
            self.b.view_mut::<B>(B::rb(&mut g)),
            dy,
            B::view(&u),
            m,
            n,
            r,
            true,
        )?;
        let mut du = be.alloc(Storage::Bf16, n * r)?;
        be.matmul(B::view_mut(&mut du), dy, b, n, m, r, false)?;
        be.scale(B::view_mut(&mut du), self.scaling)?;
        let du = B::view(&du);
        be.matmul_at(self.a.view_mut::<B>(g), du, x, r, n, k, true)?;
        match self.dropout.mask() {
            None => be.matmul(dx, du, a, n, r, k, true)?,
            Some(mask) => {
                let mut dxa = be.alloc(Storage::Bf16, n * k)?;
                be.matmul(B::view_mut(&mut dxa), du, a, n, r, k, false)?;
                mask.apply(dropout::host_mut::<B>(B::view_mut(&mut dxa))?, 0);
                be.add_assign(dx, B::view(&dxa))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
