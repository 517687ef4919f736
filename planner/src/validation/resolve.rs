//! One `[[run]]` of runs.toml resolved into what the planner takes: the framework profile it
//! ran under, its model (architecture keys or a `specs/models/` preset), its cluster preset and
//! the knobs it pins.
//!
//! The framework: a run states it with `framework = "…"` (top level of the run),
//! `training.framework` or `parallel.framework`, naming a profile of specs/frameworks/. A run
//! that states none gets its source's profile (Narayanan SC'21 → megatron-legacy, Korthikanti
//! → megatron-lm-2022, llm.c → llm.c, llm-foundry → llm-foundry); a run of another source
//! that states none is skipped. `parallel.compile = true` takes the stated profile's compiled
//! variant ([`framework::compiled`], the mapping `tessera plan --compile` uses): `pytorch-eager`
//! → `pytorch-compile`, `torchtitan` → `torchtitan-compile` (each TransformerBlock and, since
//! torchtitan 0.2.2's defaults, the loss compiled; FSDP2 and TP/PP stay torchtitan's); a
//! profile without one skips the run, naming it and the profiles that have one.

use toml::Value;

use super::{get, int, num, text, Family, Run};
use crate::framework::{self, Profile};
use crate::layout::Recompute;
use crate::model::{
    Activation, Architecture, AttentionImpl, FlashKernel, Model, Norm, Position, Training,
};
use crate::schedule::ScheduleKind;
use crate::search::Pins;
use crate::spec::Cluster;

/// What the runs resolve against: the cluster presets their GPUs map to (node counts are
/// replaced by each run's) and the model presets a run may name (`model.preset`), as texts:
/// this crate reads no files.
#[derive(Debug, Clone, Copy)]
pub struct Presets<'a> {
    pub a100: &'a Cluster,
    pub h100: &'a Cluster,
    /// Further GPU presets (specs/clusters/: H800, H200 where one exists), matched by the
    /// GPU's name (`H800` in the run's `cluster.gpu` takes the preset whose device is an H800).
    pub others: &'a [Cluster],
    /// `(name, TOML text)` of specs/models/*.toml, for `model.preset = "llama3-8b"`.
    pub models: &'a [(String, String)],
}

impl<'a> Presets<'a> {
    /// The A100 and H100 presets alone (no further GPUs, no model presets).
    pub fn a100_h100(a100: &'a Cluster, h100: &'a Cluster) -> Presets<'a> {
        Presets {
            a100,
            h100,
            others: &[],
            models: &[],
        }
    }
}

/// The keys a run may state its framework under, in the order they are read.
pub const FRAMEWORK_KEYS: [&str; 3] = ["framework", "training.framework", "parallel.framework"];

/// The profile a run states, if any: `Ok(None)` when it states none; `Err` names the key and
/// the known names when the name is not a profile, or when two keys disagree.
pub fn stated_framework(r: &Value) -> Result<Option<&'static Profile>, String> {
    let mut found: Option<(&str, &str)> = None;
    for key in FRAMEWORK_KEYS {
        let Some(name) = text(r, key) else { continue };
        if let Some((k0, n0)) = found {
            if n0 != name {
                return Err(format!(
                    "`{k0}` = \"{n0}\" and `{key}` = \"{name}\" disagree"
                ));
            }
            continue;
        }
        found = Some((key, name));
    }
    let Some((key, name)) = found else {
        return Ok(None);
    };
    let mut profile = framework::by_name(alias(name)).ok_or_else(|| {
        format!(
            "unknown framework \"{name}\" in `{key}`; known: {}",
            framework::names().join(", ")
        )
    })?;
    if get(r, "parallel.compile").and_then(Value::as_bool) == Some(true) {
        profile = framework::compiled(profile)
            .map_err(|e| format!("`parallel.compile` = true: {}; {}", e.problem(), e.fix()))?;
    }
    Ok(Some(profile))
}

