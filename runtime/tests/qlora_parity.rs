//! QLoRA on the tiny model (issue 37): the blocks' linears are quantized to NF4 (block 64,
//! double quantization) from the GLOBAL tensors, so every layout computes with the single
//! rank's dequantized weights bit for bit and trains the adapters like it (lora_parity.rs's
//! tolerances); the base stays NF4; the bytes each rank holds are the plan's; a checkpoint
//! resumes bit-identically and on another layout.

mod tiny;

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_planner::finetune::{Lora, Method, Target};
use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::model::Model;
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind::OneFOneB;
use tessera_runtime::checkpoint::{Checkpoint, SaveOptions};
use tessera_runtime::exec::{gather, train, StageModel, Stop, TrainOptions, TrainReport};
use tessera_runtime::layers::TpShard;
use tessera_runtime::quant::Nf4Tensor;
use tiny::layout;

#[global_allocator]
static ALLOC: tessera_runtime::alloc::TrackingAlloc = tessera_runtime::alloc::TrackingAlloc;

/// The tracking allocator counts by rank number, which every run of the process shares: the
/// tests take turns so that one's rank 0 is not charged another's bytes.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

const STEPS: usize = 4;

fn model(method: Method) -> Model {
    let mut m = tiny::model();
    m.training.method = method;
    m.lora = Some(Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: vec![Target::Qkv, Target::O, Target::Up, Target::Down],
    });
    m
}

fn plan(l: Layout) -> Plan {
    tiny::plan(&model(Method::Qlora), &l)
}

fn run_with(plan: &Plan, opts: &TrainOptions) -> TrainReport {
    train(plan, &tiny::data(), opts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{}: {e}", plan.parallel.layout().label()))
}

fn opts() -> TrainOptions {
    TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    }
}

fn run(plan: &Plan) -> TrainReport {
    run_with(plan, &opts())
}

fn single() -> Layout {
    layout(1, 1, 1, 0, OneFOneB, 1, Recompute::None)
}

fn sp(l: Layout) -> Layout {
    Layout {
        sequence_parallel: true,
        ..l
    }
}

/// The blocks' linear weights (what QLoRA stores in NF4).
fn is_nf4(name: &str) -> bool {
    name.starts_with("h.")
        && name.ends_with(".weight")
        && !name.contains(".ln_")
        && !name.contains(".lora_")
}

/// The f32 initial tensors of the LoRA model (the same seed, the same base).
fn initial() -> BTreeMap<String, Vec<f32>> {
    let p = tiny::plan(&model(Method::Lora), &single());
    let layout = StageModel::build(&p, 0, TpShard::new(0, 1)).unwrap().layout;
    let flat = layout.init(TrainOptions::default().seed);
    gather(&[(&layout, &flat)])
}

/// Every tensor within lora_parity.rs's tolerance (B: 2e-5, the rest 1e-5 relative L2), the
/// NF4 base bit-identical, and the losses within 1e-5.
fn assert_same(got: &TrainReport, want: &TrainReport, what: &str) {
    tiny::assert_losses_close(got, want, what);
    let tol = |name: &str| match (is_nf4(name), name.contains(".lora_B.")) {
        (true, _) => -1.0,
        (false, true) => 2e-5,
        (false, false) => 1e-5,
    };
    tiny::assert_tensors_close(&got.params, &want.params, what, tol);
}

/// The base is NF4: each linear weight the run computed with is the single rank's whole
/// tensor quantized by `Nf4Tensor` (bitsandbytes' quantize_4bit) and dequantized, before and
/// after training (its codes and scales never move), and not the f32 weight itself.
fn assert_nf4_base(got: &TrainReport, init: &BTreeMap<String, Vec<f32>>, what: &str) {
    let mut n = 0;
    for (name, w) in init.iter().filter(|(n, _)| is_nf4(n)) {
        let t = Nf4Tensor::quantize(w, &[w.len()], true).unwrap();
        assert!(
            got.params[name] == t.dequantize(),
            "{what}: {name} is not the NF4 base"
        );
        assert!(got.params[name] != *w, "{what}: {name} was not quantized");
        n += 1;
    }
    // q, k, v, o, fc, proj × 4 layers.
    assert_eq!(n, 24, "{what}");
}

