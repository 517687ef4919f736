//! Measuring this host for the CPU backend's cluster spec (`tessera calibrate`): what one rank
//! gets when `ranks` ranks run at once as threads, each with its share of the cores, the way
//! `tessera run` runs them.
//!
//! - GEMM: square f32 products through the runtime's own matmul ([`crate::cpu::matmul`]), at
//!   each size, every rank at once; the rate per rank.
//! - Memory: a copy of a buffer larger than the caches, every rank at once; bytes read and
//!   written per second per rank.
//! - Exponentials: the runtime's GELU forward (one `expf` per element) on a buffer that stays
//!   in the caches, every rank at once; elements per second per rank. The backend's GELU,
//!   SiLU, softmax and loss kernels are bound by it, not by memory.
//! - Collectives: the ranks' [`LocalComm`] all-reduce, small (its latency) and large (its bus
//!   bandwidth, NCCL's convention: `2(n−1)/n · bytes / time`).
//!
//! Each figure is the best of a few repetitions (the machine is shared and noisy).

use std::sync::{Barrier, Mutex};
use std::time::Instant;

use tessera_planner::spec::GIB;
use tessera_planner::Cluster;

use crate::comm::{Comm, LocalComm};

/// What one rank measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub ranks: usize,
    pub threads_per_rank: usize,
    /// The host's cores, which the ranks share.
    pub cores: usize,
    /// `(n, GFLOP/s per rank)` of an n×n×n f32 product.
    pub gemm: Vec<(usize, f64)>,
    /// Bytes read plus written per second per rank, GB/s.
    pub copy_gbps: f64,
    /// GELU elements (one exponential each) per second per rank, billions.
    pub exp_gops: f64,
    /// All-reduce bus bandwidth per rank, GB/s, and the latency of one ring step, µs (0 for a
    /// single rank).
    pub comm_gbps: f64,
    pub comm_latency_us: f64,
}

/// The sizes measured: the smallest dimensions of the layers the cost model times (16 and 32
/// are the head dimensions of small models' attention products).
pub const GEMM_SIZES: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];

/// Runs `setup(rank)` on `ranks` threads, then, all together after a barrier, `work` on what
/// each set up: the seconds from the first start to the last finish (the wall time of the ranks
/// sharing the cores, as in training).
fn at_once<S>(
    ranks: usize,
    threads: usize,
    setup: &(dyn Fn(usize) -> S + Sync),
    work: &(dyn Fn(&mut S) + Sync),
) -> f64 {
    let barrier = Barrier::new(ranks);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let barrier = &barrier;
                s.spawn(move || {
                    crate::cpu::set_threads(threads);
                    let mut state = setup(r);
                    barrier.wait();
                    let start = Instant::now();
                    work(&mut state);
                    let end = Instant::now();
                    std::hint::black_box(&state);
                    (start, end)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a measuring thread does not panic"))
            .collect()
    });
    let first = spans.iter().map(|s| s.0).min().expect("one rank at least");
    let last = spans.iter().map(|s| s.1).max().expect("one rank at least");
    (last - first).as_secs_f64()
}

/// The fastest of `reps` runs of [`at_once`].
fn best<S>(
    reps: usize,
    ranks: usize,
    threads: usize,
    setup: &(dyn Fn(usize) -> S + Sync),
    work: &(dyn Fn(&mut S) + Sync),
) -> f64 {
    (0..reps)
        .map(|_| at_once(ranks, threads, setup, work))
        .fold(f64::INFINITY, f64::min)
}

/// Seconds per all-reduce of `bytes` on every one of `ranks` ranks at once.
fn all_reduce_seconds(ranks: usize, threads: usize, bytes: usize, reps: usize) -> f64 {
    let comms: Vec<Mutex<Option<LocalComm>>> = LocalComm::group(ranks)
        .into_iter()
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let t = at_once(
        ranks,
        threads,
        &|r| {
            let comm = comms[r]
                .lock()
                .expect("not poisoned")
                .take()
                .expect("one run");
            (comm, vec![1.0f32; bytes / 4])
        },
        &|(comm, buf)| {
            for _ in 0..reps {
                comm.all_reduce_sum(buf).expect("local all-reduce");
            }
        },
    );
    t / reps as f64
}

/// This host's cores (1 where the count cannot be read).
pub fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Each of `ranks` ranks' share of the cores, at least one thread: how `tessera run` and
/// `tessera calibrate` give threads to ranks.
pub fn threads_per_rank(ranks: usize) -> usize {
    (host_cores() / ranks.max(1)).max(1)
}

