//! CPU training speed: GPT-2 124M at micro-batch 4, sequence 64 and sequence 1024, on 1 and 2
//! ranks, side by side with the GEMM crate's standalone rate on the model's own matmul shapes.
//!
//! Two ranks run twice: plain DP (each rank updates all 124M parameters) and ZeRO-1 (each rank
//! updates its half). The binary's tracking allocator is installed, as in `tessera run`.
//!
//! Definitions (the same at both sequence lengths):
//! - model FLOPs of a step = 6·N·tokens + 12·L·T²·h per sequence (PaLM's MFU count): N the
//!   matmul parameters (every layer's projections and the tied head), the attention's q·kᵀ and
//!   p·v products counted over the full T×T square, as if the causal half were computed;
//! - model FLOP/s per rank = model FLOPs / (step wall time · ranks), the whole step (forward,
//!   backward, DP sync, optimizer, data) in the denominator;
//! - GEMM alone = the gemm crate called directly (row-major, one thread per rank, `ranks`
//!   threads at once) on every matmul shape of one micro-batch (each linear layer's forward,
//!   input-gradient and weight-gradient products, the head's three, and the attention's six
//!   per head over the full T×T square), weighted by their FLOPs: total FLOPs over the sum of
//!   the per-shape times. The ratio of the two is the figure to compare.
//!
//! Run: `cargo bench -p tessera-runtime --bench cpu_train` (results go to docs/performance.md by
//! hand, with the machine and the date). Ratios, not absolute numbers, are what to compare.
//! `CPU_TRAIN_SEQ=64` (or `1024`) and `CPU_TRAIN_RUNS=1,2z0,2z1` pick a subset.

use std::path::Path;
use std::time::Instant;

use tessera_planner::layout::Layout;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_runtime::alloc::{peak_bytes, TrackingAlloc};
use tessera_runtime::backend::cpu::kernels::matmul::{count_matmuls, matmul_stats};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, TrainOptions};

const MICRO: u64 = 4;
const GLOBAL_BATCH: u64 = 8;
/// (sequence length, steps run; the first is a warm-up and not timed).
const SHAPES: [(u64, usize); 2] = [(64, 4), (1024, 3)];

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn plan(seq: u64, dp: u64, zero_stage: u8) -> Plan {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // Global batch 8: two micro-batches of 4 on one rank, one each on two DP ranks.
    let over = TrainingOverrides {
        seq_len: Some(seq),
        global_batch: Some(GLOBAL_BATCH),
        ..Default::default()
    };
    let model = load_model(&root.join("specs/models/gpt2-124m.toml"), over).expect("preset loads");
    let cluster = load_cluster(
        &root.join("specs/clusters/cpu-8.toml"),
        ClusterOverrides {
            nodes: None,
            devices: Some(dp),
        },
    )
    .expect("preset loads");
    let layout = Layout::without_pipeline(dp, 1, zero_stage, MICRO);
    Plan::new(&model, &cluster, &layout, SearchSummary::pinned())
}

/// Model FLOPs of one training step: 6·N·tokens for the linear layers and the tied head, and
/// 12·T²·h per sequence per layer for the attention's score/value products (forward 4·T²·h,
/// backward twice that; the full T×T square, causal half included).
fn step_flops(plan: &Plan) -> (f64, f64) {
    let a = &plan.job.model.architecture;
    let t = &plan.job.model.training;
    let tokens = (t.global_batch * t.seq_len) as f64;
    let linear_params =
        a.layers as f64 * (a.layer_params().sharded as f64) + (a.vocab * a.hidden) as f64;
    let linear = 6.0 * linear_params * tokens;
    let attention = 3.0
        * a.layers as f64
        * t.global_batch as f64
        * 4.0
        * (t.seq_len * t.seq_len * a.hidden) as f64;
    (linear, attention)
}