/// The profile a published run's common name for its framework stands for (the run names its
/// stack, not a profile of specs/frameworks/): FSDP and DDP loops, Hugging Face Accelerate and
/// the Trainer run PyTorch eagerly (pytorch-eager); Megatron-DeepSpeed is DeepSpeed's engine
/// (deepspeed); Megatron-LM today is Megatron-Core (megatron-core); Composer is llm-foundry's.
fn alias(name: &str) -> &str {
    match name.to_ascii_lowercase().as_str() {
        "fsdp" | "fsdp1" | "pytorch-fsdp" | "ddp" | "pytorch" | "pytorch-ddp" | "nanogpt"
        | "accelerate" | "hf-accelerate" | "transformers" | "hf-trainer" => "pytorch-eager",
        "megatron-deepspeed" | "deepspeed-megatron" => "deepspeed",
        "megatron-lm" | "megatron" | "nemo" | "megatron-bridge" | "nemo-megatron" => {
            "megatron-core"
        }
        "composer" | "mosaicml" | "llmfoundry" => "llm-foundry",
        "llmc" => "llm.c",
        _ => name,
    }
}

/// The profile of a source's framework, for its runs that state none.
pub fn family_profile(family: Family) -> &'static str {
    match family {
        Family::Megatron => "megatron-legacy",
        Family::Korthikanti => "megatron-lm-2022",
        Family::LlmC => "llm.c",
        Family::Mpt => "llm-foundry",
    }
}

/// The H100 preset of a run's part: the 700 W DGX one, or, where the run states
/// `cluster.power_w` below 700 (torchtitan's hosts: "the default 500W power limit"), the preset
/// of that power limit among the further presets (`h100-96g-500w`, device named `…-500W`): its
/// tensor cores run at the clock that limit allows, which the GEMMs measured on it carry.
fn h100_part<'a>(r: &Value, p: &Presets<'a>) -> Result<&'a Cluster, String> {
    let Some(watts) = num(r, "cluster.power_w") else {
        return Ok(p.h100);
    };
    if watts >= 700.0 {
        return Ok(p.h100);
    }
    let tag = format!("{watts:.0}W");
    p.others
        .iter()
        .find(|c| c.device.name.contains("H100") && c.device.name.ends_with(&tag))
        .ok_or_else(|| {
            format!(
                "`cluster.power_w` = {watts}: no H100 preset for a {watts} W power limit \
                 (specs/clusters/ has h100-96g-500w for 500 W; the 700 W part is dgx-h100-80g)"
            )
        })
}

fn cluster_for(r: &Value, p: &Presets, gpus: u64) -> Result<Cluster, String> {
    let gpu = text(r, "cluster.gpu").unwrap_or("");
    // The A100's 40 GB part is the same die with half the memory at 1,555 GB/s: its own preset
    // where one is given (a run on it must fit in 40 GB, not the 80 GB preset's).
    let a100_40 = (gpu.contains("A100") && gpu.contains("40"))
        .then(|| {
            p.others
                .iter()
                .find(|c| c.device.name.contains("A100-SXM4-40GB"))
        })
        .flatten();
    let base = if gpu.contains("H100") {
        h100_part(r, p)?
    } else if let Some(c) = a100_40 {
        c
    } else if gpu.contains("A100") {
        p.a100
    } else if let Some(c) = ["H800", "H200"].iter().find_map(|g| {
        gpu.contains(g)
            .then(|| p.others.iter().find(|c| c.device.name.contains(g)))
            .flatten()
    }) {
        c
    } else {
        return Err(format!(
            "no cluster preset for the GPU \"{gpu}\" (specs/clusters/ has A100, H100{})",
            p.others
                .iter()
                .map(|c| format!(", {}", c.device.name))
                .collect::<String>()
        ));
    };
    let mut cluster = base.clone();
    // The part's memory as the run names it ("H100 96GB HBM2e" beside the 80 GB preset;
    // `cluster.gpu_memory_gb` where stated): the capacity a run that ran must fit in. The
    // presets state their parts' marketed size the same way (80 for "80GB").
    if let Some(gb) = num(r, "cluster.gpu_memory_gb").or_else(|| marketed_gb(gpu)) {
        cluster.device.memory_gib = gb;
    }
    // A run on fewer GPUs than a node (one H100) has that many on its node.
    cluster.gpus_per_node =
        int(r, "cluster.gpus_per_node").unwrap_or(base.gpus_per_node.min(gpus.max(1)));
    cluster.devices = gpus;
    cluster.nodes = gpus.div_ceil(cluster.gpus_per_node);
    Ok(cluster)
}

