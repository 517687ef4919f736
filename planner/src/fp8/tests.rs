//! FP8 linears against times, bytes and terms worked out by hand on the H100 preset:
//! bf16 peak 989.4 TFLOP/s × gemm_efficiency 0.670 = 662.898 TFLOP/s, FP8 peak 1979 × 0.644 =
//! 1274.476 TFLOP/s, 132 SMs, memory 3350 GB/s × 0.726 = 2432.1 GB/s, 2.43 µs per launch.

use super::report::{self, linears, Fp8Linear};
use super::*;
use crate::layout::{Layout, Recompute};
use crate::spec::{self, ClusterOverrides, TrainingOverrides};
use std::path::Path;

const BF16_RATE: f64 = 989.4e12 * 0.670;
const FP8_RATE: f64 = 1979e12 * 0.644;
const BW: f64 = 3350e9 * 0.726;
const LAUNCH: f64 = 2.43e-6;

fn specs() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs")
}

fn model(name: &str, recipe: Recipe) -> Model {
    let mut m = spec::load_model(
        &specs().join(format!("models/{name}.toml")),
        TrainingOverrides::default(),
    )
    .unwrap();
    m.training.fp8 = recipe;
    m
}

/// `name` under `framework`'s profile (its FP8 linears: torchao's or Transformer Engine's).
fn on(framework: &str, name: &str, recipe: Recipe) -> Model {
    let mut m = model(name, recipe);
    m.training.framework = Some(framework.into());
    m
}

/// torchao's `Float8Linear` (torchtitan's float8 converter).
fn ao(name: &str, recipe: Recipe) -> Model {
    on("torchtitan", name, recipe)
}

fn h100() -> Cluster {
    spec::load_cluster(
        &specs().join("clusters/dgx-h100-80g.toml"),
        ClusterOverrides::default(),
    )
    .unwrap()
}

fn row<'a>(rows: &'a [Fp8Linear], name: &str) -> &'a Fp8Linear {
    rows.iter().find(|r| r.name == name).unwrap()
}

fn close(got: f64, want: f64) {
    assert!(
        (got / want - 1.0).abs() < 1e-9,
        "got {got:e}, want {want:e}"
    );
}

/// Llama-3 70B's MLP at TP 8, micro-batch 1, sequence 8192 (no SP): gate and up are each
/// x (8192 × 8192) · w (8192 × 3584), 28672 / 8 = 3584 columns on the rank.
///
/// Tiles of a (m × n) output with inner size k, on 132 SMs: 256 × 128 or 128 × 256 tiles of
/// 8192 × 3584 are 32 × 28 = 64 × 14 = 896, in ceil(896 / 132) = 7 waves; 128 × 128 tiles,
/// 1792 in 14 waves, the same work. A wave of 256 × 128 tiles is 2 · 256 · 128 · k FLOPs per SM.
/// - forward (8192 × 8192 · 8192 × 3584) and weight gradient (3584 × 8192 · 8192 × 8192, the
///   same output): 7 waves · 2 · 32768 · 8192 · 132 = 496,068,722,688 FLOP-equivalents each;
/// - input gradient (8192 × 3584 · 3584 × 8192): output 8192 × 8192, 2048 tiles of 256 × 128
///   in 16 waves: 16 · 2 · 32768 · 3584 · 132 = 496,068,722,688 as well.
///
/// So each of the three GEMMs is that over the rate, plus a launch (all are compute-bound: the
/// largest moves 2 · (8192² + 2 · 8192 · 3584) = 251.7 MB, 103 µs at 2432.1 GB/s):
/// bf16 3 · (748.33 µs + 2.43 µs), FP8 3 · (389.23 µs + 2.43 µs).
/// Tensorwise casts (torchao's roofline bytes): forward, X 6 B × 8192 · 8192 and W's amax and
/// forward cast 5 B × 8192 · 3584, 549,453,824 B in 4 kernels; backward, dY 6 B × 8192 · 3584
/// and W's backward cast 3 B × 8192 · 3584, 264,241,152 B in 3 kernels: 334.56 µs + 7 launches.
/// Per GEMM pair (gate and up, count 2) every figure doubles.
/// bf16 2 · 2252.29 µs = 4504.58 µs; FP8 2 · (1174.99 µs + 351.57 µs) = 3053.13 µs: FP8 wins, by
/// 32%.
#[test]
fn a_large_linear_wins() {
    let m = ao("llama3-70b", Recipe::Tensorwise);
    let layout = Layout {
        recompute: Recompute::Full,
        ..Layout::without_pipeline(1, 8, 1, 1)
    };
    let rows = linears(&m, &h100(), &layout);
    let r = row(&rows, "gate_up");
    assert_eq!((r.m, r.k, r.n, r.count), (8192.0, 8192.0, 3584.0, 2.0));
    let work = 7.0 * 2.0 * 32768.0 * 8192.0 * 132.0;
    assert_eq!(work, 16.0 * 2.0 * 32768.0 * 3584.0 * 132.0);
    let bf16 = 2.0 * 3.0 * (work / BF16_RATE + LAUNCH);
    let fp8_gemm = 2.0 * 3.0 * (work / FP8_RATE + LAUNCH);
    let cast = 2.0 * ((549_453_824.0 + 264_241_152.0) / BW + 7.0 * LAUNCH);
    close(r.bf16_s, bf16);
    close(r.fp8_gemm_s, fp8_gemm);
    close(r.cast_s, cast);
    assert!(r.wins);
    // 4504.58 µs against 3053.13 µs.
    assert!((bf16 - 4504.58e-6).abs() < 0.01e-6, "{bf16}");
    assert!(
        (fp8_gemm + cast - 3053.13e-6).abs() < 0.01e-6,
        "{}",
        fp8_gemm + cast
    );
}