/// Measures this host for `ranks` ranks of `threads_per_rank` threads each.
pub fn measure(ranks: usize, threads_per_rank: usize) -> Measured {
    let ranks = ranks.max(1);
    let threads = threads_per_rank.max(1);
    let mut gemm = Vec::new();
    for n in GEMM_SIZES {
        let a = vec![0.5f32; n * n];
        let b = vec![0.25f32; n * n];
        // About 10^9 FLOPs per rank, at least one product.
        let count = (1e9 / (2.0 * (n * n * n) as f64)).ceil().max(1.0) as usize;
        let t = best(
            3,
            ranks,
            threads,
            &|_| {
                let mut c = vec![0.0f32; n * n];
                crate::cpu::matmul(&mut c, &a, &b, n, n, n, false);
                c
            },
            &|c| {
                // The three products of a linear layer, as the runtime calls them: forward
                // `x · Wᵀ`, input gradient `dy · W`, weight gradient `dyᵀ · x` (accumulated).
                for _ in 0..count.div_ceil(3) {
                    crate::cpu::matmul_bt(c, &a, &b, n, n, n, false);
                    crate::cpu::matmul(c, &a, &b, n, n, n, false);
                    crate::cpu::matmul_at(c, &a, &b, n, n, n, true);
                }
            },
        );
        let products = 3 * count.div_ceil(3);
        gemm.push((n, 2.0 * (n * n * n * products) as f64 / t / 1e9));
    }
    // 64 MiB per rank, beyond the caches: read 4 B and write 4 B per element.
    let len = 16 << 20;
    let t = best(
        3,
        ranks,
        threads,
        // Both buffers written in the setup: no page faults inside the timed copy.
        &|_| (vec![1.0f32; len], vec![2.0f32; len]),
        &|(src, dst)| dst.copy_from_slice(src),
    );
    let copy_gbps = 8.0 * len as f64 / t / 1e9;
    // 16 Ki elements in and out (128 KiB): cache-resident, as a small layer's activations are.
    let (n, reps) = (1 << 14, 1000);
    let t = best(
        3,
        ranks,
        threads,
        &|_| (vec![0.5f32; n], vec![0.0f32; n]),
        &|(x, y)| {
            for _ in 0..reps {
                crate::cpu::gelu_forward(y, x);
            }
        },
    );
    let exp_gops = (n * reps) as f64 / t / 1e9;
    let (comm_gbps, comm_latency_us) = if ranks > 1 {
        let n = ranks as f64;
        let small = all_reduce_seconds(ranks, threads, 8, 200);
        let big_bytes = 16 << 20;
        let big = all_reduce_seconds(ranks, threads, big_bytes, 3);
        (
            2.0 * (n - 1.0) / n * big_bytes as f64 / big / 1e9,
            small / (2.0 * (n - 1.0)) * 1e6,
        )
    } else {
        (0.0, 0.0)
    };
    Measured {
        ranks,
        threads_per_rank: threads,
        cores: host_cores(),
        gemm,
        copy_gbps,
        exp_gops,
        comm_gbps,
        comm_latency_us,
    }
}

/// The host's available memory (Linux `MemAvailable`), in bytes.
pub fn available_memory_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// Each of `ranks` virtual devices' share of the host's available memory, GiB (rounded down
/// to 0.1), or `fallback` where it cannot be read.
pub fn memory_gib_per_rank(ranks: usize, fallback: f64) -> f64 {
    available_memory_bytes()
        .map(|b| ((b / ranks.max(1) as f64 / GIB) * 10.0).floor() / 10.0)
        .filter(|g| *g > 0.0)
        .unwrap_or(fallback)
}

/// `cluster` with the measured figures: the best GEMM rate as the peak and each size's share of
/// it as the `matmul_efficiency` curve; half the copy rate as the memory bandwidth (the cost
/// model counts 16-bit elements, the CPU backend moves f32); the GELU rate as the device's
/// `transcendental_gops`; the all-reduce's bus bandwidth and
/// ring-step latency as both links (one host); `memory_gib` per device; the host's cores as the
/// cores the ranks share (the cost model lets one rank's work fill another's waits where the
/// ranks outnumber them). Efficiencies are 1: the
/// rates are what was reached.
pub fn calibrated(cluster: &Cluster, m: &Measured, memory_gib: f64) -> Cluster {
    let mut c = cluster.clone();
    let peak = m.gemm.iter().map(|g| g.1).fold(0.0, f64::max);
    c.name = format!("{}-calibrated", cluster.name);
    c.device.memory_gib = memory_gib;
    c.device.peak_tflops = peak / 1000.0;
    c.device.memory_bandwidth_gbps = m.copy_gbps / 2.0;
    c.device.transcendental_gops = Some(m.exp_gops);
    c.device.shared_cores = Some(m.cores.max(1) as u64);
    if m.ranks > 1 {
        for link in [&mut c.intra_node, &mut c.inter_node] {
            link.bandwidth_gbps = m.comm_gbps;
            link.latency_us = m.comm_latency_us;
        }
    }
    let k = &mut c.calibration;
    k.matmul_efficiency = m
        .gemm
        .iter()
        .map(|&(n, g)| [n as f64, (g / peak).clamp(0.001, 1.0)])
        .collect();
    k.gemm_efficiency = None;
    k.memory_efficiency = 1.0;
    k.intra_node_efficiency = 1.0;
    k.inter_node_efficiency = 1.0;
    c.calibrated = true;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every figure is a positive, finite rate, on one rank and on two at once.
    #[test]
    fn measurements_are_positive_rates() {
        for ranks in [1, 2] {
            let m = measure(ranks, 1);
            assert_eq!(m.gemm.len(), GEMM_SIZES.len());
            for &(n, g) in &m.gemm {
                assert!(g.is_finite() && g > 0.0, "{n}: {g}");
            }
            assert!(m.copy_gbps.is_finite() && m.copy_gbps > 0.0);
            assert!(m.exp_gops.is_finite() && m.exp_gops > 0.0);
            if ranks > 1 {
                assert!(m.comm_gbps > 0.0 && m.comm_latency_us > 0.0, "{m:?}");
            }
        }
    }
}
