//! The checks `Plan::load` makes: every section any command reads, with the spec parsers'
//! rules for `job`, the layout's rules for `parallel`, the stages against the layers, and the
//! `predicted` section recomputed from the job and the layout and compared field by field.

use serde_json::Value;

use super::{stages_for_split, Plan, Predicted, Stage};
use crate::error::Diagnostic;
use crate::layout::Layout;
use crate::mesh::MESH_ORDER;
use crate::source::Source;

/// Relative difference below which two stored numbers count as equal (the JSON round trip is
/// exact; this only absorbs last-bit differences of libm between machines).
const TOLERANCE: f64 = 1e-9;

impl Plan {
    /// Checks that the plan's parts agree with each other.
    pub(super) fn check(&self, src: &Source) -> Result<(), Diagnostic> {
        let bad = |field: &str, problem: String| {
            Diagnostic::new(
                &src.path,
                field,
                problem,
                "the plan was edited or damaged; re-create it with `tessera plan … -o plan.json`",
            )
            .at(src.json_key(field))
        };
        // The job first: every later check computes with its values.
        self.job
            .model
            .check()
            .map_err(|p| p.with_fix_of(REPLAN).in_json(src, "job.model"))?;
        self.job
            .cluster
            .check()
            .map_err(|p| p.with_fix_of(REPLAN).in_json(src, "job.cluster"))?;
        let p = &self.parallel;
        for (field, v) in [
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.micro_batch", p.micro_batch),
            ("parallel.virtual_stages", p.virtual_stages),
        ] {
            if v == 0 {
                return Err(bad(field, "must be at least 1, found 0".into()));
            }
        }
        let layout = p.layout();
        if let Err(why) = layout.check(&self.job.model, &self.job.cluster) {
            return Err(bad("parallel", why.to_string()));
        }
        let world = p.dp.checked_mul(p.tp).and_then(|x| x.checked_mul(p.pp));
        if world != Some(p.world) {
            return Err(bad(
                "parallel.world",
                format!(
                    "world {} is not dp {} × tp {} × pp {}",
                    p.world, p.dp, p.tp, p.pp
                ),
            ));
        }
        if p.mesh_order != MESH_ORDER {
            return Err(bad(
                "parallel.mesh_order",
                format!("mesh order \"{}\" is not \"{MESH_ORDER}\"", p.mesh_order),
            ));
        }
        if p.microbatches != layout.microbatches(&self.job.model) {
            return Err(bad(
                "parallel.microbatches",
                format!(
                    "{} micro-batches does not match global_batch / (dp · micro_batch)",
                    p.microbatches
                ),
            ));
        }
        let split = split_of(&self.stages, &layout, self.job.model.architecture.layers);
        if split
            .as_ref()
            .is_none_or(|sp| self.stages != stages_for_split(&layout, sp))
        {
            return Err(bad(
                "stages",
                "the stage layer ranges do not cover the model's layers in pipeline order (each chunk at least one layer, embedding on the first, head on the last)"
                    .into(),
            ));
        }
        if let Some(v) = &p.vocab {
            let want = super::VocabPadding::of(&self.job.model, p.tp);
            if *v != want {
                return Err(bad(
                    "parallel.vocab",
                    format!(
                        "says the vocabulary is {} padded to {}, but the model and TP {} give {} padded to {}",
                        v.model, v.padded, p.tp, want.model, want.padded
                    ),
                ));
            }
        }
        if self.job.parameters != self.job.model.architecture.param_count() {
            return Err(bad(
                "job.parameters",
                "the parameter count does not match the model".into(),
            ));
        }
        let split = split.expect("checked above");
        let derived = Predicted::derive(&self.job.model, &self.job.cluster, &layout, &split);
        let stored = serde_json::to_value(&self.predicted).expect("a plan serialises");
        let want = serde_json::to_value(&derived).expect("a plan serialises");
        if let Some((field, got, expected)) = first_difference("predicted", &stored, &want) {
            return Err(bad(
                &field,
                format!(
                    "the stored prediction says {got}, but the job and layout give {expected} (predictions are derived, not inputs)"
                ),
            ));
        }
        if self.feasible != derived.memory.fits() {
            return Err(bad(
                "feasible",
                format!(
                    "says {}, but the predicted peak of {} bytes {} the device's {} bytes",
                    self.feasible,
                    derived.memory.peak_bytes,
                    if derived.memory.fits() {
                        "fits in"
                    } else {
                        "exceeds"
                    },
                    derived.memory.capacity_bytes
                ),
            ));
        }
        check_search(&self.search.alternatives, src)
    }
}

