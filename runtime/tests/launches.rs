//! Kernel launches per transformer layer and micro-batch on the device backend, counted on the
//! kernel emulator (`emu/`) by `Device::launches`: one block's forward and backward, GPT-2-shaped
//! (LayerNorm, GELU, biases, multi-head attention) and Llama-shaped (RMSNorm, SwiGLU, RoPE, GQA,
//! no biases), one rank, every activation kept. The counts do not depend on the sizes (tiny here),
//! so they are GPT-2 124M's too. docs/cuda.md ("Launches per layer") records them; run with
//! `--nocapture` to print them:
//!
//! ```sh
//! cargo test --release -p tessera-runtime --test launches -- --nocapture
//! ```
//!
//! Skips, with the reason printed, where there is no C++ compiler for the emulator.

#[allow(dead_code)]
mod emu;

use tessera_runtime::backend::cuda::{Device, HostStaged, Launches};
use tessera_runtime::backend::{Backend, Storage};
use tessera_runtime::comm::LocalComm;
use tessera_runtime::layers::{
    Activation, BlockActs, BlockConfig, BlockWorkspace, Dims, NormKind, Recompute, TpShard,
    TransformerBlock,
};
use tessera_runtime::params::ParamLayout;

fn gpt2() -> BlockConfig {
    BlockConfig {
        hidden: 64,
        heads: 4,
        kv_heads: 4,
        head_dim: 16,
        ffn_hidden: 256,
        activation: Activation::Gelu,
        norm: NormKind::LayerNorm,
        rope_theta: None,
        rope_scaling: None,
        bias: true,
        qkv_bias: true,
        norm_eps: 1e-5,
        init_std: 0.02,
        proj_init_std: 0.01,
    }
}

fn llama() -> BlockConfig {
    BlockConfig {
        kv_heads: 2,
        ffn_hidden: 128,
        activation: Activation::SwiGlu,
        norm: NormKind::RmsNorm,
        rope_theta: Some(10_000.0),
        bias: false,
        qkv_bias: false,
        ..gpt2()
    }
}

/// (forward, backward) launches of one block on one micro-batch of 2 × 16 tokens.
fn per_layer(cfg: &BlockConfig) -> Option<(Launches, Launches)> {
    let launcher = match emu::launcher() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIPPED: the CUDA kernel emulator is not available: {why}");
            return None;
        }
    };
    let dev = Device::new(launcher);
    let comm = HostStaged::new(dev.clone(), LocalComm::group(1).pop().unwrap());
    let d = Dims { b: 2, t: 16 };
    let mut layout = ParamLayout::new();
    let block = TransformerBlock::new(&mut layout, "h.0", cfg, TpShard::SINGLE).unwrap();
    let p = dev.upload(Storage::Bf16, &layout.init(7)).unwrap();
    let mut g = dev.alloc(Storage::F32, layout.len()).unwrap();
    let n = d.n() * cfg.hidden;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let x = dev.upload(Storage::Bf16, &x).unwrap();
    let dout = dev.upload(Storage::Bf16, &vec![1e-3; n]).unwrap();
    let (mut out, mut dx) = (
        dev.alloc(Storage::Bf16, n).unwrap(),
        dev.alloc(Storage::Bf16, n).unwrap(),
    );
    let mut acts = BlockActs::new(&dev, &block, d, Recompute::None).unwrap();
    let mut ws = BlockWorkspace::new(&dev, &block, d).unwrap();
    type D = Device<emu::EmuLauncher>;
    let v = D::view;
    let before = dev.launches();
    block
        .forward(
            &dev,
            v(&p),
            v(&x),
            D::view_mut(&mut out),
            &mut acts,
            &mut ws,
            &comm,
        )
        .unwrap();
    let mid = dev.launches();
    block
        .backward(
            &dev,
            v(&p),
            D::view_mut(&mut g),
            v(&dout),
            D::view_mut(&mut dx),
            &acts,
            &mut ws,
            &comm,
        )
        .unwrap();
    let after = dev.launches();
    // The backward ran to the end (its input gradient is finite).
    let dx = dev.download(v(&dx)).unwrap();
    assert!(dx.iter().all(|x| x.is_finite()));
    Some((mid - before, after - mid))
}

fn show(what: &str, (f, b): (Launches, Launches)) {
    println!(
        "{what}: forward {} launches ({} kernels + {} GEMMs), backward {} ({} kernels + {} GEMMs), {} per layer per micro-batch",
        f.total(),
        f.kernels,
        f.gemms,
        b.total(),
        b.kernels,
        b.gemms,
        f.total() + b.total()
    );
}

/// (forward kernels, forward GEMMs, backward kernels, backward GEMMs).
fn counts((f, b): (Launches, Launches)) -> (u64, u64, u64, u64) {
    (f.kernels, f.gemms, b.kernels, b.gemms)
}

/// The counts after the fusions (bias + GELU forward and backward, bias + residual + norm,
/// bias + residual, LayerNorm's two parameter sums in one); before them: GPT-2 15 + 32 (11
/// kernels + 4 GEMMs, 24 + 8), Llama 12 + 21 (8 + 4, 13 + 8). A change that adds a launch
/// to a layer fails here; update docs/cuda.md with the new numbers.
#[test]
fn launches_per_layer() {
    let Some(g) = per_layer(&gpt2()) else { return };
    show("GPT-2 layer", g);
    let Some(l) = per_layer(&llama()) else { return };
    show("Llama layer", l);
    assert_eq!(counts(g), (7, 4, 21, 8), "GPT-2 layer");
    assert_eq!(counts(l), (7, 4, 13, 8), "Llama layer");
}
