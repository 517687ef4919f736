//! `tessera calibrate CLUSTER.toml [-o calibrated.toml] [--ranks N | --gpu | --from-json FILE]`: measure this host for the
//! CPU backend and write the cluster spec with the measured figures, for `tessera plan` to use as
//! it uses the presets.
//!
//! The measurements are `tessera_runtime::calibrate`'s: each rank's GEMM rate at the sizes the
//! cost model uses, memory bandwidth and the local all-reduce, with every rank running at once
//! on its share of the cores, as `tessera run` runs them. GPU clusters take `--gpu` (or
//! `--from-json`): their kernels measured through PyTorch (`calibrate_gpu`). Rank counts this host cannot measure (too many per
//! core, or more buffers than its memory holds: `RankLimit`) are refused before anything is
//! allocated, naming the flag or the spec's fields, the limit and how it was derived.
//!
//! Each figure is repeated until its runs agree (`tessera_runtime::calibrate::stability`); the
//! output and the written spec say each one's spread, which did not settle, and whether other
//! processes shared the host meanwhile. Either calibration's spec is read back by the planner's
//! own parser and checks before it is written ([`plan_reads`]): what `plan` would refuse is
//! refused here, by the same rules.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tessera_planner::source::Source;
use tessera_planner::spec::{parse_cluster_toml, ClusterOverrides, DeviceKind};
use tessera_planner::Diagnostic;
use tessera_runtime::calibrate::stability::{KEEP, STABLE_SPREAD};
use tessera_runtime::calibrate::{
    calibrated, measure_with, memory_gib_per_device, phases, threads_per_rank, Measured, RankLimit,
    BYTES_PER_RANK,
};

use super::calibrate_gpu;
use crate::files::{check_outputs, named, write_output};
use crate::output::table;

#[derive(Args)]
pub struct CalibrateArgs {
    /// The CPU cluster spec to calibrate. Kept from it: `nodes`, `gpus_per_node`,
    /// `device.name`, `device.kind`, `[overhead]` and `calibration.flash_attention_efficiency`;
    /// with one rank also `[intra_node]` and `[inter_node]`, which take two ranks to measure;
    /// its `name` gets `-calibrated` appended. Everything else is this host's: the measured
    /// rates (`peak_tflops`, `memory_bandwidth_gbps`, `transcendental_gops`, the links,
    /// `matmul_efficiency`), its cores (`shared_cores`), its available memory over the spec's
    /// devices (`memory_gib`; the spec's own where it cannot be read), and efficiencies of 1
    /// (`memory_efficiency`, `intra_node_efficiency`, `inter_node_efficiency`: the rates are
    /// what was reached). Dropped: `sms`, `kernel_launch_us` and `gemm_efficiency` (the
    /// measured GEMM curve replaces the model that reads them).
    cluster: PathBuf,
    /// Where to write the calibrated spec (default: standard output).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Ranks to measure at once (default: the spec's devices). At most what this host can
    /// measure: 8 per core, as many as fit in three quarters of its available memory (144 MiB
    /// each), and 1024.
    #[arg(long, value_parser = parse_ranks, allow_negative_numbers = true, conflicts_with_all = ["gpu", "from_json"])]
    ranks: Option<u64>,
    /// Measure a GPU cluster's kernels on this machine's GPU through PyTorch (the Python of
    /// `TESSERA_PYTHON`, or `python3`, running scripts/calibrate_gpu.py, which the binary
    /// carries): bf16 GEMMs by shape, causal SDPA, element-wise bandwidth, the host's cost per
    /// eager op and the loss. Writes the GPU spec with `[calibration]` measured
    /// (`matmul_efficiency`, `memory_efficiency`, `flash_attention_efficiency`, `host_op_us`)
    /// and the rest the input's, `gemm_efficiency` dropped. No GPU (or no PyTorch): a message
    /// saying what was looked for, exit status 3, nothing written.
    #[arg(long, conflicts_with = "from_json")]
    gpu: bool,
    /// As --gpu, from a measurement taken elsewhere: the JSON that scripts/calibrate_gpu.py
    /// printed there.
    #[arg(long, value_name = "FILE")]
    from_json: Option<PathBuf>,
    /// With --gpu: how long to wait for the measuring script, in seconds (default 900). A script
    /// still running then is stopped, with everything it started, and nothing is written.
    #[arg(long, value_name = "SECONDS", value_parser = parse_timeout)]
    timeout: Option<f64>,
    /// Measure only this machine's host tier for a GPU cluster: the spec is written with its
    /// `[host]` table replaced (memory from /proc/meminfo, the runtime's AdamW rate on all
    /// cores, the NVMe with --nvme-dir; the host↔device link kept from the spec). --gpu
    /// writes the same `[host]` beside its `[calibration]`.
    #[arg(long, conflicts_with_all = ["gpu", "from_json", "ranks"])]
    host: bool,
    /// With --host or --gpu: a directory on the node's NVMe where 1 GiB is written and read back
    /// with O_DIRECT to measure `nvme_gbps`; `nvme_gib` is its filesystem's size. Without it
    /// the spec's NVMe is kept.
    #[arg(long, value_name = "DIR")]
    nvme_dir: Option<PathBuf>,
    /// Measure only how fast this node writes checkpoints to DIR (a folder on the checkpoint
    /// filesystem, not the offload NVMe): 1 GiB written by one writer per core, each file
    /// fsynced, as a save writes its shards. The spec is written with its `[storage]`
    /// `write_gbps` replaced; the rest is the input's.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["gpu", "from_json", "ranks", "host", "nvme_dir"])]
    storage: Option<PathBuf>,
}

