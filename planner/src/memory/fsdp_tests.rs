//! FSDP2 and the caching allocator on Llama-3 8B (vocab 128256, hidden 4096, 32 layers, GQA
//! 32/8 heads, SwiGLU 14336, untied), figures counted by hand in each test.

use crate::layout::{Layout, Recompute};
use crate::memory::{estimate_every_term as estimate, estimate_split, MemoryReport, StageBytes};
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::spec::{self, Cluster, ClusterOverrides, TrainingOverrides};
use std::path::Path;

fn llama3_8b(framework: Option<&str>) -> Model {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut m = spec::load_model(
        &root.join("models/llama3-8b.toml"),
        TrainingOverrides::default(),
    )
    .unwrap();
    m.training.framework = framework.map(str::to_string);
    m
}

fn h100(nodes: u64) -> Cluster {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    spec::load_cluster(
        &root.join("clusters/dgx-h100-80g.toml"),
        ClusterOverrides {
            nodes: Some(nodes),
            devices: None,
        },
    )
    .unwrap()
}

/// FSDP over 8 GPUs (ZeRO-3, DP 8), one sequence per micro-batch, the given recompute.
fn fsdp8(recompute: Recompute) -> Layout {
    Layout {
        recompute,
        ..Layout::without_pipeline(8, 1, 3, 1)
    }
}

fn term(r: &MemoryReport, stage: usize, name: &str) -> Option<u64> {
    r.per_stage[stage]
        .terms
        .iter()
        .find(|t| t.name == name)
        .map(|t| t.bytes)
}

/// Parameters, by hand: embedding 128256 × 4096 = 525,336,576; output layer the same; final
/// norm 4096; one block: Q, O 4096² each + K, V 4096 × 1024 each = 41,943,040, MLP 3 × 4096 ×
/// 14336 = 176,160,768, two norms 8192: 218,112,000. The model: 32 × 218,112,000 +
/// 1,050,677,248 = 8,030,261,248.
const ROOT: u64 = 525_336_576 * 2 + 4096;
const BLOCK: u64 = 218_112_000;
const PARAMS: u64 = 32 * BLOCK + ROOT;

/// torchtitan's root module (embedding + final norm + output layer, 1,050,677,248 params)
/// stays gathered through the backward: its bf16 parameters 2,101,354,496 B (1.957 GiB) and its
/// bf16 gradient as much, 4,202,708,992 B on every rank; under megatron-core's ZeRO-3 the
/// root's 16-bit weight is 1/8 sharded like the rest (no such term).
#[test]
fn fsdp2_holds_the_root_module_unsharded() {
    assert_eq!(ROOT, 1_050_677_248);
    let cluster = h100(1);
    let titan = estimate(
        &llama3_8b(Some("torchtitan")),
        &cluster,
        &fsdp8(Recompute::Full),
    );
    assert_eq!(term(&titan, 0, "unsharded_root"), Some(4_202_708_992));
    let mcore = estimate(&llama3_8b(None), &cluster, &fsdp8(Recompute::Full));
    assert_eq!(term(&mcore, 0, "unsharded_root"), None);
    // megatron-core's 16-bit weights, 2 B / 8 of every parameter: 8,030,261,248 / 4.
    assert_eq!(term(&mcore, 0, "weights_bf16"), Some(2_007_565_312));
}

