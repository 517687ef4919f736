//! What the executor-on-a-device tests share: the tiny model's plans, the data, and the
//! comparison with the CPU backend's run at bf16 accuracy.

use std::path::Path;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::model::Model;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{
    load_cluster, load_model, Cluster, ClusterOverrides, TrainingOverrides,
};
use tessera_runtime::backend::cuda::{Device, HostStaged, Launcher};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, train_on, RunError, TrainOptions, TrainReport};

pub const STEPS: usize = 3;
/// Sequences per step: two micro-batches of 2 per DP rank at DP 2.
const GLOBAL_BATCH: u64 = 8;

/// |loss_device − loss_cpu| ≤ this × loss_cpu. bf16 keeps 8 significant bits (relative step
/// 2⁻⁸ ≈ 0.4% per value), but the loss is a mean over 512 tokens, so rounding averages out: the
/// runs agree to 5.4e-5 (attention on tensor cores). 2e-3 leaves room for kernel
/// changes and still fails a real error: a planted bug that drops half of each residual add
/// moved the second step's loss by 2.5%.
const LOSS_RTOL: f64 = 2e-3;

pub fn plan(dp: u64, pp: u64, tp: u64, zero: u8, recompute: Recompute) -> Plan {
    plan_sp(dp, pp, tp, zero, recompute, false)
}

/// [`plan`] with or without sequence parallelism.
pub fn plan_sp(
    dp: u64,
    pp: u64,
    tp: u64,
    zero: u8,
    recompute: Recompute,
    sequence_parallel: bool,
) -> Plan {
    plan_of(
        "specs/models/tiny.toml",
        dp,
        pp,
        tp,
        zero,
        recompute,
        sequence_parallel,
    )
}

/// [`plan_sp`] for the model spec at `spec` (relative to the workspace root).
pub fn plan_of(
    spec: &str,
    dp: u64,
    pp: u64,
    tp: u64,
    zero: u8,
    recompute: Recompute,
    sequence_parallel: bool,
) -> Plan {
    plan_for(&model(spec), dp, pp, tp, zero, recompute, sequence_parallel)
}

/// [`plan_of`] for `model` (a spec's, changed: LoRA settings, say).
pub fn plan_for(
    model: &Model,
    dp: u64,
    pp: u64,
    tp: u64,
    zero: u8,
    recompute: Recompute,
    sequence_parallel: bool,
) -> Plan {
    let layout = Layout {
        pp,
        recompute,
        sequence_parallel,
        schedule: ScheduleKind::OneFOneB,
        virtual_stages: 1,
        ..Layout::without_pipeline(dp, tp, zero, 2)
    };
    let cluster = cluster("specs/clusters/cpu-8.toml", dp * pp * tp);
    plan_of_model(model, cluster, &layout)
}

/// The cluster spec at `spec` (relative to the workspace root) with `devices` devices.
pub fn cluster(spec: &str, devices: u64) -> Cluster {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let overrides = ClusterOverrides {
        nodes: None,
        devices: Some(devices),
    };
    load_cluster(&root.join(spec), overrides).unwrap()
}

/// The plan of `layout` for the model spec at `spec` (its global batch [`GLOBAL_BATCH`]) on
/// `cluster`; the layout must pass `Layout::check`.
#[allow(dead_code)] // offload_parity.rs's; the plans above go through `plan_for`
pub fn plan_on(spec: &str, cluster: Cluster, layout: &Layout) -> Plan {
    plan_of_model(&model(spec), cluster, layout)
}

/// The model spec at `spec` (relative to the workspace root), its global batch
/// [`GLOBAL_BATCH`].
pub fn model(spec: &str) -> Model {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    load_model(
        &root.join(spec),
        TrainingOverrides {
            global_batch: Some(GLOBAL_BATCH),
            ..TrainingOverrides::default()
        },
    )
    .unwrap()
}

