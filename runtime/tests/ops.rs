//! The same kernel test bodies on every backend: the CPU kernels, the CUDA kernels emulated on
//! the CPU (`emu/`: the .cu sources compiled with the host C++ compiler), and — built with
//! `--features cuda` — the CUDA kernels on a real GPU. The oracle is an f64 reference
//! (`reference/`); each backend states its tolerance (`Kernels::rtol`): 1e-5 for the f32 CPU,
//! 2e-2 of the tensor's largest magnitude for bf16 storage, 1e-5 for fp32-only paths.
//!
//! Without a C++ compiler the emulated variants print "skipped: …" and pass; without a GPU (or
//! its libraries) the CUDA variants print "skipped: no CUDA device (…)" and pass.

#[allow(dead_code)] // the executor tests' helpers
mod emu;
mod reference;

use reference as r;
use tessera_runtime::backend::cpu::kernels::AttnShape;
use tessera_runtime::backend::ops::{AdamWStep, GemmShape, Kernels, RopeShape, Storage};
use tessera_runtime::rng;

/// One test per backend from one body: `cpu`, `emulated_gpu`, and `cuda` with the feature.
macro_rules! test_device {
    ($name:ident, $body:path) => {
        mod $name {
            #[test]
            fn cpu() {
                $body(&tessera_runtime::backend::ops::CpuKernels)
            }

            #[test]
            fn emulated_gpu() {
                match crate::emu::kernels() {
                    Ok(k) => $body(&k),
                    Err(why) => eprintln!("skipped: no kernel emulator ({why})"),
                }
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                match tessera_runtime::backend::cuda::kernels(0) {
                    Ok(k) => $body(&k),
                    Err(why) => eprintln!("skipped: no CUDA device ({why})"),
                }
            }
        }
    };
}

fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, seed, 0x0b5, 0, std);
    v
}

/// `max|got − want| ≤ rtol · max|want|`, no NaN.
fn check(k: &dyn Kernels, what: &str, got: &[f32], want: &[f64], storage: Storage) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let rtol = f64::from(k.rtol(storage));
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    let (mut at, mut err) = (0, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (f64::from(g) - w).abs();
        if e.is_nan() || e > err {
            (at, err) = (i, if e.is_nan() { f64::INFINITY } else { e });
        }
    }
    assert!(
        err <= rtol * scale,
        "{what} on {}: max error {err:e} at {at} ({} vs {}) exceeds {rtol:e} × {scale:e}",
        k.name(),
        got[at],
        want[at]
    );
}

fn plus(a: &[f32], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(&a, b)| f64::from(a) + b).collect()
}

fn gemm_body(k: &dyn Kernels) {
    for &(m, kk, n) in &[(5, 7, 3), (33, 17, 9)] {
        for ta in [false, true] {
            for tb in [false, true] {
                let g = GemmShape {
                    m,
                    k: kk,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                };
                let (a, b) = (randn(m * kk, 1, 1.0), randn(kk * n, 2, 1.0));
                let want = r::gemm(&a, &b, m, kk, n, ta, tb);
                let mut out = vec![f32::NAN; m * n];
                k.gemm(&mut out, &a, &b, g, false).unwrap();
                check(k, &format!("gemm {g:?}"), &out, &want, Storage::Bf16);
                let init = randn(m * n, 3, 1.0);
                let mut acc = init.clone();
                k.gemm(&mut acc, &a, &b, g, true).unwrap();
                check(
                    k,
                    &format!("gemm acc {g:?}"),
                    &acc,
                    &plus(&init, &want),
                    Storage::Bf16,
                );
            }
        }
    }
}
test_device!(gemm, super::gemm_body);

fn linear_body(k: &dyn Kernels) {
    let (n, i, o) = (13, 24, 10);
    let (x, w, b) = (randn(n * i, 4, 1.0), randn(o * i, 5, 0.5), randn(o, 6, 1.0));
    let prod = r::gemm(&x, &w, n, i, o, false, true);
    let with_bias: Vec<f64> = prod
        .iter()
        .enumerate()
        .map(|(j, p)| p + f64::from(b[j % o]))
        .collect();
    let mut out = vec![f32::NAN; n * o];
    k.linear_forward(&mut out, &x, &w, Some(&b), n, i, o)
        .unwrap();
    check(k, "linear + bias", &out, &with_bias, Storage::Bf16);
    k.linear_forward(&mut out, &x, &w, None, n, i, o).unwrap();
    check(k, "linear", &out, &prod, Storage::Bf16);
    // Bias backward over 150 rows (three row chunks on a GPU).
    let dout = randn(150 * o, 7, 1.0);
    let init = randn(o, 8, 1.0);
    let sums: Vec<f64> = (0..o)
        .map(|c| (0..150).map(|rw| f64::from(dout[rw * o + c])).sum())
        .collect();
    let mut db = init.clone();
    k.bias_backward(&mut db, &dout, o).unwrap();
    check(k, "bias backward", &db, &plus(&init, &sums), Storage::Bf16);
}
test_device!(linear, super::linear_body);

