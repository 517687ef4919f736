//! The profile's data: what a framework can run and how it runs it, as read from
//! specs/frameworks/*.toml (specs/frameworks/README.md documents every key).

use serde::{Deserialize, Serialize};

use crate::fp8::recipe::{Fp8Engine, Fp8Linear};
use crate::layout::{CpComm, Layout, Recompute};
use crate::model::{Family, Model};
use crate::schedule::ScheduleKind;
use crate::spec::{Cluster, DeviceKind};

/// One framework profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The name a spec's `training.framework` and `--framework` use.
    pub name: String,
    /// One line on what the profile is (which framework, which version or era).
    pub summary: String,
    /// Where the profile's values come from (papers, source files at a commit).
    pub sources: Vec<String>,
    /// The profile of the same framework under `torch.compile`, which `tessera plan --compile`
    /// and a groundtruth run's `parallel.compile = true` switch to ([`super::compiled`]); a
    /// compiled profile names itself. Absent: the framework has no compiled variant (it is not
    /// PyTorch-based, or its compiled runs are not profiled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compiled: Option<String>,
    /// The search space: what the framework can run.
    pub can_run: CanRun,
    /// How it runs it: the kernels' costs.
    pub runs: Runs,
    /// How it holds memory.
    pub memory: Memory,
}

/// What the framework can run. A layout outside it is rejected by the search under
/// [`super::CANNOT_RUN`], naming the knob.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CanRun {
    pub tensor_parallel: bool,
    pub sequence_parallel: bool,
    /// TP runs without sequence parallelism too. False: its TP always shards the norms by
    /// sequence (torchtitan's `apply_tp`), so TP > 1 needs SP. Absent: true.
    #[serde(default = "yes")]
    pub tp_without_sp: bool,
    pub pipeline: bool,
    /// The highest ZeRO stage its pipeline runs with (DeepSpeed's `PipelineEngine` asserts
    /// "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism": 1). Absent: 3.
    #[serde(default = "zero3")]
    pub pipeline_max_zero: u8,
    /// Pipeline schedules by plan.json name (`1f1b`, `interleaved`, `gpipe`).
    pub schedules: Vec<ScheduleKind>,
    pub context_parallel: bool,
    /// CP exchanges: `p2p` (ring), `allgather`.
    pub cp_comm: Vec<CpComm>,
    pub expert_parallel: bool,
    /// ZeRO stages (0: none; 3: FSDP FULL_SHARD).
    pub zero_stages: Vec<u8>,
    /// Sharding within a node, replicated across nodes (FSDP HYBRID_SHARD, HSDP).
    pub hybrid_sharding: bool,
    pub recompute: Vec<Recompute>,
    /// Recompute every k-th layer only (k > 1).
    pub partial_recompute: bool,
    /// The model families its model code builds (`gpt`, `llama`, `deepseek`, `other`; see
    /// [`Family`]). Absent from a file: every family.
    #[serde(default = "every_family")]
    pub architectures: Vec<Family>,
    /// It builds mixture-of-experts MLPs. Absent: true.
    #[serde(default = "yes")]
    pub moe: bool,
    /// It builds grouped-query attention (fewer K/V heads than query heads). Absent: true.
    #[serde(default = "yes")]
    pub gqa: bool,
    /// The device kinds it runs on (`gpu`, `cpu`). Absent: both.
    #[serde(default = "every_device")]
    pub devices: Vec<DeviceKind>,
    /// The offloads it runs (`none`, `optimizer`, `params`). Absent: none only.
    #[serde(default = "no_offload")]
    pub offload: Vec<crate::layout::OffloadStates>,
    /// Where it offloads to (`cpu`, `nvme`). Absent: host memory only.
    #[serde(default = "host_memory")]
    pub offload_to: Vec<crate::layout::OffloadTier>,
    /// It offloads saved activations to host memory. Absent: false.
    #[serde(default)]
    pub offload_activations: bool,
    /// It overlaps the tensor-parallel collectives with the GEMMs they feed or follow
    /// (`training.tp_comm_overlap`; `crate::cost::tp_overlap`). Absent: false.
    #[serde(default)]
    pub tp_comm_overlap: bool,
}

