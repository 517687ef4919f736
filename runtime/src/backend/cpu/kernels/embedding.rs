//! Token and position embeddings, forward and backward.
//!
//! Token rows may be a vocabulary shard: rows `vocab_start .. vocab_start + V_local` of the
//! global table; tokens outside the shard produce zero rows (the vocab-parallel layer sums the
//! shards with an all-reduce). Backward ACCUMULATES into the tables. Must not allocate.

/// `out[n] = wte[tokens[n] − vocab_start]`, or zeros when the token is not in this shard;
/// `out: (N, C)`, `tokens: (N)`, `wte: (V_local, C)`.
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    vocab_start: usize,
    c: usize,
) {
    let vl = wte.len() / c;
    for (o, &tok) in out.chunks_exact_mut(c).zip(tokens) {
        match (tok as usize).checked_sub(vocab_start).filter(|&r| r < vl) {
            Some(r) => o.copy_from_slice(&wte[r * c..(r + 1) * c]),
            None => o.fill(0.0),
        }
    }
}

/// `dwte[tokens[n] − vocab_start] += dout[n]` for tokens in this shard, in row order.
pub fn embedding_backward(
    dwte: &mut [f32],
    tokens: &[u32],
    dout: &[f32],
    vocab_start: usize,
    c: usize,
) {
    let vl = dwte.len() / c;
    for (g, &tok) in dout.chunks_exact(c).zip(tokens) {
        if let Some(r) = (tok as usize).checked_sub(vocab_start).filter(|&r| r < vl) {
            dwte[r * c..(r + 1) * c]
                .iter_mut()
                .zip(g)
                .for_each(|(d, g)| *d += g);
        }
    }
}

/// `out[b, t] += wpe[t]`; `out: (B, T, C)`, `wpe: (T_max ≥ T, C)`.
pub fn pos_embedding_forward(out: &mut [f32], wpe: &[f32], t: usize, c: usize) {
    for (row, o) in out.chunks_exact_mut(c).enumerate() {
        let p = row % t;
        o.iter_mut()
            .zip(&wpe[p * c..(p + 1) * c])
            .for_each(|(o, w)| *o += w);
    }
}

/// `dwpe[t] += Σ_b dout[b, t]`, batches in order.
pub fn pos_embedding_backward(dwpe: &mut [f32], dout: &[f32], t: usize, c: usize) {
    for (row, g) in dout.chunks_exact(c).enumerate() {
        let p = row % t;
        dwpe[p * c..(p + 1) * c]
            .iter_mut()
            .zip(g)
            .for_each(|(d, g)| *d += g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lookup_and_gradients() {
        let c = 2;
        let wte: Vec<f32> = (0..6).map(|v| v as f32).collect(); // rows 10, 11, 12 of a vocab
        let mut out = vec![9.0; 8];
        embedding_forward(&mut out, &[11, 3, 12, 10], &wte, 10, c);
        assert_eq!(out, vec![2.0, 3.0, 0.0, 0.0, 4.0, 5.0, 0.0, 1.0]);
        let mut d = vec![0.0; 6];
        embedding_backward(&mut d, &[11, 3, 11, 10], &[1.0; 8], 10, c);
        assert_eq!(d, vec![1.0, 1.0, 2.0, 2.0, 0.0, 0.0]);
        let wpe = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut x = vec![0.0; 8]; // B=2, T=2
        pos_embedding_forward(&mut x, &wpe, 2, c);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
        let mut dw = vec![0.0; 6];
        pos_embedding_backward(&mut dw, &x, 2, c);
        assert_eq!(dw, vec![2.0, 4.0, 6.0, 8.0, 0.0, 0.0]);
    }
}