/// GPT-2 124M's attention output projection at micro-batch 1, sequence 1024, TP 1:
/// x (1024 × 768) · w (768 × 768). The smallest tile wins each GEMM: 128 × 128 tiles, 8 × 6 =
/// 48 of them (the weight gradient's 768 × 768 output, 36), one wave each.
/// - forward and input gradient: 2 · 128 · 128 · 768 · 132 = 3,321,888,768 FLOP-equivalents
///   (a wave of 256 × 128 tiles, 24 of them, would be twice that): bf16 5.011 µs, FP8 2.606 µs;
///   their memory rooflines are below (bf16 2 · (786,432 + 589,824 + 786,432) B = 1.78 µs,
///   FP8 786,432 + 589,824 + 2 · 786,432 B = 1.21 µs);
/// - weight gradient (768 × 1024 · 1024 × 768): 2 · 16384 · 1024 · 132 = 4,429,185,024:
///   bf16 6.682 µs, FP8 3.475 µs.
///
/// Each with a launch: bf16 23.99 µs, FP8 GEMMs 15.98 µs. The casts: forward 6 B × 786,432 + 5 B ×
/// 589,824 = 7,667,712 B in 4 kernels; backward 6 B × 786,432 + 3 B × 589,824 = 6,488,064 B in
/// 3 kernels: 5.82 µs + 17.01 µs = 22.83 µs. FP8 loses, 38.81 µs against 23.99: the launches
/// and the casts' bytes outweigh the 8 µs the GEMMs save.
#[test]
fn a_small_linear_loses() {
    let m = ao("gpt2-124m", Recipe::Tensorwise);
    let mut m = m;
    m.training.seq_len = 1024;
    let layout = Layout::without_pipeline(1, 1, 1, 1);
    let rows = linears(&m, &h100(), &layout);
    let r = row(&rows, "proj");
    assert_eq!((r.m, r.k, r.n, r.count), (1024.0, 768.0, 768.0, 1.0));
    let wave = |k: f64| 2.0 * 16384.0 * k * 132.0;
    let bf16 = 2.0 * wave(768.0) / BF16_RATE + wave(1024.0) / BF16_RATE + 3.0 * LAUNCH;
    let fp8_gemm = 2.0 * wave(768.0) / FP8_RATE + wave(1024.0) / FP8_RATE + 3.0 * LAUNCH;
    let cast = (7_667_712.0 + 6_488_064.0) / BW + 7.0 * LAUNCH;
    close(r.bf16_s, bf16);
    close(r.fp8_gemm_s, fp8_gemm);
    close(r.cast_s, cast);
    assert!(!r.wins);
    assert!((bf16 - 23.99e-6).abs() < 0.01e-6, "{bf16}");
    assert!(
        (fp8_gemm + cast - 38.81e-6).abs() < 0.01e-6,
        "{}",
        fp8_gemm + cast
    );
}