fn no_offload() -> Vec<crate::layout::OffloadStates> {
    vec![crate::layout::OffloadStates::None]
}

fn host_memory() -> Vec<crate::layout::OffloadTier> {
    vec![crate::layout::OffloadTier::Cpu]
}

fn every_family() -> Vec<Family> {
    Family::ALL.to_vec()
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn zero3() -> u8 {
    3
}

fn every_device() -> Vec<DeviceKind> {
    vec![DeviceKind::Gpu, DeviceKind::Cpu]
}

/// A model or cluster a profile cannot build or run on: the `[can_run]` key that says so, what
/// the job has instead, and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbuildable {
    /// `can_run.architectures`, `can_run.moe`, `can_run.gqa` or `can_run.devices`, with its value.
    pub key: String,
    /// What the job has that the key excludes.
    pub found: String,
    /// The change that would pass.
    pub fix: String,
}

/// How the loss is computed, in time and in the memory peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossKind {
    /// One kernel reads the 16-bit logits and writes their gradient in place (llm.c's
    /// `fused_classifier`, Megatron's `--cross-entropy-loss-fusion`).
    Fused,
    /// torch.compile's generated loss: one fused reduction each way over the 16-bit logits, no
    /// fp32 N × V buffer, but the backward writes the gradient into a new 16-bit N × V buffer
    /// while the saved logits are alive (Inductor does not write into a saved input).
    Compiled,
    /// Megatron's vocab-parallel cross-entropy on an fp32 copy of the logits: the softmax is
    /// computed in place in that copy and kept for the backward (one fp32 N × V/TP buffer).
    VocabParallelFp32,
    /// PyTorch's `cross_entropy(logits.float())`: the fp32 upcast, the log-softmax output and,
    /// at the start of the backward, its gradient are alive together (three fp32 N × V buffers).
    UnfusedFp32,
    /// The same loss in a training loop that frees the 16-bit logits before the backward
    /// (torchtitan's train.py: `del pred` before `loss.backward()`, "need to free pred before
    /// bwd to avoid peaking memory"): 2 B per logit less at the loss's peak; the same kernels.
    UnfusedFp32Freed,
}

/// The flash-class attention kernel a framework runs (`runs.attention_kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionKernel {
    /// FlashAttention-2 or a kernel of its speed (the cluster's `flash_attention_efficiency`).
    #[default]
    Flash,
    /// cuDNN's fused attention (the cluster's `cudnn_attention_efficiency` where it has one).
    Cudnn,
}

/// What the host pays per op it dispatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostCost {
    /// Eager PyTorch: Python, the dispatcher, autograd and the launch, per op (the cluster's
    /// `host_dispatch_us` per dispatch and `host_launch_us` per launch where the profile counts
    /// them, else `host_op_us` per bare-op equivalent).
    Dispatch,
    /// A compiled or C++ program: only the kernel launch per op (the cluster's launch latency).
    Launch,
    /// CUDA graphs: the whole step is one graph launch; no per-op host floor.
    Graph,
}