#[test]
fn qlora_trains_on_an_nf4_base_unlike_lora() {
    let _turn = turn();
    let init = initial();
    let q = run(&plan(single()));
    assert_nf4_base(&q, &init, "single rank");
    let lora = run(&tiny::plan(&model(Method::Lora), &single()));
    let (a, b) = (q.steps[0].loss, lora.steps[0].loss);
    assert!(
        a != b,
        "the first loss is the NF4 base's, not the f32 one's: {a} vs {b}"
    );
    assert!(q.steps[STEPS - 1].loss < a, "the adapters learn");
}

#[test]
fn tensor_and_pipeline_parallel_qlora_equals_the_single_rank() {
    let _turn = turn();
    let init = initial();
    let want = run(&plan(single()));
    for (l, what) in [
        (
            sp(layout(1, 1, 2, 0, OneFOneB, 1, Recompute::None)),
            "tp2 sp",
        ),
        (
            layout(2, 2, 1, 3, OneFOneB, 1, Recompute::None),
            "dp2 pp2 zero3",
        ),
        (layout(1, 1, 4, 0, OneFOneB, 1, Recompute::None), "tp4"),
    ] {
        let got = run(&plan(l));
        assert_same(&got, &want, what);
        assert_nf4_base(&got, &init, what);
    }
}