/// torchao's rowwise recipe on GPT-2's projection as above (m = 1024, k = n = 768): X and dY 8 B
/// each × 786,432, W 3 B forward and 7 B backward × 589,824, and the two backward GEMMs' outputs
/// rescaled after cuBLAS (read and write 2 + 2 B): the input gradient 1024 × 768 = 786,432 and the
/// weight gradient 768 × 768 = 589,824 elements. Forward 6,291,456 + 1,769,472 = 8,060,928 B in
/// 3 kernels; backward 6,291,456 + 4,128,768 + 4 · 1,376,256 = 15,925,248 B in 2 + 2 + 2 = 6:
/// 23,986,176 B at 2432.1 GB/s (9.862 µs) and 9 launches (21.87 µs), 31.73 µs.
#[test]
fn rowwise_rescales_the_backward_gemms_outputs() {
    let mut m = ao("gpt2-124m", Recipe::Rowwise);
    m.training.seq_len = 1024;
    let layout = Layout::without_pipeline(1, 1, 1, 1);
    let r = row(&linears(&m, &h100(), &layout), "proj").clone();
    let cast = (8_060_928.0 + 15_925_248.0) / BW + 9.0 * LAUNCH;
    close(r.cast_s, cast);
    assert!((cast - 31.73e-6).abs() < 0.01e-6, "{cast}");
}

/// Delayed scaling casts each activation operand once (4 B: read 2, write both layouts) and
/// the weight once per step: with 8 micro-batches, 4 B × k · n / 8 per micro-batch, and one
/// launch per 8. GPT-2's projection as above: forward 4 · 786,432 + 4 · 589,824 / 8 =
/// 3,440,640 B and 1 + 1/8 kernels; backward 4 · 786,432 = 3,145,728 B and 1 kernel.
#[test]
fn delayed_scaling_casts_the_weight_once_per_step() {
    let mut m = model("gpt2-124m", Recipe::Delayed);
    m.training.seq_len = 1024;
    m.training.global_batch = 8;
    let layout = Layout::without_pipeline(1, 1, 1, 1);
    assert_eq!(layout.microbatches(&m), 8);
    let r = row(&linears(&m, &h100(), &layout), "proj").clone();
    close(r.cast_s, (3_440_640.0 + 3_145_728.0) / BW + 2.125 * LAUNCH);
}

/// Transformer Engine's current scaling (tensorwise under Megatron-Core): each operand an amax
/// pass and a fused cast-transpose, 6 B in 2 kernels, the weight's once per step. GPT-2's
/// projection with 8 micro-batches: forward 6 · 786,432 + 6 · 589,824 / 8 = 5,160,960 B and
/// 2 + 2/8 kernels; backward 6 · 786,432 = 4,718,592 B and 2 kernels: 9,879,552 B and 4.25
/// launches. Under llm-foundry, which passes no `is_first_microbatch`, delayed scaling recasts
/// the weight each micro-batch: 4 · 786,432 + 4 · 589,824 = 5,505,024 B and 2 kernels forward,
/// 3,145,728 B and 1 backward. Under ZeRO-3 Megatron-Core keeps no FP8 weight either: current
/// scaling's forward is 6 · 786,432 + 6 · 589,824 = 8,257,536 B in 4 kernels, with the same
/// backward, 12,976,128 B and 6 launches.
#[test]
fn transformer_engine_casts_by_its_framework() {
    let gpt2 = |f, r| {
        let mut m = on(f, "gpt2-124m", r);
        m.training.seq_len = 1024;
        m.training.global_batch = 8;
        m
    };
    let layout = Layout::without_pipeline(1, 1, 1, 1);
    let proj = |m: &Model| row(&linears(m, &h100(), &layout), "proj").cast_s;
    close(
        proj(&gpt2("megatron-core", Recipe::Tensorwise)),
        9_879_552.0 / BW + 4.25 * LAUNCH,
    );
    close(
        proj(&gpt2("llm-foundry", Recipe::Delayed)),
        (5_505_024.0 + 3_145_728.0) / BW + 3.0 * LAUNCH,
    );
    let zero3 = Layout::without_pipeline(1, 1, 3, 1);
    let m = gpt2("megatron-core", Recipe::Tensorwise);
    close(
        row(&linears(&m, &h100(), &zero3), "proj").cast_s,
        12_976_128.0 / BW + 6.0 * LAUNCH,
    );
    // Megatron-Core caches it: as delayed_scaling_casts_the_weight_once_per_step.
    close(
        proj(&gpt2("megatron-core", Recipe::Delayed)),
        (3_440_640.0 + 3_145_728.0) / BW + 2.125 * LAUNCH,
    );
}

