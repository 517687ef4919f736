//! Measuring this host for the CPU backend's cluster spec (`tessera calibrate`): what one rank
//! gets when `ranks` ranks run at once as threads, each with its share of the cores, the way
//! `tessera run` runs them.
//!
//! - GEMM: square f32 products through the runtime's own matmul ([`crate::backend::cpu::kernels::matmul`]), at
//!   each size, every rank at once; the rate per rank.
//! - Memory: a copy of a buffer larger than the caches, every rank at once; bytes read and
//!   written per second per rank.
//! - Exponentials: the runtime's GELU forward (one `expf` per element) on a buffer that stays
//!   in the caches, every rank at once; elements per second per rank. The backend's GELU,
//!   SiLU, softmax and loss kernels are bound by it, not by memory.
//! - Collectives: the ranks' [`LocalComm`] all-reduce, small (its latency) and large (its bus
//!   bandwidth, NCCL's convention: `2(n−1)/n · bytes / time`).
//!
//! Each figure is repeated until its runs agree, and the calibration records what else ran on
//! the host meanwhile ([`stability`]): the machine may be shared and noisy, and a figure it
//! gave under load says so.

pub mod host;
pub mod stability;
pub mod storage;

use std::sync::{Barrier, Mutex};
use std::time::Instant;

use stability::{repeat, CpuTimes, PHASE_BUDGET_S};
pub use stability::{Load, Spread};

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
    /// How each figure's runs agreed, in the order measured: each GEMM size, the copy, the
    /// exponentials, and with 2+ ranks the all-reduce's latency and bandwidth.
    pub spreads: Vec<(String, Spread)>,
    /// What else ran on the host while it measured, where `/proc` can be read.
    pub load: Option<Load>,
}

impl Measured {
    /// The figures whose runs did not agree within [`stability::STABLE_SPREAD`].
    pub fn unstable(&self) -> Vec<&(String, Spread)> {
        self.spreads.iter().filter(|(_, s)| !s.stable()).collect()
    }

    /// Whether other processes took more than [`stability::LOADED_SHARE`] of the host's CPU
    /// time while it measured.
    pub fn under_load(&self) -> bool {
        self.load.is_some_and(|l| l.loaded())
    }

    /// The spread of the figure named `name`.
    pub fn spread_of(&self, name: &str) -> Option<Spread> {
        self.spreads
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| *s)
    }
}

/// The sizes measured: the smallest dimensions of the layers the cost model times (16 and 32
/// are the head dimensions of small models' attention products).
pub const GEMM_SIZES: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];

/// Elements of each of the memory copy's two buffers per rank: 64 MiB of f32, beyond the
/// caches.
const COPY_ELEMENTS: usize = 16 << 20;

/// Bytes of the large all-reduce per rank (its bus bandwidth).
const ALL_REDUCE_BYTES: usize = 16 << 20;

/// The most ranks measured per core. Every phase runs all ranks at once, so its time grows with
/// the ranks per core (on the 2-core development machine, busy with builds, 2026-11-25: 8 ranks
/// took 9 to 12 s, 16 took 22 to 24 s); 8 per core keeps a calibration under half a minute and
/// allows the README's job (8 ranks on a 2-core machine).
pub const RANKS_PER_CORE: u64 = 8;

/// The most ranks measured on any host: the all-reduce sends a message between every pair of
/// ranks, so its time and channels grow as the square of the ranks.
pub const MAX_RANKS: u64 = 1024;

/// The most memory one rank holds at once: the memory copy's two buffers (the largest phase),
/// plus its thread's stack, the GEMM's packing buffers and the allocator's slack (16 MiB; the
/// process's peak was 137 MiB a rank with 8 and 16 ranks).
pub const BYTES_PER_RANK: u64 = 2 * COPY_ELEMENTS as u64 * 4 + (16 << 20);

/// Bytes per ordered pair of ranks: the all-reduce's channel between them
/// ([`LocalComm::group`] makes one per pair) and its first block of messages.
pub const BYTES_PER_RANK_PAIR: u64 = 2 << 10;

