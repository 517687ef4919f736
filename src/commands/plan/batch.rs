//! `tessera plan`'s batch-size lines (issue 40): the tokens each optimizer step takes; for a
//! pretraining job, the batch size and learning rate DeepSeek LLM's compute-optimal law gives
//! (`tessera_planner::batch_law`), with its source, its fitted range and a warning when the
//! global batch is far from it; and, when `--global-batch` changes the spec's batch, the
//! learning-rate rules for the change. Printed only: plan.json does not carry them.

use tessera_planner::batch_law::{self, Advice, BatchChange, Optimum, Place};
use tessera_planner::optimizer::DEFAULT_LR;
use tessera_planner::spec::{self, TrainingOverrides};
use tessera_planner::Model;

use super::PlanArgs;

/// The lines for `model` trained on `budget` tokens (`None`: the job states no budget).
pub(super) fn print(args: &PlanArgs, model: &Model, budget: Option<f64>) {
    let t = &model.training;
    println!(
        "tokens per optimizer step: {} (global batch {} × sequence {})",
        t.global_batch.saturating_mul(t.seq_len),
        t.global_batch,
        t.seq_len
    );
    if let Some(from) = spec_batch(args).filter(|b| *b != t.global_batch) {
        print_change(from, model);
    }
    match batch_law::advise(model, budget) {
        Advice::FineTuning(method) => println!(
            "batch-size law: none for fine-tuning (training.method = \"{}\"): the published \
             compute-optimal laws, {} among them, were fitted on pretraining from scratch, so no \
             batch size or learning rate is given here",
            method.name(),
            batch_law::SOURCE
        ),
        Advice::NeedsBudget => println!(
            "batch-size law: needs the training budget in tokens (`training.tokens`): the \
             compute-optimal batch size and learning rate of {} are functions of the compute \
             C = M · D (M the non-embedding FLOPs per token, D the tokens)",
            batch_law::SOURCE
        ),
        Advice::Law {
            flops_per_token,
            tokens,
            optimum,
        } => print_law(model, flops_per_token, tokens, &optimum),
    }
    println!();
}

/// The law's batch size and learning rate, whether C is in its fitted range, and where the
/// job's global batch lies against the band.
fn print_law(model: &Model, m: f64, d: f64, o: &Optimum) {
    let t = &model.training;
    let seq = t.seq_len as f64;
    let moe = if model.architecture.moe.is_some() {
        " (an MoE model: M counts the active parameters, each MoE layer's shared part and its \
         experts_per_token routed experts)"
    } else {
        ""
    };
    println!(
        "batch-size law, {}: C = M · D = {m:.3e} FLOPs/token{moe} × {d:.3e} tokens = {:.3e} \
         FLOPs → B_opt {} tokens per step ({:.0} sequences of {}), peak learning rate {:.2e}",
        batch_law::SOURCE,
        o.compute,
        tokens(o.batch_tokens),
        o.batch_tokens / seq,
        t.seq_len,
        o.lr
    );
    let (lo, hi) = batch_law::FITTED_FLOPS;
    if o.fitted() {
        println!("  C is within the fitted range ({lo:.0e} to {hi:.0e} FLOPs)");
    } else {
        println!(
            "  C is outside the fitted range ({lo:.0e} to {hi:.0e} FLOPs; the paper validated \
             it at {:.0e} and took its 7B and 67B settings from it at about 8e22 and 9e23): an \
             extrapolation",
            batch_law::VALIDATED_FLOPS
        );
    }
    let job = t.global_batch.saturating_mul(t.seq_len) as f64;
    let (low, high) = o.band();
    let band = format!(
        "[B_opt/{0}, {0}·B_opt] = [{1}, {2}] tokens",
        batch_law::BAND,
        tokens(low),
        tokens(high)
    );
    match o.place(job) {
        Place::Within => println!(
            "  the global batch, {} tokens, is within {band}",
            tokens(job)
        ),
        side => println!(
            "warning: the global batch, {} tokens per step, is {} {band}, a factor of {} \
             either way around the law's optimum (our conservative reading of the broad \
             near-optimal band of DeepSeek LLM's Figs. 2–3, within 0.25% of the best loss): \
             change `training.global_batch` (or --global-batch) towards {:.0} sequences",
            tokens(job),
            if side == Place::Below {
                "below"
            } else {
                "above"
            },
            batch_law::BAND,
            o.batch_tokens / seq
        ),
    }
    println!("  why it matters: {}", batch_law::CRITICAL_BATCH);
}

/// The spec's own global batch when `--global-batch` overrides it; `None` without the flag or
/// for a Hugging Face config, which states none.
fn spec_batch(args: &PlanArgs) -> Option<u64> {
    args.global_batch?;
    let over = TrainingOverrides {
        seq_len: args.seq_len,
        ..Default::default()
    };
    spec::load_model(&args.model, over)
        .ok()
        .map(|m| m.training.global_batch)
}

/// The change of global batch from `from` sequences to `model`'s, and the learning-rate rules
/// with the rates they give from the job's peak learning rate (`tessera plan --global-batch`,
/// `tessera replan`).
pub(crate) fn print_change(from: u64, model: &Model) {
    let lr = model.optimizer.lr;
    let change = BatchChange {
        from,
        to: model.training.global_batch,
    };
    println!(
        "{}; from optimizer.lr {lr}{}; this job's optimizer, AdamW, is Adam-like",
        change.describe(Some(lr)),
        if lr == DEFAULT_LR {
            " (the default where the spec states none)"
        } else {
            ""
        }
    );
}

/// A token count for reading: 9.237M, 315548.
fn tokens(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.3}B", x / 1e9),
        x if x >= 1e6 => format!("{:.3}M", x / 1e6),
        x => format!("{x:.0}"),
    }
}
