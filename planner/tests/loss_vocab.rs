//! The loss as the framework computes it, and the vocabulary as it holds it (issue 28, item 3):
//! worked figures computed by hand in the comments.

use std::path::Path;

use tessera_planner::cost::loss::{LossCost, UNALIGNED_GEMM_EFFICIENCY};
use tessera_planner::cost::ops::{self, Device};
use tessera_planner::cost::Options;
use tessera_planner::framework::{self, LossKind};
use tessera_planner::layout::Layout;
use tessera_planner::memory::{self, logits};
use tessera_planner::plan::VocabPadding;
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_planner::{Cluster, Model};

fn spec(dir: &str, name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../specs")
        .join(dir)
        .join(format!("{name}.toml"))
}

fn model(name: &str, framework: Option<&str>) -> Model {
    let mut m = load_model(&spec("models", name), TrainingOverrides::default()).expect("spec");
    m.training.framework = framework.map(str::to_string);
    m
}

fn h100() -> Cluster {
    load_cluster(
        &spec("clusters", "dgx-h100-80g"),
        ClusterOverrides::default(),
    )
    .expect("spec")
}

/// One fp32 N × V buffer at 16,384 tokens × 128,256 vocabulary (Llama 3, TP 1; 128256 is
/// already a multiple of 128): 16384 × 128256 × 4 B = 8,405,385,216 B = 7.83 GiB. The
/// vocabulary-parallel loss keeps one; PyTorch's unfused loss three (25,216,155,648 B =
/// 23.48 GiB) plus the bf16 logits (16384 × 128256 × 2 = 4,202,692,608 B); the fused loss no
/// fp32 buffer, only the bf16 logits.
#[test]
fn logits_buffers_by_loss_kind_at_a_128k_vocabulary() {
    let m = model("llama3-8b", None);
    let fp32 = 8_405_385_216.0;
    let bf16 = 4_202_692_608.0;
    let of = |kind| -> Vec<(&str, f64)> {
        let loss = logits::Loss {
            kind,
            parallel: false,
        };
        logits::terms(&m, 16384.0, 1, loss, true)
            .into_iter()
            .map(|(n, b, _)| (n, b))
            .collect()
    };
    assert_eq!(of(LossKind::VocabParallelFp32), vec![("logits_fp32", fp32)]);
    let unfused = of(LossKind::UnfusedFp32);
    let fp32_total: f64 = unfused
        .iter()
        .filter(|(n, _)| n.contains("fp32"))
        .map(|(_, b)| b)
        .sum();
    assert_eq!(fp32_total, 3.0 * fp32, "{unfused:?}");
    assert!(unfused.contains(&("logits_16bit", bf16)), "{unfused:?}");
    assert_eq!(of(LossKind::Fused), vec![("logits_16bit", bf16)]);

    // The same through the memory model of a whole layout (TP 1, one stage, micro-batch
    // 2 × 8192 = 16,384 tokens, one micro-batch held by 1F1B's last stage): the profile's loss
    // picks the terms.
    let l = Layout::without_pipeline(1, 1, 0, 2);
    let terms = |fw: &str| {
        let r = memory::estimate(&model("llama3-8b", Some(fw)), &h100(), &l);
        r.per_stage[0]
            .terms
            .iter()
            .map(|t| (t.name.clone(), t.bytes))
            .collect::<Vec<_>>()
    };
    let core = terms("megatron-core");
    assert!(
        core.contains(&("logits_fp32".into(), fp32 as u64)),
        "{core:?}"
    );
    assert!(!core.iter().any(|(n, _)| n == "logits_fp32_grad"));
    let titan = terms("torchtitan");
    for name in ["logits_fp32", "logits_fp32_grad", "logits_fp32_grad_input"] {
        assert!(
            titan.contains(&(name.into(), fp32 as u64)),
            "{name}: {titan:?}"
        );
    }
    let compiled = terms("pytorch-compile");
    assert!(
        !compiled.iter().any(|(n, _)| n.starts_with("logits_fp32")),
        "{compiled:?}"
    );
}

