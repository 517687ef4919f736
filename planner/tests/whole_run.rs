//! The whole run (issue 40): time and cost to a token budget, interruptions, Daly's checkpoint
//! interval, goodput and the bytes a save writes, each against a figure worked by hand (in the
//! comments) or published.

use std::path::Path;

use tessera_planner::layout::Layout;
use tessera_planner::memory;
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_planner::whole_run::{self, checkpoint};
use tessera_planner::{Cluster, Model};

fn spec(dir: &str, name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../specs")
        .join(dir)
        .join(format!("{name}.toml"))
}

fn model(name: &str, over: TrainingOverrides) -> Model {
    load_model(&spec("models", name), over).expect("spec")
}

fn cluster(name: &str, over: ClusterOverrides) -> Cluster {
    load_cluster(&spec("clusters", name), over).expect("spec")
}

fn close(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        (got - want).abs() <= rel * want.abs(),
        "{what}: got {got}, want {want} (±{:.3}%)",
        100.0 * rel
    );
}

/// Daly (2006) worked three examples with a 5-minute dump: τ_opt 117 min at M = 24 h, 57 min
/// at M = 6 h and 9.1 min at M = 15 min (the paper's figures, to its rounding).
#[test]
fn daly_interval_matches_the_papers_worked_examples() {
    let min = 60.0;
    for (m_min, published) in [(24.0 * 60.0, 117.0), (6.0 * 60.0, 57.0), (15.0, 9.1)] {
        let tau = whole_run::daly_interval(5.0 * min, m_min * min) / min;
        let tol = if published < 10.0 { 0.05 } else { 0.5 };
        assert!(
            (tau - published).abs() <= tol,
            "M = {m_min} min: τ = {tau:.2} min, Daly published {published}"
        );
    }
    // Past δ ≥ 2M the estimate is M itself.
    assert_eq!(whole_run::daly_interval(100.0, 40.0), 40.0);
}

/// τ = 1000 s of compute, δ = 50 s per save, R = 600 s per restart, M = 36,000 s:
/// τ/(τ+δ) = 1000/1050 = 0.952381; each interruption costs (600 + 1050/2)/36000 = 0.03125 of
/// the time: goodput = 0.952381 × 0.96875 = 0.922619.
#[test]
fn goodput_is_the_saves_and_the_lost_work_taken_out() {
    close(
        whole_run::goodput(1000.0, 50.0, 600.0, 36_000.0),
        0.922_619,
        1e-5,
        "goodput",
    );
    // Interruptions faster than a restart leave nothing.
    assert_eq!(whole_run::goodput(10.0, 1.0, 600.0, 300.0), 0.0);
}

/// Llama 3.1 405B's 15T tokens at global batch 2048 × 8192 = 16,777,216 tokens per step:
/// 15e12 / 16,777,216 = 894,069.67, so 894,070 steps. At 6.0 s per step: 894,070 × 6 / 3600 =
/// 1,490.117 h; on 16,384 GPUs 24,414,071 GPU-hours, $48,828,143 at $2/GPU-hour. The H100
/// preset's reliability (Llama 3: 50,677 GPU-hours per interruption): 16,384 / 50,677 =
/// 0.323302 interruptions per hour, 481.76 over 1,490.117 h.
#[test]
fn a_token_budget_gives_days_gpu_hours_cost_and_interruptions() {
    let m = model(
        "llama3.1-405b",
        TrainingOverrides {
            tokens: Some(15_000_000_000_000),
            ..Default::default()
        },
    );
    let mut c = cluster(
        "dgx-h100-80g",
        ClusterOverrides {
            nodes: Some(2048),
            devices: None,
        },
    );
    c.cost = Some(tessera_planner::spec::Cost {
        usd_per_gpu_hour: 2.0,
    });
    let w = whole_run::whole_run(&m, &c, 6.0, None).expect("a budget");
    assert_eq!(w.tokens_per_step, 16_777_216);
    assert_eq!(w.steps, 894_070);
    close(w.compute_hours, 1_490.116_667, 1e-7, "compute hours");
    close(w.gpu_hours, 24_414_071.47, 1e-7, "GPU-hours");
    close(w.cost_usd.expect("a price"), 48_828_142.93, 1e-7, "cost");
    close(
        whole_run::interruption_rate(&c).expect("[reliability]"),
        0.323_302_48,
        1e-6,
        "interruptions per hour",
    );
    close(
        w.interruptions.expect("[reliability]"),
        481.758,
        1e-5,
        "interruptions",
    );
    // Spot capacity adds each node's preemptions: 2048 nodes × 0.001 per hour.
    c.reliability.as_mut().unwrap().preemptions_per_hour = 0.001;
    close(
        whole_run::interruption_rate(&c).unwrap(),
        0.323_302_48 + 2.048,
        1e-6,
        "with preemptions",
    );
}