/// Llama-3 8B's layer on a rank (TP 1): Q, O 4096² + K, V 4096 × 1024 = 41,943,040, gate, up
/// and down 3 · 4096 · 14336 = 176,160,768: 218,103,808 FP8-linear parameters (the two norms'
/// 8192 stay 16-bit). TE under Megatron-Core keeps 2 B of each (the FP8 weight and its
/// transpose), current scaling (tensorwise) included, blockwise 8/16384 B more for the 128 × 128
/// blocks' scales; torchao keeps none, nor does TE under llm-foundry, which recasts the weight
/// in every forward, nor TE under ZeRO-3, whose weights are gathered for each pass and freed.
#[test]
fn the_weight_cache_per_recipe() {
    let lin = 218_103_808.0;
    close(
        linear_params(&model("llama3-8b", Recipe::None), 1, false),
        lin,
    );
    let zero1 = Layout::without_pipeline(1, 1, 1, 1);
    let cache = |f, r| weight_cache(&on(f, "llama3-8b", r), &zero1, 32, 0);
    let zero3 = Layout::without_pipeline(8, 1, 3, 1);
    for r in [Recipe::Tensorwise, Recipe::Delayed, Recipe::Blockwise] {
        assert_eq!(
            weight_cache(&on("megatron-core", "llama3-8b", r), &zero3, 32, 0),
            0.0
        );
    }
    for f in ["megatron-core", "torchtitan", "llm-foundry"] {
        assert_eq!(cache(f, Recipe::None), 0.0);
        assert_eq!(cache(f, Recipe::Rowwise), 0.0);
    }
    close(cache("megatron-core", Recipe::Tensorwise), 2.0 * lin * 32.0);
    assert_eq!(cache("torchtitan", Recipe::Tensorwise), 0.0);
    close(cache("megatron-core", Recipe::Delayed), 2.0 * lin * 32.0);
    close(
        cache("megatron-core", Recipe::Blockwise),
        (2.0 + 8.0 / 16384.0) * lin * 32.0,
    );
    assert_eq!(cache("llm-foundry", Recipe::Delayed), 0.0);
    // The memory report names it, on the plan's one stage.
    let m = model("llama3-8b", Recipe::Delayed);
    let layout = Layout::without_pipeline(8, 1, 1, 1);
    let r = crate::memory::estimate(&m, &h100(), &layout);
    let t = r.per_stage[0]
        .terms
        .iter()
        .find(|t| t.name == "fp8_weight_cache")
        .unwrap();
    assert_eq!(t.bytes, (2.0 * lin * 32.0) as u64);
    let none = crate::memory::estimate(&ao("llama3-8b", Recipe::Tensorwise), &h100(), &layout);
    assert!(!none.per_stage[0]
        .terms
        .iter()
        .any(|t| t.name == "fp8_weight_cache"));
}

/// Transformer Engine's linears save their inputs in FP8, whatever the recipe: Llama-3 8B at
/// micro-batch 1, sequence 8192, TP 1, no recompute, QKV's and the MLP's inputs (8192 × 4096
/// each) and the down projection's (8192 × 14336) drop from 2 B to 1: 8192 · (4096 + 4096 +
/// 14336) = 184,549,376 B less per layer. torchao's save the 16-bit input: no change.
#[test]
fn te_recipes_save_the_linears_inputs_in_fp8() {
    let act = |f, r| {
        crate::memory::activations::layer_bytes(
            &on(f, "llama3-8b", r),
            1,
            1,
            false,
            Recompute::None,
        )
    };
    let base = |f| act(f, Recipe::None);
    assert_eq!(act("torchtitan", Recipe::Tensorwise), base("torchtitan"));
    assert_eq!(act("torchtitan", Recipe::Rowwise), base("torchtitan"));
    let less = 184_549_376.0;
    for r in [Recipe::Tensorwise, Recipe::Delayed, Recipe::Blockwise] {
        assert_eq!(base("megatron-core") - act("megatron-core", r), less);
    }
    assert_eq!(
        base("llm-foundry") - act("llm-foundry", Recipe::Delayed),
        less
    );
}