/// How the framework runs a layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Runs {
    /// The data-parallel gradient sync overlaps the backward.
    pub overlap_dp: bool,
    /// Under pipeline parallelism too: false where the framework's pipeline reduces the
    /// gradients only after the last micro-batch's backward (DeepSpeed's `TrainSchedule`
    /// ends with `ReduceGrads`). Absent: true.
    #[serde(default = "yes")]
    pub overlap_dp_pipeline: bool,
    pub loss: LossKind,
    /// Under TP the loss runs as DTensor's `loss_parallel` (torchtitan's, unless
    /// `parallelism.disable_loss_parallel`), whose backward holds one more fp32 buffer of the
    /// rank's vocabulary share beside an unfused loss's (`memory::logits`). Absent: false.
    #[serde(default)]
    pub loss_parallel: bool,
    /// Pads the vocabulary to the spec's `make_vocab_size_divisible_by` × TP (Megatron); false:
    /// the vocabulary is used as it is (unaligned GEMMs where it is not a multiple of 64).
    pub pad_vocab: bool,
    /// Flash attention is run where the spec asks for it; false: the framework materialises
    /// the softmax whatever the spec says.
    pub flash_attention: bool,
    /// The host's time for one transformer layer's forward and backward per micro-batch, in
    /// bare-op equivalents (measured by scripts/host_layer_cost.py; the file names the run):
    /// the floor of a profile that has no counts below.
    pub host_ops_forward: u32,
    pub host_ops_backward: u32,
    /// One layer's dispatcher calls and kernel launches per pass, counted from a profiler
    /// trace (scripts/host_layer_trace.py): where present they replace `host_ops_*` for
    /// `host_cost = "dispatch"`. Absent: 0, not counted.
    #[serde(default)]
    pub host_dispatches_forward: u32,
    #[serde(default)]
    pub host_dispatches_backward: u32,
    #[serde(default)]
    pub host_launches_forward: u32,
    #[serde(default)]
    pub host_launches_backward: u32,
    pub host_cost: HostCost,
    /// Stages send whole activations with blocking p2p (DeepSpeed's pipeline engine), instead of
    /// Megatron's scatter/gather (1/TP of them) overlapped with compute.
    pub blocking_p2p: bool,
    /// Overlapped collectives slow the GEMMs they overlap (NCCL's SMs and memory bandwidth).
    pub overlap_slows_compute: bool,
    /// Offload's host↔device copies run on their own stream beside the compute (DeepSpeed's
    /// `overlap_comm` and ZeRO-3 prefetch, FSDP's pre-forward copies on its unshard stream):
    /// per layer only the copy beyond the layer's compute shows (Calculon's rule). False: the
    /// whole copy shows. Absent: false.
    #[serde(default)]
    pub offload_overlap: bool,
    /// The framework's host AdamW rate relative to the cluster's `adamw_gparams_per_s` (a
    /// vectorized CPU Adam such as DeepSpeed's CPU-Adam): 1 for that, less for PyTorch's own
    /// CPU AdamW. Absent: 1.
    #[serde(default = "one")]
    pub host_adamw_speed: f64,
    /// The flash-class attention kernel it runs where the cluster measures more than one
    /// (`calibration.cudnn_attention_efficiency`): `cudnn` for Transformer Engine's
    /// FusedAttention, which TE (>= 1.2) prefers over FlashAttention on Hopper. Absent:
    /// FlashAttention-2 (`flash_attention_efficiency`).
    #[serde(default)]
    pub attention_kernel: AttentionKernel,
    /// What `recompute = "selective"` re-runs under flash attention (`runs.selective`).
    /// Absent: `core-attention`.
    #[serde(default)]
    pub selective: SelectiveKind,
    /// The library its FP8 linears run on (`training.fp8`): Transformer Engine's modules or
    /// torchao's `Float8Linear` (`crate::fp8::recipe::CastBytes` says what each casts). Absent:
    /// torchao.
    #[serde(default)]
    pub fp8_linear: Fp8Linear,
    /// Its Transformer Engine linears keep the FP8 weight (and its transpose) across a step's
    /// micro-batches: the framework passes TE's `is_first_microbatch` (Megatron-Core). Absent:
    /// false, the weight cast in every micro-batch's forward.
    #[serde(default)]
    pub fp8_weight_cache: bool,
}

impl Runs {
    /// How its FP8 linears run.
    pub fn fp8_engine(&self) -> Fp8Engine {
        Fp8Engine {
            linear: self.fp8_linear,
            weight_cache: self.fp8_weight_cache,
        }
    }
}