/// GPT-2 124M's checkpoint under the CPU's fp32 policy, as runtime/benches/checkpoint.rs measured
/// it (docs/checkpoints.md): 1,494,029,410 bytes on disk for 1 rank and 1,495,417,072 for 8
/// ranks (DP 2 × PP 2 × TP 2, ZeRO-1): the f32 weights and both moments, 12 B per parameter,
/// plus safetensors headers and the index (well under 0.1%); the last stage's copy of GPT-2's
/// tied embedding is not saved.
#[test]
fn save_bytes_match_the_measured_checkpoint() {
    let over = TrainingOverrides {
        seq_len: Some(64),
        global_batch: Some(8),
        ..Default::default()
    };
    let m = model("gpt2-124m", over);
    // The 8-rank tolerance is 1%: tensors TP replicates (the learned positions, the norms, the
    // row-parallel biases, about 0.8M parameters here) are counted on each TP rank, where the
    // checkpoint stores them once; 0.64% over here.
    for (layout, devices, on_disk, tol) in [
        (
            Layout::without_pipeline(1, 1, 0, 4),
            1,
            1_494_029_410.0,
            1e-3,
        ),
        (
            {
                let mut l = Layout::without_pipeline(2, 2, 1, 2);
                l.pp = 2;
                l
            },
            8,
            1_495_417_072.0,
            1e-2,
        ),
    ] {
        let c = cluster(
            "cpu-8",
            ClusterOverrides {
                nodes: None,
                devices: Some(devices),
            },
        );
        let mem = memory::estimate(&m, &c, &layout);
        let b = checkpoint::save_bytes(&m, &c, &layout, &mem);
        assert_eq!(b.per_parameter, 12.0, "fp32 weight, m, v");
        close(b.total, on_disk, tol, &format!("{devices} rank(s)"));
        // One node holds every rank of cpu-8.
        assert_eq!(b.busiest_node, b.total);
    }
}

/// Under the default mixed-precision policy a save is 14 B per parameter (bf16 weights 2, fp32
/// master 4, Adam's moments 8), spread over the DP replicas: GPT-2 124M with DP 8 on one DGX
/// H100 writes 124,475,904 × 14 = 1,742,662,656 B (the vocabulary padded to 50,304 rows), and
/// at the preset's 0.98 GB/s per node the save takes 1.778 s.
#[test]
fn mixed_precision_saves_fourteen_bytes_per_parameter() {
    let m = model("gpt2-124m", TrainingOverrides::default());
    let c = cluster("dgx-h100-80g", ClusterOverrides::default());
    let layout = Layout::without_pipeline(8, 1, 1, 8);
    let mem = memory::estimate(&m, &c, &layout);
    let b = checkpoint::save_bytes(&m, &c, &layout, &mem);
    assert_eq!(b.per_parameter, 14.0);
    close(b.total, 1_742_662_656.0, 1e-9, "bytes");
    let cad = whole_run::cadence(&m, &c, &layout, &mem, 1.0).expect("[reliability] and [storage]");
    close(cad.save_s, 1.778_227, 1e-5, "save seconds");
}