const REPLAN: &str =
    "the plan was edited or damaged; fix the value, or re-create the plan with `tessera plan … -o plan.json`";

/// The first path where two JSON values differ (numbers within [`TOLERANCE`]), with both values.
fn first_difference(path: &str, got: &Value, want: &Value) -> Option<(String, String, String)> {
    let differ = || Some((path.to_string(), got.to_string(), want.to_string()));
    match (got, want) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64()?, b.as_f64()?);
            let scale = a.abs().max(b.abs()).max(f64::MIN_POSITIVE);
            ((a - b).abs() / scale > TOLERANCE).then(differ).flatten()
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                return Some((
                    path.to_string(),
                    format!("{} entries", a.len()),
                    format!("{} entries", b.len()),
                ));
            }
            a.iter()
                .zip(b)
                .enumerate()
                .find_map(|(i, (x, y))| first_difference(&format!("{path}[{i}]"), x, y))
        }
        (Value::Object(a), Value::Object(b)) => b.iter().find_map(|(k, y)| match a.get(k) {
            Some(x) => first_difference(&format!("{path}.{k}"), x, y),
            None => Some((format!("{path}.{k}"), "nothing".into(), y.to_string())),
        }),
        _ if got == want => None,
        _ => differ(),
    }
}

/// The search summary is a record of the search, not derived from the job: its numbers must
/// still be numbers a reader can use.
fn check_search(alternatives: &[super::Alternative], src: &Source) -> Result<(), Diagnostic> {
    for (i, a) in alternatives.iter().enumerate() {
        let field = format!("search.alternatives[{i}]");
        let bad_number = [
            ("step_time_s", a.step_time_s),
            ("tokens_per_s", a.tokens_per_s),
            ("mfu", a.mfu),
        ]
        .into_iter()
        .chain(a.breakdown.iter().map(|t| ("breakdown", t.seconds)))
        .find(|(_, v)| !v.is_finite() || *v < 0.0);
        if let Some((key, v)) = bad_number {
            return Err(Diagnostic::new(
                &src.path,
                format!("{field}.{key}"),
                format!("must be a number of zero or more, found {v}"),
                REPLAN,
            )
            .at(src.json_key(&format!("search.alternatives.{key}"))));
        }
    }
    Ok(())
}

/// The split (layers per virtual stage) that `stages` describe, if their chunks cover
/// `0..layers` contiguously in virtual-stage order with at least one layer each.
fn split_of(stages: &[Stage], layout: &Layout, layers: u64) -> Option<Vec<u64>> {
    // Allocate by what the file lists, never by a count it claims.
    let chunks = usize::try_from(layout.chunks()?).ok()?;
    if stages.iter().map(|s| s.chunks.len()).sum::<usize>() != chunks {
        return None;
    }
    let mut ranges = vec![None; chunks];
    for st in stages {
        for ch in &st.chunks {
            let slot = ranges.get_mut(ch.virtual_stage as usize)?;
            if slot.is_some() {
                return None;
            }
            *slot = Some(ch.layers);
        }
    }
    let mut next = 0;
    let mut split = Vec::with_capacity(chunks);
    for r in ranges {
        let [start, end] = r?;
        if start != next || end <= start {
            return None;
        }
        split.push(end - start);
        next = end;
    }
    (next == layers).then_some(split)
}
