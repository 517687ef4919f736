//! Parameter layout: every parameter shard of a rank lives in ONE flat f32 buffer (and its
//! gradient at the same offsets in a second one), llm.c style.
//!
//! Modules register their tensors in a [`ParamLayout`] at construction and keep only a
//! [`ParamRef`] (offset, len); forward/backward receive the flat buffers. Each entry records the
//! tensor's global name and shape and where this shard sits in it, so an optimizer, ZeRO
//! (`(offset, len)` ranges of the flat buffer), a checkpoint writer or a parity test can treat all
//! parameters uniformly. Initialisation is by global element index ([`crate::rng`]), so a shard
//! holds exactly the values the same elements have in the unsharded model.
//!
//! This module must not know about layers or communication.

use crate::backend::Backend;
use std::ops::Range;

use crate::rng;

/// How a tensor's initial values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `std · N(0, 1)` from the counter RNG keyed by the tensor's global name.
    Normal { std: f32 },
    /// Every element equal (norm weights 1, biases 0).
    Const(f32),
    /// `U(-bound, bound)` from the counter RNG keyed by the tensor's global name (LoRA's A:
    /// PEFT's `kaiming_uniform_(a=√5)`, i.e. `bound = 1/√in`).
    Uniform { bound: f32 },
}

/// How a tensor is split across the ranks of its tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Every TP rank holds the whole tensor (norms, row-parallel biases).
    Replicated,
    /// Dimension `dim` split into `parts` equal slices; this rank holds slice `rank`.
    Split {
        dim: usize,
        rank: usize,
        parts: usize,
    },
}

/// What a module asks for when it registers a parameter.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    /// Global name, the same under every layout (e.g. `h.3.attn.wq`): it keys the initialiser.
    pub name: String,
    pub global_shape: Vec<usize>,
    pub shard: Shard,
    /// Weight decay applies (matrices) or not (norms, biases).
    pub decay: bool,
    pub init: Init,
}

/// A registered parameter shard and where it lives.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    pub name: String,
    pub global_shape: Vec<usize>,
    /// Global coordinates of this shard's first element, per dimension.
    pub shard_start: Vec<usize>,
    pub shard_shape: Vec<usize>,
    /// Position in the flat buffer.
    pub offset: usize,
    pub len: usize,
    pub decay: bool,
    /// True when split over TP; false when every TP rank holds a copy (count it once in norms).
    pub tp_sharded: bool,
    pub init: Init,
    /// Trains (has a gradient and optimizer state); false for a frozen base's tensors, which
    /// sit in the layout's frozen region, past every trainable one.
    pub trainable: bool,
}

/// Why a parameter cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    #[error("parameter {name}: dimension {dim} of size {size} does not split into {parts} equal shards; choose a TP degree that divides it")]
    NotDivisible {
        name: String,
        dim: usize,
        size: usize,
        parts: usize,
    },
    #[error("parameter {name}: shard {rank} of {parts} along dimension {dim} does not exist for shape {shape:?}")]
    BadShard {
        name: String,
        dim: usize,
        rank: usize,
        parts: usize,
        shape: Vec<usize>,
    },
    #[error("parameter {name} registered twice")]
    Duplicate { name: String },
    #[error("parameter {name}: a copy registered before the tensor itself")]
    CopyFirst { name: String },
    #[error("a layout's tensors can be appended to another only when both freeze (the appended one holding frozen tensors only) or neither does")]
    Frozen,
}

/// A view of one tensor (or several adjacent ones) in the flat buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamRef {
    pub offset: usize,
    pub len: usize,
}

impl ParamRef {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
    /// This tensor's part of a backend view of the flat buffer.
    pub fn view<'a, B: Backend>(&self, flat: B::Ref<'a>) -> B::Ref<'a> {
        B::sub(flat, self.range())
    }
    /// This tensor's part of a backend write view of the flat buffer.
    pub fn view_mut<'a, B: Backend>(&self, flat: B::Mut<'a>) -> B::Mut<'a> {
        B::sub_mut(flat, self.range())
    }
    pub fn of<'a>(&self, flat: &'a [f32]) -> &'a [f32] {
        &flat[self.range()]
    }
    pub fn of_mut<'a>(&self, flat: &'a mut [f32]) -> &'a mut [f32] {
        &mut flat[self.range()]
    }
    /// The view spanning `self` and `next`, which must follow it directly.
    pub fn join(&self, next: ParamRef) -> ParamRef {
        assert_eq!(
            self.offset + self.len,
            next.offset,
            "ParamRefs not adjacent"
        );
        ParamRef {
            offset: self.offset,
            len: self.len + next.len,
        }
    }
}

impl ParamInfo {
    pub fn param_ref(&self) -> ParamRef {
        ParamRef {
            offset: self.offset,
            len: self.len,
        }
    }