/// What a framework's selective recompute is, under flash attention (`runs.selective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SelectiveKind {
    /// The attention core alone (Korthikanti et al.'s selective; Megatron's
    /// `--recompute-granularity selective` with its default `recompute_modules = ["core_attn"]`;
    /// Tessera's runtime): under flash attention the core keeps nothing the output projection
    /// does not keep anyway, so the layer stores what it stores without recompute and the
    /// backward re-runs the attention kernel's forward.
    #[default]
    CoreAttention,
    /// torchtitan's per-op selective checkpointing (`selective_ac_option = "op"`): every second
    /// matmul's output and the attention kernel's are saved, element-wise results recomputed.
    OpSac,
}

/// The sharding policy of ZeRO-3-class data parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharding {
    /// ZeRO as the precision policy's states say (DeepSpeed, Megatron's distributed optimizer).
    Zero,
    /// FSDP2 (`fully_shard` with `MixedPrecisionPolicy`): fp32 sharded parameters, fp32
    /// gradients, Adam's two moments: 16 B/param sharded, bf16 copies only while gathered.
    Fsdp2,
    /// FSDP1 (`FullyShardedDataParallel` with mixed precision), as the policy's states say.
    Fsdp1,
}

/// Which number a framework reports as its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reports {
    /// `torch.cuda.max_memory_allocated()`: live tensors.
    Allocated,
    /// `torch.cuda.max_memory_reserved()`: what the caching allocator holds.
    Reserved,
}

/// How the framework holds memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub sharding: Sharding,
    /// FSDP's root module (embedding, final norm, output layer) stays unsharded through the
    /// backward (FSDP2's `reshard_after_forward` is false for the root).
    pub unsharded_root: bool,
    /// The number the framework's logs report.
    pub reports: Reports,
    /// How ZeRO-3 (outside FSDP2) gathers parameters: a whole block at a time (Megatron's and
    /// FSDP1's units), or each leaf module as DeepSpeed's stage 3 fetches it. Absent: `block`.
    #[serde(default)]
    pub zero3_fetch: Zero3Fetch,
    /// How the framework gets device memory: PyTorch's caching allocator (cached, split
    /// blocks: `allocator_reserved`), or every buffer allocated once up front (llm.c's
    /// `cudaMalloc`s, Tessera's runtime), which leaves no slack. Absent: `caching`.
    #[serde(default)]
    pub allocator: Allocator,
    /// The pipeline keeps each in-flight micro-batch's stage output until its backward, and
    /// one receive buffer each for activations and gradients (DeepSpeed's pipeline engine:
    /// `pipe_buffers['outputs']`, `pipe_recv_buf`, `grad_layer`). Absent: false.
    #[serde(default)]
    pub pipe_buffers: bool,
    /// The block's element-wise ops run fused, keeping only what fused kernels keep for the
    /// backward (Megatron's fused kernels, `torch.compile`'s generated ones); false: eager
    /// PyTorch, whose SwiGLU also keeps `silu(gate)`
    /// ([`crate::memory::activations::layer_tensors`]). Absent: true.
    #[serde(default = "yes")]
    pub fused_elementwise: bool,
}

/// ZeRO-3's gather unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Zero3Fetch {
    /// One transformer block's parameters, the current and the prefetched one.
    #[default]
    Block,
    /// DeepSpeed stage 3: each leaf module's parameters as its forward or backward needs them,
    /// within `stage3_max_live_parameters`, gradients through a `reduce_bucket_size` bucket.
    Submodule,
}

/// The framework's device allocator.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Allocator {
    /// PyTorch's `CUDACachingAllocator`.
    #[default]
    Caching,
    /// Buffers allocated once, before the first step.
    Static,
}

fn device_name(d: DeviceKind) -> &'static str {
    match d {
        DeviceKind::Gpu => "gpu",
        DeviceKind::Cpu => "cpu",
    }
}

