//! RoPE's cos and sin tables: host math in f64, stored in f32, which every backend uploads as
//! they are (the CPU's kernels in `cpu::kernels::rope`, the device's through
//! `layers::attention::RopeTables`). Pairs follow the "rotate-half" convention of
//! `cpu::kernels::rope`; a `rope_scaling` (Llama 3.1's `llama3` type) rescales each pair's
//! frequency first, as transformers' `_compute_llama3_parameters` does ([`RopeScaling::scale`]).

use tessera_planner::model::RopeScaling;

/// The rotation frequency of each pair `i < hd/2`: `θ^(−2i/hd)`, rescaled by `scaling`.
pub fn rope_inv_freq(hd: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    (0..hd / 2)
        .map(|i| {
            let f = theta.powf(-2.0 * i as f64 / hd as f64);
            scaling.map_or(f, |s| s.scale(f))
        })
        .collect()
}

/// `(cos, sin)`, each `(T, hd/2)`, for positions `0..t`; computed in f64, stored in f32.
pub fn rope_tables(t: usize, hd: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    rope_tables_scaled(t, hd, theta, None)
}

/// [`rope_tables`] with the frequencies rescaled by `scaling` (none: the same tables).
pub fn rope_tables_scaled(
    t: usize,
    hd: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
) -> (Vec<f32>, Vec<f32>) {
    assert!(
        hd.is_multiple_of(2),
        "RoPE needs an even head size, got {hd}"
    );
    let half = hd / 2;
    let inv_freq = rope_inv_freq(hd, theta, scaling);
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in 0..t {
        for f in &inv_freq {
            let angle = pos as f64 * f;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}
