//! Vocab-parallel token embedding and learned position embedding.
//!
//! [`VocabParallelEmbedding`]: rank r holds table rows `[r·V/t, (r+1)·V/t)`; each rank looks up
//! the tokens it owns (zeros elsewhere) and an all-reduce (`reduce_from_tp`) sums the shards.
//! Backward is local: `dout` is replicated, each rank accumulates its own rows.
//! [`PositionEmbedding`] is replicated and ADDED to the token embedding after the all-reduce.
//! Must not allocate in forward/backward.

use crate::backend::{Backend, Collective};
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

use super::tp::{reduce_from_tp_forward, TpShard};
use super::LayerError;

/// Token embedding `(V, C)` split on V.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    /// `(V_local, C)`; also the LM head weight when embeddings are tied
    /// (see [`ColumnParallelLinear::tied`](super::ColumnParallelLinear::tied)).
    pub w: ParamRef,
    pub vocab: usize,
    pub vocab_start: usize,
    pub vocab_local: usize,
    pub c: usize,
}

impl VocabParallelEmbedding {
    /// Registers `{name}.weight (V, C)`, split on V, with weight decay.
    pub fn new(
        layout: &mut ParamLayout,
        name: &str,
        vocab: usize,
        c: usize,
        tp: TpShard,
        std: f32,
    ) -> Result<Self, LayerError> {
        Self::new_or_copy(layout, name, vocab, c, tp, std, false)
    }

    /// [`new`](Self::new), or with `copy` a second copy of a table `layout` already holds (a
    /// tied output layer's on the rank that also embeds, `ParamLayout::add_copy`).
    pub fn new_or_copy(
        layout: &mut ParamLayout,
        name: &str,
        vocab: usize,
        c: usize,
        tp: TpShard,
        std: f32,
        copy: bool,
    ) -> Result<Self, LayerError> {
        let (vocab_start, vocab_local) =
            tp.split(vocab, "vocabulary size (pad it to a multiple of TP)")?;
        let spec = ParamSpec {
            name: format!("{name}.weight"),
            global_shape: vec![vocab, c],
            shard: tp.shard(0),
            decay: true,
            init: Init::Normal { std },
        };
        let w = match copy {
            true => layout.add_copy(spec)?,
            false => layout.add(spec)?,
        };
        Ok(Self {
            w,
            vocab,
            vocab_start,
            vocab_local,
            c,
        })
    }

    /// `out (N, C) = Σ_ranks masked_lookup(tokens (N))`; identical on every TP rank.
    pub fn forward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        tokens: &B::Ids,
        mut out: B::Mut<'_>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.forward_partial(be, p, tokens, B::rb(&mut out))?;
        reduce_from_tp_forward(comm, out)?;
        Ok(())
    }

    /// This rank's part of [`forward`](Self::forward) before the TP sum: the rows of tokens in
    /// its vocabulary range, zeros elsewhere (sequence parallelism reduce-scatters it).
    pub fn forward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        tokens: &B::Ids,
        out: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let w = self.w.view::<B>(p);
        be.embedding_forward(out, tokens, w, self.vocab_start, self.c)?;
        Ok(())
    }

    /// `dW[rows owned] += dout (N, C)`; no communication.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        g: B::Mut<'_>,
        tokens: &B::Ids,
        dout: B::Ref<'_>,
    ) -> Result<(), LayerError> {
        let dw = self.w.view_mut::<B>(g);
        be.embedding_backward(dw, tokens, dout, self.vocab_start, self.c)?;
        Ok(())
    }
}

/// Learned positions `(T_max, C)`, replicated.
#[derive(Debug, Clone)]
pub struct PositionEmbedding {
    pub w: ParamRef,
    pub max_t: usize,
    pub c: usize,
}

impl PositionEmbedding {
    /// Registers `{name}.weight (T_max, C)`, replicated, with weight decay.
    pub fn new(
        layout: &mut ParamLayout,
        name: &str,
        max_t: usize,
        c: usize,
        std: f32,
    ) -> Result<Self, LayerError> {
        let w = layout.add(ParamSpec {
            name: format!("{name}.weight"),
            global_shape: vec![max_t, c],
            shard: Shard::Replicated,
            decay: true,
            init: Init::Normal { std },
        })?;
        Ok(Self { w, max_t, c })
    }