    /// Elements of the global tensor.
    pub fn len_global(&self) -> usize {
        self.global_shape.iter().product()
    }

    /// Contiguous runs of the shard: `(local_start, global_start, len)`, covering the shard in
    /// order. Row-major global indices; a run is one slice of the last dimension.
    pub fn runs(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let nd = self.shard_shape.len();
        let run = self.shard_shape[nd - 1];
        let mut gstride = vec![1usize; nd];
        for d in (0..nd - 1).rev() {
            gstride[d] = gstride[d + 1] * self.global_shape[d + 1];
        }
        (0..self.len.checked_div(run).unwrap_or(0)).map(move |o| {
            let (mut rest, mut g) = (o, self.shard_start[nd - 1]);
            for d in (0..nd - 1).rev() {
                let local = rest % self.shard_shape[d];
                rest /= self.shard_shape[d];
                g += (local + self.shard_start[d]) * gstride[d];
            }
            (o * run, g, run)
        })
    }

    /// Writes this shard's values (`shard.len() == self.len`) into the global tensor.
    pub fn copy_shard_to_global(&self, shard: &[f32], global: &mut [f32]) {
        for (l, g, n) in self.runs() {
            global[g..g + n].copy_from_slice(&shard[l..l + n]);
        }
    }

    /// Reads this shard's values out of the global tensor.
    pub fn copy_global_to_shard(&self, global: &[f32], shard: &mut [f32]) {
        for (l, g, n) in self.runs() {
            shard[l..l + n].copy_from_slice(&global[g..g + n]);
        }
    }

    /// Initialises this shard (`out.len() == self.len`) by global index.
    pub fn init_shard(&self, seed: u64, out: &mut [f32]) {
        match self.init {
            Init::Const(v) => out.fill(v),
            Init::Normal { std } => {
                let stream = rng::stream_id(&self.name);
                for (l, g, n) in self.runs() {
                    rng::fill_normal(&mut out[l..l + n], seed, stream, g as u64, std);
                }
            }
            Init::Uniform { bound } => {
                let stream = rng::stream_id(&self.name);
                for (l, g, n) in self.runs() {
                    rng::fill_uniform(&mut out[l..l + n], seed, stream, g as u64, bound);
                }
            }
        }
    }
}

/// The list of parameter shards of one rank (one pipeline stage's share of the model), in
/// registration order, packed without gaps into a flat buffer of `len()` elements.
///
/// A layout made by [`ParamLayout::frozen_at`] (adapter fine-tuning) keeps two regions:
/// [`add`](Self::add) registers a FROZEN tensor in the region that starts at the given offset,
/// [`add_trainable`](Self::add_trainable) a trainable one at the trainable cursor. With the
/// frozen region starting where the trainable tensors end, `[0, trainable_len())` holds every
/// trainable tensor: the gradient buffer, the optimizer and ZeRO cover that prefix only.
#[derive(Debug, Clone, Default)]
pub struct ParamLayout {
    entries: Vec<ParamInfo>,
    /// The trainable cursor.
    len: usize,
    /// `(start, len)` of the frozen region, when [`add`](Self::add) freezes.
    frozen: Option<(usize, usize)>,
    /// The linears being built keep their weights in NF4, outside the flat buffer (QLoRA:
    /// `layers::nf4_base`).
    nf4_linears: bool,
}

impl ParamLayout {
    pub fn new() -> Self {
        Self::default()
    }

    /// A layout whose [`add`](Self::add) registers frozen tensors, packed from `start` on.
    /// Build twice: once at `0` to learn [`trainable_len`](Self::trainable_len), then at it.
    pub fn frozen_at(start: usize) -> Self {
        Self {
            frozen: Some((start, 0)),
            ..Self::default()
        }
    }

    /// Whether the linears built next store their weights in NF4 (QLoRA's frozen base).
    pub fn nf4_linears(&self) -> bool {
        self.nf4_linears
    }

    /// Sets [`nf4_linears`](Self::nf4_linears): the model turns it on for its blocks only
    /// (bitsandbytes converts every `nn.Linear` but the output head).
    pub fn set_nf4_linears(&mut self, on: bool) {
        self.nf4_linears = on;
    }

    /// Whether [`add`](Self::add) registers frozen tensors.
    pub fn freezing(&self) -> bool {
        self.frozen.is_some()
    }

    /// Elements of the trainable prefix `[0, trainable_len())` (all of them unless freezing).
    pub fn trainable_len(&self) -> usize {
        self.len
    }

    /// Registers a tensor shard at the end of the flat buffer (of its frozen region when the
    /// layout freezes).
    pub fn add(&mut self, spec: ParamSpec) -> Result<ParamRef, ParamError> {
        let frozen = self.frozen.is_some();
        self.register(spec, !frozen)
    }

