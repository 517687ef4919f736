//! `tessera calibrate --gpu` and `--from-json`: a GPU's `[calibration]` table from kernel
//! measurements taken through PyTorch (`scripts/calibrate_gpu.py`, embedded in the binary and
//! run with `TESSERA_PYTHON` or `python3`), or from such a measurement taken elsewhere.
//!
//! Every figure is a measured time turned into a fraction of the cluster spec's own peaks
//! (`peak_tflops`, `memory_bandwidth_gbps`), the fractions the cost model multiplies them by:
//! - `matmul_efficiency`: for each smallest dimension measured, the median over the GEMMs with
//!   that smallest dimension of 2·m·k·n / seconds / peak (the median keeps one launch-bound
//!   square from setting the point that a transformer layer's GEMMs of that width reach);
//! - `flash_attention_efficiency`: the median over the causal SDPA configurations of their
//!   forward+backward FLOPs, 3.5 × 2·b·h·T²·d (the backward 2.5× the forward: Dao 2023,
//!   FlashAttention-2; as planner/src/cost/ops.rs counts them), over seconds and peak;
//! - `memory_efficiency`: the median over the element-wise kernels of bytes / seconds / bandwidth;
//! - `host_op_us`: the wall time of the tiny eager ops over their count, µs per op forward and
//!   backward (the host's floor per op);
//! - `host_launch_us` and `host_dispatch_us`, where the script split the forward op: the median
//!   host time of one `cudaLaunchKernel`, and the forward's time per op less that launch;
//! - the loss kernels: written as comments (no `[calibration]` key reads them yet).
//!
//! A measurement that does not fit the spec is refused before anything is computed from it
//! ([`check_fits`]: another GPU, another dtype; `measured` refuses a kernel in another kind's
//! list), and the script is stopped at `--timeout`.

pub mod measured;

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use tessera_planner::precision::Policy;
use tessera_planner::Cluster;

pub use measured::Measurement;

/// The measuring script, as the binary carries it.
const SCRIPT: &str = include_str!("../../../scripts/calibrate_gpu.py");

/// The script's exit status when it finds no GPU (no PyTorch, or no CUDA device); also the
/// exit status of `tessera calibrate --gpu` then.
pub const NO_GPU: i32 = 3;

/// What running the script gave.
pub enum Outcome {
    Measured(Box<Measurement>),
    /// No GPU: what was looked for and why it was not found.
    NoGpu(String),
}

/// How long `--gpu` waits for the measuring script by default, seconds: on an H100 the script
/// takes a few minutes at most (importing PyTorch, the GEMM and attention shapes, and
/// `torch.compile` of the loss); fifteen minutes leaves room for a slow or shared GPU.
pub const DEFAULT_TIMEOUT_S: f64 = 900.0;