/// FSDP2's sharded states are 16 B/param (fp32 parameter 4 + fp32 gradient 4 + Adam m, v 8)
/// where megatron-core's `default` policy counts 20: over DP 8, 8,030,261,248 × 16 / 8 =
/// 16,060,522,496 B against × 20 / 8 = 20,075,653,120 B. FSDP2's bf16 copies are one block
/// gathered, one prefetched and one block's unsharded bf16 gradient: 6 × 218,112,000 =
/// 1,308,672,000 B (megatron-core's zero3_gathered_layers is 2 × 2 + 2 B too, but it is its own
/// term).
#[test]
fn fsdp2_states_are_16_bytes_per_param() {
    assert_eq!(PARAMS, 8_030_261_248);
    let cluster = h100(1);
    let states = |r: &MemoryReport| -> u64 {
        r.per_stage[0]
            .terms
            .iter()
            .filter(|t| {
                t.kind == "model_states"
                    && !t.name.contains("gathered")
                    && !t.name.contains("reduce_scatter")
                    && t.name != "unsharded_root"
            })
            .map(|t| t.bytes)
            .sum()
    };
    let titan = estimate(
        &llama3_8b(Some("torchtitan")),
        &cluster,
        &fsdp8(Recompute::Full),
    );
    let mcore = estimate(&llama3_8b(None), &cluster, &fsdp8(Recompute::Full));
    assert_eq!(states(&titan), 16_060_522_496);
    assert_eq!(states(&mcore), 20_075_653_120);
    assert_eq!(term(&titan, 0, "params_fp32_sharded"), Some(PARAMS / 2));
    assert_eq!(
        term(&titan, 0, "fsdp2_gathered_blocks"),
        Some(1_308_672_000)
    );
    assert_eq!(term(&titan, 0, "zero3_gathered_layers"), None);
}

/// The fp32 reduce-scatter input of the largest module reduced on a stage: on one stage the
/// root, 1,050,677,248 × 4 = 4,202,708,992 B; on a middle stage of PP 4 (no root) one block,
/// 218,112,000 × 4 = 872,448,000 B; on PP 4's first stage the embedding, 525,336,576 × 4 =
/// 2,101,346,304 B.
#[test]
fn fsdp2_reduce_scatter_buffer_is_the_largest_module_in_fp32() {
    let cluster = h100(4);
    let model = llama3_8b(Some("torchtitan"));
    let one = estimate(&model, &cluster, &fsdp8(Recompute::Full));
    assert_eq!(
        term(&one, 0, "fsdp2_reduce_scatter_fp32"),
        Some(4_202_708_992)
    );
    let pp4 = estimate(&model, &cluster, &pipelined());
    assert_eq!(
        term(&pp4, 0, "fsdp2_reduce_scatter_fp32"),
        Some(2_101_346_304)
    );
    assert_eq!(
        term(&pp4, 1, "fsdp2_reduce_scatter_fp32"),
        Some(872_448_000)
    );
    assert_eq!(term(&pp4, 1, "unsharded_root"), None);
}

/// DP 8 × PP 4 on 32 GPUs, 1F1B, full recompute, 8 layers a stage.
fn pipelined() -> Layout {
    Layout {
        pp: 4,
        schedule: ScheduleKind::OneFOneB,
        ..fsdp8(Recompute::Full)
    }
}

/// Full recompute re-runs one layer's forward in the backward: its whole activations for one
/// sequence of 8192 tokens (b = 1, flash attention, no dropout), per token in bf16: the two
/// norms' inputs and outputs 4 × 2 × 4096 = 32,768; Q, K, V 2 × (4096 + 1024 + 1024) = 12,288;
/// the fp32 log-sum-exp 4 × 32 = 128; the output projection's input 2 × 4096 = 8,192; gate, up
/// and down-projection input 3 × 2 × 14336 = 86,016: 139,392 B; eager torchtitan's SwiGLU also
/// keeps silu(gate), 2 × 14336 = 28,672: 168,064 B × 8192 = 1,376,780,288 B (compiled, without
/// it, 139,392 × 8192 = 1,141,899,264 B). megatron-core's profile does not select the term.
#[test]
fn full_recompute_holds_one_layer_working_set() {
    let cluster = h100(1);
    let titan = estimate(
        &llama3_8b(Some("torchtitan")),
        &cluster,
        &fsdp8(Recompute::Full),
    );
    assert_eq!(
        term(&titan, 0, "recompute_working_set"),
        Some(1_376_780_288)
    );
    let compiled = estimate(
        &llama3_8b(Some("torchtitan-compile")),
        &cluster,
        &fsdp8(Recompute::Full),
    );
    assert_eq!(
        term(&compiled, 0, "recompute_working_set"),
        Some(1_141_899_264)
    );
    let selective = estimate(
        &llama3_8b(Some("torchtitan")),
        &cluster,
        &fsdp8(Recompute::Selective),
    );
    assert_eq!(term(&selective, 0, "recompute_working_set"), None);
    let mcore = estimate(&llama3_8b(None), &cluster, &fsdp8(Recompute::Full));
    assert_eq!(term(&mcore, 0, "recompute_working_set"), None);
}

