//! The cluster spec in TOML: raw structs close to the file, then one resolved [`Cluster`].
//!
//! The keys are a contract documented in specs/README.md; add keys, never rename them.
//! The optional `[calibration]` table holds the cost model's constants (how close kernels and
//! collectives get to the peaks); every other part of the cost model is derived from the spec.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::fields::{toml_error, Field, Fields, Num};
use crate::error::Diagnostic;
use crate::source::Source;

/// What a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Gpu,
    /// A virtual device on the host CPU (threads as ranks).
    Cpu,
}

/// One accelerator (or virtual CPU device).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub kind: DeviceKind,
    pub memory_gib: f64,
    /// Dense peak in the training dtype, TFLOP/s.
    pub peak_tflops: f64,
    /// Dense FP8 tensor-core peak, TFLOP/s (`training.fp8`'s GEMMs); absent on devices
    /// without FP8 tensor cores (before Ada and Hopper), which refuse an FP8 plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_tflops_fp8: Option<f64>,
    /// GB/s.
    pub memory_bandwidth_gbps: f64,
    /// Streaming multiprocessors (108 on the A100, 132 on the H100 SXM): the GEMM model's wave
    /// quantisation. 0 (absent) models none.
    #[serde(default)]
    pub sms: u64,
    /// Microseconds each kernel launch adds. Absent: 0.
    #[serde(default)]
    pub kernel_launch_us: f64,
    /// Billions of element-wise evaluations per second of a kernel with one exponential per
    /// element (GELU, SiLU, softmax, the loss). Where given, those kernels take the longer of
    /// their bytes and their exponentials: the CPU backend's are bound by `expf`
    /// (`tessera calibrate` measures it). Absent (GPUs, whose special-function units keep these
    /// kernels memory-bound): bytes only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transcendental_gops: Option<f64>,
    /// CPU backend: the cores a node's ranks (threads) share. Fewer than the node's ranks: they
    /// time-share them, and the cost model's rates are what each rank reaches while all run
    /// (`tessera calibrate` measures them so). Absent: every device is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_cores: Option<u64>,
    /// The one precision policy the device's backend runs (the CPU backend: `fp32`); it
    /// replaces the model spec's `training.precision` in plans for this cluster. Absent: the
    /// model spec's policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// CPU backend: the L2 cache per core, KiB. The `gemm` crate sizes the packing slab it keeps
    /// on every thread that multiplies (a rank's) by it (gemm-common 0.19, `L2_SLAB`), so a
    /// rank's memory depends on it. Absent: not counted (`tessera calibrate` writes this
    /// host's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l2_cache_kib: Option<f64>,
}

/// A link class: GB/s per device in one direction, and latency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub bandwidth_gbps: f64,
    pub latency_us: f64,
}

/// Memory the framework takes on every device besides the model's tensors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Overhead {
    /// Fixed: runtime context, library workspaces, communication buffers (GiB).
    pub context_gib: f64,
    /// Allocator slack, as a fraction added on top of all tensors.
    pub fragmentation: f64,
    /// The CUDA context of each process (MiB). Absent: 0 (then `context_gib` holds it).
    #[serde(default)]
    pub cuda_context_mib: f64,
    /// cuBLAS and cuBLASLt workspaces (MiB).
    #[serde(default)]
    pub cublas_workspace_mib: f64,
    /// NCCL's buffers for each communicator a rank belongs to (MiB): TP, DP (two under hybrid
    /// sharding), PP and the tied embedding's first–last group, each when it has 2+ ranks.
    #[serde(default)]
    pub nccl_mib_per_communicator: f64,
}

impl Overhead {
    /// The `[overhead]` table of a cluster spec as a calibration writes it: these values, kept
    /// from the input spec (`tessera calibrate`, on the CPU and with `--gpu`).
    pub fn toml_table(&self) -> String {
        format!(
            "[overhead]  # the input spec's\ncontext_gib = {}\nfragmentation = {}\ncuda_context_mib = {}\ncublas_workspace_mib = {}\nnccl_mib_per_communicator = {}\n",
            self.context_gib,
            self.fragmentation,
            self.cuda_context_mib,
            self.cublas_workspace_mib,
            self.nccl_mib_per_communicator
        )
    }
}

