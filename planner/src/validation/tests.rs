//! Runs that state their framework: resolved with that profile's conventions and the run's own
//! architecture keys, replayed under the profile, and grouped by it in the report.

use super::*;
use crate::model::{Activation, AttentionImpl, Norm, Position};
use crate::source::Source;
use crate::spec::{parse_cluster_toml, ClusterOverrides};

fn preset(name: &str, text: &str) -> Cluster {
    let src = Source {
        path: format!("specs/clusters/{name}").into(),
        text: text.into(),
    };
    parse_cluster_toml(&src, ClusterOverrides::default()).unwrap()
}

fn presets() -> (Cluster, Cluster) {
    (
        preset(
            "dgx-a100-80g.toml",
            include_str!("../../../specs/clusters/dgx-a100-80g.toml"),
        ),
        preset(
            "dgx-h100-80g.toml",
            include_str!("../../../specs/clusters/dgx-h100-80g.toml"),
        ),
    )
}

/// A torchtitan Llama 3 8B run from a source the validation has no family for: 8 H100s,
/// FSDP over all 8 (`dp_shard = 8`), selective recompute, local batch 1.
const TORCHTITAN: &str = r#"
[[run]]
id = "titan-llama3-8b-8xh100"
source = "someone's torchtitan benchmark"
framework = "torchtitan"
[run.model]
layers = 32
hidden = 4096
heads = 32
kv_heads = 8
ffn_hidden = 14336
vocab = 128256
seq_len = 8192
activation = "swiglu"
norm = "rmsnorm"
position = "rope"
tied_embeddings = false
bias = false
rope_theta = 500000.0
[run.cluster]
gpu = "H100-SXM5-80GB"
num_gpus = 8
[run.parallel]
dp_shard = 8
global_batch = 8
micro_batch = 1
recompute = "selective"
[run.measured]
iter_time_s = 6.0
max_reserved_gib = 60.0

[[run]]
id = "unknown-framework"
source = "someone else"
[run.training]
framework = "megatron-lm-2023"
[run.model]
layers = 2
hidden = 64
heads = 2
vocab = 100
seq_len = 16
[run.cluster]
gpu = "H100-SXM5-80GB"
num_gpus = 1
[run.parallel]
global_batch = 1
[run.measured]
iter_time_s = 1.0
"#;

#[test]
fn a_run_stating_torchtitan_resolves_with_its_profile_and_llama_keys() {
    let (a100, h100) = presets();
    let (runs, skipped) = load(TORCHTITAN, &a100, &h100).unwrap();
    assert_eq!(runs.len(), 1, "skipped: {skipped:?}");
    let run = &runs[0];
    assert_eq!(run.family, None);
    assert_eq!(run.profile.name, "torchtitan");
    assert_eq!(run.model.training.framework.as_deref(), Some("torchtitan"));
    let a = &run.model.architecture;
    assert_eq!(a.activation, Activation::Swiglu);
    assert_eq!(a.norm, Norm::Rmsnorm);
    assert_eq!(a.position, Position::Rope);
    assert!(!a.tied_embeddings && !a.bias && !a.qkv_bias);
    assert_eq!(
        (a.kv_heads, a.head_dim, a.ffn_hidden),
        (8, 4096 / 32, 14336)
    );
    assert_eq!(a.rope_theta, 500000.0);
    // torchtitan's profile: `pad_vocab = false` (vocabulary as it is), flash attention, no
    // Megatron-era dropout or fp32 main gradients.
    assert_eq!(a.vocab_divisible_by, 1);
    let t = &run.model.training;
    assert_eq!(t.attention, AttentionImpl::Flash);
    assert_eq!((t.precision.as_str(), t.dropout), ("mixed16", 0.0));
    // dp_shard 8 is FSDP over 8 ranks: ZeRO-3 at DP 8; TP and PP default to 1.
    assert_eq!(run.pins.zero, Some(3));
    assert_eq!(
        (run.pins.dp, run.pins.tp, run.pins.pp),
        (Some(8), Some(1), Some(1))
    );
    assert_eq!(run.measured_memory_gib, Some(60.0));
    let row = replay(run).unwrap();
    assert_eq!(row.profile, "torchtitan");
    assert_eq!(row.layout.sharding.zero_stage, 3);
    // torchtitan reports max_reserved: the compared figure is the peak less the CUDA context
    // and NCCL's buffers, so above the tensors alone and below the peak.
    assert!(row.predicted_reported_gib > row.predicted_tensors_gib);
    assert!(row.predicted_reported_gib < row.predicted_memory_gib);
}