/// `--timeout`: seconds above 0, at most a week.
fn parse_timeout(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= 604_800.0 => Ok(x),
        Ok(x) => Err(format!(
            "must be a number of seconds above 0 and at most 604800 (a week), found {x}\n  fix: pass --timeout {} (the default) or the seconds the measurement may take",
            calibrate_gpu::DEFAULT_TIMEOUT_S
        )),
        Err(e) => Err(format!(
            "expected a number of seconds ({e})\n  fix: pass --timeout {} (the default) or the seconds the measurement may take",
            calibrate_gpu::DEFAULT_TIMEOUT_S
        )),
    }
}

/// `--ranks`: a whole number, at least 1 (whether this host can measure it is checked before
/// measuring, with the reason).
fn parse_ranks(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("must be at least 1, found 0\n  fix: pass --ranks 1 or more".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!(
            "expected a whole number of ranks ({e})\n  fix: pass --ranks between 1 and {}, what this host can measure",
            RankLimit::of_host().max.max(1)
        )),
    }
}

/// The refusal of a rank count this host cannot measure; `what` says where the count comes
/// from.
fn too_many(limit: &RankLimit, file: &Path, field: &str, what: String) -> Diagnostic {
    let fix = if limit.max == 0 {
        format!(
            "free memory: one rank takes {} MiB, and this host cannot spare it",
            BYTES_PER_RANK >> 20
        )
    } else {
        format!(
            "pass --ranks {} or fewer (the written spec keeps the spec's devices, whatever the ranks measured){}",
            limit.max,
            if field == "--ranks" {
                ""
            } else {
                ", or calibrate a spec with fewer devices"
            }
        )
    };
    Diagnostic::new(
        file,
        field,
        format!(
            "{what} cannot be measured at once on this host: it measures at most {} ranks, {}",
            limit.max,
            limit.derivation()
        ),
        fix,
    )
}

/// The spec `text` with its `[name]` table replaced by the measured `table`, checked by the
/// planner's own parser (`plan_reads`) and written.
fn write_table(
    args: &CalibrateArgs,
    text: &str,
    name: &str,
    table: &str,
    what: &str,
) -> anyhow::Result<ExitCode> {
    let text = super::calibrate_host::with_table(text, name, table);
    plan_reads(&text, args.output.as_deref(), what, &|field| {
        format!("the measured `{field}`")
    })?;
    emit(args.output.as_deref(), &text)?;
    Ok(ExitCode::SUCCESS)
}