/// The memory size in a GPU's name: the number before "GB" ("A100-SXM4-80GB" → 80,
/// "H100 96GB" → 96), if any.
fn marketed_gb(gpu: &str) -> Option<f64> {
    let upper = gpu.to_ascii_uppercase();
    let end = upper.find("GB")?;
    let digits: String = upper[..end]
        .trim_end()
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect();
    let gb: f64 = digits.chars().rev().collect::<String>().parse().ok()?;
    (gb > 0.0).then_some(gb)
}

fn preset_architecture(r: &Value, p: &Presets) -> Result<Option<Architecture>, String> {
    let Some(name) = text(r, "model.preset") else {
        return Ok(None);
    };
    let Some((_, text)) = p.models.iter().find(|(n, _)| n == name) else {
        return Err(format!(
            "no model preset \"{name}\" (`model.preset`); known: {}",
            p.models
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    };
    let src = crate::source::Source {
        path: format!("specs/models/{name}.toml").into(),
        text: text.clone(),
    };
    crate::spec::parse_model_toml(&src, Default::default())
        .map(|m| Some(m.architecture))
        .map_err(|d| format!("model preset \"{name}\": {d}"))
}

fn enum_key<T>(r: &Value, key: &str, choices: &[(&str, T)]) -> Result<Option<T>, String>
where
    T: Copy,
{
    let Some(v) = text(r, key) else {
        return Ok(None);
    };
    choices
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(v))
        .map(|(_, t)| Some(*t))
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            format!("`{key}` = \"{v}\" is not one of {}", names.join(" | "))
        })
}

/// Resolves one run against the presets.
pub fn resolve(r: &Value, p: &Presets) -> Result<Run, String> {
    let id = text(r, "id").unwrap_or("?").to_string();
    let source = text(r, "source")
        .or_else(|| {
            get(r, "sources")
                .and_then(|s| s.get(0))
                .and_then(Value::as_str)
        })
        .unwrap_or("");
    let family = Family::of(source);
    let stated = stated_framework(r)?;
    let builtin = |name: &str| framework::by_name(name).ok_or("a built-in profile");
    // The profile whose model conventions the run takes: the stated one, else its source's.
    let (profile, conventions) = match (stated, family) {
        (Some(p), _) => (p, p),
        // Narayanan et al. SC'21 Table 2's ZeRO-3 baseline ran "ZeRO-3 via DeepSpeed
        // integrated into Megatron codebase" (runs.toml's notes; §5.2): DeepSpeed runs the
        // layout, Megatron's GPT keeps its conventions.
        (None, Some(Family::Megatron)) if int(r, "parallel.zero_stage") == Some(3) => {
            (builtin("deepspeed")?, builtin(family_profile(Family::Megatron))?)
        }
        (None, Some(f)) => (builtin(family_profile(f))?, builtin(family_profile(f))?),
        (None, None) => {
            return Err(format!(
                "no framework conventions for this source; state one with `framework = \"…\"` (known: {})",
                framework::names().join(", ")
            ))
        }
    };
    let need = |path: &str| int(r, path).ok_or(format!("the source does not give `{path}`"));
    let preset = preset_architecture(r, p)?;
    let from = |path: &str, of_preset: Option<u64>| int(r, path).or(of_preset).ok_or(());
    let arch_int = |path: &str, f: fn(&Architecture) -> u64| {
        from(path, preset.as_ref().map(f))
            .map_err(|()| format!("the source does not give `{path}`"))
    };
    let layers = arch_int("model.layers", |a| a.layers)?;
    let hidden = arch_int("model.hidden", |a| a.hidden)?;
    let heads = arch_int("model.heads", |a| a.heads)?;
    let vocab = arch_int("model.vocab", |a| a.vocab)?;
    let seq_len = need("model.seq_len")?;
    let global_batch = need("parallel.global_batch")?;
    let gpus = need("cluster.num_gpus")?;
    let cluster = cluster_for(r, p, gpus)?;
    let architecture = architecture(
        r,
        preset,
        [layers, hidden, heads, vocab],
        seq_len,
        conventions,
    )?;
    let mut training = training(
        r,
        family,
        stated.is_some(),
        conventions,
        seq_len,
        global_batch,
    )?;
    training.framework = Some(profile.name.clone());
    training.fp8 = super::resolve_fp8::recipe(r, profile, &cluster)?;
    training.tp_comm_overlap = tp_comm_overlap(r, profile)?;
    let model = Model {
        name: id.clone(),
        architecture,
        training,
        optimizer: Default::default(),
        schedule: Default::default(),
        lora: None,
    };
    let (pins, open) = pins(r, family, stated.is_some(), conventions)?;
    Ok(Run {
        id,
        family,
        source: family.map_or_else(|| source.to_string(), |f| f.name().to_string()),
        profile,
        model,
        cluster,
        pins,
        open,
        measured_step_s: num(r, "measured.iter_time_s"),
        measured_tokens_per_s_per_gpu: num(r, "measured.tokens_per_s"),
        measured_mfu: num(r, "measured.mfu"),
        measured_memory_gib: num(r, "measured.memory_gb")
            .or_else(|| num(r, "measured.memory_gib"))
            .or_else(|| num(r, "measured.max_reserved_gib")),
        measured_tflops: num(r, "measured.tflops_per_gpu"),
    })
}