/// The share of the host's available memory the measurement may take; the rest stays with the
/// system and the other processes.
pub const MEMORY_SHARE: f64 = 0.75;

/// Bytes the measurement holds at its peak with `ranks` ranks.
pub fn bytes_needed(ranks: u64) -> f64 {
    let n = ranks as f64;
    n * BYTES_PER_RANK as f64 + n * n * BYTES_PER_RANK_PAIR as f64
}

/// How many ranks this host can measure at once, and why: the smallest of
/// [`RANKS_PER_CORE`] × its cores, the ranks whose [`bytes_needed`] fit in [`MEMORY_SHARE`] of
/// its available memory, and [`MAX_RANKS`].
#[derive(Debug, Clone, PartialEq)]
pub struct RankLimit {
    /// The most ranks allowed (0: not even one rank's buffers fit).
    pub max: u64,
    pub cores: usize,
    /// [`RANKS_PER_CORE`] × `cores`.
    pub by_cores: u64,
    /// Available memory, bytes, where it can be read.
    pub available_bytes: Option<f64>,
    /// The most ranks whose buffers fit in the memory share, where it can be read.
    pub by_memory: Option<u64>,
}

impl RankLimit {
    /// This host's limit (nothing is allocated to find it).
    pub fn of_host() -> RankLimit {
        RankLimit::new(host_cores(), available_memory_bytes())
    }

    pub fn new(cores: usize, available_bytes: Option<f64>) -> RankLimit {
        let by_cores = RANKS_PER_CORE.saturating_mul(cores.max(1) as u64);
        let available_bytes = available_bytes.filter(|a| a.is_finite() && *a >= 0.0);
        let by_memory = available_bytes.map(|avail| {
            let budget = avail * MEMORY_SHARE;
            // n·B + n²·P ≤ budget, solved for n and then corrected for rounding (n stays far
            // below 2^53, where the correction is exact: 10^15 pairs are 2 EiB).
            let (b, p) = (BYTES_PER_RANK as f64, BYTES_PER_RANK_PAIR as f64);
            let root = (-b + (b * b + 4.0 * p * budget).sqrt()) / (2.0 * p);
            let mut n = root.floor().min(1e15) as u64;
            while n > 0 && bytes_needed(n) > budget {
                n -= 1;
            }
            while n < 1_000_000_000_000_000 && bytes_needed(n + 1) <= budget {
                n += 1;
            }
            n
        });
        let max = by_cores.min(by_memory.unwrap_or(u64::MAX)).min(MAX_RANKS);
        RankLimit {
            max,
            cores,
            by_cores,
            available_bytes,
            by_memory,
        }
    }

    /// Whether `ranks` ranks can be measured.
    pub fn allows(&self, ranks: u64) -> bool {
        (1..=self.max).contains(&ranks)
    }

    /// How the limit was derived, in words.
    pub fn derivation(&self) -> String {
        let mib = |b: u64| b >> 20;
        let memory = match (self.available_bytes, self.by_memory) {
            (Some(avail), Some(n)) => format!(
                "{n} ranks fit in {:.0}% of this host's {:.1} GiB of available memory at {} MiB a rank (two {} MiB copy buffers, stack and GEMM scratch) and {} KiB a pair of ranks (the all-reduce's channels)",
                MEMORY_SHARE * 100.0,
                avail / GIB,
                mib(BYTES_PER_RANK),
                mib(COPY_ELEMENTS as u64 * 4),
                BYTES_PER_RANK_PAIR >> 10
            ),
            _ => "this host's available memory cannot be read (no /proc/meminfo), so it sets no bound".into(),
        };
        format!(
            "the smallest of {RANKS_PER_CORE} ranks per core × {} core{} = {} (every phase runs all ranks at once, so its time grows with the ranks per core); {memory}; and {MAX_RANKS} on any host (the all-reduce's messages grow as the square of the ranks)",
            self.cores,
            if self.cores == 1 { "" } else { "s" },
            self.by_cores
        )
    }
}

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
                    crate::backend::cpu::kernels::set_threads(threads);
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