/// Runs the measuring script with `TESSERA_PYTHON` (or `python3`); its progress goes to
/// standard error as it runs. A script still running after `timeout` is stopped (its whole
/// process group: Python and whatever it started) and the error says how long it was given.
pub fn measure(timeout: Duration) -> Result<Outcome> {
    let python = std::env::var("TESSERA_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut script = tempfile::Builder::new()
        .prefix("tessera-calibrate-gpu")
        .suffix(".py")
        .tempfile()?;
    script.write_all(SCRIPT.as_bytes())?;
    script.flush()?;
    let looked_for = format!(
        "looked for a CUDA device through PyTorch (torch.cuda.is_available()) with `{python}`"
    );
    let mut command = Command::new(&python);
    command
        .arg(script.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Its own process group, so that a timeout stops what the script started too.
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            return Ok(Outcome::NoGpu(format!(
                "no GPU to measure: {looked_for}, which could not be started ({e})\n  fix: set TESSERA_PYTHON to a Python with PyTorch on a machine with a CUDA GPU, or measure there and convert with --from-json"
            )))
        }
    };
    let mut stdout = child.stdout.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        stdout.read_to_end(&mut v).map(|_| v)
    });
    // The script's progress, passed on as it comes; its no-GPU line is kept for the message.
    let stderr = child.stderr.take().expect("piped");
    let err_reader = std::thread::spawn(move || -> std::io::Result<String> {
        let mut last = String::new();
        for line in BufReader::new(stderr).lines() {
            let line = line?;
            match line.strip_prefix("no GPU to measure: ") {
                Some(why) => last = why.to_string(),
                None => eprintln!("{line}"),
            }
        }
        Ok(last)
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() >= timeout {
            stop_group(&mut child);
            // The readers are left to end with the pipes: a process that left the group could
            // hold them open.
            bail!(
                "the measuring script (`{python}` running scripts/calibrate_gpu.py) did not finish within {} (--timeout {}); it was stopped, and nothing was written\n  fix: run scripts/calibrate_gpu.py by hand to see where it stops (a busy or hung GPU, a Python waiting on input), or pass --timeout with more seconds if it was still measuring",
                seconds(timeout.as_secs_f64()),
                timeout.as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let last = err_reader
        .join()
        .map_err(|_| anyhow!("reading the measuring script's messages failed"))??;
    let stdout = out_reader
        .join()
        .map_err(|_| anyhow!("reading the measuring script's output failed"))??;
    match status.code() {
        Some(0) => {
            let text = String::from_utf8(stdout)
                .map_err(|_| anyhow!("the measuring script printed bytes that are not UTF-8"))?;
            Ok(Outcome::Measured(Box::new(measured::parse(
                &text,
                "the measuring script's output",
            )?)))
        }
        Some(NO_GPU) => Ok(Outcome::NoGpu(format!(
            "no GPU to measure: {looked_for}: {}\n  fix: run on a machine with a CUDA GPU and PyTorch (set TESSERA_PYTHON to its Python), or measure there with scripts/calibrate_gpu.py and convert with --from-json",
            if last.is_empty() { "the script found none" } else { &last }
        ))),
        code => bail!(
            "the measuring script (`{python}` running scripts/calibrate_gpu.py) failed with {}; its messages are above\n  fix: run scripts/calibrate_gpu.py by hand to see the failure",
            code.map_or("a signal".to_string(), |c| format!("exit status {c}"))
        ),
    }
}

/// `s` seconds in words: "1 s", "2.5 s", "15 min".
fn seconds(s: f64) -> String {
    if s >= 60.0 && s % 60.0 == 0.0 {
        format!("{} min", s / 60.0)
    } else {
        format!("{s} s")
    }
}

/// Kills `child`'s process group (the child where groups do not exist) and reaps it.
fn stop_group(child: &mut std::process::Child) {
    #[cfg(unix)]
    // SAFETY: a signal to the process group the child leads (spawned with `process_group(0)`,
    // so its group id is its pid); the child is not yet reaped, so the id is still its own.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The median of non-empty `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A fraction rounded to three decimals, refused outside (0, 1] naming what, the measurement's
/// `fields` it comes from, and `origin`.
fn fraction(origin: &str, fields: &str, what: &str, x: f64, over: &str) -> Result<f64> {
    let r = (x * 1000.0).round() / 1000.0;
    if r.is_nan() || r > 1.0 {
        bail!("{origin}: field {fields}: {what} reach {x:.3} of the spec's {over}, above 1\n  fix: check the cluster spec's {over} (the measured device is faster than it says) and that the times are seconds per call");
    }
    if r <= 0.0 {
        bail!("{origin}: field {fields}: {what} reach {x:.5} of the spec's {over}, which rounds to 0\n  fix: measure shapes large enough to time (scripts/calibrate_gpu.py's own)");
    }
    Ok(r)
}

/// `list[i]` for each of `idx`, as a message names them: "`gemm[8]`, `gemm[9]`".
fn paths(list: &str, idx: impl IntoIterator<Item = usize>) -> String {
    idx.into_iter()
        .map(|i| format!("`{list}[{i}]`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The GPU model a device name names: its first token with a digit that is neither a memory
/// size (`80GB`) nor a form factor or memory type (`SXM5`, `HBM3`): `H100` in both "NVIDIA
/// H100 80GB HBM3" and "H100-SXM5-80GB", `4090` in "NVIDIA GeForce RTX 4090".
fn gpu_model(name: &str) -> Option<String> {
    name.to_uppercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .find(|t| {
            t.chars().any(|c| c.is_ascii_digit())
                && !(t.ends_with("GB") || t.ends_with('G'))
                && !["SXM", "HBM", "PCIE", "NVL", "GDDR"]
                    .iter()
                    .any(|p| t.starts_with(p))
        })
        .map(str::to_string)
}

/// The form factor a device name states, where it states one: `SXM`, `PCIE` or `NVL`.
fn form_factor(name: &str) -> Option<&'static str> {
    let upper = name.to_uppercase();
    let tokens: Vec<&str> = upper.split(|c: char| !c.is_ascii_alphanumeric()).collect();
    ["SXM", "PCIE", "NVL"]
        .into_iter()
        .find(|f| tokens.iter().any(|t| t.starts_with(f)))
}

/// The dtype the spec's `peak_tflops` is for: the compute dtype of the device's precision
/// policy (`fp32` for a policy with 32-bit activations), bf16 otherwise (the GPU presets'
/// peaks are dense bf16, the plans' 16-bit compute).
pub fn spec_dtype(c: &Cluster) -> &'static str {
    match c.device.precision.as_deref().and_then(Policy::by_name) {
        Some(p) if p.activation_bytes == 4 => "fp32",
        _ => "bf16",
    }
}

/// Refuses a measurement that does not fit the spec it would calibrate: another GPU (its
/// model, its form factor where both names state one, or its memory more than 10% from the
/// spec's), or GEMMs (and attention, where an entry says) in another dtype than the one the
/// spec's `peak_tflops` is for.
pub fn check_fits(c: &Cluster, m: &Measurement, origin: &str, spec: &Path) -> Result<()> {
    let (theirs, ours) = (&m.device_name, &c.device.name);
    let fix = format!(
        "measure on the spec's GPU ({ours}), or calibrate a cluster spec for the {theirs}: a copy of {} with its [device] (`name`, `memory_gib`, `peak_tflops`, `memory_bandwidth_gbps`) the {theirs}'s",
        spec.display()
    );
    match (gpu_model(theirs), gpu_model(ours)) {
        (Some(a), Some(b)) if a == b => {}
        (a, b) => bail!(
            "{origin}: field `device.name` = \"{theirs}\": {}, and {} `[device].name` is \"{ours}\"{}: the efficiencies would be another GPU's time over this one's peaks\n  fix: {fix}",
            a.map_or("names no GPU model".to_string(), |a| format!("the model {a}")),
            spec.display(),
            b.map_or(" (no GPU model in it)".to_string(), |b| format!(", the model {b}"))
        ),
    }
    if let (Some(a), Some(b)) = (form_factor(theirs), form_factor(ours)) {
        if a != b {
            bail!(
                "{origin}: field `device.name` = \"{theirs}\": the {a} part, and {} `[device].name` is \"{ours}\", the {b} part (other clocks, power and memory)\n  fix: {fix}",
                spec.display()
            );
        }
    }
    if let Some(gib) = m.device_memory_gib {
        let want = c.device.memory_gib;
        if (gib / want - 1.0).abs() > 0.1 {
            bail!(
                "{origin}: field `device.memory_gib` = {gib}: the measured {theirs} has {gib:.1} GiB, and {} `device.memory_gib` is {want}: another model of the GPU\n  fix: {fix}",
                spec.display()
            );
        }
    }
    let want = spec_dtype(c);
    let why = match c.device.precision.as_deref() {
        Some(p) => format!("its `device.precision` is \"{p}\""),
        None => "the GPU presets' peaks are dense bf16, the plans' 16-bit compute".into(),
    };
    let wrong = m
        .gemm
        .iter()
        .enumerate()
        .find(|(_, g)| g.dtype != want)
        .map(|(i, g)| (format!("gemm[{i}].dtype"), g.dtype.as_str()))
        .or_else(|| {
            m.attention.iter().enumerate().find_map(|(i, a)| {
                a.dtype
                    .as_deref()
                    .filter(|d| *d != want)
                    .map(|d| (format!("attention[{i}].dtype"), d))
            })
        });
    if let Some((field, found)) = wrong {
        bail!(
            "{origin}: field `{field}` = \"{found}\": {} calibrates {want} kernels ({why}); {found} kernels reach another fraction of another peak\n  fix: measure {want} kernels (scripts/calibrate_gpu.py measures bf16), or drop the {found} entries",
            spec.display()
        );
    }
    Ok(())
}

/// The `matmul_efficiency` curve: `(smallest dimension, efficiency, shapes)` by dimension.
pub fn matmul_curve(c: &Cluster, m: &Measurement, origin: &str) -> Result<Vec<(f64, f64, usize)>> {
    let peak = c.device.peak_tflops * 1e12;
    let mut by_dim: Vec<(f64, Vec<f64>, Vec<usize>)> = Vec::new();
    for (i, g) in m.gemm.iter().enumerate() {
        let d = g.m.min(g.k).min(g.n);
        let e = 2.0 * g.m * g.k * g.n / g.seconds / peak;
        match by_dim.iter_mut().find(|(x, _, _)| *x == d) {
            Some((_, v, idx)) => {
                v.push(e);
                idx.push(i);
            }
            None => by_dim.push((d, vec![e], vec![i])),
        }
    }
    by_dim.sort_by(|a, b| a.0.total_cmp(&b.0));
    by_dim
        .into_iter()
        .map(|(d, v, idx)| {
            let n = v.len();
            let what = format!("the GEMMs of smallest dimension {d}");
            let at = paths("gemm", idx);
            Ok((
                d,
                fraction(origin, &at, &what, median(v), "peak_tflops")?,
                n,
            ))
        })
        .collect()
}

/// The smallest dimension from which an FP8 GEMM counts towards `gemm_efficiency_fp8`.
pub const FP8_FULL_WAVES: f64 = 4096.0;

/// `gemm_efficiency_fp8` from the measurement's FP8 GEMMs, with one line per GEMM; `None`
/// without FP8 GEMMs. Refused where the spec states no FP8 peak, or no GEMM is large enough.
pub fn fp8_efficiency(
    c: &Cluster,
    m: &Measurement,
    at: &str,
) -> Result<Option<(f64, Vec<String>)>> {
    if m.gemm_fp8.is_empty() {
        return Ok(None);
    }
    let Some(peak_tflops) = c.device.peak_tflops_fp8 else {
        bail!(
            "{at}: field `gemm_fp8`: FP8 GEMMs were measured, and the spec's [device] states no peak_tflops_fp8 to take them as a fraction of\n  fix: add the GPU's dense FP8 peak (`peak_tflops_fp8`, the datasheet's figure without sparsity) to [device], or drop `gemm_fp8`"
        );
    };
    let peak = peak_tflops * 1e12;
    let mut lines = Vec::new();
    let mut full = Vec::new();
    let mut idx = Vec::new();
    for (i, g) in m.gemm_fp8.iter().enumerate() {
        let flops = 2.0 * g.m * g.k * g.n / g.seconds;
        lines.push(format!(
            "{:.0} × {:.0} × {:.0}: {:.1} TFLOP/s, {:.3}",
            g.m,
            g.k,
            g.n,
            flops / 1e12,
            flops / peak
        ));
        if g.m.min(g.k).min(g.n) >= FP8_FULL_WAVES {
            full.push(flops / peak);
            idx.push(i);
        }
    }
    if full.is_empty() {
        bail!(
            "{at}: field `gemm_fp8`: no FP8 GEMM has every dimension {FP8_FULL_WAVES} or more, so none fills full waves of large tiles\n  fix: measure with this version's scripts/calibrate_gpu.py (squares up to 16384)"
        );
    }
    let e = fraction(
        at,
        &paths("gemm_fp8", idx),
        "the FP8 GEMMs",
        median(full),
        "peak_tflops_fp8",
    )?;
    Ok(Some((e, lines)))
}

/// The calibrated cluster as a spec file: the input's device, links and overheads, and a
/// `[calibration]` table of measured figures, each with what measured it.
/// `at` names the measurement in errors; `origin` says where it was taken, in the spec.
pub fn spec_text(c: &Cluster, m: &Measurement, at: &str, origin: &str) -> Result<String> {
    let peak = c.device.peak_tflops * 1e12;
    let curve = matmul_curve(c, m, at)?;
    let attn: Vec<f64> = m
        .attention
        .iter()
        .map(|a| 3.5 * 2.0 * a.b * a.heads * a.seq * a.seq * a.dhead / a.fwd_bwd_seconds / peak)
        .collect();
    let flash = fraction(
        at,
        &paths("attention", 0..m.attention.len()),
        "causal SDPA forward+backward",
        median(attn),
        "peak_tflops",
    )?;
    let bw = c.device.memory_bandwidth_gbps * 1e9;
    let ew: Vec<f64> = m
        .elementwise
        .iter()
        .map(|e| e.bytes / e.seconds / bw)
        .collect();
    let memory = fraction(
        at,
        &paths("elementwise", 0..m.elementwise.len()),
        "the element-wise kernels",
        median(ew),
        "memory_bandwidth_gbps",
    )?;
    let host_op_us = m.host_seconds / m.host_ops * 1e6;

    let mut s = String::new();
    let name = format!("{}-calibrated", c.name);
    let _ = writeln!(
        s,
        "# {name} by `tessera calibrate --gpu`: kernels measured through PyTorch\n\
         # (scripts/calibrate_gpu.py) on {}, {origin}.\n\
         # Every efficiency is a measured time over this spec's peaks: isolated kernels, not training steps.",
        m.device
    );
    let _ = writeln!(
        s,
        "name = \"{name}\"\nnodes = {}\ngpus_per_node = {}\n",
        c.nodes, c.gpus_per_node
    );
    let d = &c.device;
    let _ = writeln!(
        s,
        "[device]  # the input spec's\nname = \"{}\"\nkind = \"gpu\"\nmemory_gib = {}\npeak_tflops = {}\nmemory_bandwidth_gbps = {}",
        d.name, d.memory_gib, d.peak_tflops, d.memory_bandwidth_gbps
    );
    if let Some(x) = d.peak_tflops_fp8 {
        let _ = writeln!(s, "peak_tflops_fp8 = {x}");
    }
    if d.sms > 0 {
        let _ = writeln!(s, "sms = {}", d.sms);
    }
    if d.kernel_launch_us > 0.0 {
        let _ = writeln!(s, "kernel_launch_us = {}", d.kernel_launch_us);
    }
    if let Some(x) = d.transcendental_gops {
        let _ = writeln!(s, "transcendental_gops = {x}");
    }
    if let Some(p) = &d.precision {
        let _ = writeln!(s, "precision = \"{p}\"");
    }
    for (t, l) in [("intra_node", &c.intra_node), ("inter_node", &c.inter_node)] {
        let _ = writeln!(
            s,
            "\n[{t}]  # the input spec's\nbandwidth_gbps = {}\nlatency_us = {}",
            l.bandwidth_gbps, l.latency_us
        );
    }
    let _ = writeln!(s, "\n{}", c.overhead.toml_table());
    let _ = writeln!(
        s,
        "[calibration]\n# {} GEMMs (cuBLAS through `a @ b`), by smallest dimension: the median over the shapes\n\
         # with that smallest dimension of 2·m·k·n / seconds / peak_tflops. No gemm_efficiency: the\n\
         # measured curve replaces the tile and wave model's one constant.",
        spec_dtype(c)
    );
    for (dim, e, n) in &curve {
        let _ = writeln!(s, "#   {dim:.0}: {e:.3} (median of {n} shape(s))");
    }
    let pts: Vec<String> = curve
        .iter()
        .map(|(d, e, _)| format!("[{d:.0}, {e:.3}]"))
        .collect();
    let _ = writeln!(s, "matmul_efficiency = [{}]", pts.join(", "));
    if let Some((e, lines)) = fp8_efficiency(c, m, at)? {
        let _ = writeln!(
            s,
            "# FP8 GEMMs (torch._scaled_mm: e4m3, tensorwise scales, bf16 out), 2·m·k·n / seconds / peak_tflops_fp8;\n\
             # gemm_efficiency_fp8 is the median over those of smallest dimension {FP8_FULL_WAVES} or more (full waves\n\
             # of large tiles, the constant the tile and wave model multiplies):"
        );
        for l in lines {
            let _ = writeln!(s, "#   {l}");
        }
        let _ = writeln!(s, "gemm_efficiency_fp8 = {e:.3}");
    }
    let _ = writeln!(
        s,
        "# Element-wise kernels ({}): the median of bytes read and written / seconds / memory_bandwidth_gbps.\nmemory_efficiency = {memory:.3}",
        m.elementwise
            .iter()
            .map(|e| format!("{} {:.0} GB/s", e.op, e.bytes / e.seconds / 1e9))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        s,
        "# Causal SDPA forward+backward ({}): the median of 3.5 × 2·b·h·T²·d FLOPs / seconds / peak_tflops.\nflash_attention_efficiency = {flash:.3}",
        m.attention
            .iter()
            .map(|a| format!("T {:.0} d {:.0}", a.seq, a.dhead))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        s,
        "# The host's cost per eager op, forward and backward: {:.0} ops ({}) in {:.4} s.\nhost_op_us = {host_op_us:.2}",
        m.host_ops, m.host_what, m.host_seconds
    );
    if let Some(h) = m.host_split {
        let launch = h.launch_seconds * 1e6;
        let dispatch = h.forward_seconds / m.host_ops * 1e6 - launch;
        if dispatch <= 0.0 {
            bail!(
                "{at}: field `host_op.forward_seconds`: {:.2} µs per forward op is no more than its one launch, {launch:.2} µs: the two were not measured alike\n  fix: measure again with scripts/calibrate_gpu.py on an idle host",
                h.forward_seconds / m.host_ops * 1e6
            );
        }
        let _ = writeln!(
            s,
            "# The forward op split (planner/src/cost/host.rs): one cudaLaunchKernel took {launch:.2} µs of host time\n\
             # (median, profiled), the rest of the forward's {:.2} µs per op is its dispatch.\n\
             host_dispatch_us = {dispatch:.2}\nhost_launch_us = {launch:.2}",
            h.forward_seconds / m.host_ops * 1e6
        );
    }
    let k = &c.calibration;
    let _ = writeln!(
        s,
        "intra_node_efficiency = {}  # the input spec's (collectives are not measured here)\ninter_node_efficiency = {}  # the input spec's",
        k.intra_node_efficiency, k.inter_node_efficiency
    );
    let _ = writeln!(
        s,
        "# The loss, forward+backward (no key reads it yet; the cost model's loss is in planner/src/cost/ops.rs):"
    );
    for l in &m.loss {
        let _ = writeln!(
            s,
            "#   {} on {} {:.0} × {:.0} logits: {:.3} ms",
            l.variant,
            l.dtype,
            l.n,
            l.vocab,
            l.seconds * 1e3
        );
    }
    Ok(s)
}

/// Reads a measurement file for `--from-json`.
pub fn read(path: &Path) -> Result<Measurement> {
    measured::read(path)
}