/// torchtitan reports max_memory_reserved: on PP 4's middle stage the transient blocks are one
/// gathered block (218,112,000 × 2 = 436,224,000 B), the fp32 reduce-scatter input
/// (872,448,000 B) and the recomputed layer (eager: 1,376,780,288 B, with silu(gate)); the
/// largest, / 2 MiB = 656.5, rounds up to 657 × 2,097,152 = 1,377,828,864 B of
/// allocator_reserved; the presets charge no flat fragmentation. megatron-core reports the
/// allocated bytes: no slack is charged (a steady step reuses each cached block).
#[test]
fn reserved_is_one_segment_of_the_largest_transient_block() {
    let cluster = h100(4);
    let titan = estimate(&llama3_8b(Some("torchtitan")), &cluster, &pipelined());
    assert_eq!(term(&titan, 1, "allocator_reserved"), Some(1_377_828_864));
    assert_eq!(term(&titan, 1, "allocator_fragmentation"), None);
    let mcore = estimate(&llama3_8b(None), &cluster, &pipelined());
    assert_eq!(term(&mcore, 1, "allocator_reserved"), None);
    assert_eq!(term(&mcore, 1, "allocator_fragmentation"), None);
}

/// torchtitan against torchtitan-compile on one layout (Llama-3 8B, FSDP2 over 8 H100s, one
/// sequence of 8192 tokens per micro-batch, no recompute), by the mechanisms' formulas:
/// - eager SwiGLU keeps silu(gate) per layer, 2 B × 8192 tokens × 14336 = 234,881,024 B, × 32
///   layers = 7,516,192,768 B; compiled, Inductor recomputes it;
/// - torchtitan's eager loss keeps three fp32 N × V buffers at the start of its backward
///   (logits.rs: 4 B × 8192 × 128256 = 4,202,692,608 B each, 12,608,077,824 B) and frees the
///   16-bit logits first (`del pred`); the compiled loss keeps no fp32 buffer but holds the
///   saved 16-bit logits and writes their 16-bit gradient into a new buffer in its backward,
///   2 × 2 B × 8192 × 128256 = 2 × 2,101,346,304 = 4,202,692,608 B;
/// - the reserved segment is the largest transient block's in both: the root module's fp32
///   reduce-scatter input, 1,050,677,248 × 4 = 4,202,708,992 B (the fp32 logits are 16,384 B
///   smaller), 2005 × 2 MiB = 4,204,789,760 B.
///
/// So the eager peak is 7,516,192,768 + 12,608,077,824 − 4,202,692,608 = 15,921,577,984 B
/// above the compiled one; under full recompute only the recomputed layer keeps silu(gate):
/// 234,881,024 + 12,608,077,824 − 4,202,692,608 = 8,640,266,240 B.
#[test]
fn compile_lowers_the_fsdp2_peak_by_silu_and_the_fp32_loss() {
    let cluster = h100(1);
    for (recompute, diff) in [
        (Recompute::None, 15_921_577_984u64),
        (Recompute::Full, 8_640_266_240),
    ] {
        let eager = estimate(&llama3_8b(Some("torchtitan")), &cluster, &fsdp8(recompute));
        let compiled = estimate(
            &llama3_8b(Some("torchtitan-compile")),
            &cluster,
            &fsdp8(recompute),
        );
        for r in [&eager, &compiled] {
            assert_eq!(term(r, 0, "allocator_reserved"), Some(4_204_789_760));
        }
        assert_eq!(term(&compiled, 0, "logits_fp32"), None);
        assert_eq!(term(&compiled, 0, "logits_16bit"), Some(2_101_346_304));
        assert_eq!(term(&compiled, 0, "logits_16bit_grad"), Some(2_101_346_304));
        assert_eq!(
            eager.peak_bytes - compiled.peak_bytes,
            diff,
            "{recompute:?}: eager {} compiled {}",
            eager.peak_bytes,
            compiled.peak_bytes
        );
    }
}