/// [`at_once`] repeated until its runs agree ([`repeat`]).
fn stable<S>(
    ranks: usize,
    threads: usize,
    setup: &(dyn Fn(usize) -> S + Sync),
    work: &(dyn Fn(&mut S) + Sync),
) -> (f64, Spread) {
    repeat(PHASE_BUDGET_S, || at_once(ranks, threads, setup, work))
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

/// Measures this host for `ranks` ranks of `threads_per_rank` threads each. The caller checks
/// `ranks` against [`RankLimit`] first: every rank holds up to [`BYTES_PER_RANK`].
pub fn measure(ranks: usize, threads_per_rank: usize) -> Measured {
    measure_with(ranks, threads_per_rank, &mut |_| {})
}

/// The phases [`measure_with`] reports for `ranks` ranks: a GEMM size each, the copy, the
/// exponentials, and with 2+ ranks the all-reduce's latency and bandwidth.
pub fn phases(ranks: usize) -> usize {
    GEMM_SIZES.len() + 2 + if ranks > 1 { 2 } else { 0 }
}

/// [`measure`], calling `on_phase` with each phase's name as it starts ([`phases`] of them).
pub fn measure_with(
    ranks: usize,
    threads_per_rank: usize,
    on_phase: &mut dyn FnMut(&str),
) -> Measured {
    let ranks = ranks.max(1);
    let threads = threads_per_rank.max(1);
    let load_before = stability::load_average();
    let cpu_before = CpuTimes::now();
    let mut spreads = Vec::new();
    let mut gemm = Vec::new();
    for n in GEMM_SIZES {
        let phase = format!("f32 GEMM {n}×{n}×{n}");
        on_phase(&phase);
        let a = vec![0.5f32; n * n];
        let b = vec![0.25f32; n * n];
        // About 10^9 FLOPs per rank, at least one product.
        let count = (1e9 / (2.0 * (n * n * n) as f64)).ceil().max(1.0) as usize;
        let (t, spread) = stable(
            ranks,
            threads,
            &|_| {
                let mut c = vec![0.0f32; n * n];
                crate::backend::cpu::kernels::matmul(&mut c, &a, &b, n, n, n, false);
                c
            },
            &|c| {
                // The three products of a linear layer, as the runtime calls them: forward
                // `x · Wᵀ`, input gradient `dy · W`, weight gradient `dyᵀ · x` (accumulated).
                for _ in 0..count.div_ceil(3) {
                    crate::backend::cpu::kernels::matmul_bt(c, &a, &b, n, n, n, false);
                    crate::backend::cpu::kernels::matmul(c, &a, &b, n, n, n, false);
                    crate::backend::cpu::kernels::matmul_at(c, &a, &b, n, n, n, true);
                }
            },
        );
        spreads.push((phase, spread));
        let products = 3 * count.div_ceil(3);
        gemm.push((n, 2.0 * (n * n * n * products) as f64 / t / 1e9));
    }
    // 64 MiB per rank, beyond the caches: read 4 B and write 4 B per element.
    on_phase("memory copy");
    let len = COPY_ELEMENTS;
    let (t, spread) = stable(
        ranks,
        threads,
        // Both buffers written in the setup: no page faults inside the timed copy.
        &|_| (vec![1.0f32; len], vec![2.0f32; len]),
        &|(src, dst)| dst.copy_from_slice(src),
    );
    spreads.push(("memory copy".to_string(), spread));
    let copy_gbps = 8.0 * len as f64 / t / 1e9;
    // 16 Ki elements in and out (128 KiB): cache-resident, as a small layer's activations are.
    on_phase("GELU (one exp per element)");
    let (n, reps) = (1 << 14, 1000);
    let (t, spread) = stable(
        ranks,
        threads,
        &|_| (vec![0.5f32; n], vec![0.0f32; n]),
        &|(x, y)| {
            for _ in 0..reps {
                crate::backend::cpu::kernels::gelu_forward(y, x);
            }
        },
    );
    spreads.push(("GELU (one exp per element)".to_string(), spread));
    let exp_gops = (n * reps) as f64 / t / 1e9;
    let (comm_gbps, comm_latency_us) = if ranks > 1 {
        let n = ranks as f64;
        let phase = "all-reduce latency (8 B)";
        on_phase(phase);
        let (small, spread) = repeat(PHASE_BUDGET_S, || {
            all_reduce_seconds(ranks, threads, 8, 200)
        });
        spreads.push((phase.to_string(), spread));
        let phase = "all-reduce bandwidth (16 MiB)";
        on_phase(phase);
        let big_bytes = ALL_REDUCE_BYTES;
        let (big, spread) = repeat(PHASE_BUDGET_S, || {
            all_reduce_seconds(ranks, threads, big_bytes, 3)
        });
        spreads.push((phase.to_string(), spread));
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
        spreads,
        load: match (cpu_before, CpuTimes::now()) {
            (Some(a), Some(b)) => Load::between(a, b, load_before),
            _ => None,
        },
    }
}

/// The host's available memory (Linux `MemAvailable`), in bytes.
pub fn available_memory_bytes() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024.0)
}