fn embedding_body(k: &dyn Kernels) {
    let (c, vs, vl, t) = (40, 10usize, 13usize, 5);
    let tokens: Vec<u32> = (0..50u32).map(|i| (i * 7) % 30).collect(); // some outside 10..23
    let wte = randn(vl * c, 9, 1.0);
    let mut out = vec![f32::NAN; tokens.len() * c];
    k.embedding_forward(&mut out, &tokens, &wte, vs, c).unwrap();
    let want: Vec<f64> = (0..out.len())
        .map(|i| {
            let tok = tokens[i / c] as usize;
            if (vs..vs + vl).contains(&tok) {
                f64::from(wte[(tok - vs) * c + i % c])
            } else {
                0.0
            }
        })
        .collect();
    check(k, "embedding forward", &out, &want, Storage::Bf16);
    let wpe = randn(8 * c, 10, 1.0); // T_max = 8 ≥ t
    let base = out.clone();
    k.pos_embedding_forward(&mut out, &wpe, t, c).unwrap();
    let want: Vec<f64> = (0..out.len())
        .map(|i| f64::from(base[i]) + f64::from(wpe[((i / c) % t) * c + i % c]))
        .collect();
    check(k, "position embedding forward", &out, &want, Storage::Bf16);
    let dout = randn(tokens.len() * c, 11, 1.0);
    let init = randn(vl * c, 12, 1.0);
    let mut dwte = init.clone();
    k.embedding_backward(&mut dwte, &tokens, &dout, vs, c)
        .unwrap();
    let mut want = r::f64s(&init);
    for (n, &tok) in tokens.iter().enumerate() {
        if (vs..vs + vl).contains(&(tok as usize)) {
            for i in 0..c {
                want[(tok as usize - vs) * c + i] += f64::from(dout[n * c + i]);
            }
        }
    }
    check(k, "embedding backward", &dwte, &want, Storage::Bf16);
    let init = randn(8 * c, 13, 1.0);
    let mut dwpe = init.clone();
    k.pos_embedding_backward(&mut dwpe, &dout, t, c).unwrap();
    let mut want = r::f64s(&init);
    for (row, g) in dout.chunks_exact(c).enumerate() {
        for i in 0..c {
            want[(row % t) * c + i] += f64::from(g[i]);
        }
    }
    check(
        k,
        "position embedding backward",
        &dwpe,
        &want,
        Storage::Bf16,
    );
}
test_device!(embedding, super::embedding_body);

fn layernorm_body(k: &dyn Kernels) {
    for &(n, c) in &[(150, 45), (6, 300)] {
        let (x, w, b) = (randn(n * c, 14, 1.0), randn(c, 15, 1.0), randn(c, 16, 1.0));
        let (want, wm, wr) = r::layernorm(&x, &w, Some(&b), c, 1e-5);
        let (mut out, mut mean, mut rstd) =
            (vec![f32::NAN; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
        k.layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, Some(&b), c, 1e-5)
            .unwrap();
        check(k, "layernorm forward", &out, &want, Storage::Bf16);
        check(k, "layernorm mean", &mean, &wm, Storage::Bf16);
        check(k, "layernorm rstd", &rstd, &wr, Storage::Bf16);
        let (nb, _, _) = r::layernorm(&x, &w, None, c, 1e-5);
        k.layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, None, c, 1e-5)
            .unwrap();
        check(
            k,
            "layernorm forward without bias",
            &out,
            &nb,
            Storage::Bf16,
        );
        let dy = randn(n * c, 17, 1.0);
        let (dx0, dw0, db0) = (randn(n * c, 18, 1.0), randn(c, 19, 1.0), randn(c, 20, 1.0));
        let (mut dx, mut dw, mut db) = (dx0.clone(), dw0.clone(), db0.clone());
        k.layernorm_backward(
            &mut dx,
            &mut dw,
            Some(&mut db),
            &dy,
            &x,
            &w,
            &mean,
            &rstd,
            c,
        )
        .unwrap();
        let (wdx, wdw, wdb) = r::layernorm_backward(&dy, &x, &w, c, 1e-5);
        check(
            k,
            "layernorm dinp (accumulated)",
            &dx,
            &plus(&dx0, &wdx),
            Storage::Bf16,
        );
        check(
            k,
            "layernorm dweight",
            &dw,
            &plus(&dw0, &wdw),
            Storage::Bf16,
        );
        check(k, "layernorm dbias", &db, &plus(&db0, &wdb), Storage::Bf16);
    }
}
test_device!(layernorm, super::layernorm_body);

fn rmsnorm_body(k: &dyn Kernels) {
    for &(n, c) in &[(150, 45), (6, 300)] {
        let (x, w) = (randn(n * c, 21, 1.0), randn(c, 22, 1.0));
        let (want, wr) = r::rmsnorm(&x, &w, c, 1e-5);
        let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
        k.rmsnorm_forward(&mut out, &mut rstd, &x, &w, c, 1e-5)
            .unwrap();
        check(k, "rmsnorm forward", &out, &want, Storage::Bf16);
        check(k, "rmsnorm rstd", &rstd, &wr, Storage::Bf16);
        let dy = randn(n * c, 23, 1.0);
        let (dx0, dw0) = (randn(n * c, 24, 1.0), randn(c, 25, 1.0));
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        k.rmsnorm_backward(&mut dx, &mut dw, &dy, &x, &w, &rstd, c)
            .unwrap();
        let (wdx, wdw) = r::rmsnorm_backward(&dy, &x, &w, c, 1e-5);
        check(
            k,
            "rmsnorm dinp (accumulated)",
            &dx,
            &plus(&dx0, &wdx),
            Storage::Bf16,
        );
        check(k, "rmsnorm dweight", &dw, &plus(&dw0, &wdw), Storage::Bf16);
    }
}
test_device!(rmsnorm, super::rmsnorm_body);

