//! The CPU memory model against the runtime: `tessera run` measures each rank's peak (the
//! tracking allocator) and the plan predicts it; on the README's plan and two other layouts
//! every rank must be within 10% (docs/performance.md, "CPU memory").
//!
//! The prediction counts the gemm crate's packing slab from the cluster spec's
//! `[device] l2_cache_kib`, and the slab is the L2 cache per core of the host that runs: the
//! test plans on a copy of cpu-8 stating this host's, read from sysfs by the gemm crate's rule.

mod common;

use common::{run, s, Scratch, README_TINY_LAYOUT};

/// This host's L2 cache per core in KiB as gemm-common 0.19 reads it on Linux (cache.rs): the
/// level-2 data or unified cache of a CPU, its size over the CPUs that share it. `None` where
/// sysfs does not say (the preset's 512 KiB is used then).
fn host_l2_kib() -> Option<u64> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    for entry in std::fs::read_dir(dir).ok()? {
        let p = entry.ok()?.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).map(|t| t.trim().to_string());
        let (Ok(level), Ok(kind), Ok(size)) = (read("level"), read("type"), read("size")) else {
            continue;
        };
        if level != "2" || !matches!(kind.as_str(), "Data" | "Unified") {
            continue;
        }
        let kib: u64 = match size.strip_suffix('K') {
            Some(k) => k.parse().ok()?,
            None => size.strip_suffix('M')?.parse::<u64>().ok()? * 1024,
        };
        let shared: u64 = read("shared_cpu_list")
            .ok()?
            .split(',')
            .map(|r| match r.split_once('-') {
                Some((a, b)) => b.parse::<u64>().unwrap() + 1 - a.parse::<u64>().unwrap(),
                None => 1,
            })
            .sum();
        return Some(kib / shared.max(1));
    }
    None
}

/// cpu-8 as this host runs it: the preset with this host's L2 cache per core.
fn cluster(dir: &Scratch) -> String {
    let preset = "specs/clusters/cpu-8.toml";
    let want = host_l2_kib().map(|k| format!("l2_cache_kib = {k}"));
    let edits: Vec<(&str, &str)> = match &want {
        Some(w) => vec![("l2_cache_kib = 512", w.as_str())],
        None => vec![],
    };
    s(&dir.copy_edit(preset, &edits))
}

/// Plans tiny with `layout` on this host's cpu-8, runs it for `steps` and returns each rank's
/// measured/predicted from the memory report, checked to be one per rank.
fn ratios(dir: &Scratch, name: &str, layout: &[&str], steps: &str, ranks: usize) -> Vec<f64> {
    let (c, plan) = (cluster(dir), s(&dir.path(name)));
    let mut args = vec!["plan", "specs/models/tiny.toml", c.as_str()];
    args.extend_from_slice(layout);
    args.extend(["-o", plan.as_str()]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let r = run(&["run", plan.as_str(), "--steps", steps]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // The report's rows: rank, stage, measured MiB, predicted MiB, measured/predicted.
    let rows: Vec<f64> = r
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 5 && w[0].parse::<u64>().is_ok() && w[1].parse::<u64>().is_ok())
        .map(|w| w[4].parse().expect("a ratio"))
        .collect();
    assert_eq!(rows.len(), ranks, "one row per rank:\n{}", r.stdout);
    rows
}

fn within_10_percent(what: &str, ratios: &[f64]) {
    for (rank, x) in ratios.iter().enumerate() {
        assert!(
            (0.9..=1.1).contains(x),
            "{what}: rank {rank} measured {x:.2}× its predicted memory (all: {ratios:?})"
        );
    }
}

/// The README's run (DP 2 × PP 2 × TP 2, ZeRO-1, 1F1B): 3 steps reach the peak of 50 (the
/// pools and the activations of the micro-batches in flight are all there by the first step's
/// end; measured on rank 0: 3,791,833 B at 3 steps, 3,792,929 B at 50).
#[test]
fn the_readme_plan_is_within_10_percent_on_every_rank() {
    let dir = Scratch::new();
    let layout = &README_TINY_LAYOUT[2..];
    within_10_percent("README plan", &ratios(&dir, "readme.json", layout, "3", 8));
}

/// ZeRO-3 with TP and sequence parallelism (the CPU runtime keeps whole weights and
/// gradients; the all-gathers' messages; SP's collectives) and an interleaved pipeline
/// (messages both ways on every stage).
#[test]
fn zero3_and_interleaved_plans_are_within_10_percent() {
    let dir = Scratch::new();
    let zero3 = [
        "--dp",
        "4",
        "--pp",
        "1",
        "--tp",
        "2",
        "--sp",
        "--micro-batch",
        "2",
        "--zero",
        "3",
    ];
    within_10_percent("ZeRO-3", &ratios(&dir, "zero3.json", &zero3, "2", 8));
    let interleaved = [
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
        "--no-sp",
        "--micro-batch",
        "1",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
        "--zero",
        "2",
    ];
    let x = ratios(&dir, "interleaved.json", &interleaved, "2", 8);
    within_10_percent("interleaved", &x);
}