fn quoted<T: Copy>(set: &[T], name: impl Fn(T) -> &'static str) -> String {
    let names: Vec<String> = set.iter().map(|x| format!("\"{}\"", name(*x))).collect();
    format!("[{}]", names.join(", "))
}

impl CanRun {
    /// The first `[can_run]` key that excludes the model or the cluster's devices (the job, not
    /// one layout of it): the device kind, the family, MoE, grouped-query attention. The
    /// fix names the built-in profiles that would pass.
    pub fn refuses_job(&self, model: &Model, cluster: &Cluster) -> Option<Unbuildable> {
        let a = &model.architecture;
        let kind = cluster.device.kind;
        let with = |passes: &dyn Fn(&CanRun) -> bool| {
            let names: Vec<&str> = super::all()
                .iter()
                .filter(|p| passes(&p.can_run))
                .map(|p| p.name.as_str())
                .collect();
            match names.is_empty() {
                true => "none of the built-in profiles does".to_string(),
                false => format!("--framework {}", names.join(" | ")),
            }
        };
        if !self.devices.contains(&kind) {
            let d = device_name(kind);
            return Some(Unbuildable {
                key: format!("can_run.devices = {}", quoted(&self.devices, device_name)),
                found: format!(
                    "the cluster {} is of {d} devices ({})",
                    cluster.name, cluster.device.name
                ),
                fix: format!(
                    "plan for a cluster of {} devices, or name a framework that runs on {d}: {}",
                    self.devices
                        .iter()
                        .map(|d| device_name(*d))
                        .collect::<Vec<_>>()
                        .join(" or "),
                    with(&|c| c.devices.contains(&kind))
                ),
            });
        }
        let family = a.family();
        if !self.architectures.contains(&family) {
            return Some(Unbuildable {
                key: format!(
                    "can_run.architectures = {}",
                    quoted(&self.architectures, Family::name)
                ),
                found: format!(
                    "{} is a {} model ({})",
                    model.name,
                    family.name(),
                    family.what()
                ),
                fix: format!(
                    "plan a {} model, or name a framework that builds {} models: {}",
                    self.architectures
                        .iter()
                        .map(|f| f.name())
                        .collect::<Vec<_>>()
                        .join(" or "),
                    family.name(),
                    with(&|c| c.architectures.contains(&family) && c.devices.contains(&kind))
                ),
            });
        }
        if let Some(moe) = a.moe.as_ref().filter(|_| !self.moe) {
            return Some(Unbuildable {
                key: "can_run.moe = false".into(),
                found: format!(
                    "{} is a mixture of experts ({} experts, {} per token)",
                    model.name, moe.experts, moe.experts_per_token
                ),
                fix: format!(
                    "plan a dense model, or name a framework that builds mixtures of experts: {}",
                    with(&|c| c.moe
                        && c.architectures.contains(&family)
                        && c.devices.contains(&kind))
                ),
            });
        }
        if a.grouped_query() && !self.gqa {
            return Some(Unbuildable {
                key: "can_run.gqa = false".into(),
                found: format!(
                    "{} has grouped-query attention ({} K/V heads for {} query heads)",
                    model.name, a.kv_heads, a.heads
                ),
                fix: format!(
                    "set kv_heads = heads ({}) for multi-head attention, or name a framework that builds grouped-query attention: {}",
                    a.heads,
                    with(&|c| c.gqa && c.architectures.contains(&family) && c.devices.contains(&kind))
                ),
            });
        }
        None
    }