/// A cluster, resolved. `devices` is how many of its devices the plan uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    pub nodes: u64,
    pub gpus_per_node: u64,
    /// Devices the plan uses: nodes × gpus_per_node, or fewer with `--devices`.
    pub devices: u64,
    pub device: Device,
    pub intra_node: Link,
    pub inter_node: Link,
    pub overhead: Overhead,
    /// Cost-model constants; the defaults when the spec has no `[calibration]` table.
    #[serde(default)]
    pub calibration: Calibration,
    /// Whether the spec has a `[calibration]` table; false means every constant above is the
    /// default (a plan then carries the `uncalibrated_cluster` caveat).
    #[serde(default)]
    pub calibrated: bool,
    /// Each node's host tier (`[host]`): where offload puts what leaves the device. Absent:
    /// not stated (all zero), and no layout offloads.
    #[serde(default)]
    pub host: super::host::Host,
    /// `[cost]`: the price of a GPU-hour; absent: no cost is printed (no preset states one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<super::whole_run::Cost>,
    /// `[reliability]`: interruptions and restarts; absent: none are predicted, and
    /// `run --save-every auto` is refused. Plans written before it existed read as absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reliability: Option<super::whole_run::Reliability>,
    /// `[storage]`: the checkpoint filesystem's write bandwidth; absent: no save time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<super::whole_run::Storage>,
}

/// How close real kernels and collectives get to the device's and links' peaks: the cost
/// model's constants. They live here, in the cluster spec, and nowhere else.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// Fraction of `peak_tflops` a matrix multiply reaches, by its smallest dimension
    /// (min of M, N, K): `[dimension, fraction]` points, linear in log2(dimension) between
    /// points and flat beyond the first and last.
    pub matmul_efficiency: Vec<[f64; 2]>,
    /// Fraction of `memory_bandwidth_gbps` that memory-bound (element-wise) kernels reach.
    pub memory_efficiency: f64,
    /// Fraction of `peak_tflops` a full wave of large GEMM tiles reaches. When present, GEMMs
    /// are timed by the tile and wave model (`cost::gemm`) and `matmul_efficiency` is not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_efficiency: Option<f64>,
    /// Fraction of `peak_tflops_fp8` a full wave of large FP8 GEMM tiles reaches (a measured
    /// FP8 GEMM's). Absent: `gemm_efficiency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_efficiency_fp8: Option<f64>,
    /// Fraction of `peak_tflops` that fused (flash) attention reaches on the FLOPs it executes.
    pub flash_attention_efficiency: f64,
    /// The same for cuDNN's fused attention, where it is measured on this GPU and a framework
    /// runs it (a profile's `runs.attention_kernel = "cudnn"`: Transformer Engine's
    /// FusedAttention, which TE prefers on Hopper). Absent: `flash_attention_efficiency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cudnn_attention_efficiency: Option<f64>,
    /// NCCL bus bandwidth of a collective inside a node, as a fraction of the intra-node link.
    pub intra_node_efficiency: f64,
    /// NCCL bus bandwidth across nodes, as a fraction of the inter-node link (NIC line rate).
    pub inter_node_efficiency: f64,
    /// Microseconds the host spends per op an eager PyTorch framework dispatches (Python, the
    /// dispatcher, autograd's recording, the launch): the host floor of `host_cost = "dispatch"`
    /// profiles that carry bare-op equivalents and no counts (`cost::host`).
    /// `scripts/host_op_cost.py` measures it. Absent: `cost::host::DEFAULT_HOST_OP_US`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_op_us: Option<f64>,
    /// Microseconds the host spends per dispatcher call of an eager layer (Python, the
    /// dispatcher, autograd's recording; the launch not included), for profiles that count
    /// their layer's dispatches (`cost::host`). Absent: `cost::host::DEFAULT_HOST_OP_US`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_dispatch_us: Option<f64>,
    /// Microseconds the host spends per kernel launch (cudaLaunchKernel), for profiles that
    /// count their layer's launches. Absent: the device's `kernel_launch_us`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_launch_us: Option<f64>,
    /// CTAs (one per channel) an NCCL collective occupies while it overlaps compute: the SMs it
    /// takes from the kernels it overlaps (`cost::interference`). Absent:
    /// `cost::interference::DEFAULT_NCCL_CTAS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl_ctas: Option<f64>,
}

impl Default for Calibration {
    /// The A100 preset's values (specs/clusters/dgx-a100-80g.toml says where they come from).
    fn default() -> Self {
        Calibration {
            matmul_efficiency: DEFAULT_MATMUL_EFFICIENCY.to_vec(),
            memory_efficiency: 0.75,
            gemm_efficiency: None,
            gemm_efficiency_fp8: None,
            flash_attention_efficiency: 0.31,
            cudnn_attention_efficiency: None,
            intra_node_efficiency: 0.775,
            inter_node_efficiency: 0.86,
            host_op_us: None,
            host_dispatch_us: None,
            host_launch_us: None,
            nccl_ctas: None,
        }
    }
}