pub fn run(args: CalibrateArgs) -> anyhow::Result<ExitCode> {
    if let (Some(t), false) = (args.timeout, args.gpu) {
        bail!(
            "--timeout {t}: only --gpu waits on a measuring script; {} has no timeout to set\n  fix: drop --timeout, or pass --gpu to measure this machine's GPU",
            if args.from_json.is_some() {
                "--from-json converts a measurement already taken and"
            } else {
                "the CPU calibration runs in this process and"
            }
        );
    }
    let outputs: Vec<_> = args
        .output
        .iter()
        .map(|p| named("-o/--output", p))
        .collect();
    let mut inputs = vec![named("CLUSTER", &args.cluster)];
    if let Some(j) = &args.from_json {
        inputs.push(named("--from-json", j));
    }
    check_outputs(&inputs, &outputs)?;
    let src = Source::read(&args.cluster)?;
    let cluster = parse_cluster_toml(&src, ClusterOverrides::default())?;
    if let Some(dir) = &args.storage {
        let table = super::calibrate_host::measured_storage(dir)?;
        return write_table(
            &args,
            &src.text,
            "storage",
            &table,
            "the storage measurement",
        );
    }
    if args.host {
        if cluster.device.kind != DeviceKind::Gpu {
            bail!(
                "{}: `{}` is a CPU cluster: its devices are this host, and offload has no tier to move to\n  fix: pass --host with a GPU cluster spec (specs/clusters/dgx-h100-80g.toml)",
                args.cluster.display(),
                cluster.name
            );
        }
        let table = super::calibrate_host::measured_host(&cluster, args.nvme_dir.as_deref())?;
        return write_table(&args, &src.text, "host", &table, "the host measurement");
    }
    if args.nvme_dir.is_some() && !args.gpu {
        bail!("--nvme-dir measures the NVMe for the host tier, and only --host and --gpu write one\n  fix: add --host (or --gpu), or drop --nvme-dir");
    }
    if args.gpu || args.from_json.is_some() {
        return gpu(&args, &cluster);
    }
    if cluster.device.kind != DeviceKind::Cpu {
        bail!(
            "{}: `{}` is a GPU cluster; tessera calibrate without --gpu measures the CPU backend's ranks on this host\n  fix: pass --gpu to measure this machine's GPU through PyTorch (or --from-json with a measurement taken on one), or calibrate a CPU cluster (specs/clusters/cpu-8.toml)",
            args.cluster.display(),
            cluster.name
        );
    }
    // Checked before anything is allocated: every rank holds up to BYTES_PER_RANK.
    let limit = RankLimit::of_host();
    let ranks = match args.ranks {
        Some(n) => {
            if !limit.allows(n) {
                return Err(too_many(
                    &limit,
                    Path::new("<command line>"),
                    "--ranks",
                    format!("{n} ranks"),
                )
                .into());
            }
            n
        }
        None => {
            let n = cluster.devices;
            if !limit.allows(n) {
                let d = too_many(
                    &limit,
                    &args.cluster,
                    "nodes × gpus_per_node",
                    format!(
                        "{} nodes × {} gpus_per_node = {n} devices, the ranks measured unless --ranks says otherwise,",
                        cluster.nodes, cluster.gpus_per_node
                    ),
                );
                return Err(d.at(src.toml_key("nodes")).into());
            }
            n
        }
    } as usize;
    let threads = threads_per_rank(ranks);
    eprintln!(
        "measuring {ranks} rank(s) at once, {threads} thread(s) each, on {} core(s)…",
        limit.cores
    );
    let m = measure_with_progress(ranks, threads);
    let spread = |phase: &str| m.spread_of(phase).map_or(String::new(), |s| s.describe());
    let mut t = table(&["what", "per rank", "spread (3 fastest runs)"], &[1, 2]);
    for (n, g) in &m.gemm {
        let phase = format!("f32 GEMM {n}×{n}×{n}");
        t.add_row(vec![
            phase.clone(),
            format!("{g:.1} GFLOP/s"),
            spread(&phase),
        ]);
    }
    t.add_row(vec![
        "memory copy".into(),
        format!("{:.2} GB/s", m.copy_gbps),
        spread("memory copy"),
    ]);
    t.add_row(vec![
        "GELU (one exp per element)".into(),
        format!("{:.3} G elements/s", m.exp_gops),
        spread("GELU (one exp per element)"),
    ]);
    if ranks > 1 {
        t.add_row(vec![
            "all-reduce bus bandwidth".into(),
            format!("{:.2} GB/s", m.comm_gbps),
            spread("all-reduce bandwidth (16 MiB)"),
        ]);
        t.add_row(vec![
            "all-reduce latency per ring step".into(),
            format!("{:.1} µs", m.comm_latency_us),
            spread("all-reduce latency (8 B)"),
        ]);
    }
    eprintln!("{t}");
    let (stability, load) = stability_lines(&m);
    eprintln!(
        "{}{stability}",
        if m.unstable().is_empty() {
            ""
        } else {
            "warning: "
        }
    );
    eprintln!("{}{load}", if m.under_load() { "warning: " } else { "" });
    // Each virtual device's memory cap: this host's available memory (read before measuring)
    // shared by the devices of the written spec, however many ranks were measured.
    let memory_gib = memory_gib_per_device(
        limit.available_bytes,
        cluster.devices,
        cluster.device.memory_gib,
    );
    let text = super::calibrate_host::with_whole_run_tables(
        &spec_text(&calibrated(&cluster, &m, memory_gib), &m),
        &cluster,
    );
    plan_reads(
        &text,
        args.output.as_deref(),
        "this host's measurement",
        &|field| {
            format!(
                "the measured rates, or {}'s `{field}`",
                args.cluster.display()
            )
        },
    )?;
    emit(args.output.as_deref(), &text)?;
    Ok(ExitCode::SUCCESS)
}