/// The architecture: a GPT as Megatron-LM builds it (GeLU, LayerNorm, learned positions, tied
/// embeddings) unless the run's keys or its preset say otherwise.
fn architecture(
    r: &Value,
    preset: Option<Architecture>,
    [layers, hidden, heads, vocab]: [u64; 4],
    seq_len: u64,
    profile: &Profile,
) -> Result<Architecture, String> {
    let bool_key = |k: &str| get(r, k).and_then(Value::as_bool);
    let activation = enum_key(
        r,
        "model.activation",
        &[("gelu", Activation::Gelu), ("swiglu", Activation::Swiglu)],
    )?;
    let norm = enum_key(
        r,
        "model.norm",
        &[("layernorm", Norm::Layernorm), ("rmsnorm", Norm::Rmsnorm)],
    )?;
    let position = enum_key(
        r,
        "model.position",
        &[("learned", Position::Learned), ("rope", Position::Rope)],
    )?;
    let base = preset.unwrap_or(Architecture {
        // GPT-2 and Megatron's GPT carry biases; llm-foundry's MPT sets `no_bias: true`
        // (llmfoundry/models/mpt/configuration_mpt.py).
        bias: profile.name != "llm-foundry",
        qkv_bias: profile.name != "llm-foundry",
        // Megatron-LM pads to 128 × TP (`--make-vocab-size-divisible-by 128`), llm.c to a
        // multiple of 128 (50257 → 50304); a profile with `pad_vocab = false` trains the
        // vocabulary as it is.
        vocab_divisible_by: if profile.runs.pad_vocab { 128 } else { 1 },
        ..Architecture::gpt(layers, hidden, heads, vocab, seq_len)
    });
    let mut a = Architecture {
        layers,
        hidden,
        heads,
        vocab,
        ..base
    };
    a.kv_heads = int(r, "model.kv_heads").unwrap_or(a.kv_heads);
    a.head_dim = int(r, "model.head_dim").unwrap_or(if a.hidden == base.hidden {
        a.head_dim
    } else {
        hidden / heads.max(1)
    });
    a.ffn_hidden = int(r, "model.ffn_hidden").unwrap_or(a.ffn_hidden);
    a.activation = activation.unwrap_or(a.activation);
    a.norm = norm.unwrap_or(a.norm);
    a.position = position.unwrap_or(a.position);
    a.tied_embeddings = bool_key("model.tied_embeddings").unwrap_or(a.tied_embeddings);
    if let Some(b) = bool_key("model.bias") {
        a.bias = b;
        a.qkv_bias = b;
    }
    a.vocab_divisible_by = int(r, "model.vocab_divisible_by").unwrap_or(a.vocab_divisible_by);
    a.rope_theta = num(r, "model.rope_theta").unwrap_or(a.rope_theta);
    if a.position == Position::Learned {
        a.max_positions = seq_len;
    }
    Ok(a)
}