    /// `out (rows, C) += wpe[(first + i) mod t]` for rows `first..first + rows` of the `B·T`
    /// flattened tokens: all of them (`first = 0`), or the rows a sequence-parallel rank holds.
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        out: B::Mut<'_>,
        t: usize,
        first: usize,
    ) -> Result<(), LayerError> {
        if t > self.max_t {
            return Err(LayerError::Config(format!(
                "sequence length {t} exceeds the position table ({})",
                self.max_t
            )));
        }
        be.pos_embedding_forward(out, self.w.view::<B>(p), t, self.c, first)?;
        Ok(())
    }

    /// [`forward`](Self::forward) for tokens at arbitrary global positions (a context-parallel
    /// rank's): local token `j` of each sequence of `positions.len()` tokens sits at position
    /// `positions[j]`; `out` holds rows `first..first + rows` of the flattened tokens. Runs of
    /// consecutive positions (a CP rank's two chunks) take one kernel call each.
    pub fn forward_at<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut out: B::Mut<'_>,
        positions: &[usize],
        first: usize,
    ) -> Result<(), LayerError> {
        self.check_positions(positions)?;
        let rows = B::len_mut(&out) / self.c;
        let w = self.w.view::<B>(p);
        for (r, pos, len) in runs(positions, first, rows) {
            let o = B::sub_mut(
                B::rb(&mut out),
                (r - first) * self.c..(r - first + len) * self.c,
            );
            let src = B::sub(w, pos * self.c..(pos + len) * self.c);
            be.pos_embedding_forward(o, src, len, self.c, 0)?;
        }
        Ok(())
    }

    /// [`backward`](Self::backward) for tokens at `positions` (as [`forward_at`](Self::forward_at),
    /// over all rows of `dout`): `dwpe[positions[j]] += Σ_b dout[b, j]`.
    pub fn backward_at<B: Backend>(
        &self,
        be: &B,
        mut g: B::Mut<'_>,
        dout: B::Ref<'_>,
        positions: &[usize],
    ) -> Result<(), LayerError> {
        self.check_positions(positions)?;
        let rows = B::len(dout) / self.c;
        for (r, pos, len) in runs(positions, 0, rows) {
            let dw = B::sub_mut(
                self.w.view_mut::<B>(B::rb(&mut g)),
                pos * self.c..(pos + len) * self.c,
            );
            let d = B::sub(dout, r * self.c..(r + len) * self.c);
            be.pos_embedding_backward(dw, d, len, self.c)?;
        }
        Ok(())
    }

    fn check_positions(&self, positions: &[usize]) -> Result<(), LayerError> {
        match positions.iter().max() {
            Some(&m) if m < self.max_t => Ok(()),
            Some(&m) => Err(LayerError::Config(format!(
                "position {m} exceeds the position table ({})",
                self.max_t
            ))),
            None => Err(LayerError::Config("no token positions".into())),
        }
    }

    /// `dwpe[t] += Σ_b dout[b, t]`.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        g: B::Mut<'_>,
        dout: B::Ref<'_>,
        t: usize,
    ) -> Result<(), LayerError> {
        be.pos_embedding_backward(self.w.view_mut::<B>(g), dout, t, self.c)?;
        Ok(())
    }
}