fn attention_body(k: &dyn Kernels) {
    let shapes = [
        AttnShape {
            b: 2,
            t: 37,
            hq: 4,
            hkv: 2,
            hd: 24,
        },
        AttnShape {
            b: 1,
            t: 70,
            hq: 2,
            hkv: 1,
            hd: 64,
        },
        AttnShape {
            b: 1,
            t: 20,
            hq: 2,
            hkv: 2,
            hd: 128,
        },
        // The tensor-core kernels' tiles: three 64-row tiles (the last partial), GQA 4:2.
        AttnShape {
            b: 2,
            t: 130,
            hq: 4,
            hkv: 2,
            hd: 32,
        },
    ];
    for s in shapes {
        let qkv = randn(s.b * s.t * s.qkv_width(), 26, 1.0);
        let mut y = vec![f32::NAN; s.b * s.t * s.y_width()];
        let mut saved = Vec::new();
        k.attention_forward(&mut y, &mut saved, &qkv, s).unwrap();
        check(
            k,
            &format!("attention forward {s:?}"),
            &y,
            &r::attention(&qkv, &s),
            Storage::Bf16,
        );
        let dy = randn(y.len(), 27, 1.0);
        let mut dqkv = vec![f32::NAN; qkv.len()];
        k.attention_backward(&mut dqkv, &dy, &qkv, &y, &saved, s)
            .unwrap();
        check(
            k,
            &format!("attention backward {s:?}"),
            &dqkv,
            &r::attention_backward(&qkv, &dy, &s),
            Storage::Bf16,
        );
    }
}
test_device!(attention, super::attention_body);

fn activations_body(k: &dyn Kernels) {
    let x = randn(300, 28, 2.0);
    let dy = randn(300, 29, 1.0);
    let mut out = vec![f32::NAN; 300];
    k.gelu_forward(&mut out, &x).unwrap();
    check(
        k,
        "gelu forward",
        &out,
        &x.iter().map(|&v| r::gelu(f64::from(v))).collect::<Vec<_>>(),
        Storage::Bf16,
    );
    k.gelu_backward(&mut out, &x, &dy).unwrap();
    let want: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &g)| r::gelu_grad(f64::from(v)) * f64::from(g))
        .collect();
    check(k, "gelu backward", &out, &want, Storage::Bf16);
    let f = 25;
    let (n, xs) = (6, randn(6 * 2 * f, 30, 2.0));
    let dys = randn(n * f, 31, 1.0);
    let mut o = vec![f32::NAN; n * f];
    k.swiglu_forward(&mut o, &xs, f).unwrap();
    let (mut fw, mut bw) = (vec![0.0; n * f], vec![0.0; n * 2 * f]);
    for rw in 0..n {
        for j in 0..f {
            let (g, u) = (
                f64::from(xs[rw * 2 * f + j]),
                f64::from(xs[rw * 2 * f + f + j]),
            );
            let (s, d) = (r::sigmoid(g), f64::from(dys[rw * f + j]));
            fw[rw * f + j] = g * s * u;
            bw[rw * 2 * f + j] = d * u * s * (1.0 + g * (1.0 - s));
            bw[rw * 2 * f + f + j] = d * g * s;
        }
    }
    check(k, "swiglu forward", &o, &fw, Storage::Bf16);
    let mut d = vec![f32::NAN; n * 2 * f];
    k.swiglu_backward(&mut d, &xs, &dys, f).unwrap();
    check(k, "swiglu backward", &d, &bw, Storage::Bf16);
}
test_device!(activations, super::activations_body);

fn crossentropy_body(k: &dyn Kernels) {
    let (n, v) = (9, 300);
    let logits = randn(n * v, 32, 2.0);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % v as u32).collect();
    let dl = randn(n, 33, 1.0);
    let (wl, wg) = r::crossentropy(&logits, &targets, &dl, v);
    let (mut loss, mut max, mut sumexp) = (vec![f32::NAN; n], vec![f32::NAN; n], vec![f32::NAN; n]);
    k.crossentropy_forward(&mut loss, &mut max, &mut sumexp, &logits, &targets, v)
        .unwrap();
    check(k, "cross-entropy loss", &loss, &wl, Storage::Bf16);
    let mut g = logits.clone();
    k.crossentropy_backward(&mut g, &max, &sumexp, &targets, &dl, 0, v)
        .unwrap();
    check(k, "cross-entropy gradient", &g, &wg, Storage::Bf16);
    // One vocabulary shard (columns 100..200) with the global row statistics.
    let shard: Vec<f32> = logits
        .chunks_exact(v)
        .flat_map(|rw| rw[100..200].to_vec())
        .collect();
    let want: Vec<f64> = wg
        .chunks_exact(v)
        .flat_map(|rw| rw[100..200].to_vec())
        .collect();
    let mut gs = shard.clone();
    k.crossentropy_backward(&mut gs, &max, &sumexp, &targets, &dl, 100, 100)
        .unwrap();
    check(
        k,
        "cross-entropy gradient of a vocabulary shard",
        &gs,
        &want,
        Storage::Bf16,
    );
    let (mut fl, mut fg) = (vec![f32::NAN; n], logits.clone());
    k.crossentropy_fused(&mut fl, &mut fg, &targets, &dl, v)
        .unwrap();
    check(k, "fused cross-entropy loss", &fl, &wl, Storage::Bf16);
    check(k, "fused cross-entropy gradient", &fg, &wg, Storage::Bf16);
}
test_device!(crossentropy, super::crossentropy_body);