/// The training conventions: a source's as before where the run states no framework; the
/// profile's (and the run's own keys) where it does.
fn training(
    r: &Value,
    family: Option<Family>,
    stated: bool,
    profile: &Profile,
    seq_len: u64,
    global_batch: u64,
) -> Result<Training, String> {
    // Megatron-LM of 2020–22 trains with the `megatron` policy (fp32 main gradients,
    // `--accumulate-allreduce-grads-in-fp32`) and dropout 0.1 (`--hidden-dropout 0.1
    // --attention-dropout 0.1`, examples/pretrain_gpt.sh), materialising the softmax: the
    // profiles without flash attention.
    let megatron_era = !profile.runs.flash_attention;
    // FP8 is beside the precision policy (`training.fp8`, read by `resolve_fp8`): a run whose
    // precision text names it keeps its framework's policy for the states.
    let precision = match text(r, "training.precision") {
        Some(p) if stated && crate::precision::Policy::by_name(p).is_some() => p.to_string(),
        Some(p) if stated && !super::resolve_fp8::names_fp8(p) => {
            return Err(format!(
                "`training.precision` = \"{p}\" is not a precision policy (megatron | mixed16 | default | fp32)"
            ))
        }
        _ if megatron_era => "megatron".into(),
        _ => "mixed16".into(),
    };
    // llm-foundry's benchmark sweep (scripts/train/benchmarking/submit_benchmarks.py,
    // `--attn_impl` default 'triton', with flash-attn 1.0.3.post0 and triton 2.0.0.dev20221202
    // pinned in setup.py) ran FlashAttention's Triton kernel; llm.c runs cuDNN's fused attention
    // (FlashAttention-2 class), as do PyTorch's SDPA and torchtitan.
    let flash_kernel = match enum_key(
        r,
        "training.flash_kernel",
        &[
            ("fa2", FlashKernel::Fa2),
            ("fa1", FlashKernel::Fa1),
            ("triton", FlashKernel::Triton),
        ],
    )? {
        Some(k) => k,
        None if !stated && family == Some(Family::Mpt) => FlashKernel::Triton,
        None => FlashKernel::Fa2,
    };
    let dropout = match num(r, "training.dropout").or_else(|| num(r, "model.dropout")) {
        Some(d) if stated => d,
        _ if megatron_era => 0.1,
        _ => 0.0,
    };
    Ok(Training {
        seq_len,
        global_batch,
        tokens: None,
        precision,
        attention: if profile.runs.flash_attention {
            AttentionImpl::Flash
        } else {
            AttentionImpl::Eager
        },
        flash_kernel,
        dropout,
        framework: Some(profile.name.clone()),
        method: Default::default(),
        optimizer_states: Default::default(),
        fp8: Default::default(),
        tp_comm_overlap: false,
    })
}

/// The keys a run may state TP communication overlap under, in the order they are read.
pub const TP_OVERLAP_KEYS: [&str; 3] = [
    "training.tp_comm_overlap",
    "parallel.tp_comm_overlap",
    "parallel.async_tp",
];

/// Whether the run overlapped its TP collectives with the GEMMs (`training.tp_comm_overlap`):
/// stated by one of [`TP_OVERLAP_KEYS`], or by its `source` naming async TP ("async TP",
/// "AsyncTP", "async-TP"), as torchtitan's tables do. Refused under a profile that cannot.
fn tp_comm_overlap(r: &Value, profile: &Profile) -> Result<bool, String> {
    let mut stated = None;
    for key in TP_OVERLAP_KEYS {
        match get(r, key) {
            None => {}
            Some(Value::Boolean(b)) => {
                stated = Some((*b, key));
                break;
            }
            Some(_) => return Err(format!("`{key}` must be true or false")),
        }
    }
    let source = text(r, "source").unwrap_or_default().to_lowercase();
    let named = ["async tp", "asynctp", "async-tp"]
        .iter()
        .any(|n| source.contains(n));
    let (on, said) = match stated {
        Some((b, key)) => (b, key),
        None => (named, "source"),
    };
    if on && !profile.can_run.tp_comm_overlap {
        return Err(format!(
            "`{said}` says the TP collectives were overlapped with the GEMMs, but the framework profile {} cannot (specs/frameworks/, can_run.tp_comm_overlap)",
            profile.name
        ));
    }
    Ok(on)
}

