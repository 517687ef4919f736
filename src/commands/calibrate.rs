//! `tessera calibrate CLUSTER.toml [-o calibrated.toml] [--ranks N]`: measure this host for the
//! CPU backend and write the cluster spec with the measured figures, for `tessera plan` to use as
//! it uses the presets.
//!
//! The measurements are `tessera_runtime::calibrate`'s: each rank's GEMM rate at the sizes the
//! cost model uses, memory bandwidth and the local all-reduce, with every rank running at once
//! on its share of the cores, as `tessera run` runs them. GPU clusters are refused: measuring
//! GPUs needs a GPU (and is not built yet).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::Args;
use tessera_planner::spec::{load_cluster, ClusterOverrides, DeviceKind};
use tessera_runtime::calibrate::{
    calibrated, host_cores, measure, memory_gib_per_rank, threads_per_rank, Measured,
};

use crate::files::{check_outputs, named, write_output};
use crate::output::table;

#[derive(Args)]
pub struct CalibrateArgs {
    /// The CPU cluster spec to calibrate (its name, nodes and memory caps are kept).
    cluster: PathBuf,
    /// Where to write the calibrated spec (default: standard output).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Ranks to measure at once (default: the spec's devices).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    ranks: Option<u64>,
}

pub fn run(args: CalibrateArgs) -> anyhow::Result<ExitCode> {
    let outputs: Vec<_> = args
        .output
        .iter()
        .map(|p| named("-o/--output", p))
        .collect();
    check_outputs(&[named("CLUSTER", &args.cluster)], &outputs)?;
    let cluster = load_cluster(&args.cluster, ClusterOverrides::default())?;
    if cluster.device.kind != DeviceKind::Cpu {
        bail!(
            "{}: `{}` is a GPU cluster; tessera calibrate measures the CPU backend's ranks on this host, and measuring GPUs is not built yet\n  fix: calibrate a CPU cluster (specs/clusters/cpu-8.toml), or keep the GPU preset's cited constants",
            args.cluster.display(),
            cluster.name
        );
    }
    let ranks = args.ranks.unwrap_or(cluster.devices) as usize;
    let threads = threads_per_rank(ranks);
    eprintln!(
        "measuring {ranks} rank(s) at once, {threads} thread(s) each, on {} core(s)…",
        host_cores()
    );
    let m = measure(ranks, threads);
    let mut t = table(&["what", "per rank"], &[1]);
    for (n, g) in &m.gemm {
        t.add_row(vec![
            format!("f32 GEMM {n}×{n}×{n}"),
            format!("{g:.1} GFLOP/s"),
        ]);
    }
    t.add_row(vec![
        "memory copy".into(),
        format!("{:.2} GB/s", m.copy_gbps),
    ]);
    t.add_row(vec![
        "GELU (one exp per element)".into(),
        format!("{:.3} G elements/s", m.exp_gops),
    ]);
    if ranks > 1 {
        t.add_row(vec![
            "all-reduce bus bandwidth".into(),
            format!("{:.2} GB/s", m.comm_gbps),
        ]);
        t.add_row(vec![
            "all-reduce latency per ring step".into(),
            format!("{:.1} µs", m.comm_latency_us),
        ]);
    }
    eprintln!("{t}");
    // Each virtual device's memory cap: this host's available memory shared by the ranks.
    let memory_gib = memory_gib_per_rank(ranks, cluster.device.memory_gib);
    let text = spec_text(&calibrated(&cluster, &m, memory_gib), &m);
    match &args.output {
        Some(path) => {
            write_output(path, text.as_bytes())?;
            println!("wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The calibrated cluster as a spec file, with where each figure comes from.
fn spec_text(c: &tessera_planner::Cluster, m: &Measured) -> String {
    let k = &c.calibration;
    let curve: Vec<String> = k
        .matmul_efficiency
        .iter()
        .map(|[n, e]| format!("[{n:.0}, {e:.3}]"))
        .collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {} by `tessera calibrate` on this host ({} cores): {} ranks measured at once, {} thread(s) each.\n\
         # Every rate is what one rank reached while the others ran too (runtime/src/calibrate.rs).",
        c.name, m.cores, m.ranks, m.threads_per_rank
    );
    let _ = writeln!(s, "name = \"{}\"", c.name);
    let _ = writeln!(
        s,
        "nodes = {}\ngpus_per_node = {}\n",
        c.nodes, c.gpus_per_node
    );
    let d = &c.device;
    let _ = writeln!(
        s,
        "[device]\nname = \"{}\"\nkind = \"cpu\"\nmemory_gib = {}               # this host's available memory over the ranks\npeak_tflops = {:.6}          # the best f32 GEMM rate per rank\nmemory_bandwidth_gbps = {:.3}  # half the measured copy rate: the cost model counts 16-bit elements, the CPU moves f32\ntranscendental_gops = {:.4}   # GELU elements per second per rank, billions: the exp-bound kernels' rate\nshared_cores = {}              # this host's cores, which the ranks' threads share\n",
        d.name,
        d.memory_gib,
        d.peak_tflops,
        d.memory_bandwidth_gbps,
        m.exp_gops,
        m.cores
    );
    for (t, l) in [("intra_node", &c.intra_node), ("inter_node", &c.inter_node)] {
        let _ = writeln!(
            s,
            "[{t}]\nbandwidth_gbps = {:.3}  # the all-reduce's bus bandwidth between the ranks' threads (measured with 2+ ranks)\nlatency_us = {:.2}\n",
            l.bandwidth_gbps, l.latency_us
        );
    }
    let _ = writeln!(
        s,
        "[overhead]\ncontext_gib = {}\nfragmentation = {}\n",
        c.overhead.context_gib, c.overhead.fragmentation
    );
    let _ = writeln!(
        s,
        "[calibration]\n# Measured: each size's GEMM rate over the best one.\nmatmul_efficiency = [{}]\nmemory_efficiency = {}\nflash_attention_efficiency = {}\nintra_node_efficiency = {}\ninter_node_efficiency = {}",
        curve.join(", "),
        k.memory_efficiency,
        k.flash_attention_efficiency,
        k.intra_node_efficiency,
        k.inter_node_efficiency
    );
    s
}
