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
        let (vocab_start, vocab_local) =
            tp.split(vocab, "vocabulary size (pad it to a multiple of TP)")?;
        let w = layout.add(ParamSpec {
            name: format!("{name}.weight"),
            global_shape: vec![vocab, c],
            shard: tp.shard(0),
            decay: true,
            init: Init::Normal { std },
        })?;
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
}