const DEFAULT_MATMUL_EFFICIENCY: [[f64; 2]; 8] = [
    [64.0, 0.18],
    [128.0, 0.56],
    [256.0, 0.58],
    [512.0, 0.60],
    [1024.0, 0.61],
    [2048.0, 0.67],
    [4096.0, 0.68],
    [8192.0, 0.70],
];

impl Calibration {
    /// The matmul efficiency curve at smallest dimension `dim`.
    pub fn matmul_efficiency_at(&self, dim: f64) -> f64 {
        let pts = &self.matmul_efficiency;
        let x = dim.max(1.0).log2();
        let first = pts[0];
        if x <= first[0].log2() {
            return first[1];
        }
        for w in pts.windows(2) {
            let (x0, x1) = (w[0][0].log2(), w[1][0].log2());
            if x <= x1 {
                return w[0][1] + (w[1][1] - w[0][1]) * (x - x0) / (x1 - x0);
            }
        }
        pts[pts.len() - 1][1]
    }
}

impl Cluster {
    pub fn memory_bytes(&self) -> f64 {
        self.device.memory_gib * GIB
    }
}

pub use crate::units::GIB;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    name: Field<String>,
    nodes: Field<i64>,
    gpus_per_node: Field<i64>,
    device: Option<RawDevice>,
    intra_node: Option<RawLink>,
    inter_node: Option<RawLink>,
    overhead: Option<RawOverhead>,
    calibration: Option<RawCalibration>,
    host: Option<super::host::RawHost>,
    cost: Option<super::whole_run::RawCost>,
    reliability: Option<super::whole_run::RawReliability>,
    storage: Option<super::whole_run::RawStorage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Field<String>,
    kind: Field<String>,
    memory_gib: Field<Num>,
    peak_tflops: Field<Num>,
    peak_tflops_fp8: Field<Num>,
    memory_bandwidth_gbps: Field<Num>,
    sms: Field<i64>,
    kernel_launch_us: Field<Num>,
    transcendental_gops: Field<Num>,
    shared_cores: Field<i64>,
    precision: Field<String>,
    l2_cache_kib: Field<Num>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    bandwidth_gbps: Field<Num>,
    latency_us: Field<Num>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOverhead {
    context_gib: Field<Num>,
    fragmentation: Field<Num>,
    cuda_context_mib: Field<Num>,
    cublas_workspace_mib: Field<Num>,
    nccl_mib_per_communicator: Field<Num>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCalibration {
    matmul_efficiency: Field<Vec<(Num, Num)>>,
    gemm_efficiency: Field<Num>,
    gemm_efficiency_fp8: Field<Num>,
    memory_efficiency: Field<Num>,
    flash_attention_efficiency: Field<Num>,
    cudnn_attention_efficiency: Field<Num>,
    intra_node_efficiency: Field<Num>,
    inter_node_efficiency: Field<Num>,
    host_op_us: Field<Num>,
    host_dispatch_us: Field<Num>,
    host_launch_us: Field<Num>,
    nccl_ctas: Field<Num>,
}

pub const CLUSTER_KEYS: &[&str] = &[
    "name",
    "nodes",
    "gpus_per_node",
    "device",
    "intra_node",
    "inter_node",
    "overhead",
    "kind",
    "memory_gib",
    "peak_tflops",
    "peak_tflops_fp8",
    "memory_bandwidth_gbps",
    "sms",
    "kernel_launch_us",
    "transcendental_gops",
    "shared_cores",
    "precision",
    "l2_cache_kib",
    "bandwidth_gbps",
    "latency_us",
    "context_gib",
    "fragmentation",
    "cuda_context_mib",
    "cublas_workspace_mib",
    "nccl_mib_per_communicator",
    "calibration",
    "matmul_efficiency",
    "gemm_efficiency",
    "gemm_efficiency_fp8",
    "memory_efficiency",
    "flash_attention_efficiency",
    "cudnn_attention_efficiency",
    "intra_node_efficiency",
    "inter_node_efficiency",
    "host_op_us",
    "host_dispatch_us",
    "host_launch_us",
    "nccl_ctas",
    "host",
    "link_gbps",
    "nvme_gbps",
    "nvme_gib",
    "adamw_gparams_per_s",
    "cost",
    "usd_per_gpu_hour",
    "reliability",
    "gpu_mtbf_hours",
    "restart_minutes",
    "preemptions_per_hour",
    "storage",
    "write_gbps",
];

/// Command-line choices of how much of the cluster to use.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClusterOverrides {
    /// `--nodes N`: replaces the spec's `nodes`.
    pub nodes: Option<u64>,
    /// `--devices N`: the first N devices (may be fewer than one node).
    pub devices: Option<u64>,
}