    /// Registers a trainable tensor shard at the trainable cursor (an adapter).
    pub fn add_trainable(&mut self, spec: ParamSpec) -> Result<ParamRef, ParamError> {
        self.register(spec, true)
    }

    /// Registers a second shard of a tensor this layout already holds, `spec` as the first's:
    /// a tied embedding table's copy for the output layer in another chunk of the same rank
    /// (ZB-V puts the first and the last model piece on PP rank 0). It initialises as the
    /// first; [`get`](Self::get) by name finds the first.
    pub fn add_copy(&mut self, spec: ParamSpec) -> Result<ParamRef, ParamError> {
        if self.get(&spec.name).is_none() {
            return Err(ParamError::CopyFirst { name: spec.name });
        }
        let trainable = self.frozen.is_none();
        self.register_unchecked(spec, trainable)
    }

    fn register(&mut self, spec: ParamSpec, trainable: bool) -> Result<ParamRef, ParamError> {
        if self.entries.iter().any(|e| e.name == spec.name) {
            return Err(ParamError::Duplicate { name: spec.name });
        }
        self.register_unchecked(spec, trainable)
    }

    fn register_unchecked(
        &mut self,
        spec: ParamSpec,
        trainable: bool,
    ) -> Result<ParamRef, ParamError> {
        let mut e = Self::describe(spec)?;
        let len = e.len;
        let offset = match (trainable, self.frozen.as_mut()) {
            (false, Some((start, flen))) => {
                *flen += len;
                *start + *flen - len
            }
            _ => {
                self.len += len;
                self.len - len
            }
        };
        (e.offset, e.trainable) = (offset, trainable);
        self.entries.push(e);
        Ok(ParamRef { offset, len })
    }

    /// Where the shard `spec` asks for lies in its global tensor, without registering it (a
    /// tensor held outside the flat buffer: QLoRA's NF4 weights). Offset 0, frozen.
    pub fn describe(spec: ParamSpec) -> Result<ParamInfo, ParamError> {
        let mut shard_start = vec![0; spec.global_shape.len()];
        let mut shard_shape = spec.global_shape.clone();
        let tp_sharded = match spec.shard {
            Shard::Replicated => false,
            Shard::Split { dim, rank, parts } => {
                if dim >= shard_shape.len() || rank >= parts {
                    return Err(ParamError::BadShard {
                        name: spec.name,
                        dim,
                        rank,
                        parts,
                        shape: spec.global_shape,
                    });
                }
                let size = spec.global_shape[dim];
                if !size.is_multiple_of(parts) {
                    return Err(ParamError::NotDivisible {
                        name: spec.name,
                        dim,
                        size,
                        parts,
                    });
                }
                shard_shape[dim] = size / parts;
                shard_start[dim] = rank * size / parts;
                parts > 1
            }
        };
        let len = shard_shape.iter().product();
        Ok(ParamInfo {
            name: spec.name,
            global_shape: spec.global_shape,
            shard_start,
            shard_shape,
            offset: 0,
            len,
            decay: spec.decay,
            tp_sharded,
            init: spec.init,
            trainable: false,
        })
    }

    /// Appends every tensor of `other` after this layout's tensors of its kind; returns where
    /// `other`'s flat buffer (its offset 0) now starts.
    /// - Neither freezes: `other` goes after the trainable tensors (routed experts in training).
    /// - Both freeze and `other` holds frozen tensors only, its frozen region starting at 0:
    ///   they go to the end of this layout's frozen region (routed experts of a frozen base
    ///   under adapter fine-tuning), so the trainable prefix does not move.
    ///
    /// Any other mix would move a frozen region or interleave the two kinds.
    pub fn append(&mut self, other: ParamLayout) -> Result<usize, ParamError> {
        let base = match (self.frozen.as_mut(), other.frozen) {
            (None, None) => {
                let base = self.len;
                self.len += other.len;
                base
            }
            (Some((start, flen)), Some((0, olen))) if other.len == 0 => {
                let base = *start + *flen;
                *flen += olen;
                base
            }
            _ if other.entries.is_empty() => return Ok(self.len),
            _ => return Err(ParamError::Frozen),
        };
        for mut e in other.entries {
            if self.entries.iter().any(|x| x.name == e.name) {
                return Err(ParamError::Duplicate { name: e.name });
            }
            e.offset += base;
            self.entries.push(e);
        }
        Ok(base)
    }

    pub fn entries(&self) -> &[ParamInfo] {
        &self.entries
    }