/// ZeRO-3 with torchao's float8 all-gather (tensorwise) gathers a Llama-3 8B layer's
/// 218,103,808 linear weights in 1 B and its 8192 norm weights in 2: 218,120,192 B against
/// 2 × 218,112,000 = 436,224,000 in bf16, about half. Rowwise has no float8 all-gather.
#[test]
fn float8_all_gather_moves_half_the_bytes() {
    let c = h100();
    let layout = Layout::without_pipeline(8, 1, 3, 1);
    let links = crate::cost::comm::Links::new(&c, &layout.mesh(&c));
    let options = crate::cost::Options::for_model(&ao("llama3-8b", Recipe::None), &c);
    let gather =
        |m: &Model| crate::cost::layer_times(m, &c, &layout, &links, options).zero3_first_gather;
    close(
        gather(&ao("llama3-8b", Recipe::None)),
        links.dp.all_gather(436_224_000.0),
    );
    close(
        gather(&ao("llama3-8b", Recipe::Tensorwise)),
        links.dp.all_gather(218_120_192.0),
    );
    close(
        gather(&ao("llama3-8b", Recipe::Rowwise)),
        links.dp.all_gather(436_224_000.0),
    );
    // Transformer Engine's linears (Megatron-Core) gather the 16-bit weights.
    close(
        gather(&on("megatron-core", "llama3-8b", Recipe::Tensorwise)),
        links.dp.all_gather(436_224_000.0),
    );
}

/// A device without an FP8 peak refuses the recipe, naming the key; 16-bit plans pass.
#[test]
fn a_device_without_an_fp8_peak_refuses() {
    let a100 = spec::load_cluster(
        &specs().join("clusters/dgx-a100-80g.toml"),
        ClusterOverrides::default(),
    )
    .unwrap();
    let p = Path::new("m.toml");
    let c = Path::new("c.toml");
    let e = check(&model("llama3-8b", Recipe::Delayed), &a100, p, c).unwrap_err();
    assert_eq!(e.field, "device.peak_tflops_fp8");
    assert!(e.problem.contains("\"delayed\""), "{}", e.problem);
    assert!(check(&model("llama3-8b", Recipe::None), &a100, p, c).is_ok());
    assert!(check(&model("llama3-8b", Recipe::Delayed), &h100(), p, c).is_ok());
}

/// `training.fp8` reads every recipe, defaults to none, and refuses another value naming the
/// file, the line, the field and the accepted values.
#[test]
fn the_spec_key() {
    let src = |fp8: &str| {
        crate::source::Source::from_text(
            "m.toml",
            format!("name = \"m\"\n[architecture]\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 100\n[training]\nseq_len = 64\nglobal_batch = 8\n{fp8}\n"),
        )
    };
    let parse = |fp8: &str| spec::parse_model_toml(&src(fp8), TrainingOverrides::default());
    assert_eq!(parse("").unwrap().training.fp8, Recipe::None);
    for (name, r) in RECIPES {
        assert_eq!(parse(&format!("fp8 = \"{name}\"")).unwrap().training.fp8, r);
    }
    let e = parse("fp8 = \"rowise\"").unwrap_err();
    assert_eq!(e.field, "training.fp8");
    assert_eq!(e.location, Some((10, 7)));
    assert!(
        e.fix.contains("\"rowwise\"")
            && e.fix
                .contains("none | tensorwise | rowwise | delayed | blockwise"),
        "{}",
        e.fix
    );
}

/// A plan written before the key existed reads as fp8 = none, and a none plan writes no key.
#[test]
fn older_plans_read_as_none() {
    let m = model("llama3-8b", Recipe::None);
    let mut v = serde_json::to_value(&m.training).unwrap();
    assert!(v.get("fp8").is_none());
    let t: crate::model::Training = serde_json::from_value(v.clone()).unwrap();
    assert_eq!(t.fp8, Recipe::None);
    v["fp8"] = "blockwise".into();
    let t: crate::model::Training = serde_json::from_value(v).unwrap();
    assert_eq!(t.fp8, Recipe::Blockwise);
}

/// The report names a peak beyond the device's memory: 81 GiB with FP8 on an 80 GiB device
/// does not fit, the 16-bit 79 GiB does.
#[test]
fn the_report_names_a_peak_that_does_not_fit() {
    let g = 1u64 << 30;
    let c = report::Fp8Change {
        recipe: Recipe::Tensorwise,
        stated: false,
        step_time_s_bf16: 2.0,
        step_time_s_fp8: 1.5,
        peak_bytes_bf16: 79 * g,
        peak_bytes_fp8: 81 * g,
        linears: Vec::new(),
        memory: String::new(),
    };
    let line = &report::lines(&c, 80 * g)[1];
    assert_eq!(
        line,
        "  step 1.500 s with FP8, 2.000 s without (-25.0%); peak memory 81.00 GiB with (over the device's 80.00 GiB: does not fit), 79.00 GiB without"
    );
}