/// The loss's time on the H100 preset (3350 GB/s × memory_efficiency 0.726 = 2432.1 GB/s,
/// 2.43 µs per launch) at 16,384 × 128,256 = 2,101,346,304 logits: the fused loss moves 4 + 2
/// B per logit (12.61 GB, 5.18 ms), the unfused PyTorch loss 22 + 26 (100.86 GB, 41.47 ms):
/// 8× the bytes. The difference of the two heads is only the loss (same GEMMs, same norm):
/// forward 18 B × N·V / bandwidth + 2 launches (3 kernels against 1), backward 24 B × N·V /
/// bandwidth + 3 launches (4 against 1).
#[test]
fn unfused_loss_moves_eight_times_the_fused_bytes() {
    let fused = LossCost::of(LossKind::Fused);
    let unfused = LossCost::of(LossKind::UnfusedFp32);
    assert_eq!(fused.bytes.0 + fused.bytes.1, 6.0);
    assert_eq!(unfused.bytes.0 + unfused.bytes.1, 48.0);
    // Megatron's charge is today's: 18 + 22.
    assert_eq!(
        LossCost::of(LossKind::VocabParallelFp32).bytes,
        (18.0, 22.0)
    );

    let c = h100();
    let dev = Device::of(&c);
    let mut m = model("llama3-8b", None);
    m.training.seq_len = 8192;
    let (ff, fb) = ops::head(&m, &dev, 1, false, 2, LossKind::Fused, true);
    let (uf, ub) = ops::head(&m, &dev, 1, false, 2, LossKind::UnfusedFp32, true);
    let logits = 16384.0 * 128256.0;
    let bw = 3350e9 * 0.726;
    let launch = 2.43e-6;
    let want_f = 18.0 * logits / bw + 2.0 * launch;
    let want_b = 24.0 * logits / bw + 3.0 * launch;
    assert!(
        ((uf - ff) / want_f - 1.0).abs() < 1e-9,
        "{} vs {want_f}",
        uf - ff
    );
    assert!(
        ((ub - fb) / want_b - 1.0).abs() < 1e-9,
        "{} vs {want_b}",
        ub - fb
    );
    // 41.47 ms against 5.18 ms of loss alone.
    assert!((48.0 * logits / bw - 41.47e-3).abs() < 0.01e-3);
    assert!((6.0 * logits / bw - 5.18e-3).abs() < 0.01e-3);
}

/// GPT-2's 50257-token vocabulary: megatron-core pads it to 50304 (128 × TP 1); torchtitan
/// and pytorch-eager use it as it is. The unpadded output layer holds 47 rows fewer
/// (47 × 768 = 36,096 parameters), but its rows (50257 × 2 B = 100,514 B, not a multiple of
/// 16) make its three GEMMs unaligned: charged 1/0.71 of the aligned time.
#[test]
fn unpadded_gpt2_vocabulary_runs_unaligned_gemms() {
    let c = h100();
    let core = model("gpt2-124m", None);
    let titan = model("gpt2-124m", Some("torchtitan"));
    assert!(!Options::for_model(&titan, &c).pad_vocab);
    assert_eq!(
        Options::for_model(&titan, &c).loss,
        LossKind::UnfusedFp32Freed
    );
    assert!(Options::for_model(&core, &c).pad_vocab);

    let pads = VocabPadding::of(&core, 1, framework::by_name("megatron-core").unwrap());
    assert_eq!(pads.padded, 50304);
    assert!(
        pads.reason.contains("megatron-core profile pads"),
        "{}",
        pads.reason
    );
    for fw in ["torchtitan", "pytorch-eager"] {
        let v = VocabPadding::of(&core, 1, framework::by_name(fw).unwrap());
        assert_eq!(v.padded, 50257, "{fw}");
        assert!(v.reason.contains("does not pad"), "{}", v.reason);
        assert!(v.reason.contains("unaligned"), "{}", v.reason);
    }

    // Parameters per rank (one stage, tied embeddings: one 768-wide table).
    let l = Layout::without_pipeline(1, 1, 0, 1);
    let params = |m: &Model| memory::estimate(m, &c, &l).per_stage[0].params_per_rank;
    assert_eq!(params(&core) - params(&titan), 47 * 768);

    // The output layer's GEMMs alone: a device with unlimited bandwidth and no launches, GEMMs
    // at the calibration's curve (its efficiency at the smallest dimension, 768, is the same
    // for every vocabulary below), so a GEMM's time is its FLOPs: 2·t·768·V each.
    let dev = Device {
        bandwidth: f64::INFINITY,
        gemm: None,
        launch: 0.0,
        ..Device::of(&c)
    };
    let head = |m: &Model, pad: bool| {
        let (f, b) = ops::head(m, &dev, 1, false, 4, LossKind::Fused, pad);
        f + b
    };
    // The aligned reference: a 50256-token vocabulary (100,512 B rows = 16 × 6282), unpadded.
    let mut aligned = core.clone();
    aligned.architecture.vocab = 50256;
    let base = head(&aligned, false);
    // Unpadded 50257: 50257/50256 of the FLOPs at 0.71 of the rate.
    let want = 50257.0 / 50256.0 / UNALIGNED_GEMM_EFFICIENCY;
    assert!((head(&core, false) / base / want - 1.0).abs() < 1e-12);
    assert!((UNALIGNED_GEMM_EFFICIENCY - 0.71).abs() < 1e-12);
    // Padded 50304: 50304/50256 of the FLOPs, aligned, at the full rate (1.00096×, against the
    // unpadded 1.4085×).
    assert!((head(&core, true) / base - 50304.0 / 50256.0).abs() < 1e-12);
}