fn adamw_body(k: &dyn Kernels) {
    let n = 1000;
    let (p0, g) = (randn(n, 34, 1.0), randn(n, 35, 0.1));
    let (m0, v0) = (
        randn(n, 36, 0.01),
        randn(n, 37, 0.01).iter().map(|x| x * x).collect::<Vec<_>>(),
    );
    let step = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 3,
        grad_scale: 0.5,
    };
    let (bc1, bc2) = (1.0 - 0.9f64.powi(3), 1.0 - 0.95f64.powi(3));
    let (mut wp, mut wm, mut wv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let gi = f64::from(g[i]) * 0.5;
        wm[i] = 0.9 * f64::from(m0[i]) + 0.1 * gi;
        wv[i] = 0.95 * f64::from(v0[i]) + 0.05 * gi * gi;
        let p = f64::from(p0[i]);
        wp[i] = p - 1e-2 * ((wm[i] / bc1) / ((wv[i] / bc2).sqrt() + 1e-8) + 0.1 * p);
    }
    let (mut p, mut m, mut v, mut p16) = (p0.clone(), m0.clone(), v0.clone(), vec![f32::NAN; n]);
    k.adamw(&mut p, Some(&mut p16), &g, &mut m, &mut v, &step)
        .unwrap();
    check(k, "adamw params", &p, &wp, Storage::F32);
    check(k, "adamw m", &m, &wm, Storage::F32);
    check(k, "adamw v", &v, &wv, Storage::F32);
    // The bf16 working copy is exactly the rounding of the updated f32 master weights.
    for (i, (&h, &m)) in p16.iter().zip(&p).enumerate() {
        let want = tessera_runtime::backend::bf16::round(m);
        assert_eq!(
            h.to_bits(),
            want.to_bits(),
            "adamw bf16 copy on {} at {i}: {h} vs round({m}) = {want}",
            k.name()
        );
    }
}
test_device!(adamw, super::adamw_body);

/// RoPE against an f64 rotation of the same angles: the q and k heads of a fused qkv row turn
/// (v untouched), position `row % t`; the backward turns back, so forward then backward is the
/// identity within bf16 storage.
fn rope_body(k: &dyn Kernels) {
    let (b, t, heads, hd) = (2, 7, 3, 8);
    let width = heads * hd + 5; // extra columns that must not move
    let x = randn(b * t * width, 40, 1.5);
    let (cos, sin) = tessera_runtime::backend::cpu::kernels::rope_tables(t, hd, 10000.0);
    let half = hd / 2;
    let mut want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for (row, r) in want.chunks_exact_mut(width).enumerate() {
        let pos = (row % t) as f64;
        for h in 0..heads {
            for i in 0..half {
                let angle = pos * 10000f64.powf(-2.0 * i as f64 / hd as f64);
                let (a, c) = (r[h * hd + i], r[h * hd + i + half]);
                r[h * hd + i] = a * angle.cos() - c * angle.sin();
                r[h * hd + i + half] = c * angle.cos() + a * angle.sin();
            }
        }
    }
    let shape = RopeShape {
        t,
        width,
        heads,
        hd,
    };
    let mut y = x.clone();
    k.rope(&mut y, shape, (&cos, &sin), false).unwrap();
    check(k, "rope forward", &y, &want, Storage::Bf16);
    k.rope(&mut y, shape, (&cos, &sin), true).unwrap();
    let back: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    check(k, "rope backward of forward", &y, &back, Storage::Bf16);
}
test_device!(rope, super::rope_body);

/// The residual add (bf16 storage) and the squared norm of fp32 gradients (f64 sum of fp32
/// chunk sums), against f64; the norm over several chunks and a ragged last one.
fn residual_and_norm_body(k: &dyn Kernels) {
    let (a, b) = (randn(1000, 50, 1.0), randn(1000, 51, 2.0));
    let mut out = vec![f32::NAN; 1000];
    k.residual_add(&mut out, &a, &b).unwrap();
    let want: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| f64::from(x) + f64::from(y))
        .collect();
    check(k, "residual add", &out, &want, Storage::Bf16);
    let g = randn(3 * 4096 + 123, 52, 0.5);
    let got = k.sum_squares(&g).unwrap();
    let want: f64 = g.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let rtol = f64::from(k.rtol(Storage::F32));
    assert!(
        (got - want).abs() <= rtol * want,
        "{}: sum of squares {got} vs {want}",
        k.name()
    );
    assert_eq!(k.sum_squares(&[]).unwrap(), 0.0);
}
test_device!(residual_and_norm, super::residual_and_norm_body);

