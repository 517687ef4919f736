//! What a run reports as it goes and when it ends: the JSON line and progress text of each
//! step, the summary lines (loss, validation loss, step time against the plan's prediction),
//! and each rank's measured memory against the plan's. The host memory a CPU run needs is
//! estimated here too, from the same plan terms.

use tessera_planner::plan::Plan;
use tessera_planner::spec::DeviceKind;

use crate::exec::StepMetrics;

/// The JSON line of one step: `step`, `loss`, `step_time_s`, `tokens_per_s`, `tokens_seen`,
/// `lr`, `grad_norm`, and `val_loss` at the steps that evaluate.
pub fn json_line(m: &StepMetrics) -> serde_json::Value {
    let mut line = serde_json::json!({
        "step": m.step,
        "loss": m.loss,
        "step_time_s": m.step_time_s,
        "tokens_per_s": m.tokens_per_s,
        "tokens_seen": m.tokens_seen,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
    });
    if let Some(v) = m.val_loss {
        line["val_loss"] = v.into();
    }
    line
}

/// The progress message after a step: loss, the latest validation loss, tokens/s.
pub fn progress(m: &StepMetrics, last_val: Option<f64>) -> String {
    match last_val {
        Some(v) => format!(
            "loss {:.4}  val {:.4}  {:.0} tokens/s",
            m.loss, v, m.tokens_per_s
        ),
        None => format!("loss {:.4}  {:.0} tokens/s", m.loss, m.tokens_per_s),
    }
}

/// The lines that end a run: the loss from first to last step, the validation loss from
/// first to last evaluation, and the measured step time against the plan's prediction (steps
/// after the first: the first includes one-time allocation).
pub fn summary(plan: &Plan, steps: &[StepMetrics]) -> Vec<String> {
    let mut lines = Vec::new();
    if let (Some(a), Some(b)) = (steps.first(), steps.last()) {
        lines.push(format!(
            "loss {:.4} → {:.4} over {} steps",
            a.loss,
            b.loss,
            steps.len()
        ));
    }
    let evals: Vec<_> = steps
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.step + 1, v)))
        .collect();
    if let (Some(a), Some(b)) = (evals.first(), evals.last()) {
        lines.push(format!(
            "validation loss {:.4} (after step {}) → {:.4} (after step {}), {} evaluations",
            a.1,
            a.0,
            b.1,
            b.0,
            evals.len()
        ));
    }
    let timed: Vec<f64> = steps.iter().skip(1).map(|m| m.step_time_s).collect();
    if !timed.is_empty() {
        let mean = timed.iter().sum::<f64>() / timed.len() as f64;
        let t = &plan.job.model.training;
        lines.push(format!(
            "step time {:.4} s measured (mean of steps 2..{}), {:.0} tokens/s; predicted {:.4} s ({:.2}× measured){}",
            mean,
            steps.len(),
            (t.global_batch * t.seq_len) as f64 / mean,
            plan.predicted.step_time_s,
            plan.predicted.step_time_s / mean,
            match (
                plan.job.cluster.device.kind == DeviceKind::Cpu,
                plan.job.cluster.calibrated,
            ) {
                (true, false) => {
                    " — this CPU cluster spec is nominal: `tessera calibrate` measures this host"
                }
                (true, true) => " — on the cluster spec's measured constants",
                _ => "",
            }
        ));
    }
    lines
}

/// How far measured memory may stray from the prediction before the report says so.
const MEMORY_TOLERANCE: f64 = 0.10;

