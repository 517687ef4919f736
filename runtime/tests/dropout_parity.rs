//! Dropout parity (issue 37): with dropout 0.1 on the embedding, attention and residual sites
//! (and LoRA dropout 0.1 on the adapters), every layout of the tiny model trains exactly like
//! the single rank — losses and every tensor within `parity.rs`'s 1e-5 relative — because each
//! mask is drawn by the element's global sequence, position, feature and head, never by what a
//! rank holds. Dropout is not a no-op (it changes the loss), and evaluation does not drop.
//! (The CPU plan's memory against the runtime's: `dropout_memory.rs`.)

mod tiny;

use tessera_planner::finetune::{Lora, Method, Target};
use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::model::Model;
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind::{self, Gpipe, Interleaved, OneFOneB};
use tessera_runtime::exec::{train, EvalSet, TrainOptions, TrainReport};
use tiny::layout;

const STEPS: usize = 5;
const P: f64 = 0.1;

/// The tiny model with `training.dropout = p`.
fn model(p: f64) -> Model {
    let mut m = tiny::model();
    m.training.dropout = p;
    m
}

/// The tiny model fine-tuned with LoRA (r 4, alpha 8, every linear of its blocks) with
/// `[lora] dropout = lora` and `training.dropout = p` on the frozen base's sites.
fn lora_model(p: f64, lora: f64) -> Model {
    let mut m = model(p);
    m.training.method = Method::Lora;
    m.lora = Some(Lora {
        rank: 4,
        alpha: 8.0,
        dropout: lora,
        targets: vec![Target::Qkv, Target::O, Target::Up, Target::Down],
    });
    m
}