/// `fill` and `copy` (the executor's buffer primitives, `fill_*` and `copy_*`) on views at an
/// offset into larger buffers, in both storages: the range gets the value (or the source
/// range), everything outside it keeps its value. The fill value, 7.5, is far from every
/// N(0, 1) sample, so a write one element past either end shows.
fn fill_and_copy_body(k: &dyn Kernels) {
    for storage in [Storage::Bf16, Storage::F32] {
        let x0 = randn(1000, 60, 1.0);
        let range = 137..890;
        let mut x = x0.clone();
        k.fill(&mut x, range.clone(), 7.5, storage).unwrap();
        let want: Vec<f64> = x0
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if range.contains(&i) {
                    7.5
                } else {
                    f64::from(v)
                }
            })
            .collect();
        check(k, &format!("fill {storage:?}"), &x, &want, storage);
        // The whole buffer (no offset), and an empty view (no launch).
        k.fill(&mut x, 0..1000, -3.0, storage).unwrap();
        check(
            k,
            &format!("fill all {storage:?}"),
            &x,
            &[-3.0; 1000],
            storage,
        );
        k.fill(&mut x, 500..500, 1.0, storage).unwrap();
        check(
            k,
            &format!("fill none {storage:?}"),
            &x,
            &[-3.0; 1000],
            storage,
        );

        let (d0, src) = (randn(800, 61, 1.0), randn(1000, 62, 1.0));
        let (at, from) = (50, 200..700);
        let mut d = d0.clone();
        k.copy(&mut d, at, &src, from.clone(), storage).unwrap();
        let want: Vec<f64> = d0
            .iter()
            .enumerate()
            .map(
                |(i, &v)| match i.checked_sub(at).filter(|j| *j < from.len()) {
                    Some(j) => f64::from(src[from.start + j]),
                    None => f64::from(v),
                },
            )
            .collect();
        check(
            k,
            &format!("copy at an offset {storage:?}"),
            &d,
            &want,
            storage,
        );
        let mut whole = d0[..300].to_vec();
        k.copy(&mut whole, 0, &src[..300], 0..300, storage).unwrap();
        check(
            k,
            &format!("copy all {storage:?}"),
            &whole,
            &r::f64s(&src[..300]),
            storage,
        );
    }
}
test_device!(fill_and_copy, super::fill_and_copy_body);

/// `x *= s` in activation storage (a LoRA adapter's `alpha / r` on its intermediate), over
/// several blocks and a length that is not a multiple of the block size; a negative, non-power-
/// of-two factor, so a kernel that adds instead of multiplying, or drops the sign, fails.
fn scale_body(k: &dyn Kernels) {
    let x0 = randn(3001, 63, 1.0);
    let mut x = x0.clone();
    k.scale(&mut x, -1.75).unwrap();
    let want: Vec<f64> = x0.iter().map(|&v| f64::from(v) * -1.75).collect();
    check(k, "scale", &x, &want, Storage::Bf16);
}
test_device!(scale, super::scale_body);

/// The bias add after a linear layer: `y (N, c) += b (c)`, every row; N·c not a multiple of
/// the block size, over several blocks.
fn add_bias_body(k: &dyn Kernels) {
    let (n, c) = (37, 45);
    let (y0, b) = (randn(n * c, 63, 1.0), randn(c, 64, 1.0));
    let mut y = y0.clone();
    k.add_bias(&mut y, &b).unwrap();
    let want: Vec<f64> = y0
        .iter()
        .enumerate()
        .map(|(i, &v)| f64::from(v) + f64::from(b[i % c]))
        .collect();
    check(k, "add bias", &y, &want, Storage::Bf16);
}
test_device!(add_bias, super::add_bias_body);

