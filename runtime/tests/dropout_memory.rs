//! The CPU runtime keeps no dropout mask (it draws each again where needed,
//! runtime/src/layers/dropout.rs): a CPU plan with dropout predicts the bytes of one without,
//! and the runtime's measured peak is the same; LoRA dropout's per-call dropped input is
//! counted as the runtime allocates it. One test in its own binary: the tracking allocator's
//! peaks are per rank index, which concurrent tests would share.

mod tiny;

use tessera_planner::finetune::{Lora, Method, Target};
use tessera_planner::layout::Layout;
use tessera_planner::model::Model;
use tessera_runtime::alloc::TrackingAlloc;
use tessera_runtime::exec::{train, TrainOptions};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn model(p: f64, lora: Option<f64>) -> Model {
    let mut m = tiny::model();
    m.training.dropout = p;
    if let Some(dropout) = lora {
        m.training.method = Method::Lora;
        m.lora = Some(Lora {
            rank: 4,
            alpha: 8.0,
            dropout,
            targets: vec![Target::Qkv, Target::O, Target::Up, Target::Down],
        });
    }
    m
}

/// (measured, predicted) peak bytes of rank 0, one rank, 2 steps.
fn peak(m: &Model) -> (f64, f64) {
    let plan = tiny::plan(m, &Layout::without_pipeline(1, 1, 0, 2));
    let opts = TrainOptions {
        steps: 2,
        ..TrainOptions::default()
    };
    let r = train(&plan, &tiny::data(), &opts, &mut |_| {}).unwrap();
    (
        r.peak_bytes[0] as f64,
        plan.predicted.memory.peak_bytes as f64,
    )
}

#[test]
fn a_dropout_plan_predicts_what_the_runtime_holds() {
    let (m0, p0) = peak(&model(0.0, None));
    let (m1, p1) = peak(&model(0.1, None));
    assert_eq!(p1, p0, "predicted: no masks held");
    assert!(
        (m1 - m0).abs() <= 0.01 * m0,
        "measured: {m1} with dropout vs {m0} without"
    );
    let (l0, q0) = peak(&model(0.0, Some(0.0)));
    let (l1, q1) = peak(&model(0.0, Some(0.1)));
    eprintln!("lora: measured {l0} → {l1}, predicted {q0} → {q1}");
    assert!(q1 > q0, "the dropped copy is counted");
    // LoRA dropout leaves the prediction as close to the measurement as it was without.
    let (r0, r1) = (l0 / q0, l1 / q1);
    assert!(
        (r1 - r0).abs() <= 0.02,
        "measured/predicted: {r1:.3} with LoRA dropout, {r0:.3} without"
    );
}