    /// Total elements of the flat buffer (the frozen region included).
    pub fn len(&self) -> usize {
        match self.frozen {
            Some((start, flen)) => self.len.max(start + flen),
            None => self.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, name: &str) -> Option<&ParamInfo> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// A zeroed flat buffer of [`len`](Self::len) elements.
    pub fn zeros(&self) -> Vec<f32> {
        vec![0.0; self.len()]
    }

    /// The flat parameter buffer initialised from `seed` by global index.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut flat = self.zeros();
        for e in &self.entries {
            e.init_shard(seed, e.param_ref().of_mut(&mut flat));
        }
        flat
    }

    /// The pieces of `range` (a range of the flat buffer, e.g. a ZeRO shard) that fall in each
    /// tensor, in order: `(flat sub-range, tensor)`.
    pub fn segments(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (Range<usize>, &ParamInfo)> {
        self.entries.iter().filter_map(move |e| {
            let (s, t) = (range.start.max(e.offset), range.end.min(e.offset + e.len));
            (s < t).then_some((s..t, e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: &[usize], shard: Shard) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            global_shape: shape.to_vec(),
            shard,
            decay: true,
            init: Init::Normal { std: 1.0 },
        }
    }

    #[test]
    fn shards_initialise_to_slices_of_the_full_tensor() {
        for dim in 0..3 {
            let shape = [4, 6, 8];
            let mut full = ParamLayout::new();
            full.add(spec("w", &shape, Shard::Replicated)).unwrap();
            let fw = full.init(9);
            let mut rebuilt = vec![0.0; fw.len()];
            for rank in 0..2 {
                let mut l = ParamLayout::new();
                l.add(spec(
                    "w",
                    &shape,
                    Shard::Split {
                        dim,
                        rank,
                        parts: 2,
                    },
                ))
                .unwrap();
                let e = &l.entries()[0];
                assert!(e.tp_sharded);
                let w = l.init(9);
                let mut from_global = vec![0.0; e.len];
                e.copy_global_to_shard(&fw, &mut from_global);
                assert_eq!(w, from_global);
                e.copy_shard_to_global(&w, &mut rebuilt);
            }
            assert_eq!(rebuilt, fw);
        }
    }

    #[test]
    fn errors_and_segments() {
        let mut l = ParamLayout::new();
        let a = l.add(spec("a", &[3, 2], Shard::Replicated)).unwrap();
        let b = l
            .add(spec(
                "b",
                &[4],
                Shard::Split {
                    dim: 0,
                    rank: 1,
                    parts: 2,
                },
            ))
            .unwrap();
        assert_eq!((a.offset, a.len, b.offset, b.len), (0, 6, 6, 2));
        assert_eq!(a.join(b), ParamRef { offset: 0, len: 8 });
        assert!(matches!(
            l.add(spec(
                "c",
                &[3],
                Shard::Split {
                    dim: 0,
                    rank: 0,
                    parts: 2
                }
            )),
            Err(ParamError::NotDivisible { .. })
        ));
        assert!(matches!(
            l.add(spec("a", &[1], Shard::Replicated)),
            Err(ParamError::Duplicate { .. })
        ));
        let segs: Vec<_> = l.segments(4..7).map(|(r, e)| (r, e.name.clone())).collect();
        assert_eq!(segs, vec![(4..6, "a".to_string()), (6..7, "b".to_string())]);
    }

    #[test]
    fn a_frozen_region_follows_the_trainable_prefix() {
        let mut l = ParamLayout::frozen_at(3);
        assert!(l.freezing());
        let w = l.add(spec("w", &[2, 2], Shard::Replicated)).unwrap();
        let a = l.add_trainable(spec("a", &[3], Shard::Replicated)).unwrap();
        assert_eq!((w.offset, w.len, a.offset, a.len), (3, 4, 0, 3));
        assert_eq!((l.trainable_len(), l.len()), (3, 7));
        assert!(!l.get("w").unwrap().trainable && l.get("a").unwrap().trainable);
        let mut other = ParamLayout::new();
        other.add(spec("e", &[1], Shard::Replicated)).unwrap();
        assert_eq!(l.append(other), Err(ParamError::Frozen));
        assert_eq!(l.append(ParamLayout::new()), Ok(3));
        // A frozen layout's tensors (routed experts of a frozen base) join the frozen region.
        let mut experts = ParamLayout::frozen_at(0);
        let e = experts.add(spec("e", &[5], Shard::Replicated)).unwrap();
        assert_eq!(e.offset, 0);
        assert_eq!(l.append(experts), Ok(7));
        assert_eq!((l.trainable_len(), l.len()), (3, 12));
        let e = l.get("e").unwrap();
        assert_eq!((e.offset, e.trainable), (7, false));
        // One holding an adapter would interleave trainable tensors with frozen ones.
        let mut mixed = ParamLayout::frozen_at(0);
        mixed
            .add_trainable(spec("m", &[1], Shard::Replicated))
            .unwrap();
        assert_eq!(l.append(mixed), Err(ParamError::Frozen));
    }
}