/// Each rank's measured peak during the training steps against the plan's per-device
/// prediction: a table's header and rows, and the lines that follow it.
pub struct MemoryReport {
    pub header: [&'static str; 5],
    pub rows: Vec<[String; 5]>,
    /// What was measured and predicted, and the ranks more than 10% off (or that none is).
    pub notes: Vec<String>,
}

/// The end-of-run memory report of `plan` from each rank's measured `peak_bytes`.
pub fn memory_report(plan: &Plan, peak_bytes: &[u64], on_gpus: bool) -> MemoryReport {
    let p = &plan.parallel;
    let mib = |b: f64| format!("{:.1}", b / (1024.0 * 1024.0));
    let mesh =
        tessera_planner::Mesh::with_cp(p.dp, p.cp, p.pp, p.tp, plan.job.cluster.gpus_per_node);
    let mut off = Vec::new();
    let mut rows = Vec::new();
    for (r, &bytes) in peak_bytes.iter().enumerate() {
        let stage = mesh.coord(r as u64).pp as usize;
        let predicted = plan.predicted.memory.per_stage.get(stage);
        let ratio = match (on_gpus, predicted) {
            (false, Some(s)) if s.total_bytes > 0 && bytes > 0 => {
                Some(bytes as f64 / s.total_bytes as f64)
            }
            _ => None,
        };
        if let Some(x) = ratio.filter(|x| (x - 1.0).abs() > MEMORY_TOLERANCE) {
            off.push((r, x));
        }
        rows.push([
            r.to_string(),
            stage.to_string(),
            if on_gpus {
                "-".into()
            } else {
                mib(bytes as f64)
            },
            predicted.map_or("-".into(), |s| mib(s.total_bytes as f64)),
            ratio.map_or("-".into(), |x| format!("{x:.2}")),
        ]);
    }
    let mut notes = vec![format!(
        "measured: {}; predicted: the plan's per-device total under the \"{}\" precision policy",
        if on_gpus {
            "not tracked on GPUs yet"
        } else {
            "peak bytes each rank's thread held during the training steps (setup and the final download left out)"
        },
        plan.job.model.training.precision
    )];
    if let (Some(worst), false) = (
        off.iter()
            .max_by(|a, b| (a.1 - 1.0).abs().total_cmp(&(b.1 - 1.0).abs())),
        on_gpus,
    ) {
        notes.push(format!(
            "memory: {} of {} ranks differ from the prediction by more than {:.0}% (worst: rank {} at {:.2}× predicted); docs/performance.md (\"CPU memory\") lists what the model leaves out",
            off.len(),
            peak_bytes.len(),
            MEMORY_TOLERANCE * 100.0,
            worst.0,
            worst.1
        ));
    } else if !on_gpus && !peak_bytes.is_empty() {
        notes.push(format!(
            "memory: every rank within {:.0}% of the prediction",
            MEMORY_TOLERANCE * 100.0
        ));
    }
    if let Some(note) = slab_note(plan).filter(|_| !on_gpus && !peak_bytes.is_empty()) {
        notes.push(note);
    }
    MemoryReport {
        header: [
            "rank",
            "stage",
            "measured MiB",
            "predicted MiB",
            "measured/predicted",
        ],
        rows,
        notes,
    }
}

/// What the plan's GEMM packing slab leaves out on this host, when its L2 cache per core is not
/// the cluster spec's `[device] l2_cache_kib`: every rank's measured peak differs by the
/// difference (docs/performance.md, "CPU memory").
fn slab_note(plan: &Plan) -> Option<String> {
    let host = crate::backend::cpu::kernels::matmul::packing_slab_bytes() as f64 / 1024.0;
    let planned = plan.job.cluster.device.l2_cache_kib;
    if planned == Some(host) {
        return None;
    }
    let counted = planned.map_or("none ([device] l2_cache_kib absent)".into(), |k| {
        format!("{k} KiB ([device] l2_cache_kib)")
    });
    Some(format!(
        "memory: this host's L2 cache per core is {host} KiB, the gemm crate's packing slab on each rank's thread; the plan counts {counted}, so each rank differs by {:+.2} MiB from that alone: `tessera calibrate` writes this host's into a cluster spec",
        (host - planned.unwrap_or(0.0)) / 1024.0
    ))
}

/// Bytes of host memory a CPU run of `plan` needs: f32 weights, gradients and Adam moments for
/// every rank's parameters (ZeRO shards the moments), plus the plan's activations at 4 bytes
/// instead of 2. The CPU runtime computes attention eagerly, so a plan that assumes flash
/// attention also needs the s×s scores the plan does not count. In f64: never wraps.
pub fn host_bytes_needed(plan: &Plan) -> f64 {
    let p = &plan.parallel;
    let a = &plan.job.model.architecture;
    let t = &plan.job.model.training;
    // ZeRO shards over DP × CP; a CP rank's ring attention keeps no s×s scores.
    let shard = if p.zero_stage >= 1 {
        (p.dp * p.cp) as f64
    } else {
        1.0
    };
    let scores_per_layer =
        if t.attention == tessera_planner::model::AttentionImpl::Flash && p.cp <= 1 {
            4.0 * p.micro_batch as f64 * (a.heads / p.tp) as f64 * (t.seq_len as f64).powi(2)
        } else {
            0.0
        };
    plan.predicted
        .memory
        .per_stage
        .iter()
        .map(|s| {
            let act: f64 = s
                .terms
                .iter()
                .filter(|t| t.kind == "activations")
                .map(|t| t.bytes as f64)
                .sum();
            let scores = scores_per_layer * s.layers as f64 * s.in_flight as f64;
            let states = s.params_per_rank as f64 * (8.0 + 8.0 / shard);
            (states + 2.0 * act + scores) * (p.dp * p.cp * p.tp) as f64
        })
        .sum()
}