/// `parallel.compile = true` takes the profile's compiled variant, as `tessera plan --compile`
/// does: the torchtitan run becomes torchtitan-compile (it stayed torchtitan before); a
/// Megatron run has none and is skipped, naming the profile and the pairs that exist.
#[test]
fn parallel_compile_takes_the_compiled_variant_or_skips_the_run() {
    let (a100, h100) = presets();
    let compiled = TORCHTITAN.replacen("dp_shard = 8", "dp_shard = 8\ncompile = true", 1);
    let (runs, _) = load(&compiled, &a100, &h100).unwrap();
    let run = runs
        .iter()
        .find(|r| r.id == "titan-llama3-8b-8xh100")
        .unwrap();
    assert_eq!(run.profile.name, "torchtitan-compile");
    assert_eq!(
        run.model.training.framework.as_deref(),
        Some("torchtitan-compile")
    );
    let megatron = compiled.replacen(
        "framework = \"torchtitan\"",
        "framework = \"megatron-core\"",
        1,
    );
    let (_, skipped) = load(&megatron, &a100, &h100).unwrap();
    let s = skipped
        .iter()
        .find(|s| s.id == "titan-llama3-8b-8xh100")
        .expect("skipped");
    assert!(s.reason.contains("`parallel.compile`"), "{}", s.reason);
    assert!(
        s.reason
            .contains("\"megatron-core\" has no compiled variant"),
        "{}",
        s.reason
    );
    assert!(
        s.reason.contains("torchtitan → torchtitan-compile"),
        "{}",
        s.reason
    );
}

#[test]
fn an_unknown_framework_is_skipped_naming_the_key_and_the_known_names() {
    let (a100, h100) = presets();
    let (_, skipped) = load(TORCHTITAN, &a100, &h100).unwrap();
    let s = skipped
        .iter()
        .find(|s| s.id == "unknown-framework")
        .expect("skipped");
    assert!(s.reason.contains("\"megatron-lm-2023\""), "{}", s.reason);
    assert!(s.reason.contains("`training.framework`"), "{}", s.reason);
    assert!(s.reason.contains("torchtitan"), "{}", s.reason);
}

#[test]
fn a_model_preset_gives_the_architecture() {
    let (a100, h100) = presets();
    let text = r#"
[[run]]
id = "preset"
source = "x"
parallel.framework = "pytorch-eager"
parallel.compile = true
model.preset = "llama3-8b"
model.seq_len = 2048
cluster.gpu = "H100"
cluster.num_gpus = 1
parallel.global_batch = 1
"#;
    let models = [(
        "llama3-8b".to_string(),
        include_str!("../../../specs/models/llama3-8b.toml").to_string(),
    )];
    let p = Presets {
        a100: &a100,
        h100: &h100,
        others: &[],
        models: &models,
    };
    let (runs, skipped) = load_with(text, &p).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let r = &runs[0];
    // compile = true turns pytorch-eager into pytorch-compile.
    assert_eq!(r.profile.name, "pytorch-compile");
    let a = &r.model.architecture;
    // specs/models/llama3-8b.toml: 32 layers, h 4096, 8 KV heads, FFN 14336, vocab 128256.
    assert_eq!((a.layers, a.hidden, a.kv_heads), (32, 4096, 8));
    assert_eq!((a.ffn_hidden, a.vocab), (14336, 128256));
    assert_eq!(a.activation, Activation::Swiglu);
    // One GPU: one GPU on its node.
    assert_eq!(
        (r.cluster.devices, r.cluster.gpus_per_node, r.cluster.nodes),
        (1, 1, 1)
    );
    // An H200 run without an H200 preset is skipped with the reason.
    let h200 = text.replace("cluster.gpu = \"H100\"", "cluster.gpu = \"H200\"");
    let (_, skipped) = load_with(&h200, &p).unwrap();
    assert!(skipped[0]
        .reason
        .contains("no cluster preset for the GPU \"H200\""));
}

#[test]
fn the_report_groups_the_runs_by_profile() {
    let (a100, h100) = presets();
    let v = run_all(TORCHTITAN, &a100, &h100).unwrap();
    let md = report::markdown(&v, &[], &[&a100], COMMAND);
    assert!(md.contains("| profile | runs held out |"), "{md}");
    // The torchtitan run is on an H100, outside the A100 fit: 0 held out, 1 with the presets.
    assert!(md.contains("| torchtitan | 0 | – | – | 1 |"), "{md}");
    assert!(
        md.contains("median ≤ 6%") || md.contains("target ≤ 6%"),
        "{md}"
    );
}
