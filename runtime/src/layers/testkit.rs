//! Test kit for layers: run a layer on t threads, gather sharded parameters and activations
//! back to global tensors, and compare TP runs against the t = 1 run. Test-only.

use std::collections::BTreeMap;

use crate::comm::LocalComm;
use crate::params::ParamLayout;

use super::TpShard;

/// Runs `f` on `t` threads, one per rank of a fresh TP group.
pub fn on_tp<T: Send>(t: usize, f: impl Fn(&LocalComm, TpShard) -> T + Sync) -> Vec<T> {
    LocalComm::run(t, |c| f(&c, TpShard::new(crate::comm::Comm::rank(&c), t)))
}

/// Global tensors by name, assembled from every rank's `(layout, flat buffer)`. Replicated
/// tensors must agree BITWISE across ranks (the comm's determinism guarantee makes them).
pub fn gather(ranks: &[(&ParamLayout, &[f32])]) -> BTreeMap<String, Vec<f32>> {
    let mut out: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (layout, flat) in ranks {
        for e in layout.entries() {
            let shard = e.param_ref().of(flat);
            let global = out
                .entry(e.name.clone())
                .or_insert_with(|| vec![f32::NAN; e.global_shape.iter().product()]);
            if !e.tp_sharded && global.iter().all(|v| !v.is_nan()) {
                let same = global
                    .iter()
                    .zip(shard)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "replicated {} differs across ranks", e.name);
            }
            e.copy_shard_to_global(shard, global);
        }
    }
    out
}

/// Asserts both maps hold the same names and each tensor is close relative to its own scale.
/// A tensor whose reference is numerically zero (max below 1e-4 of the largest tensor's, e.g.
/// the key bias, whose gradient vanishes analytically because softmax ignores a per-query
/// constant) holds only rounding noise; it is judged against the largest tensor's scale.
pub fn assert_globals_close(
    a: &BTreeMap<String, Vec<f32>>,
    b: &BTreeMap<String, Vec<f32>>,
    rtol: f32,
    what: &str,
) {
    use crate::testutil::{assert_close, max_abs};
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    let global = b.values().map(|v| max_abs(v)).fold(0.0f32, f32::max);
    for (name, va) in a {
        let vb = &b[name];
        if max_abs(vb) < 1e-4 * global {
            let err = va
                .iter()
                .zip(vb)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(
                err <= rtol * global,
                "{what} {name}: error {err:e} on a zero tensor (scale {global:e})"
            );
        } else {
            assert_close(va, vb, rtol, &format!("{what} {name}"));
        }
    }
}

/// The columns of a row-major `(n, Σ widths)` activation that TP rank `tp` holds when each
/// part of global width `widths[i]` is split evenly: `[part0_r | part1_r | …]` per row.
pub fn local_cols(full: &[f32], widths: &[usize], tp: TpShard) -> Vec<f32> {
    let total: usize = widths.iter().sum();
    let mut out = Vec::with_capacity(full.len() / tp.size);
    for row in full.chunks_exact(total) {
        let mut start = 0;
        for &w in widths {
            let l = w / tp.size;
            out.extend_from_slice(&row[start + tp.rank * l..start + (tp.rank + 1) * l]);
            start += w;
        }
    }
    out
}

/// Inverse of [`local_cols`] over all ranks: the full activation from every rank's columns.
pub fn full_cols(locals: &[Vec<f32>], widths: &[usize]) -> Vec<f32> {
    let t = locals.len();
    let total: usize = widths.iter().sum();
    let rows = locals[0].len() * t / total;
    let mut out = vec![0.0; rows * total];
    for (r, local) in locals.iter().enumerate() {
        let lw = total / t;
        for (i, lrow) in local.chunks_exact(lw).enumerate() {
            let (mut start, mut ls) = (0, 0);
            for &w in widths {
                let l = w / t;
                out[i * total + start + r * l..i * total + start + (r + 1) * l]
                    .copy_from_slice(&lrow[ls..ls + l]);
                start += w;
                ls += l;
            }
        }
    }
    out
}

/// Adds `std · N(0,1)` noise, keyed by GLOBAL index, to the non-decayed tensors (norm weights,
/// biases), so they leave 1 / 0 and their gradients get exercised — identically under every
/// TP layout.
pub fn jitter_nondecay(layout: &ParamLayout, p: &mut [f32], std: f32) {
    for e in layout.entries().iter().filter(|e| !e.decay) {
        let stream = crate::rng::stream_id(&e.name) ^ 0x5eed;
        let shard = e.param_ref().of_mut(p);
        for (l, g, n) in e.runs() {
            let mut noise = vec![0.0; n];
            crate::rng::fill_normal(&mut noise, 99, stream, g as u64, std);
            shard[l..l + n]
                .iter_mut()
                .zip(noise)
                .for_each(|(v, z)| *v += z);
        }
    }
}