    /// The first knob of `layout` the framework cannot run, with the change that would pass.
    pub fn refuses(&self, l: &Layout) -> Option<(String, String)> {
        let no = |what: &str, fix: &str| Some((what.to_string(), fix.to_string()));
        if l.tp > 1 && !self.tensor_parallel {
            return no(&format!("TP {}", l.tp), "use --tp 1, or another framework");
        }
        if l.sequence_parallel && !self.sequence_parallel {
            return no("sequence parallelism", "pin --no-sp");
        }
        if l.tp > 1 && !l.sequence_parallel && !self.tp_without_sp {
            return no(
                &format!("TP {} without sequence parallelism", l.tp),
                "pin --sp, or use --tp 1",
            );
        }
        if l.pp > 1 && !self.pipeline {
            return no(&format!("PP {}", l.pp), "use --pp 1, or another framework");
        }
        if l.pp > 1 && l.sharding.zero_stage > self.pipeline_max_zero {
            return no(
                &format!("ZeRO-{} with PP {}", l.sharding.zero_stage, l.pp),
                &format!("use --zero {} or lower, or --pp 1", self.pipeline_max_zero),
            );
        }
        if l.pp > 1 && !self.schedules.contains(&l.schedule) {
            let refused = one_of(
                format!("the {} schedule", l.schedule.name()),
                "--schedule",
                &self.schedules,
                |s| s.name().to_string(),
            );
            if !l.schedule.splits_backward() {
                return refused;
            }
            // The newer schedules name the frameworks that do run them.
            let runs: Vec<&str> = crate::framework::all()
                .iter()
                .filter(|p| p.can_run.schedules.contains(&l.schedule))
                .map(|p| p.name.as_str())
                .collect();
            let who = if runs.is_empty() {
                format!(
                    "no framework profile here runs {} (DeepSeek's public DualPipe code, deepseek-ai/DualPipe, has none)",
                    l.schedule.name()
                )
            } else {
                format!(
                    "--framework {} runs {}",
                    runs.join(" | "),
                    l.schedule.name()
                )
            };
            return refused.map(|(what, fix)| (what, format!("{fix}; {who}")));
        }
        if l.cp > 1 && !self.context_parallel {
            return no(&format!("CP {}", l.cp), "use --cp 1");
        }
        if l.cp > 1 && !self.cp_comm.contains(&l.cp_comm) {
            return no("this CP exchange", "use the other --cp-comm");
        }
        if l.ep > 1 && !self.expert_parallel {
            return no(&format!("EP {}", l.ep), "use --ep 1");
        }
        if !self.zero_stages.contains(&l.sharding.zero_stage) {
            return one_of(
                format!("ZeRO-{}", l.sharding.zero_stage),
                "--zero",
                &self.zero_stages,
                |z| z.to_string(),
            );
        }
        if l.sharding.hybrid && !self.hybrid_sharding {
            return no("hybrid sharding", "pin --no-hybrid-shard");
        }
        if !self.recompute.contains(&l.recompute) {
            return one_of(
                format!("{} recompute", l.recompute.name()),
                "--recompute",
                &self.recompute,
                |r| r.name().to_string(),
            );
        }
        if l.recompute_every > 1 && !self.partial_recompute {
            return no("recompute of every k-th layer", "recompute every layer");
        }
        if !self.offload.contains(&l.offload.states) {
            return one_of(
                format!("{} offload", l.offload.states.name()),
                "--offload",
                &self.offload,
                |o| o.name().to_string(),
            );
        }
        if l.offload.optimizer() && !self.offload_to.contains(&l.offload.to) {
            return one_of(
                format!("offload to {}", l.offload.to.name()),
                "--offload-to",
                &self.offload_to,
                |o| o.name().to_string(),
            );
        }
        if l.offload.activations && !self.offload_activations {
            return no("activation offload", "drop --offload-activations");
        }
        None
    }
}

/// A knob outside the profile's set: `what`, and the fix `use FLAG a | b | …` of the set.
fn one_of<T: Copy>(
    what: String,
    flag: &str,
    set: &[T],
    name: impl Fn(T) -> String,
) -> Option<(String, String)> {
    let names = set.iter().map(|x| name(*x)).collect::<Vec<_>>().join(" | ");
    Some((what, format!("use {flag} {names}")))
}