/// Each of `devices` virtual devices' share of `available` bytes, GiB, rounded down to three
/// significant digits (never to 0), or `fallback` where the memory cannot be read: the devices
/// of one host's cluster spec share its memory, however many ranks measured it.
pub fn memory_gib_per_device(available: Option<f64>, devices: u64, fallback: f64) -> f64 {
    available
        .map(|b| floor_3_digits(b / devices.max(1) as f64 / GIB))
        .filter(|g| g.is_finite() && *g > 0.0)
        .unwrap_or(fallback)
}

/// Each of `ranks` virtual devices' share of the host's available memory, GiB
/// ([`memory_gib_per_device`] of what this host has now).
pub fn memory_gib_per_rank(ranks: usize, fallback: f64) -> f64 {
    memory_gib_per_device(available_memory_bytes(), ranks as u64, fallback)
}

/// `x` > 0 rounded down to three significant digits (2.9687 → 2.96, 0.00024138 → 0.000241).
fn floor_3_digits(x: f64) -> f64 {
    if !(x.is_finite() && x > 0.0) {
        return x;
    }
    let scale = 10f64.powi(2 - x.log10().floor() as i32);
    // The nudge keeps a last-bit error of the scaling from taking an exact value a step down.
    let y = (x * scale * (1.0 + 1e-12)).floor() / scale;
    if y > 0.0 {
        y
    } else {
        x
    }
}