/// Like with like: the bytes each rank holds in NF4 against the plan's `frozen_weights_nf4`.
/// They differ by the plan's per-parameter rate for the second-level scales (4/16384 B, where
/// a tensor of fewer than 256 blocks holds one whole f32) and the 4-byte offset per tensor.
#[test]
fn the_nf4_bytes_each_rank_holds_are_the_plans() {
    let _turn = turn();
    for l in [
        single(),
        layout(1, 1, 2, 0, OneFOneB, 1, Recompute::None),
        layout(1, 2, 2, 0, OneFOneB, 1, Recompute::None),
    ] {
        let p = plan(l);
        let r = run_with(&p, &TrainOptions { steps: 1, ..opts() });
        let mesh = tessera_planner::Mesh::new(p.parallel.dp, p.parallel.pp, p.parallel.tp, 8);
        for (rank, &held) in r.nf4_bytes.iter().enumerate() {
            let stage = mesh.coord(rank as u64).pp as usize;
            let s = &p.predicted.memory.per_stage[stage];
            let planned = s
                .terms
                .iter()
                .find(|t| t.name == "frozen_weights_nf4")
                .unwrap()
                .bytes;
            let ratio = held as f64 / planned as f64;
            assert!(
                (1.0..1.01).contains(&ratio),
                "{} rank {rank}: holds {held} B of NF4, the plan says {planned}",
                l.label()
            );
        }
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-qlora-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// 2 steps, save, resume for 2 more = 4 straight steps, bit for bit; the same checkpoint
/// resumed under TP 2 (the NF4 codes resharded, the scales read whole) trains as the single
/// rank within the parity tolerance.
#[test]
fn a_qlora_checkpoint_resumes_and_reshards() {
    let _turn = turn();
    let dir = scratch("resume");
    let p1 = plan(single());
    let straight = run(&p1);
    let stop = Stop::new();
    for s in 0..2 {
        assert!(stop.may_start(s));
    }
    stop.request();
    let first = run_with(
        &p1,
        &TrainOptions {
            stop: Some(Arc::new(stop)),
            save: Some(SaveOptions {
                dir: dir.clone(),
                every: 2,
                keep: None,
                lineage: None,
            }),
            ..opts()
        },
    );
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    tessera_runtime::exec::check_checkpoint(&ck).unwrap_or_else(|e| panic!("{e}"));
    assert!(ck.index().nf4_base);
    let resume = TrainOptions {
        resume: Some(ck),
        ..opts()
    };
    let second = run_with(&p1, &resume);
    let losses = |r: &[&TrainReport]| {
        r.iter()
            .flat_map(|r| r.steps.iter().map(|s| s.loss.to_bits()))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses(&[&first, &second]), losses(&[&straight]));
    for (name, w) in &straight.params {
        assert!(second.params[name] == *w, "{name} after the resume");
    }
    let tp2 = run_with(
        &plan(sp(layout(1, 1, 2, 0, OneFOneB, 1, Recompute::None))),
        &resume,
    );
    let mut tail = straight.clone();
    tail.steps.drain(..2);
    assert_same(&tp2, &tail, "resumed under tp2 sp");
    // A LoRA plan does not resume a QLoRA checkpoint (its base is another precision).
    let lora = tiny::plan(&model(Method::Lora), &single());
    let err = train(&lora, &tiny::data(), &resume, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("nf4_base"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// What QLoRA saves against LoRA on the same layout, measured (the peak bytes of the training
/// steps) and planned: the f32 block linears, less their NF4 bytes and the dequantized
/// transient. The plan holds the transient at the peak; the runtime frees it after each GEMM,
/// and its peak (the head's logits) comes when none is held, so the measured saving lies
/// between the planned one and the planned one plus the transient.
#[test]
fn qlora_saves_the_memory_the_plan_says() {
    let _turn = turn();
    for l in [
        single(),
        sp(layout(1, 1, 2, 0, OneFOneB, 1, Recompute::None)),
    ] {
        let stage = |p: &Plan| p.predicted.memory.per_stage[0].clone();
        let (q, f) = (plan(l), tiny::plan(&model(Method::Lora), &l));
        let two = TrainOptions { steps: 2, ..opts() };
        let (rq, rf) = (run_with(&q, &two), run_with(&f, &two));
        let measured = rf.peak_bytes[0] as i64 - rq.peak_bytes[0] as i64;
        let planned = stage(&f).total_bytes as i64 - stage(&q).total_bytes as i64;
        let transient = stage(&q)
            .terms
            .iter()
            .find(|t| t.name == "qlora_dequantized_weight")
            .unwrap()
            .bytes as i64;
        assert!(
            planned <= measured && measured <= planned + transient,
            "{}: QLoRA saves {measured} B measured, {planned} B planned (+ {transient} B transient)",
            l.label()
        );
    }
}

/// `--init-from`'s weights (here the seed's base × 1.5, a base the seed does not make) are what
/// QLoRA quantizes: the run computes with their NF4 form, on one rank and on TP 2.
#[test]
fn qlora_quantizes_the_weights_it_starts_from() {
    let _turn = turn();
    let p = tiny::plan(&model(Method::Lora), &single());
    let layout = StageModel::build(&p, 0, TpShard::new(0, 1)).unwrap().layout;
    let scaled: BTreeMap<String, Vec<f32>> = initial()
        .into_iter()
        .filter(|(n, _)| !n.contains(".lora_"))
        .map(|(n, v)| (n, v.iter().map(|x| x * 1.5).collect()))
        .collect();
    let init: tessera_runtime::exec::InitialParams = scaled
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                (layout.get(n).unwrap().global_shape.clone(), v.clone()),
            )
        })
        .collect();
    let o = TrainOptions {
        init: Some(Arc::new(init)),
        ..opts()
    };
    for l in [single(), sp(layout_tp2())] {
        let r = run_with(&plan(l), &o);
        assert_nf4_base(&r, &scaled, &l.label());
    }
}

fn layout_tp2() -> Layout {
    layout(1, 1, 2, 0, OneFOneB, 1, Recompute::None)
}