/// Every matmul of one micro-batch's forward and backward as `(m, k, n, calls)`: per linear
/// layer `y = x·Wᵀ` (rows × in × out), `dx = dy·W` (rows × out × in) and `dW = dyᵀ·x`
/// (out × rows × in); per head q·kᵀ and dy·vᵀ (T × hd × T) and p·v, pᵀ·dy, ds·k, dsᵀ·q (T × T × hd).
fn matmul_shapes(plan: &Plan) -> Vec<(usize, usize, usize, usize)> {
    let a = &plan.job.model.architecture;
    let t = plan.job.model.training.seq_len as usize;
    let (layers, h, f, v) = (
        a.layers as usize,
        a.hidden as usize,
        a.ffn_hidden as usize,
        a.vocab as usize,
    );
    let (heads, hd) = (a.heads as usize, a.head_dim as usize);
    let rows = MICRO as usize * t;
    let qkv = (a.heads + 2 * a.kv_heads) as usize * hd;
    let mut out = Vec::new();
    for (input, output, calls) in [
        (h, qkv, layers),
        (heads * hd, h, layers),
        (h, f, layers),
        (f, h, layers),
        (h, v, 1),
    ] {
        out.push((rows, input, output, calls));
        out.push((rows, output, input, calls));
        out.push((output, rows, input, calls));
    }
    let per_head = layers * MICRO as usize * heads;
    out.push((t, hd, t, 2 * per_head));
    out.push((t, t, hd, 4 * per_head));
    out
}

/// GFLOP/s of one single-threaded gemm of `(m×k)·(k×n)`, while `concurrent` threads run the
/// same gemm at once (as `concurrent` rank threads do): the per-thread rate.
fn gemm_gflops(m: usize, k: usize, n: usize, concurrent: usize) -> f64 {
    let rates: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..concurrent)
            .map(|_| {
                s.spawn(move || {
                    let a = vec![0.5f32; m * k];
                    let b = vec![0.25f32; k * n];
                    let mut c = vec![0.0f32; m * n];
                    let run = |c: &mut [f32]| {
                        // SAFETY: the pointers and strides describe the three row-major buffers above.
                        unsafe {
                            gemm::gemm(
                                m,
                                n,
                                k,
                                c.as_mut_ptr(),
                                1,
                                n as isize,
                                false,
                                a.as_ptr(),
                                1,
                                k as isize,
                                b.as_ptr(),
                                1,
                                n as isize,
                                0.0,
                                1.0,
                                false,
                                false,
                                false,
                                gemm::Parallelism::None,
                            )
                        }
                    };
                    let start = Instant::now();
                    run(&mut c);
                    // About 0.25 s of calls per shape (at least one, at most 20).
                    let reps = (0.25 / start.elapsed().as_secs_f64()).clamp(1.0, 20.0) as usize;
                    let start = Instant::now();
                    for _ in 0..reps {
                        run(&mut c);
                    }
                    2.0 * (m * k * n * reps) as f64 / start.elapsed().as_secs_f64() / 1e9
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("gemm thread"))
            .collect()
    });
    rates.iter().sum::<f64>() / rates.len() as f64
}

/// The gemm crate's per-thread rate over `shapes`, weighted by FLOPs: Σ flops / Σ (flops/rate).
fn gemm_alone(shapes: &[(usize, usize, usize, usize)], threads: usize) -> f64 {
    let (mut flops, mut secs) = (0.0, 0.0);
    for &(m, k, n, calls) in shapes {
        let f = 2.0 * (m * k * n * calls) as f64 / 1e9;
        flops += f;
        secs += f / gemm_gflops(m, k, n, threads);
    }
    flops / secs
}

fn wanted<T: PartialEq + std::fmt::Display>(var: &str, item: T) -> bool {
    match std::env::var(var) {
        Ok(list) => list.split(',').any(|s| s.trim() == item.to_string()),
        Err(_) => true,
    }
}