/// The plan of `layout` for `model` on `cluster`; the layout must pass `Layout::check`.
pub fn plan_of_model(model: &Model, cluster: Cluster, layout: &Layout) -> Plan {
    layout
        .check(model, &cluster)
        .unwrap_or_else(|e| panic!("{}: {e}", layout.label()));
    Plan::new(model, &cluster, layout, SearchSummary::pinned())
}

pub fn data() -> Tokens {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/parallelism.txt");
    Tokens::load(&path).unwrap()
}

pub fn opts() -> TrainOptions {
    TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    }
}

/// The plan trained with every rank on a device backend over `launcher(rank)`, collectives
/// through host memory.
pub fn on_device<L>(
    plan: &Plan,
    launcher: &(dyn Fn(usize) -> Result<L, RunError> + Sync),
) -> TrainReport
where
    L: Launcher + Clone + Send + Sync + 'static,
    L::Buf: Send + Sync,
{
    on_device_with(plan, launcher, &opts())
}

/// [`on_device`] with the options `opts`.
pub fn on_device_with<L>(
    plan: &Plan,
    launcher: &(dyn Fn(usize) -> Result<L, RunError> + Sync),
    opts: &TrainOptions,
) -> TrainReport
where
    L: Launcher + Clone + Send + Sync + 'static,
    L::Buf: Send + Sync,
{
    train_on(
        plan,
        &data(),
        opts,
        &mut |_| {},
        &|r| Ok(Device::new(launcher(r)?)),
        &|dev: &Device<L>, comm| -> Result<_, RunError> { Ok(HostStaged::new(dev.clone(), comm)) },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", plan.parallel.layout().label()))
}

/// The CPU backend's run of the same plan.
pub fn on_cpu(plan: &Plan) -> TrainReport {
    train(plan, &data(), &opts(), &mut |_| {}).unwrap()
}

pub fn losses(r: &TrainReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// Every step's loss within [`LOSS_RTOL`] of `want`'s.
pub fn assert_close(got: &TrainReport, want: &TrainReport, what: &str) {
    let (d, c) = (losses(got), losses(want));
    assert_eq!(d.len(), STEPS, "{what}: every step reports a loss");
    for (step, (d, c)) in d.iter().zip(&c).enumerate() {
        let err = (d - c).abs() / c.abs();
        assert!(
            err <= LOSS_RTOL,
            "{what}: step {step}: device loss {d}, CPU loss {c} (relative difference {err:.4})"
        );
    }
    eprintln!("{what}: device {d:?}\n{what}: cpu    {c:?}");
}

/// The two plans every device backend must train like the CPU: one rank, and DP 2 with ZeRO-1,
/// PP 2 (1F1B), TP 2 and selective recompute (every sync path of the executor).
pub fn one_rank() -> Plan {
    plan(1, 1, 1, 0, Recompute::None)
}

pub fn two_by_two_by_two() -> Plan {
    plan(2, 2, 2, 1, Recompute::Selective)
}

/// TP 2 with sequence parallelism and full recompute: the row-sharded norms and residuals, the
/// position embedding from a rank's first row, and the recompute of a whole block.
pub fn tp2_sequence_parallel() -> Plan {
    plan_sp(1, 1, 2, 0, Recompute::Full, true)
}

/// The tiny Llama of tests/fixtures/tiny-llama-rope.toml (RMSNorm with ε 1e-6, SwiGLU, RoPE with
/// θ 1e6 and Llama 3.1's frequency scaling, GQA: 4 query heads on 2 kv heads, no biases, an
/// untied output layer, a vocabulary of 250 that TP 2 pads to 256), on one rank.
pub const TINY_LLAMA: &str = "tests/fixtures/tiny-llama-rope.toml";

pub fn llama_one_rank() -> Plan {
    plan_of(TINY_LLAMA, 1, 1, 1, 0, Recompute::None, false)
}

/// The tiny Llama on TP 2 × PP 2 (one kv head per TP rank, one layer per stage, 1F1B) with
/// selective recompute.
pub fn llama_tp2_pp2() -> Plan {
    plan_of(TINY_LLAMA, 1, 2, 2, 0, Recompute::Selective, false)
}

/// The tiny mixture of experts (specs/models/tiny-moe.toml: 4 experts of which each token takes
/// 2, softmax router, Switch load-balancing loss, a dense first layer) on DP `dp` × TP `tp`,
/// `ep` expert-parallel ranks cut from DP, sequence parallelism with TP (Megatron-LM requires
/// it with EP).
pub fn moe_plan(dp: u64, tp: u64, ep: u64) -> Plan {
    let layout = Layout {
        ep,
        sequence_parallel: tp > 1,
        ..Layout::without_pipeline(dp, tp, 0, 2)
    };
    let cluster = cluster("specs/clusters/cpu-8.toml", dp * tp);
    plan_on("specs/models/tiny-moe.toml", cluster, &layout)
}

/// The model spec at `spec` on DP `dp` × CP `cp` × TP `tp` (one stage; context parallelism's
/// ring attention over CP ranks).
#[allow(dead_code)] // executor_emulated_cp.rs's and executor_cuda.rs's
pub fn cp_plan(spec: &str, dp: u64, cp: u64, tp: u64) -> Plan {
    let layout = Layout {
        cp,
        ..Layout::without_pipeline(dp, tp, 0, 2)
    };
    let p = plan_on(
        spec,
        cluster("specs/clusters/cpu-8.toml", dp * cp * tp),
        &layout,
    );
    assert_eq!(p.parallel.cp, cp, "{}", layout.label());
    p
}

/// The plan's parameters before any step (the CPU backend's initialisation, which every
/// backend shares: same seed, same layout).
pub fn initial_params(plan: &Plan) -> std::collections::BTreeMap<String, Vec<f32>> {
    let opts = TrainOptions { steps: 0, ..opts() };
    train(plan, &data(), &opts, &mut |_| {}).unwrap().params
}

/// The largest relative difference [`assert_updates_close`] allows: the device's bf16 runs
/// agree with the CPU's to 0.045 or better (the token embedding; 0.02–0.03 for the block
/// weights), while a device SwiGLU that swaps gate and up moves the MLP projections' updates
/// by 0.21.
pub const UPDATE_RTOL: f64 = 0.1;

/// Each tensor's update over the run (final − initial) within [`UPDATE_RTOL`] of `want`'s in
/// relative L2 norm, ‖Δgot − Δwant‖ / ‖Δwant‖: the losses alone hardly see a wrong MLP or
/// attention in the first steps, where the embedding and the head do most of the learning.
/// Tensors initialised to a constant 1 (the norm weights) are left out: the final parameters
/// are the bf16 working copy, whose spacing at 1 (2⁻⁷) exceeds a few steps' updates.
pub fn assert_updates_close(
    got: &TrainReport,
    want: &TrainReport,
    init: &std::collections::BTreeMap<String, Vec<f32>>,
    what: &str,
) {
    assert_updates_within(got, want, init, UPDATE_RTOL, what);
}

/// [`assert_updates_close`] at the relative tolerance `rtol`.
pub fn assert_updates_within(
    got: &TrainReport,
    want: &TrainReport,
    init: &std::collections::BTreeMap<String, Vec<f32>>,
    rtol: f64,
    what: &str,
) {
    let mut worst = (0.0f64, String::new());
    for (name, w0) in init {
        if w0.iter().all(|&x| x == 1.0) {
            continue;
        }
        let (g, w) = (&got.params[name], &want.params[name]);
        assert_eq!((g.len(), w.len()), (w0.len(), w0.len()), "{what}: {name}");
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for ((g, w), w0) in g.iter().zip(w).zip(w0) {
            let (dg, dw) = (f64::from(g - w0), f64::from(w - w0));
            diff += (dg - dw).powi(2);
            norm += dw.powi(2);
        }
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        assert!(
            rel <= rtol,
            "{what}: {name}: the device's update differs from the CPU's by {rel:.4} relative (allowed {rtol})"
        );
        if rel >= worst.0 {
            worst = (rel, name.clone());
        }
    }
    eprintln!(
        "{what}: updates agree to {:.4} relative or better (worst: {})",
        worst.0, worst.1
    );
}