/// The vocab-parallel cross-entropy forward as training runs it (`layers/loss.rs`): the
/// vocabulary (1500) cut into three shards of 100, 1300 (wider than a block: the strided loop)
/// and 100 columns; per shard `row_max`, then `ce_partials` against the GLOBAL max, then, on
/// the shard sums (the all-reduce, done here in f64), `ce_losses`. Each against f64 from the
/// formulas; the targets sit on the shards' edges, so every shard has rows whose target is
/// outside it (below and above), and the losses match the whole-vocabulary cross-entropy.
fn crossentropy_vocab_parallel_body(k: &dyn Kernels) {
    let v = 1500;
    let targets: Vec<u32> = vec![0, 99, 100, 1399, 1400, 1499, 57, 777, 1450];
    let n = targets.len();
    let logits = randn(n * v, 65, 2.0);
    let shards = [0..100, 100..1400, 1400..1500];
    let cols = |s: &std::ops::Range<usize>| -> Vec<f32> {
        logits
            .chunks_exact(v)
            .flat_map(|rw| rw[s.clone()].to_vec())
            .collect()
    };
    // The global row max, as the max all-reduce leaves it: one of the (f32) logits.
    let global: Vec<f32> = logits
        .chunks_exact(v)
        .map(|rw| rw.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let mut summed = vec![0.0f64; 2 * n];
    for s in &shards {
        let (w, shard) = (s.len(), cols(s));
        let mut max = vec![f32::NAN; n];
        k.row_max(&mut max, &shard, w).unwrap();
        let want: Vec<f64> = shard
            .chunks_exact(w)
            .map(|rw| rw.iter().map(|&x| f64::from(x)).fold(f64::MIN, f64::max))
            .collect();
        check(
            k,
            &format!("row max of shard {s:?}"),
            &max,
            &want,
            Storage::Bf16,
        );

        let mut both = vec![f32::NAN; 2 * n];
        k.ce_partials(&mut both, &shard, &global, &targets, s.start, w)
            .unwrap();
        let sumexp: Vec<f64> = shard
            .chunks_exact(w)
            .zip(&global)
            .map(|(rw, &m)| {
                rw.iter()
                    .map(|&x| (f64::from(x) - f64::from(m)).exp())
                    .sum()
            })
            .collect();
        let target: Vec<f64> = (0..n)
            .map(|row| {
                let t = targets[row] as usize;
                match s.contains(&t) {
                    true => f64::from(shard[row * w + t - s.start]),
                    false => 0.0,
                }
            })
            .collect();
        let what = format!("cross-entropy partials of shard {s:?}");
        check(
            k,
            &format!("{what}: Σ exp"),
            &both[..n],
            &sumexp,
            Storage::Bf16,
        );
        check(
            k,
            &format!("{what}: target"),
            &both[n..],
            &target,
            Storage::Bf16,
        );
        // A row whose target is in another shard gets exactly 0.
        for (row, &t) in targets.iter().enumerate() {
            if !s.contains(&(t as usize)) {
                assert_eq!(both[n + row], 0.0, "{what} on {}: row {row}", k.name());
            }
        }
        summed
            .iter_mut()
            .zip(&both)
            .for_each(|(a, &b)| *a += f64::from(b));
    }
    let both: Vec<f32> = summed.iter().map(|&x| x as f32).collect();
    let (mut losses, mut sumexp) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    k.ce_losses(&mut losses, &mut sumexp, &global, &both)
        .unwrap();
    let want: Vec<f64> = (0..n)
        .map(|i| f64::from(both[i]).ln() + f64::from(global[i]) - f64::from(both[n + i]))
        .collect();
    check(k, "cross-entropy losses", &losses, &want, Storage::F32);
    check(
        k,
        "cross-entropy saved sumexp",
        &sumexp,
        &r::f64s(&both[..n]),
        Storage::F32,
    );
    // The three launches compose to the whole-vocabulary loss.
    let (whole, _) = r::crossentropy(&logits, &targets, &vec![1.0; n], v);
    check(
        k,
        "vocab-parallel cross-entropy against the whole vocabulary",
        &losses,
        &whole,
        Storage::Bf16,
    );
}
test_device!(
    crossentropy_vocab_parallel,
    super::crossentropy_vocab_parallel_body
);

/// The fc layer's bias and GELU in one (`bias_gelu_forward`: `h += bias`, kept, then
/// `a = gelu(h)`), and GELU's backward with the bias gradient (`gelu_backward_bias`:
/// `dinp = gelu'(inp)·dout` overwritten, `dbias += Σ_rows dinp`): one kernel each on a device,
/// the separate kernels on the CPU. N·c = 150·45, over several blocks and (for the bias sums)
/// three row chunks; with the bias, and without it (the plain GELU kernels on every backend).
fn bias_gelu_body(k: &dyn Kernels) {
    let (n, c) = (150, 45);
    let (h0, b) = (randn(n * c, 70, 1.5), randn(c, 71, 1.0));
    for bias in [Some(&b[..]), None] {
        let what = match bias {
            Some(_) => "bias + gelu forward",
            None => "bias + gelu forward without bias",
        };
        let wh: Vec<f64> = h0
            .iter()
            .enumerate()
            .map(|(i, &v)| f64::from(v) + bias.map_or(0.0, |b| f64::from(b[i % c])))
            .collect();
        let wa: Vec<f64> = wh.iter().map(|&v| r::gelu(v)).collect();
        let (mut h, mut a) = (h0.clone(), vec![f32::NAN; n * c]);
        k.bias_gelu_forward(&mut h, &mut a, bias).unwrap();
        check(k, &format!("{what}: h (kept)"), &h, &wh, Storage::Bf16);
        check(k, &format!("{what}: gelu(h)"), &a, &wa, Storage::Bf16);
    }
    let (x, dy) = (randn(n * c, 72, 1.5), randn(n * c, 73, 1.0));
    let wd: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &g)| r::gelu_grad(f64::from(v)) * f64::from(g))
        .collect();
    let sums: Vec<f64> = (0..c)
        .map(|ch| (0..n).map(|rw| wd[rw * c + ch]).sum())
        .collect();
    let db0 = randn(c, 74, 1.0);
    let (mut d, mut db) = (vec![f32::NAN; n * c], db0.clone());
    k.gelu_backward_bias(&mut d, Some(&mut db), &x, &dy)
        .unwrap();
    check(k, "gelu backward + bias: dinp", &d, &wd, Storage::Bf16);
    check(
        k,
        "gelu backward + bias: dbias (accumulated)",
        &db,
        &plus(&db0, &sums),
        Storage::Bf16,
    );
    let mut d = vec![f32::NAN; n * c];
    k.gelu_backward_bias(&mut d, None, &x, &dy).unwrap();
    check(k, "gelu backward without bias", &d, &wd, Storage::Bf16);
}
test_device!(bias_gelu, super::bias_gelu_body);

/// A projection's bias and the residual add in one (`add_bias_residual`: `y += bias + res`),
/// with the bias and without it (the plain residual add); N·c = 37·45 over several blocks.
fn add_bias_residual_body(k: &dyn Kernels) {
    let (n, c) = (37, 45);
    let (y0, b, res) = (
        randn(n * c, 75, 1.0),
        randn(c, 76, 1.0),
        randn(n * c, 77, 2.0),
    );
    for bias in [Some(&b[..]), None] {
        let want: Vec<f64> = y0
            .iter()
            .zip(&res)
            .enumerate()
            .map(|(i, (&y, &r))| {
                f64::from(y) + bias.map_or(0.0, |b| f64::from(b[i % c])) + f64::from(r)
            })
            .collect();
        let mut y = y0.clone();
        k.add_bias_residual(&mut y, bias, &res).unwrap();
        let what = match bias {
            Some(_) => "add bias + residual",
            None => "add bias + residual without bias",
        };
        check(k, what, &y, &want, Storage::Bf16);
    }
}
test_device!(add_bias_residual, super::add_bias_residual_body);