/// Parses and resolves a TOML cluster spec.
pub fn parse_cluster_toml(src: &Source, over: ClusterOverrides) -> Result<Cluster, Diagnostic> {
    let raw: RawCluster =
        toml::from_str(&src.text).map_err(|e| toml_error(src, &e, CLUSTER_KEYS))?;
    let f = Fields { src };
    let name = f.string("", "name", &raw.name, "\"my-cluster\"")?;
    let mut nodes = f.pos_int("", "nodes", &raw.nodes, "1")?;
    let gpus_per_node = f.pos_int("", "gpus_per_node", &raw.gpus_per_node, "8")?;
    let table = |t: &str| {
        Diagnostic::new(
            &src.path,
            t,
            format!("the [{t}] table is missing"),
            format!("add a [{t}] table (see specs/README.md and specs/clusters/dgx-a100-80g.toml)"),
        )
        .at(Some((1, 1)))
    };
    let d = raw.device.ok_or_else(|| table("device"))?;
    let device = Device {
        name: f.string("device", "name", &d.name, "\"A100-SXM4-80GB\"")?,
        kind: f.choice(
            "device",
            "kind",
            &d.kind,
            &[("gpu", DeviceKind::Gpu), ("cpu", DeviceKind::Cpu)],
            Some(DeviceKind::Gpu),
        )?,
        memory_gib: f.pos_num("device", "memory_gib", &d.memory_gib, "80")?,
        peak_tflops: f.pos_num("device", "peak_tflops", &d.peak_tflops, "312")?,
        peak_tflops_fp8: f.opt_pos_num("device", "peak_tflops_fp8", &d.peak_tflops_fp8)?,
        memory_bandwidth_gbps: f.pos_num(
            "device",
            "memory_bandwidth_gbps",
            &d.memory_bandwidth_gbps,
            "2039",
        )?,
        sms: f.opt_pos_int("device", "sms", &d.sms)?.unwrap_or(0),
        kernel_launch_us: f
            .opt_nonneg_num("device", "kernel_launch_us", &d.kernel_launch_us)?
            .unwrap_or(0.0),
        transcendental_gops: f.opt_pos_num(
            "device",
            "transcendental_gops",
            &d.transcendental_gops,
        )?,
        shared_cores: f.opt_pos_int("device", "shared_cores", &d.shared_cores)?,
        l2_cache_kib: f.opt_pos_num("device", "l2_cache_kib", &d.l2_cache_kib)?,
        precision: match &d.precision {
            None => None,
            Some(_) => {
                let names = crate::precision::Policy::names();
                let options: Vec<(&str, &str)> = names.iter().map(|n| (*n, *n)).collect();
                Some(
                    f.choice("device", "precision", &d.precision, &options, None)?
                        .to_string(),
                )
            }
        },
    };
    let link = |t: &str, l: Option<RawLink>| -> Result<Link, Diagnostic> {
        let l = l.ok_or_else(|| table(t))?;
        Ok(Link {
            bandwidth_gbps: f.pos_num(t, "bandwidth_gbps", &l.bandwidth_gbps, "300")?,
            latency_us: f
                .opt_nonneg_num(t, "latency_us", &l.latency_us)?
                .unwrap_or(0.0),
        })
    };
    let intra_node = link("intra_node", raw.intra_node)?;
    let inter_node = link("inter_node", raw.inter_node)?;
    let o = raw.overhead.unwrap_or_default();
    // Every [overhead] key is optional, ≥ 0, and 0 when absent.
    let zero_or = |key: &str, v: &Field<Num>| -> Result<f64, Diagnostic> {
        Ok(f.opt_nonneg_num("overhead", key, v)?.unwrap_or(0.0))
    };
    let overhead = Overhead {
        context_gib: zero_or("context_gib", &o.context_gib)?,
        fragmentation: zero_or("fragmentation", &o.fragmentation)?,
        cuda_context_mib: zero_or("cuda_context_mib", &o.cuda_context_mib)?,
        cublas_workspace_mib: zero_or("cublas_workspace_mib", &o.cublas_workspace_mib)?,
        nccl_mib_per_communicator: zero_or(
            "nccl_mib_per_communicator",
            &o.nccl_mib_per_communicator,
        )?,
    };
    let calibrated = raw.calibration.is_some();
    let calibration = calibration(&f, raw.calibration.unwrap_or_default())?;
    let host = super::host::host(&f, raw.host)?;
    let cost = super::whole_run::cost(&f, raw.cost)?;
    let reliability = super::whole_run::reliability(&f, raw.reliability)?;
    let storage = super::whole_run::storage(&f, raw.storage)?;
    let cli = std::path::Path::new("<command line>");
    if let Some(n) = over.nodes {
        if n == 0 {
            return Err(Diagnostic::new(
                cli,
                "--nodes",
                "must be at least 1, found 0",
                "pass --nodes 1 or more",
            ));
        }
        nodes = n;
    }
    let Some(mut devices) = nodes.checked_mul(gpus_per_node) else {
        let (file, field) = if over.nodes.is_some() {
            (cli, "--nodes")
        } else {
            (src.path.as_path(), "nodes")
        };
        let at = over
            .nodes
            .is_none()
            .then(|| src.toml_key("nodes"))
            .flatten();
        return Err(Diagnostic::new(
            file,
            field,
            format!("{nodes} nodes × {gpus_per_node} GPUs per node is more devices than a 64-bit count holds"),
            format!("use at most {} nodes", u64::MAX / gpus_per_node),
        )
        .at(at));
    };
    if let Some(n) = over.devices {
        if n == 0 || n > devices {
            return Err(Diagnostic::new(
                cli,
                "--devices",
                format!("must be between 1 and the cluster's {devices} devices, found {n}"),
                format!("pass --devices between 1 and {devices}, or raise --nodes"),
            ));
        }
        devices = n;
        nodes = n.div_ceil(gpus_per_node);
    }
    let cluster = Cluster {
        name,
        nodes,
        gpus_per_node,
        devices,
        device,
        intra_node,
        inter_node,
        overhead,
        calibration,
        calibrated,
        host,
        cost,
        reliability,
        storage,
    };
    cluster.check().map_err(|p| p.in_toml(src))?;
    Ok(cluster)
}

