//! A deterministic workload over one rank's TP, DP and PP groups, to compare `Comm`
//! implementations bit for bit against [`LocalComm`](crate::comm::LocalComm): a real
//! tensor-parallel transformer block forward and backward on the TP group, activations and
//! gradients sent along the pipeline, ZeRO-style reduce-scatter / all-gather and an all-reduce
//! of the gradients over DP, a broadcast, an exact f64 sum and barriers.
//!
//! Used by the host-carrier test of `comm::channel` (CI) and by the single-GPU `cuda-local`
//! 2×2×2 test (`runtime/tests/cuda_local.rs`, needs a GPU). Its compute runs on the CPU
//! backend; only the transport varies.

use tessera_planner::Mesh;

use crate::backend::Cpu;
use crate::comm::{all_reduce_f64, Comm, RankGroups};
use crate::layers::{
    Activation, BlockActs, BlockConfig, BlockWorkspace, Dims, NormKind, Recompute, TpShard,
    TransformerBlock,
};
use crate::params::ParamLayout;
use crate::rng;

/// A GPT-2 flavoured block small enough for 8 ranks on threads.
fn config() -> BlockConfig {
    BlockConfig {
        hidden: 16,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        ffn_hidden: 32,
        activation: Activation::Gelu,
        norm: NormKind::LayerNorm,
        rope_theta: None,
        rope_scaling: None,
        bias: true,
        qkv_bias: true,
        norm_eps: 1e-5,
        init_std: 0.3,
        proj_init_std: 0.2,
    }
}

const DIMS: Dims = Dims { b: 2, t: 5 };

fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, seed, 0x9a7, 0, 1.0);
    v
}

/// Runs the workload as world rank `rank` of `mesh`; returns every value it produced, in a
/// fixed order, so two transports can be compared with `==` on the bits.
pub fn workout<C: Comm>(g: &RankGroups<C>, mesh: &Mesh, rank: usize) -> Result<Vec<f32>, String> {
    let c = mesh.coord(rank as u64);
    let mut log: Vec<f32> = Vec::new();
    let e = |e: &dyn std::fmt::Display| format!("rank {rank}: {e}");
    // Tensor parallelism: one block, forward and backward.
    let cfg = config();
    let tp = TpShard::new(g.tp.rank(), g.tp.size());
    let mut layout = ParamLayout::new();
    let block = TransformerBlock::new(&mut layout, "h.0", &cfg, tp).map_err(|x| e(&x))?;
    let p = layout.init(7);
    let n = DIMS.n() * cfg.hidden;
    let x = randn(n, 100 + c.dp * 10 + c.pp);
    let mut acts = BlockActs::new(&Cpu, &block, DIMS, Recompute::None).map_err(|x| e(&x))?;
    let mut ws = BlockWorkspace::new(&Cpu, &block, DIMS).map_err(|x| e(&x))?;
    let mut out = vec![0.0; n];
    block
        .forward(&Cpu, &p, &x, &mut out, &mut acts, &mut ws, &g.tp)
        .map_err(|x| e(&x))?;
    let gy = randn(n, 200 + c.dp * 10 + c.pp);
    let (mut grads, mut dx) = (layout.zeros(), vec![0.0; n]);
    block
        .backward(&Cpu, &p, &mut grads, &gy, &mut dx, &acts, &mut ws, &g.tp)
        .map_err(|x| e(&x))?;
    log.extend_from_slice(&out);
    log.extend_from_slice(&dx);
    log.extend_from_slice(&grads);
    // Pipeline: activations forward, gradients back (buffered sends, blocking receives).
    let (stage, stages) = (g.pp.rank(), g.pp.size());
    let mut buf = vec![0.0; n];
    if stage + 1 < stages {
        g.pp.send(&out, stage + 1).map_err(|x| e(&x))?;
    }
    if stage > 0 {
        g.pp.recv(&mut buf, stage - 1).map_err(|x| e(&x))?;
        log.extend_from_slice(&buf);
        g.pp.send(&dx, stage - 1).map_err(|x| e(&x))?;
    }
    if stage + 1 < stages {
        g.pp.recv(&mut buf, stage + 1).map_err(|x| e(&x))?;
        log.extend_from_slice(&buf);
    }
    // Data parallelism: ZeRO reduce-scatter + all-gather (padded), then a plain all-reduce.
    let dp = g.dp.size();
    let s = grads.len().div_ceil(dp);
    let mut padded = grads.clone();
    padded.resize(s * dp, 0.0);
    let mut shard = vec![0.0; s];
    g.dp.reduce_scatter_sum(&padded, &mut shard)
        .map_err(|x| e(&x))?;
    log.extend_from_slice(&shard);
    let mut full = vec![0.0; s * dp];
    g.dp.all_gather(&shard, &mut full).map_err(|x| e(&x))?;
    log.extend_from_slice(&full);
    g.dp.all_reduce_sum(&mut grads).map_err(|x| e(&x))?;
    log.extend_from_slice(&grads);
    // A broadcast from the last TP rank, an exact f64 sum over PP, barriers everywhere.
    let mut b = randn(7, 300 + rank as u64);
    g.tp.broadcast(&mut b, g.tp.size() - 1).map_err(|x| e(&x))?;
    log.extend_from_slice(&b);
    let total =
        all_reduce_f64(&g.pp, out.iter().map(|&v| f64::from(v)).sum()).map_err(|x| e(&x))?;
    let bits = total.to_bits();
    log.push(f32::from_bits((bits >> 32) as u32));
    log.push(f32::from_bits(bits as u32));
    for group in [&g.tp, &g.dp, &g.pp] {
        group.barrier().map_err(|x| e(&x))?;
    }
    Ok(log)
}

/// Runs [`workout`] on one thread per world rank; results indexed by world rank.
pub fn run_all<C: Comm + Send>(
    groups: Vec<RankGroups<C>>,
    mesh: &Mesh,
) -> Vec<Result<Vec<f32>, String>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, g)| s.spawn(move || workout(&g, mesh, r)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("the rank panicked".into())))
            .collect()
    })
}