/// The search's affine per-stage bytes equal the per-term report under torchtitan's profile,
/// uneven splits, every recompute, with and without pipelining.
#[test]
fn stage_bytes_equal_the_report_under_fsdp2() {
    let cluster = h100(4);
    for name in ["torchtitan", "torchtitan-compile"] {
        stage_bytes_equal_the_report(&cluster, &llama3_8b(Some(name)));
    }
}

fn stage_bytes_equal_the_report(cluster: &Cluster, model: &Model) {
    for recompute in Recompute::ALL {
        for (pp, zero) in [(1, 3), (4, 3), (4, 0), (2, 3)] {
            let l = Layout {
                pp,
                recompute,
                sharding: crate::layout::Sharding {
                    zero_stage: zero,
                    hybrid: false,
                },
                ..fsdp8(recompute)
            };
            let mut split = l.split_layers(model.architecture.layers);
            if pp > 1 {
                split[0] += 1;
                split[pp as usize - 1] -= 1;
            }
            let report = estimate_split(model, cluster, &l, &split);
            let fast = StageBytes::new(model, cluster, &l);
            for s in &report.per_stage {
                let got = fast.bytes(s.stage as usize, s.layers);
                assert!(
                    (got - s.total_bytes as f64).abs() <= 64.0,
                    "{} stage {}: {got} vs {}",
                    l.label(),
                    s.stage,
                    s.total_bytes
                );
            }
        }
    }
}

/// FSDP2's peak is the larger of its two phases, not the sum of every term (Llama-3 8B, FSDP
/// over 8 H100s, one micro-batch of one sequence a step: global batch 8).
/// - Eager torchtitan, no recompute: the start of the backward is the peak (every layer's
///   activations and the three fp32 loss buffers). Absent there, against the sum: the sharded
///   fp32 gradient (none yet with one micro-batch), 8,030,261,248 × 4 / 8 = 4,015,130,624 B; the
///   root's fp32 reduce-scatter input, 4,202,708,992 B; two of the three gathered blocks' bf16
///   copies (the prefetch and the unsharded gradient), 2/3 × 1,308,672,000 = 872,448,000 B; the
///   root's bf16 gradient, 2,101,354,496 B: 11,191,642,112 B in all.
/// - Compiled torchtitan under full recompute (no fp32 loss buffer, one layer's input kept per
///   layer): the end of the backward is the peak: every gradient and the root's reduce-scatter
///   input, no logits, and one layer's checkpoint, 2 B × 8192 × 4096 = 67,108,864 B.
#[test]
fn fsdp2_peak_is_the_larger_phase() {
    let cluster = h100(1);
    let one_step = |framework: &str| {
        let mut m = llama3_8b(Some(framework));
        m.training.global_batch = 8;
        m
    };
    let eager = one_step("torchtitan");
    let l = fsdp8(Recompute::None);
    let phased = estimate_split(&eager, &cluster, &l, &[32]);
    let summed = estimate(&eager, &cluster, &l);
    assert_eq!(summed.peak_bytes - phased.peak_bytes, 11_191_642_112);
    assert_eq!(term(&phased, 0, "grads_fp32_sharded"), None);
    assert_eq!(term(&phased, 0, "fsdp2_reduce_scatter_fp32"), None);
    assert_eq!(term(&phased, 0, "fsdp2_gathered_blocks"), Some(436_224_000));
    assert_eq!(term(&phased, 0, "unsharded_root"), Some(2_101_354_496));
    assert!(term(&phased, 0, "logits_fp32_grad_input").is_some());

    let compiled = one_step("torchtitan-compile");
    let l = fsdp8(Recompute::Full);
    let phased = estimate_split(&compiled, &cluster, &l, &[32]);
    assert_eq!(
        term(&phased, 0, "fsdp2_reduce_scatter_fp32"),
        Some(4_202_708_992)
    );
    assert_eq!(term(&phased, 0, "grads_fp32_sharded"), Some(PARAMS / 2));
    assert_eq!(term(&phased, 0, "logits_16bit"), None);
    assert_eq!(term(&phased, 0, "layer_activations"), Some(67_108_864));
    assert!(phased.peak_bytes < estimate(&compiled, &cluster, &l).peak_bytes);
    // The search's affine bytes take the same maximum.
    let fast = StageBytes::new(&compiled, &cluster, &l);
    assert!((fast.bytes(0, 32) - phased.peak_bytes as f64).abs() <= 64.0);
}

