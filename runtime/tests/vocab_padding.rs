//! A padded vocabulary (Megatron-LM's `--make-vocab-size-divisible-by`) changes memory and
//! time, not the model: the runtime computes logits for the real rows only, so padding rows are
//! never in the softmax and never get a gradient. The reference is the unpadded single-rank run.

mod tiny;

use tessera_planner::layout::Layout;
use tessera_planner::plan::Plan;
use tessera_runtime::exec::TrainReport;

const STEPS: usize = 4;
/// Not a multiple of 128: padded to 256 at TP 1 and 2 with the default divisor.
const VOCAB: u64 = 200;
const HIDDEN: usize = 64;

fn plan(tp: u64, divisible_by: u64) -> Plan {
    let mut model = tiny::model();
    model.architecture.vocab = VOCAB;
    model.architecture.vocab_divisible_by = divisible_by;
    tiny::plan(&model, &Layout::without_pipeline(1, tp, 0, 2))
}

fn run(plan: &Plan) -> TrainReport {
    tiny::run(plan, STEPS)
}

/// The first `VOCAB` rows of the embedding table, where the padded runs hold more.
fn real_rows(r: &TrainReport) -> &[f32] {
    &r.params["wte.weight"][..VOCAB as usize * HIDDEN]
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n).sqrt()
}

#[test]
fn padded_vocabulary_trains_the_unpadded_model() {
    let reference = plan(1, 1);
    let vocab = reference.parallel.vocab.as_ref().unwrap();
    assert_eq!((vocab.model, vocab.padded), (200, 200));
    let want = run(&reference);
    assert_eq!(want.params["wte.weight"].len(), 200 * HIDDEN);
    // 200 rounded up to 128 × TP: 256 at TP 1 (56 padding rows), 256 at TP 2 (rank 1 holds 72
    // real rows and the 56 padding rows).
    for tp in [1, 2] {
        let p = plan(tp, 128);
        let v = p.parallel.vocab.as_ref().unwrap();
        assert_eq!((v.model, v.padded, v.multiple), (200, 256, 128 * tp));
        let got = run(&p);
        assert_eq!(
            got.params["wte.weight"].len(),
            256 * HIDDEN,
            "TP {tp}: padded table"
        );
        for (a, b) in got.steps.iter().zip(&want.steps) {
            assert!(
                (a.loss - b.loss).abs() <= 1e-5 * b.loss,
                "TP {tp}: step {} loss {} vs unpadded {}",
                a.step,
                a.loss,
                b.loss
            );
        }
        let d = rel_l2(real_rows(&got), real_rows(&want));
        assert!(d <= 1e-5, "TP {tp}: real embedding rows differ by {d:e}");
    }
}