/// The residual stream before a norm, in f64: `x + proj_bias (when given) + res`.
fn residual_stream(x: &[f32], proj_bias: Option<&[f32]>, res: &[f32], c: usize) -> Vec<f64> {
    x.iter()
        .zip(res)
        .enumerate()
        .map(|(i, (&x, &r))| {
            f64::from(x) + proj_bias.map_or(0.0, |b| f64::from(b[i % c])) + f64::from(r)
        })
        .collect()
}

/// A projection's bias, the residual add and the next LayerNorm in one
/// (`residual_layernorm_forward`): `x += proj_bias + res` in place (checked: it is the residual
/// stream the next block reads), then `out`, `mean`, `rstd` of LayerNorm(x), against f64 from
/// the formula. Rows of 45 (one block, 150 rows) and of 300 (wider than a block); each Option
/// with and without, and an eps (0.5) large enough that using another one shows.
fn residual_layernorm_body(k: &dyn Kernels) {
    for &(n, c) in &[(150, 45), (6, 300)] {
        let (x0, res) = (randn(n * c, 80, 1.0), randn(n * c, 81, 1.0));
        let (pb, w, b) = (randn(c, 82, 1.0), randn(c, 83, 1.0), randn(c, 84, 1.0));
        let cases = [
            (Some(&pb[..]), Some(&b[..]), 1e-5f32),
            (None, Some(&b[..]), 0.5),
            (Some(&pb[..]), None, 0.5),
            (None, None, 1e-5),
        ];
        for (proj_bias, bias, eps) in cases {
            let what = format!(
                "residual layernorm ({n}×{c}, projection bias {}, norm bias {}, eps {eps})",
                proj_bias.is_some(),
                bias.is_some()
            );
            let xs = residual_stream(&x0, proj_bias, &res, c);
            let (mut wo, mut wm, mut wr) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            for row in 0..n {
                let v = &xs[row * c..(row + 1) * c];
                let mu = v.iter().sum::<f64>() / c as f64;
                let var = v.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / c as f64;
                let rs = 1.0 / (var + f64::from(eps)).sqrt();
                for i in 0..c {
                    wo[row * c + i] =
                        (v[i] - mu) * rs * f64::from(w[i]) + bias.map_or(0.0, |b| f64::from(b[i]));
                }
                (wm[row], wr[row]) = (mu, rs);
            }
            let mut x = x0.clone();
            let (mut out, mut mean, mut rstd) =
                (vec![f32::NAN; n * c], vec![f32::NAN; n], vec![f32::NAN; n]);
            k.residual_layernorm_forward(
                &mut x, proj_bias, &res, &mut out, &mut mean, &mut rstd, &w, bias, c, eps,
            )
            .unwrap();
            check(k, &format!("{what}: x (residual)"), &x, &xs, Storage::Bf16);
            check(k, &format!("{what}: out"), &out, &wo, Storage::Bf16);
            check(k, &format!("{what}: mean"), &mean, &wm, Storage::Bf16);
            check(k, &format!("{what}: rstd"), &rstd, &wr, Storage::Bf16);
        }
    }
}
test_device!(residual_layernorm, super::residual_layernorm_body);

/// `residual_layernorm`'s RMSNorm twin (`residual_rmsnorm_forward`): `x += proj_bias + res`
/// in place, then `out`, `rstd` of RMSNorm(x), against f64 from the formula.
fn residual_rmsnorm_body(k: &dyn Kernels) {
    for &(n, c) in &[(150, 45), (6, 300)] {
        let (x0, res) = (randn(n * c, 85, 1.0), randn(n * c, 86, 1.0));
        let (pb, w) = (randn(c, 87, 1.0), randn(c, 88, 1.0));
        for (proj_bias, eps) in [(Some(&pb[..]), 1e-5f32), (None, 1e-5), (Some(&pb[..]), 0.5)] {
            let what = format!(
                "residual rmsnorm ({n}×{c}, projection bias {}, eps {eps})",
                proj_bias.is_some()
            );
            let xs = residual_stream(&x0, proj_bias, &res, c);
            let (mut wo, mut wr) = (vec![0.0; n * c], vec![0.0; n]);
            for row in 0..n {
                let v = &xs[row * c..(row + 1) * c];
                let ms = v.iter().map(|x| x * x).sum::<f64>() / c as f64;
                wr[row] = 1.0 / (ms + f64::from(eps)).sqrt();
                for i in 0..c {
                    wo[row * c + i] = v[i] * wr[row] * f64::from(w[i]);
                }
            }
            let mut x = x0.clone();
            let (mut out, mut rstd) = (vec![f32::NAN; n * c], vec![f32::NAN; n]);
            k.residual_rmsnorm_forward(&mut x, proj_bias, &res, &mut out, &mut rstd, &w, c, eps)
                .unwrap();
            check(k, &format!("{what}: x (residual)"), &x, &xs, Storage::Bf16);
            check(k, &format!("{what}: out"), &out, &wo, Storage::Bf16);
            check(k, &format!("{what}: rstd"), &rstd, &wr, Storage::Bf16);
        }
    }
}
test_device!(residual_rmsnorm, super::residual_rmsnorm_body);