/// The runs of rows `first..first + rows` (flattened `(b, positions.len())` tokens) whose
/// positions are consecutive: `(row, first position, length)`.
fn runs(positions: &[usize], first: usize, rows: usize) -> Vec<(usize, usize, usize)> {
    let t = positions.len();
    let mut out = Vec::new();
    let mut r = first;
    while r < first + rows {
        let j = r % t;
        let mut len = 1;
        while r + len < first + rows && j + len < t && positions[j + len] == positions[j] + len {
            len += 1;
        }
        out.push((r, positions[j], len));
        r += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::layers::testkit::{assert_globals_close, gather, on_tp};
    use crate::testutil::{assert_close, randn};

    #[test]
    fn vocab_parallel_embedding_matches_single_rank() {
        let (vocab, c, t) = (12, 4, 3);
        let tokens: Vec<u32> = vec![0, 11, 5, 6, 6, 2];
        let gy = randn(tokens.len() * c, 1, 1.0);
        let run = |tpn: usize| {
            on_tp(tpn, |comm, tp| {
                let mut layout = ParamLayout::new();
                let e = VocabParallelEmbedding::new(&mut layout, "wte", vocab, c, tp, 1.0).unwrap();
                let pos = PositionEmbedding::new(&mut layout, "wpe", 4, c, 1.0).unwrap();
                let p = layout.init(3);
                let mut out = vec![0.0; tokens.len() * c];
                e.forward(&Cpu, &p, &tokens, &mut out, comm).unwrap();
                pos.forward(&Cpu, &p, &mut out, t, 0).unwrap();
                let mut g = layout.zeros();
                e.backward(&Cpu, &mut g, &tokens, &gy).unwrap();
                pos.backward(&Cpu, &mut g, &gy, t).unwrap();
                (layout, g, out)
            })
        };
        let one = run(1);
        // Row 1 is token 11 at position 1.
        let wte = gather(&[(&one[0].0, &one[0].0.init(3)[..])]);
        let want: Vec<f32> = (0..c)
            .map(|j| wte["wte.weight"][11 * c + j] + wte["wpe.weight"][c + j])
            .collect();
        assert_eq!(one[0].2[c..2 * c], want[..]);
        let want_g = gather(&[(&one[0].0, &one[0].1)]);
        for tpn in [2, 3, 4] {
            let ranks = run(tpn);
            for r in &ranks {
                assert_close(&r.2, &one[0].2, 1e-6, "embedding out");
            }
            let g = gather(&ranks.iter().map(|r| (&r.0, &r.1[..])).collect::<Vec<_>>());
            assert_globals_close(&g, &want_g, 1e-6, "embedding grads");
        }
    }

    #[test]
    fn positions_at_match_the_contiguous_table() {
        let c = 3;
        let mut layout = ParamLayout::new();
        let pos = PositionEmbedding::new(&mut layout, "wpe", 8, c, 1.0).unwrap();
        let p = layout.init(5);
        // Two sequences of 8 tokens; CP 2 rank 1 holds positions 2, 3, 4, 5.
        let full = randn(2 * 8 * c, 7, 1.0);
        let mut want = full.clone();
        pos.forward(&Cpu, &p, &mut want, 8, 0).unwrap();
        let positions = crate::layers::context_parallel::cp_positions(8, 2, 1);
        assert_eq!(positions, vec![2, 3, 4, 5]);
        let mine = crate::layers::context_parallel::cp_split(&full, 2, 8, 2, 1);
        let mut got = mine.clone();
        pos.forward_at(&Cpu, &p, &mut got, &positions, 0).unwrap();
        assert_eq!(
            got,
            crate::layers::context_parallel::cp_split(&want, 2, 8, 2, 1)
        );
        // A row range (sequence parallelism): rows 3..7 of the 8 local rows.
        let mut part = mine[3 * c..7 * c].to_vec();
        pos.forward_at(&Cpu, &p, &mut part, &positions, 3).unwrap();
        assert_eq!(part, got[3 * c..7 * c]);
        // Backward: the gradient lands on the rank's positions only.
        let mut g = layout.zeros();
        pos.backward_at(&Cpu, &mut g, &mine, &positions).unwrap();
        let mut g_full = layout.zeros();
        let mut masked = vec![0.0; full.len()];
        for (i, row) in full.chunks_exact(c).enumerate() {
            if (2..6).contains(&(i % 8)) {
                masked[i * c..(i + 1) * c].copy_from_slice(row);
            }
        }
        pos.backward(&Cpu, &mut g_full, &masked, 8).unwrap();
        assert_eq!(g, g_full);
    }
}
