//! CPU training speed: GPT-2 124M at micro-batch 4 and sequence 64 on 1 and 2 ranks, side by
//! side with the GEMM crate's standalone rate on the model's own matmul shapes.
//!
//! Two ranks run twice: plain DP (each rank updates all 124M parameters) and ZeRO-1 (each rank
//! updates its half). The binary's tracking allocator is installed, as in `tessera run`.
//!
//! Run: `cargo bench -p tessera-runtime --bench cpu_train` (results go to docs/performance.md by
//! hand, with the machine and the date). Ratios, not absolute numbers, are what to compare.

use std::path::Path;
use std::time::Instant;

use tessera_planner::layout::Layout;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_runtime::alloc::{peak_bytes, TrackingAlloc};
use tessera_runtime::cpu::matmul::{count_matmuls, matmul_stats};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, TrainOptions};

const SEQ: u64 = 64;
const MICRO: u64 = 4;
const STEPS: usize = 4;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn plan(dp: u64, zero_stage: u8) -> Plan {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // Global batch 8: two micro-batches of 4 on one rank, one each on two DP ranks.
    let over = TrainingOverrides {
        seq_len: Some(SEQ),
        global_batch: Some(8),
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

/// Matmul FLOPs of one training step (forward 2·N·tokens for the linear layers and the tied
/// head, backward twice that), and the attention score/value matmuls (4·s²·h per sequence
/// per layer forward, causal half not skipped by the kernel counted as computed).
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

/// GFLOP/s of one single-threaded gemm of `(m×k)·(k×n)`, while `concurrent` threads run the
/// same gemm at once (as `concurrent` rank threads do): the per-thread rate.
fn gemm_gflops(m: usize, k: usize, n: usize, concurrent: usize) -> f64 {
    let reps = 20;
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
                    run(&mut c);
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

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = Tokens::load(&root.join("examples/data/parallelism.txt")).expect("bundled text");
    // The tokenizer is byte-level; GPT-2's vocabulary covers every byte.
    println!("GPT-2 124M, micro-batch {MICRO}, sequence {SEQ}, global batch 8, {STEPS} steps (first excluded)");
    let rows = (MICRO * SEQ) as usize;
    let gemm_ref = [
        (rows, 768, 2304),
        (rows, 768, 3072),
        (rows, 3072, 768),
        (rows, 768, 768),
    ];
    println!("gemm crate standalone on the model's shapes {gemm_ref:?}, one thread per rank:");
    // Per-thread rate of the gemm crate alone, with 1 and with 2 threads running at once.
    let alone: Vec<f64> = [1, 2]
        .into_iter()
        .map(|threads| {
            let rate = gemm_ref
                .iter()
                .map(|&(m, k, n)| gemm_gflops(m, k, n, threads))
                .sum::<f64>()
                / gemm_ref.len() as f64;
            println!("  gemm alone, {threads} concurrent thread(s): {rate:.1} GFLOP/s per thread (mean over the shapes)");
            rate
        })
        .collect();
    for (dp, zero) in [(1u64, 0u8), (2, 0), (2, 1)] {
        let single = alone[dp as usize - 1];
        let plan = plan(dp, zero);
        let opts = TrainOptions {
            steps: STEPS,
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
        let tokens = (8 * SEQ) as f64;
        let linear_rate = linear / step / 1e9 / dp as f64;
        println!(
            "{dp} rank(s), ZeRO-{zero}: the model's gemm calls ran at {:.1} GFLOP/s per rank thread = {:.0}% of standalone gemm ({:.3} TFLOP counted over the timed steps, {:.3} TFLOP expected from the model)\n    {:.3} s/step ({:.3} s forward+backward, {:.3} s DP sync + optimizer on rank 0), {:.0} tokens/s, {:.1} GFLOP/s on the linear layers ({:.1} per rank, {:.0}% of standalone gemm per rank; {:.0}% counting forward+backward time only), {:.1} GFLOP/s with attention, peak {:.0} MiB on rank 0",
            mm.gflops_per_thread(),
            100.0 * mm.gflops_per_thread() / single,
            mm.flops as f64 / 1e12,
            (linear + attention) * timed.len() as f64 / 1e12,
            step,
            per_step(fb),
            per_step(opt),
            tokens / step,
            linear / step / 1e9,
            linear_rate,
            100.0 * linear_rate / single,
            100.0 * linear / dp as f64 / per_step(fb) / 1e9 / single,
            (linear + attention) / step / 1e9,
            peak_bytes(0) as f64 / (1u64 << 20) as f64,
        );
    }
}