/// Every kernel of `backend/cuda/kernels/*.cu` and the test above that runs it (through
/// `GpuKernels`, so through the `Device` method training calls) against an f64 reference
/// (docs/cuda.md, "Op-test coverage", has the same table). A kernel added without an entry
/// fails here, and so does an entry whose kernel is gone.
const COVERAGE: &[(&str, &str)] = &[
    ("embedding_forward", "embedding"),
    ("embedding_backward", "embedding"),
    ("pos_embedding_forward", "embedding"),
    ("pos_embedding_backward", "embedding"),
    ("layernorm_forward", "layernorm"),
    ("layernorm_backward", "layernorm"),
    ("layernorm_param_grads", "layernorm"),
    ("rmsnorm_forward", "rmsnorm"),
    ("rmsnorm_backward", "rmsnorm"),
    ("rmsnorm_param_grads", "rmsnorm"),
    ("residual_layernorm_forward", "residual_layernorm"),
    ("residual_rmsnorm_forward", "residual_rmsnorm"),
    ("attention_forward", "attention"),
    ("attention_forward_tc", "attention"),
    ("attention_delta", "attention"),
    ("attention_backward_dq", "attention"),
    ("attention_backward_dq_tc", "attention"),
    ("attention_backward_dkv", "attention"),
    ("attention_backward_dkv_tc", "attention"),
    ("gelu_forward", "activations"),
    ("gelu_backward", "activations"),
    ("bias_gelu_forward", "bias_gelu"),
    ("gelu_backward_bias", "bias_gelu"),
    ("add_bias_residual", "add_bias_residual"),
    ("swiglu_forward", "activations"),
    ("swiglu_backward", "activations"),
    ("crossentropy_row_max", "crossentropy_vocab_parallel"),
    ("crossentropy_partials", "crossentropy_vocab_parallel"),
    ("crossentropy_losses", "crossentropy_vocab_parallel"),
    ("crossentropy_backward", "crossentropy"),
    // Not launched by the executor (it runs the vocab-parallel three on every backend).
    ("crossentropy_forward", "crossentropy"),
    ("crossentropy_fused", "crossentropy"),
    ("adamw_step", "adamw"),
    ("rope_rotate", "rope"),
    ("sum_partials", "linear"), // also layernorm, rmsnorm (parameter gradients)
    ("column_sums", "linear"),
    ("add_bias", "add_bias"),
    ("sum_squares", "residual_and_norm"),
    ("fill_f32", "fill_and_copy"),
    ("fill_bf16", "fill_and_copy"),
    ("copy_f32", "fill_and_copy"),
    ("copy_bf16", "fill_and_copy"),
    ("add_inplace_bf16", "residual_and_norm"),
    ("scale_bf16", "scale"),
    // Backend-level ops (the ring's buffers), tested in ops_ring.rs.
    (
        "copy_f32_to_bf16",
        "ops_ring.rs: copy_of_f32_into_activations_rounds_to_bf16",
    ),
    (
        "ring_pack_kv",
        "ops_ring.rs: ring_steps_on_emulated_kernels_match_the_cpu",
    ),
    (
        "ring_forward_step",
        "ops_ring.rs: ring_steps_on_emulated_kernels_match_the_cpu",
    ),
    (
        "ring_backward_dq",
        "ops_ring.rs: ring_steps_on_emulated_kernels_match_the_cpu",
    ),
    (
        "ring_backward_dkv",
        "ops_ring.rs: ring_steps_on_emulated_kernels_match_the_cpu",
    ),
    (
        "ring_unpack",
        "ops_ring.rs: ring_steps_on_emulated_kernels_match_the_cpu",
    ),
    (
        "fp8_amax_f32",
        "fp8_gemm.rs: fp8_linear_on_emulated_kernels_matches_the_cpu_reference",
    ),
    (
        "fp8_amax_bf16",
        "fp8_gemm.rs: fp8_linear_on_emulated_kernels_matches_the_cpu_reference",
    ),
    (
        "fp8_scale",
        "fp8_gemm.rs: fp8_linear_on_emulated_kernels_matches_the_cpu_reference",
    ),
    (
        "fp8_cast_f32",
        "fp8_gemm.rs: fp8_linear_on_emulated_kernels_matches_the_cpu_reference",
    ),
    (
        "fp8_cast_bf16",
        "fp8_gemm.rs: fp8_linear_on_emulated_kernels_matches_the_cpu_reference",
    ),
];

#[test]
fn every_kernel_has_an_op_test() {
    use tessera_runtime::backend::cuda::kernels::{signatures, MODULES};
    let all: Vec<String> = MODULES
        .iter()
        .flat_map(|m| signatures(m.source).expect("kernel sources parse"))
        .map(|s| s.name)
        .collect();
    let missing: Vec<&String> = all
        .iter()
        .filter(|k| !COVERAGE.iter().any(|(c, _)| c == k))
        .collect();
    assert!(
        missing.is_empty(),
        "kernels without an op test (add one, and a COVERAGE entry): {missing:?}"
    );
    let gone: Vec<&str> = COVERAGE
        .iter()
        .map(|(c, _)| *c)
        .filter(|c| !all.iter().any(|k| k == c))
        .collect();
    assert!(
        gone.is_empty(),
        "COVERAGE names kernels that no longer exist: {gone:?}"
    );
}