/// Resolves `[calibration]`: each key optional (the default replaces it). The ranges
/// (fractions in (0, 1], an increasing curve) are `Cluster::check`'s, run on the result.
fn calibration(f: &Fields, c: RawCalibration) -> Result<Calibration, Diagnostic> {
    const T: &str = "calibration";
    let mut out = Calibration::default();
    for (field, v, slot) in [
        (
            "memory_efficiency",
            &c.memory_efficiency,
            &mut out.memory_efficiency,
        ),
        (
            "flash_attention_efficiency",
            &c.flash_attention_efficiency,
            &mut out.flash_attention_efficiency,
        ),
        (
            "intra_node_efficiency",
            &c.intra_node_efficiency,
            &mut out.intra_node_efficiency,
        ),
        (
            "inter_node_efficiency",
            &c.inter_node_efficiency,
            &mut out.inter_node_efficiency,
        ),
    ] {
        if let Some(x) = f.opt_nonneg_num(T, field, v)? {
            *slot = x;
        }
    }
    out.gemm_efficiency = f.opt_nonneg_num(T, "gemm_efficiency", &c.gemm_efficiency)?;
    out.gemm_efficiency_fp8 = f.opt_pos_num(T, "gemm_efficiency_fp8", &c.gemm_efficiency_fp8)?;
    out.cudnn_attention_efficiency = f.opt_pos_num(
        T,
        "cudnn_attention_efficiency",
        &c.cudnn_attention_efficiency,
    )?;
    out.host_op_us = f.opt_nonneg_num(T, "host_op_us", &c.host_op_us)?;
    out.host_dispatch_us = f.opt_nonneg_num(T, "host_dispatch_us", &c.host_dispatch_us)?;
    out.host_launch_us = f.opt_nonneg_num(T, "host_launch_us", &c.host_launch_us)?;
    out.nccl_ctas = f.opt_nonneg_num(T, "nccl_ctas", &c.nccl_ctas)?;
    if let Some(curve) = &c.matmul_efficiency {
        out.matmul_efficiency = curve
            .get_ref()
            .iter()
            .map(|(d, e)| [d.as_f64(), e.as_f64()])
            .collect();
    }
    Ok(out)
}