/// Eager torchtitan under full recompute, one sequence of 8192 a micro-batch: the start of the
/// backward is the peak (three fp32 loss buffers of 8192 × 128256 × 4 = 4,202,692,608 B each
/// against one layer's input per layer), and no layer's recomputed forward is alive there (full
/// recompute re-runs it inside that layer's backward, after the loss's backward has freed its
/// buffers); the end of the backward holds it, but is the smaller phase.
#[test]
fn no_recomputed_layer_is_alive_during_the_loss_backward() {
    let cluster = h100(1);
    let mut eager = llama3_8b(Some("torchtitan"));
    eager.training.global_batch = 8;
    let l = fsdp8(Recompute::Full);
    let phased = estimate_split(&eager, &cluster, &l, &[32]);
    assert_eq!(
        term(&phased, 0, "logits_fp32_grad_input"),
        Some(4_202_692_608)
    );
    assert_eq!(term(&phased, 0, "recompute_working_set"), None);
    // The sum of every term still counts it.
    assert!(term(&estimate(&eager, &cluster, &l), 0, "recompute_working_set").is_some());
}

/// torchtitan's loss under TP runs as `loss_parallel` (its profiles' `runs.loss_parallel`),
/// whose backward adds `exp(x)` to the zeroed gradient: a fourth fp32 buffer of the rank's
/// vocabulary share, 8192 tokens × 128256 / 8 rows × 4 B = 525,336,576 B at TP 8; none without
/// TP, none without loss_parallel, and none under Megatron's vocab-parallel loss. The
/// torchtitan profiles state it; the others do not.
#[test]
fn loss_parallel_holds_the_exponential_beside_the_gradient() {
    use crate::framework::LossKind;
    use crate::memory::activations::head_terms;
    use crate::memory::logits::Loss;
    let m = llama3_8b(Some("torchtitan"));
    let find = |tp: u64, kind: LossKind, parallel: bool| {
        head_terms(&m, 1, tp, true, Loss { kind, parallel }, false)
            .iter()
            .find(|t| t.0 == "logits_fp32_exp")
            .map(|t| t.1)
    };
    assert_eq!(
        find(8, LossKind::UnfusedFp32Freed, true),
        Some(525_336_576.0)
    );
    assert_eq!(find(1, LossKind::UnfusedFp32Freed, true), None);
    assert_eq!(find(8, LossKind::UnfusedFp32Freed, false), None);
    assert_eq!(find(8, LossKind::VocabParallelFp32, false), None);
    for name in crate::framework::names() {
        let p = crate::framework::by_name(name).unwrap();
        assert_eq!(
            p.runs.loss_parallel,
            name.starts_with("torchtitan"),
            "{name}"
        );
    }
}