struct Row {
    config: String,
    step: f64,
    fb: f64,
    opt: f64,
    model_rate: f64,
    alone: f64,
    gemm_calls: f64,
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = Tokens::load(&root.join("examples/data/parallelism.txt")).expect("bundled text");
    // The tokenizer is byte-level; GPT-2's vocabulary covers every byte.
    let mut table = Vec::new();
    for (seq, steps) in SHAPES {
        if !wanted("CPU_TRAIN_SEQ", seq) {
            continue;
        }
        let runs: Vec<(u64, u8)> = [(1u64, 0u8), (2, 0), (2, 1)]
            .into_iter()
            .filter(|&(dp, z)| {
                let name = if dp == 1 {
                    "1".into()
                } else {
                    format!("{dp}z{z}")
                };
                wanted("CPU_TRAIN_RUNS", name)
            })
            .collect();
        if runs.is_empty() {
            continue;
        }
        println!("GPT-2 124M, micro-batch {MICRO}, sequence {seq}, global batch {GLOBAL_BATCH}, {steps} steps (first excluded)");
        let shapes = matmul_shapes(&plan(seq, 1, 0));
        println!("gemm crate standalone on the model's {} matmul shapes (m, k, n, calls per micro-batch) {shapes:?}, one thread per rank:", shapes.len());
        // Per-thread rate of the gemm crate alone, with 1 and with 2 threads running at once.
        let alone: Vec<f64> = [1, 2]
            .into_iter()
            .map(|threads| {
                if !runs.iter().any(|&(dp, _)| dp as usize == threads) {
                    return f64::NAN;
                }
                let rate = gemm_alone(&shapes, threads);
                println!("  gemm alone, {threads} concurrent thread(s): {rate:.1} GFLOP/s per thread (FLOP-weighted over the shapes)");
                rate
            })
            .collect();
        for &(dp, zero) in &runs {
            let single = alone[dp as usize - 1];
            let plan = plan(seq, dp, zero);
            let opts = TrainOptions {
                steps,
                trace: true,
                ..TrainOptions::default()
            };
            // Count the model's own gemm calls from the end of the first (warm-up) step.
            let mut seen = 0;
            let report = train(&plan, &data, &opts, &mut |_| {
                seen += 1;
                if seen == 1 {
                    count_matmuls(true);
                }
            })
            .expect("trains");
            let mm = matmul_stats();
            count_matmuls(false);
            let timed: Vec<f64> = report.steps.iter().skip(1).map(|m| m.step_time_s).collect();
            let step = timed.iter().sum::<f64>() / timed.len() as f64;
            // Rank 0's time in forward/backward ops and in DP sync + optimizer, timed steps only.
            let (mut fb, mut opt) = (0.0, 0.0);
            for e in report.trace.iter().filter(|e| e.track == 0 && e.step >= 1) {
                match e.cat {
                    "optimizer" => opt += e.dur_us,
                    "forward" | "backward" => fb += e.dur_us,
                    _ => {}
                }
            }
            let per_step = |us: f64| us / 1e6 / timed.len() as f64;
            let (linear, attention) = step_flops(&plan);
            let tokens = (GLOBAL_BATCH * seq) as f64;
            let model_rate = (linear + attention) / step / 1e9 / dp as f64;
            println!(
                "{dp} rank(s), ZeRO-{zero}: the model's gemm calls ran at {:.1} GFLOP/s per rank thread = {:.0}% of standalone gemm ({:.3} TFLOP counted over the timed steps, {:.3} TFLOP of model FLOPs)\n    {:.3} s/step ({:.3} s forward+backward, {:.3} s DP sync + optimizer on rank 0), {:.0} tokens/s, model FLOP/s {:.1} G per rank = {:.0}% of standalone gemm ({:.0}% counting forward+backward time only), peak {:.0} MiB on rank 0",
                mm.gflops_per_thread(),
                100.0 * mm.gflops_per_thread() / single,
                mm.flops as f64 / 1e12,
                (linear + attention) * timed.len() as f64 / 1e12,
                step,
                per_step(fb),
                per_step(opt),
                tokens / step,
                model_rate,
                100.0 * model_rate / single,
                100.0 * (linear + attention) / dp as f64 / per_step(fb) / 1e9 / single,
                peak_bytes(0) as f64 / (1u64 << 20) as f64,
            );
            let config = match dp {
                1 => format!("T={seq}, 1 rank"),
                _ => format!("T={seq}, {dp} ranks, ZeRO-{zero}"),
            };
            table.push(Row {
                config,
                step,
                fb: per_step(fb),
                opt: per_step(opt),
                model_rate,
                alone: single,
                gemm_calls: mm.gflops_per_thread(),
            });
        }
    }
    println!("\n| config | s/step | forward+backward s | DP sync + optimizer s | model GFLOP/s per rank | GEMM alone GFLOP/s per thread | ratio | model's gemm calls GFLOP/s (ratio) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &table {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.0}% | {:.1} ({:.0}%) |",
            r.config,
            r.step,
            r.fb,
            r.opt,
            r.model_rate,
            r.alone,
            100.0 * r.model_rate / r.alone,
            r.gemm_calls,
            100.0 * r.gemm_calls / r.alone
        );
    }
}