fn run_with(plan: &Plan, opts: TrainOptions) -> TrainReport {
    train(plan, &tiny::data(), &opts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{}: {e}", plan.parallel.layout().label()))
}

/// `STEPS` steps, evaluating the validation loss after steps 2, 4 and 5 (as `parity.rs`).
fn run(plan: &Plan) -> TrainReport {
    let t = &plan.job.model.training;
    let (seq, batch) = (t.seq_len as usize, t.global_batch as usize);
    let (inputs, targets) = tiny::data().eval_sequences(seq, 2 * batch);
    let opts = TrainOptions {
        steps: STEPS,
        eval: Some(std::sync::Arc::new(EvalSet {
            every: 2,
            inputs,
            targets,
            source: "tiny text".into(),
        })),
        ..TrainOptions::default()
    };
    run_with(plan, opts)
}

/// Losses within 1e-5 relative, and every tensor within `tol(name)` relative L2.
fn assert_same(got: &TrainReport, want: &TrainReport, what: &str, tol: fn(&str) -> f64) {
    assert_eq!(got.steps.len(), STEPS, "{what}: every step reports a loss");
    tiny::assert_losses_close(got, want, what);
    let worst = tiny::assert_tensors_close(&got.params, &want.params, what, tol);
    eprintln!(
        "{what}: worst tensor {} at {:.2e} relative",
        worst.1, worst.0
    );
}

/// `parity.rs`'s 1e-5; `lora_parity.rs`'s 2e-5 for the B matrices (all update, from zero).
fn tolerance(name: &str) -> f64 {
    match name.contains(".lora_B.") {
        true => 2e-5,
        false => 1e-5,
    }
}

fn sp(l: Layout) -> Layout {
    Layout {
        sequence_parallel: true,
        ..l
    }
}

#[allow(clippy::too_many_arguments)]
fn l(dp: u64, pp: u64, tp: u64, zero: u8, k: ScheduleKind, v: u64, r: Recompute) -> Layout {
    layout(dp, pp, tp, zero, k, v, r)
}

fn single() -> Layout {
    l(1, 1, 1, 0, OneFOneB, 1, Recompute::None)
}

fn check(m: &Model, layouts: &[(Layout, &str)]) {
    let want = run(&tiny::plan(m, &single()));
    for (layout, what) in layouts {
        let got = run(&tiny::plan(m, layout));
        assert_same(&got, &want, what, tolerance);
    }
}

#[test]
fn dropout_parity_dp_tp_and_sequence_parallel() {
    let none = Recompute::None;
    check(
        &model(P),
        &[
            (l(2, 1, 1, 0, OneFOneB, 1, none), "dp2"),
            (l(4, 1, 1, 0, OneFOneB, 1, none), "dp4"),
            (l(1, 1, 2, 0, OneFOneB, 1, none), "tp2"),
            (l(1, 1, 4, 0, OneFOneB, 1, none), "tp4"),
            (sp(l(1, 1, 2, 0, OneFOneB, 1, none)), "tp2 sp"),
            (sp(l(2, 1, 4, 0, OneFOneB, 1, none)), "dp2 tp4 sp"),
        ],
    );
}

#[test]
fn dropout_parity_pipelines_and_interleaving() {
    let none = Recompute::None;
    check(
        &model(P),
        &[
            (l(1, 2, 1, 0, OneFOneB, 1, none), "pp2"),
            (l(1, 4, 1, 0, Gpipe, 1, none), "pp4 gpipe"),
            (l(1, 2, 1, 0, Interleaved, 2, none), "pp2 interleaved×2"),
            (
                l(2, 2, 2, 0, Interleaved, 2, none),
                "dp2 pp2 tp2 interleaved×2",
            ),
        ],
    );
}

#[test]
fn dropout_parity_zero_and_recompute() {
    let none = Recompute::None;
    check(
        &model(P),
        &[
            (l(2, 1, 1, 1, OneFOneB, 1, none), "zero1 dp2"),
            (l(2, 1, 1, 2, OneFOneB, 1, none), "zero2 dp2"),
            (l(2, 1, 1, 3, OneFOneB, 1, none), "zero3 dp2"),
            (sp(l(2, 2, 2, 3, OneFOneB, 1, none)), "zero3 dp2 pp2 tp2 sp"),
            (
                l(1, 1, 1, 0, OneFOneB, 1, Recompute::Full),
                "full recompute",
            ),
            (
                sp(l(2, 2, 2, 1, OneFOneB, 1, Recompute::Full)),
                "full recompute dp2 pp2 tp2 sp zero1",
            ),
            (
                l(1, 2, 2, 0, OneFOneB, 1, Recompute::Selective),
                "selective recompute pp2 tp2",
            ),
        ],
    );
}

#[test]
fn lora_dropout_parity() {
    let none = Recompute::None;
    check(
        &lora_model(P, P),
        &[
            (l(2, 1, 1, 0, OneFOneB, 1, none), "lora dp2"),
            (l(1, 1, 2, 0, OneFOneB, 1, none), "lora tp2"),
            (sp(l(2, 1, 4, 0, OneFOneB, 1, none)), "lora dp2 tp4 sp"),
            (
                l(1, 2, 2, 0, Interleaved, 2, none),
                "lora pp2 tp2 interleaved×2",
            ),
            (l(2, 1, 1, 3, OneFOneB, 1, none), "lora zero3 dp2"),
            (
                sp(l(1, 2, 2, 0, OneFOneB, 1, Recompute::Full)),
                "lora full recompute pp2 tp2 sp",
            ),
        ],
    );
}

/// One step at a learning rate too small to move an f32 weight: the training losses of
/// dropout 0.1 and 0 differ (dropout is applied), the validation losses after it do not (the
/// evaluation forward does not drop).
#[test]
fn dropout_changes_the_training_loss_and_not_the_evaluation() {
    let (with, without) = (model(P), model(0.0));
    let mut optimizer = with.optimizer.clone();
    (optimizer.lr, optimizer.min_lr) = (1e-30, 1e-31);
    let t = &with.training;
    let (seq, batch) = (t.seq_len as usize, t.global_batch as usize);
    let (inputs, targets) = tiny::data().eval_sequences(seq, batch);
    let opts = TrainOptions {
        steps: 1,
        optimizer: Some(optimizer),
        eval: Some(std::sync::Arc::new(EvalSet {
            every: 1,
            inputs,
            targets,
            source: "tiny text".into(),
        })),
        ..TrainOptions::default()
    };
    let a = run_with(&tiny::plan(&with, &single()), opts.clone());
    let b = run_with(&tiny::plan(&without, &single()), opts);
    let (la, lb) = (a.steps[0].loss, b.steps[0].loss);
    // Measured: 3.3e-4 relative at initialisation; the parity tolerance is 1e-5.
    assert!(
        (la - lb).abs() > 1e-4 * lb,
        "the training loss changes: {la} vs {lb}"
    );
    let (va, vb) = (a.steps[0].val_loss.unwrap(), b.steps[0].val_loss.unwrap());
    assert!(
        (va - vb).abs() <= 1e-9 * vb,
        "evaluation does not drop: {va} vs {vb}"
    );
}

/// LoRA dropout alone changes the training: B starts at zero, so the adapters' output (and
/// with it the loss) first differs once B has moved, at the second step.
#[test]
fn lora_dropout_changes_the_training_loss() {
    let opts = TrainOptions {
        steps: 3,
        ..TrainOptions::default()
    };
    let with = run_with(&tiny::plan(&lora_model(0.0, P), &single()), opts.clone());
    let without = run_with(&tiny::plan(&lora_model(0.0, 0.0), &single()), opts);
    assert_eq!(with.steps[0].loss, without.steps[0].loss, "B = 0 at step 0");
    let (la, lb) = (with.steps[2].loss, without.steps[2].loss);
    assert!(
        (la - lb).abs() > 1e-5 * lb,
        "the loss changes by step 2: {la} vs {lb}"
    );
}