/// The knobs the run pins, and the ones it leaves to the search.
fn pins(
    r: &Value,
    family: Option<Family>,
    stated: bool,
    profile: &Profile,
) -> Result<(Pins, Vec<&'static str>), String> {
    let (mut tp, mut pp) = (int(r, "parallel.tp"), int(r, "parallel.pp"));
    if stated {
        // torchtitan's and PyTorch's defaults: `tensor_parallel_degree = 1`,
        // `pipeline_parallel_degree = 1` (torchtitan/config/job_config.py).
        tp = tp.or(Some(1));
        pp = pp.or(Some(1));
    }
    if tp.is_none() || pp.is_none() {
        return Err("the source does not give TP and PP".into());
    }
    let recompute = match text(r, "parallel.recompute") {
        Some("none") => Some(Recompute::None),
        Some("selective") => Some(Recompute::Selective),
        Some("full") => Some(Recompute::Full),
        _ => None,
    };
    let v = int(r, "parallel.virtual_stages");
    let named = text(r, "parallel.schedule").unwrap_or("");
    let pipelined = pp.unwrap_or(1) > 1;
    let schedule = if v.is_some() || (named.contains("interleaved") && pipelined) {
        Some(ScheduleKind::Interleaved)
    } else if !pipelined {
        Some(ScheduleKind::OneFOneB)
    } else {
        None
    };
    let sp = get(r, "parallel.sequence_parallel")
        .and_then(Value::as_bool)
        .or((tp == Some(1)).then_some(false));
    // FSDP (PyTorch FULL_SHARD) and torchtitan's `dp_shard` degree > 1 are ZeRO-3.
    let shard = int(r, "parallel.dp_shard")
        .filter(|&d| d > 1)
        .or_else(|| int(r, "parallel.fsdp").filter(|&d| d > 1))
        .or_else(|| (get(r, "parallel.fsdp").and_then(Value::as_bool) == Some(true)).then_some(0));
    let replicate = int(r, "parallel.dp_replicate").filter(|&d| d > 1);
    let only_zero0 = profile.can_run.zero_stages == [0];
    let zero = int(r, "parallel.zero_stage")
        .map(|z| z as u8)
        .or(shard.map(|_| 3))
        .or((family.is_some_and(Family::megatron_like) && !stated).then_some(0))
        .or((stated && only_zero0).then_some(0));
    let dp = int(r, "parallel.dp").or_else(|| {
        let s = int(r, "parallel.dp_shard").filter(|&d| d > 0)?;
        Some(s * replicate.unwrap_or(1))
    });
    let pins = Pins {
        dp,
        cp: Some(int(r, "parallel.cp").unwrap_or(1)),
        cp_comm: Some(crate::layout::CpComm::P2p),
        ep: int(r, "parallel.ep"),
        pp,
        tp,
        micro_batch: int(r, "parallel.micro_batch"),
        zero,
        hybrid: Some(replicate.is_some() && shard.is_some()),
        recompute,
        recompute_every: None,
        sp,
        schedule,
        virtual_stages: v.or((!pipelined || schedule == Some(ScheduleKind::OneFOneB)).then_some(1)),
        // A run states its offload (`parallel.offload`, `parallel.offload_to`); one that does
        // not ran without.
        offload: Some(
            text(r, "parallel.offload")
                .and_then(|s| s.parse().ok())
                .unwrap_or_default(),
        ),
        offload_to: text(r, "parallel.offload_to").and_then(|s| s.parse().ok()),
        offload_activations: Some(false),
        stage_layers: crate::search::StageLayers {
            first: int(r, "parallel.first_stage_layers"),
            last: int(r, "parallel.last_stage_layers"),
        },
    };
    let mut open = Vec::new();
    for (name, missing) in [
        ("micro-batch", pins.micro_batch.is_none()),
        ("schedule", pins.schedule.is_none()),
        ("virtual stages", pins.virtual_stages.is_none()),
        ("recompute", pins.recompute.is_none()),
        ("SP", pins.sp.is_none()),
        ("ZeRO", pins.zero.is_none()),
    ] {
        if missing {
            open.push(name);
        }
    }
    Ok((pins, open))
}

#[cfg(test)]
mod tests {
    use super::marketed_gb;

    #[test]
    fn the_memory_in_a_gpus_name() {
        assert_eq!(marketed_gb("A100-SXM4-80GB"), Some(80.0));
        assert_eq!(marketed_gb("H100 96GB HBM2e"), Some(96.0));
        assert_eq!(marketed_gb("a100_40gb"), Some(40.0));
        assert_eq!(marketed_gb("H100"), None);
        assert_eq!(marketed_gb("GB200"), None);
    }

    #[test]
    fn common_framework_names_take_their_profiles() {
        assert_eq!(super::alias("FSDP"), "pytorch-eager");
        assert_eq!(super::alias("Megatron-DeepSpeed"), "deepspeed");
        assert_eq!(super::alias("torchtitan"), "torchtitan");
    }
}