/// The calibrated spec to `-o`'s file (atomically), or to standard output.
fn emit(output: Option<&std::path::Path>, text: &str) -> anyhow::Result<()> {
    match output {
        Some(path) => {
            write_output(path, text.as_bytes())?;
            println!("wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// `--gpu` / `--from-json`: the GPU cluster's `[calibration]` from kernel measurements.
fn gpu(args: &CalibrateArgs, cluster: &tessera_planner::Cluster) -> anyhow::Result<ExitCode> {
    if cluster.device.kind != DeviceKind::Gpu {
        bail!(
            "{}: `{}` is a CPU cluster; --gpu and --from-json calibrate GPU clusters\n  fix: drop the flag to measure this host's CPU ranks, or pass a GPU cluster (specs/clusters/dgx-h100-80g.toml)",
            args.cluster.display(),
            cluster.name
        );
    }
    // `at` names the measurement in errors; `origin` says in the spec where it was taken.
    let (m, at, origin) = match &args.from_json {
        Some(path) => (
            calibrate_gpu::read(path)?,
            path.display().to_string(),
            format!("measured elsewhere: {}", path.display()),
        ),
        None => match calibrate_gpu::measure(std::time::Duration::from_secs_f64(
            args.timeout.unwrap_or(calibrate_gpu::DEFAULT_TIMEOUT_S),
        ))? {
            calibrate_gpu::Outcome::Measured(m) => (
                *m,
                "the measuring script's output".into(),
                "measured on this machine".into(),
            ),
            calibrate_gpu::Outcome::NoGpu(why) => {
                eprintln!("error: {why}");
                return Ok(ExitCode::from(calibrate_gpu::NO_GPU as u8));
            }
        },
    };
    calibrate_gpu::check_fits(cluster, &m, &at, &args.cluster)?;
    let mut text = calibrate_gpu::spec_text(cluster, &m, &at, &origin)?;
    if args.from_json.is_none() {
        // Measured on this machine: its host tier too (`calibrate --host`).
        let table = super::calibrate_host::measured_host(cluster, args.nvme_dir.as_deref())?;
        text = super::calibrate_host::with_host(&text, &table);
    } else if cluster.host.stated() {
        // Measured elsewhere: the input's host tier, as it is.
        text =
            super::calibrate_host::with_host(&text, &cluster.host.toml_table("the input spec's"));
    }
    let text = super::calibrate_host::with_whole_run_tables(&text, cluster);
    plan_reads(&text, args.output.as_deref(), &at, &|field| match field {
        "calibration.matmul_efficiency" => "the measurement's `gemm` entries".to_string(),
        "calibration.memory_efficiency" => "the measurement's `elementwise` entries".to_string(),
        "calibration.flash_attention_efficiency" => {
            "the measurement's `attention` entries".to_string()
        }
        "calibration.host_op_us" => format!(
            "the measurement's `host_op.seconds` over `host_op.ops` ({} s over {} ops)",
            m.host_seconds, m.host_ops
        ),
        f => format!("{}'s `{f}`", args.cluster.display()),
    })?;
    emit(args.output.as_deref(), &text)?;
    Ok(ExitCode::SUCCESS)
}

/// Refuses a calibrated spec that `tessera plan` would refuse, before anything is written: the
/// text is read back by the planner's own cluster parser and checks (`parse_cluster_toml`,
/// `Cluster::check`), so the rules are `plan`'s and cannot drift from them. `at` names the
/// measurement; `source_of` says which part of it a spec field comes from.
fn plan_reads(
    text: &str,
    output: Option<&Path>,
    at: &str,
    source_of: &dyn Fn(&str) -> String,
) -> anyhow::Result<()> {
    let name = output.map_or_else(|| PathBuf::from("<calibrated spec>"), Path::to_path_buf);
    let Err(d) = parse_cluster_toml(&Source::from_text(name, text), ClusterOverrides::default())
    else {
        return Ok(());
    };
    // The written line of the refused key (its value as written), where there is one.
    let key = d.field.rsplit('.').next().unwrap_or(&d.field);
    let line = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| l.split('=').next().map(str::trim) == Some(key));
    bail!(
        "{at}: the calibrated spec would hold {}, which `tessera plan` refuses: `{}`: {}; it comes from {}\n  fix: {}, or measure again; nothing was written",
        line.map_or_else(|| format!("`{}`", d.field), |l| format!("`{l}`")),
        d.field,
        d.problem,
        source_of(&d.field),
        d.fix
    )
}

/// [`measure_with`] with its phases shown on standard error: a bar on a terminal, a line each
/// otherwise (logs, pipes).
fn measure_with_progress(ranks: usize, threads: usize) -> Measured {
    let total = phases(ranks);
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} phases  {elapsed}  {msg}")
            .expect("a valid template"),
    );
    let mut done = 0;
    let m = measure_with(ranks, threads, &mut |phase| {
        if bar.is_hidden() {
            eprintln!("[{}/{total}] {phase}…", done + 1);
        }
        bar.set_position(done);
        bar.set_message(phase.to_string());
        done += 1;
    });
    bar.finish_and_clear();
    m
}

/// What the repeated runs and the host's load say about a calibration, in two sentences: its
/// stability (every figure within [`STABLE_SPREAD`], or which were not) and its load (the
/// share of the host's CPU time other processes took while it measured).
fn stability_lines(m: &Measured) -> (String, String) {
    let pct = |x: f64| format!("{:.0}%", x * 100.0);
    let unstable = m.unstable();
    let stability = if unstable.is_empty() {
        let widest = m
            .spreads
            .iter()
            .max_by(|a, b| a.1.spread.total_cmp(&b.1.spread));
        format!(
            "stable: every figure is the median of its {KEEP} fastest runs, which agreed within {}{}",
            pct(STABLE_SPREAD),
            widest.map_or(String::new(), |(n, s)| format!(
                " (the widest: {:.1}%, {n})",
                s.spread * 100.0
            ))
        )
    } else {
        format!(
            "not stable: the {KEEP} fastest runs of {} did not agree within {} (each figure is the median of its {KEEP} fastest runs); calibrate again when the host is quiet, or use these figures knowing their spread",
            unstable
                .iter()
                .map(|(n, s)| format!("{n} ({})", s.describe()))
                .collect::<Vec<_>>()
                .join(", "),
            pct(STABLE_SPREAD)
        )
    };
    let load = match m.load {
        Some(l) if l.loaded() => format!(
            "under load: other processes took {} of this host's CPU time while it measured{}; the rates are what a shared host gave, lower and noisier than a quiet one's: calibrate again when the host is quiet",
            pct(l.others),
            l.load_before.map_or(String::new(), |a| format!(
                " (1-minute load average {a:.2} on {} cores when it started)",
                m.cores
            ))
        ),
        Some(l) => format!(
            "quiet: other processes took {} of this host's CPU time while it measured",
            pct(l.others)
        ),
        None => "whether other work ran while it measured could not be read (no /proc/stat)".into(),
    };
    (stability, load)
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
         # Every rate is what one rank reached while the others ran too (runtime/src/calibrate/).",
        c.name, m.cores, m.ranks, m.threads_per_rank
    );
    let (stability, load) = stability_lines(m);
    let _ = writeln!(s, "# {stability}.\n# {load}.");
    for (phase, spread) in &m.spreads {
        let _ = writeln!(s, "#   {phase}: spread {}", spread.describe());
    }
    let _ = writeln!(s, "name = \"{}\"", c.name);
    let _ = writeln!(
        s,
        "nodes = {}\ngpus_per_node = {}\n",
        c.nodes, c.gpus_per_node
    );
    let d = &c.device;
    let _ = writeln!(
        s,
        "[device]\nname = \"{}\"\nkind = \"cpu\"\nmemory_gib = {}               # this host's available memory over the spec's devices\npeak_tflops = {:.6}          # the best f32 GEMM rate per rank\nmemory_bandwidth_gbps = {:.3}  # half the measured copy rate: the cost model counts 16-bit elements, the CPU moves f32\ntranscendental_gops = {:.4}   # GELU elements per second per rank, billions: the exp-bound kernels' rate\nshared_cores = {}              # this host's cores, which the ranks' threads share\nprecision = \"fp32\"           # the CPU backend computes and stores everything in f32\nl2_cache_kib = {}             # this host's L2 per core, as the gemm crate reads it: its packing slab on every rank\n",
        d.name,
        d.memory_gib,
        d.peak_tflops,
        d.memory_bandwidth_gbps,
        m.exp_gops,
        m.cores,
        d.l2_cache_kib.unwrap_or(0.0)
    );
    for (t, l) in [("intra_node", &c.intra_node), ("inter_node", &c.inter_node)] {
        if m.ranks > 1 {
            let _ = writeln!(
                s,
                "[{t}]\nbandwidth_gbps = {:.3}  # the all-reduce's bus bandwidth between the ranks' threads\nlatency_us = {:.2}\n",
                l.bandwidth_gbps, l.latency_us
            );
        } else {
            let _ = writeln!(
                s,
                "[{t}]  # the input spec's: one rank measures no all-reduce\nbandwidth_gbps = {}\nlatency_us = {}\n",
                l.bandwidth_gbps, l.latency_us
            );
        }
    }
    let _ = writeln!(s, "{}", c.overhead.toml_table());
    let _ = writeln!(
        s,
        "[calibration]\n# Measured: each size's GEMM rate over the best one.\nmatmul_efficiency = [{}]\nmemory_efficiency = {}\nflash_attention_efficiency = {}  # the input spec's\nintra_node_efficiency = {}\ninter_node_efficiency = {}",
        curve.join(", "),
        k.memory_efficiency,
        k.flash_attention_efficiency,
        k.intra_node_efficiency,
        k.inter_node_efficiency
    );
    s
}