/// `cluster` with the measured figures: the best GEMM rate as the peak and each size's share of
/// it as the `matmul_efficiency` curve; half the copy rate as the memory bandwidth (the cost
/// model counts 16-bit elements, the CPU backend moves f32); the GELU rate as the device's
/// `transcendental_gops`; the all-reduce's bus bandwidth and
/// ring-step latency as both links (one host; with one rank they stay the input's, as nothing
/// measured them); `memory_gib` per device; the host's cores as the cores the ranks share (the
/// cost model lets one rank's work fill another's waits where the ranks outnumber them).
/// Efficiencies are 1: the rates are what was reached. The measured curve replaces the GEMM
/// tile-and-wave model (`gemm_efficiency`), the only reader of `sms` and `kernel_launch_us`,
/// so those are cleared. Kept from `cluster`: nodes, GPUs per node, the device's name and kind,
/// the overheads and `flash_attention_efficiency`; the name gets `-calibrated` appended.
pub fn calibrated(cluster: &Cluster, m: &Measured, memory_gib: f64) -> Cluster {
    let mut c = cluster.clone();
    let peak = m.gemm.iter().map(|g| g.1).fold(0.0, f64::max);
    c.name = format!("{}-calibrated", cluster.name);
    c.device.memory_gib = memory_gib;
    c.device.sms = 0;
    c.device.kernel_launch_us = 0.0;
    c.device.peak_tflops = peak / 1000.0;
    c.device.memory_bandwidth_gbps = m.copy_gbps / 2.0;
    c.device.transcendental_gops = Some(m.exp_gops);
    c.device.shared_cores = Some(m.cores.max(1) as u64);
    c.device.l2_cache_kib =
        Some(crate::backend::cpu::kernels::matmul::packing_slab_bytes() as f64 / 1024.0);
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

    /// Every figure is a positive, finite rate, on one rank and on two at once, and every
    /// phase was reported.
    #[test]
    fn measurements_are_positive_rates() {
        for ranks in [1, 2] {
            let mut seen = Vec::new();
            let m = measure_with(ranks, 1, &mut |p| seen.push(p.to_string()));
            assert_eq!(seen.len(), phases(ranks), "{seen:?}");
            assert_eq!(m.gemm.len(), GEMM_SIZES.len());
            for &(n, g) in &m.gemm {
                assert!(g.is_finite() && g > 0.0, "{n}: {g}");
            }
            assert!(m.copy_gbps.is_finite() && m.copy_gbps > 0.0);
            // Every figure has its spread, from at least three runs.
            assert_eq!(m.spreads.len(), phases(ranks), "{:?}", m.spreads);
            assert!(m.spreads.iter().all(|(_, s)| s.runs >= stability::KEEP));
            assert!(m.exp_gops.is_finite() && m.exp_gops > 0.0);
            if ranks > 1 {
                assert!(m.comm_gbps > 0.0 && m.comm_latency_us > 0.0, "{m:?}");
            }
        }
    }

    /// The README's job (8 ranks on 2 cores) is allowed; the cores, the memory and the
    /// absolute cap each bound the ranks; a host without room for one rank allows none.
    #[test]
    fn rank_limits() {
        let gib = |g: f64| Some(g * GIB);
        let l = RankLimit::new(2, gib(24.0));
        assert_eq!(l.max, 16, "{l:?}");
        assert!(l.allows(8) && l.allows(16) && !l.allows(17) && !l.allows(0));
        assert!(l.by_memory.unwrap() > 100);
        // 0.75 GiB at 144 MiB a rank: 5 ranks.
        let l = RankLimit::new(2, gib(1.0));
        assert_eq!((l.max, l.by_memory), (5, Some(5)), "{l:?}");
        assert!(bytes_needed(5) <= GIB * MEMORY_SHARE && bytes_needed(6) > GIB * MEMORY_SHARE);
        assert_eq!(RankLimit::new(1024, gib(4096.0)).max, MAX_RANKS);
        assert_eq!(RankLimit::new(2, None).max, 16);
        let l = RankLimit::new(2, Some(100.0 * (1 << 20) as f64));
        assert_eq!(l.max, 0);
        assert!(!l.allows(1));
        assert!(RankLimit::new(usize::MAX, gib(1e12)).max == MAX_RANKS);
        for odd in [f64::INFINITY, f64::NAN, -1.0, 1e300] {
            let l = RankLimit::new(2, Some(odd));
            assert!(l.max <= 16, "{odd}: {l:?}");
        }
        assert!(!l.derivation().is_empty());
    }

    /// A host's memory over a spec's devices, to three significant digits, never 0.
    #[test]
    fn memory_per_device() {
        let g = |x: f64| Some(x * GIB);
        assert_eq!(memory_gib_per_device(g(23.75), 8, 2.0), 2.96);
        assert_eq!(memory_gib_per_device(g(24.0), 1, 2.0), 24.0);
        assert_eq!(memory_gib_per_device(g(24.0), 100_000, 2.0), 0.00024);
        assert_eq!(memory_gib_per_device(None, 8, 2.0), 2.0);
        assert!(memory_gib_per_device(g(24.0), u64::MAX, 2.0) > 0.0);
        assert_eq!(memory_gib_per_device(g(24.0), 0, 2.0), 24.0);
    }
}
