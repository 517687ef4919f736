//! The checks `Plan::load` makes: every section any command reads, with the spec parsers'
//! rules for `job`, the layout's rules for `parallel`, the stages against the layers, and the
//! `predicted` section recomputed from the job and the layout and compared field by field.

use serde_json::Value;

use super::{stages_for_split, Plan, Predicted, Stage};
use crate::error::Diagnostic;
use crate::layout::{Layout, Rejection};
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
            .and_then(|()| self.job.model.plannable())
            .map_err(|p| p.with_fix_of(REPLAN).in_json(src, "job.model"))?;
        self.job
            .cluster
            .check()
            .map_err(|p| p.with_fix_of(REPLAN).in_json(src, "job.cluster"))?;
        // A stated framework must build the model on these devices (a default one is the
        // planner's own choice, and the search refuses what it cannot build).
        if crate::framework::stated(&self.job.model) {
            let profile = crate::framework::of(&self.job.model, &self.job.cluster);
            if let Err(e) = crate::framework::builds(profile, &self.job.model, &self.job.cluster) {
                let field = "job.model.training.framework";
                return Err(Diagnostic::new(
                    &src.path,
                    field,
                    e.problem(),
                    format!(
                        "{}; then re-create the plan with `tessera plan … -o plan.json`",
                        e.why.fix
                    ),
                )
                .at(src.json_key(field)));
            }
        }
        let p = &self.parallel;
        for (field, v) in [
            ("parallel.dp", p.dp),
            ("parallel.tp", p.tp),
            ("parallel.pp", p.pp),
            ("parallel.cp", p.cp),
            ("parallel.micro_batch", p.micro_batch),
            ("parallel.virtual_stages", p.virtual_stages),
        ] {
            if v == 0 {
                return Err(bad(field, "must be at least 1, found 0".into()));
            }
        }
        let layout = p.layout();
        let (model, cluster) = (&self.job.model, &self.job.cluster);
        if let Err(why) = layout
            .check(model, cluster)
            .and_then(|()| crate::search::pins::effective(&layout, model, cluster))
        {
            return Err(contradiction(src, field_of(&why, &layout), why.to_string()));
        }
        let world =
            p.dp.checked_mul(p.tp)
                .and_then(|x| x.checked_mul(p.pp))
                .and_then(|x| x.checked_mul(p.cp));
        if world != Some(p.world) {
            let cp = if p.cp != 1 {
                format!(" × cp {}", p.cp)
            } else {
                String::new()
            };
            return Err(bad(
                "parallel.world",
                format!(
                    "world {} is not dp {}{cp} × tp {} × pp {}",
                    p.world, p.dp, p.tp, p.pp
                ),
            ));
        }
        let order = layout.mesh(cluster).order();
        if p.mesh_order != order {
            return Err(bad(
                "parallel.mesh_order",
                format!("mesh order \"{}\" is not \"{order}\"", p.mesh_order),
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
        if let Some(why) = split
            .as_ref()
            .and_then(|sp| crate::search::pins::split_recomputes_as_charged(&layout, sp).err())
        {
            return Err(contradiction(src, "parallel.recompute_every", why));
        }
        if let Some(v) = &p.vocab {
            check_vocab(v, &self.job.model, &self.job.cluster, p.tp, src)?;
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

/// A `parallel` field that contradicts the job or another field, named.
fn contradiction(src: &Source, field: &str, problem: String) -> Diagnostic {
    let fix = format!(
        "the plan was edited or damaged; re-create it with `tessera plan … -o plan.json`, or set `{field}` to agree with the rest of the plan"
    );
    Diagnostic::new(&src.path, field, problem, fix).at(src.json_key(field))
}

/// The `parallel` field a broken layout rule is about. A product of the degrees that is not
/// the device count involves them all: `parallel`.
fn field_of(why: &Rejection, l: &Layout) -> &'static str {
    use crate::search::pins;
    match why.rule {
        "TP does not divide the heads" | "TP does not divide the FFN width" => "parallel.tp",
        "sequence parallelism needs TP > 1 dividing seq_len" => "parallel.sequence_parallel",
        "more pipeline chunks than layers" if l.virtual_stages > 1 => "parallel.virtual_stages",
        "more pipeline chunks than layers" => "parallel.pp",
        "DP does not divide the global batch" => "parallel.dp",
        "micro-batch does not divide the per-replica batch"
        | "interleaving needs micro-batches divisible by PP"
        | "the step has no micro-batch"
        | crate::layout::TOO_MANY_MICROBATCHES => "parallel.micro_batch",
        "recompute every N-th layer needs full recompute"
        | "recompute every N-th layer needs N ≥ 1"
        | pins::RECOMPUTE_EVERY_SPLIT => "parallel.recompute_every",
        "no such ZeRO stage" => "parallel.zero_stage",
        "interleaving needs PP ≥ 2 and v ≥ 2" if l.pp < 2 => "parallel.pp",
        "interleaving needs PP ≥ 2 and v ≥ 2" | "virtual stages need the interleaved schedule" => {
            "parallel.virtual_stages"
        }
        pins::HYBRID_WITHOUT_ZERO | pins::HYBRID_IN_ONE_NODE => "parallel.hybrid_shard",
        pins::OFFLOAD_ON_CPU | pins::OFFLOAD_WITHOUT_HOST if !l.offload.optimizer() => {
            "parallel.offload_activations"
        }
        pins::OFFLOAD_ON_CPU | pins::OFFLOAD_WITHOUT_HOST | pins::OFFLOAD_NEEDS_ZERO => {
            "parallel.offload"
        }
        pins::OFFLOAD_TARGET_WITHOUT_OFFLOAD => "parallel.offload_to",
        _ => "parallel",
    }
}

/// The stored vocabulary padding against the model's and TP's: the first field that differs,
/// with both values.
fn check_vocab(
    v: &super::VocabPadding,
    model: &crate::model::Model,
    cluster: &crate::spec::Cluster,
    tp: u64,
    src: &Source,
) -> Result<(), Diagnostic> {
    let profile = crate::framework::of(model, cluster);
    let want = super::VocabPadding::of(model, tp, profile);
    let a = &model.architecture;
    let rule = if profile.runs.pad_vocab {
        format!(
            "job.model.architecture.vocab {} rounded up to a multiple of make_vocab_size_divisible_by {} × TP {tp} = {}",
            a.vocab, a.vocab_divisible_by, want.multiple
        )
    } else {
        format!(
            "the {} profile holds it: job.model.architecture.vocab {} as it is, in TP {tp} shards",
            profile.name, a.vocab
        )
    };
    let differs = [
        ("model", v.model.to_string(), want.model.to_string()),
        (
            "multiple",
            v.multiple.to_string(),
            want.multiple.to_string(),
        ),
        ("padded", v.padded.to_string(), want.padded.to_string()),
        (
            "reason",
            format!("{:?}", v.reason),
            format!("{:?}", want.reason),
        ),
    ]
    .into_iter()
    .find(|(_, got, want)| got != want);
    let Some((key, got, expected)) = differs else {
        return Ok(());
    };
    let field = format!("parallel.vocab.{key}");
    Err(Diagnostic::new(
        &src.path,
        &field,
        format!(
            "says {got}, but the model and TP {tp} give {expected}: the vocabulary is padded as {rule}"
        ),
        format!(
            "set `{field}` to {expected} (or restore job.model.architecture.vocab_divisible_by), or re-create the plan with `tessera plan … -o plan.json`"
        ),
    )
    .at(src.json_key(&field)))
}

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

/// The split (layers per piece) that `stages` describe, if their chunks cover `0..layers`
/// contiguously in piece (model) order with at least one layer each (with two or more chunks,
/// the first and last piece may hold none: only the embedding, only the head). Under DualPipe
/// each piece is listed twice, once per direction, with the same layers.
pub(super) fn split_of(stages: &[Stage], layout: &Layout, layers: u64) -> Option<Vec<u64>> {
    // Allocate by what the file lists, never by a count it claims.
    let listed = usize::try_from(layout.chunks()?).ok()?;
    let chunks = usize::try_from(layout.pieces()?).ok()?;
    if stages.iter().map(|s| s.chunks.len()).sum::<usize>() != listed {
        return None;
    }
    let twice = layout.schedule == crate::schedule::ScheduleKind::DualPipe;
    let mut ranges = vec![None; chunks];
    for st in stages {
        for ch in &st.chunks {
            let slot = ranges.get_mut(ch.virtual_stage as usize)?;
            match slot {
                Some(r) if twice && *r == ch.layers => continue,
                Some(_) => return None,
                None => *slot = Some(ch.layers),
            }
        }
    }
    let mut next = 0;
    let mut split = Vec::with_capacity(chunks);
    for (i, r) in ranges.into_iter().enumerate() {
        let [start, end] = r?;
        // Interleaved, the first chunk may hold only the embedding and the last only the head.
        let may_be_empty = layout.virtual_stages > 1 && (i == 0 || i + 1 == chunks);
        if start != next || end < start || (end == start && !may_be_empty) {
            return None;
        }
        split.push(end - start);
        next = end;
    }
    (next == layers).then_some(split)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    /// Each chunk's `(virtual_stage, layers, embedding, head)`, per stage.
    type Table = Vec<Vec<(u64, [u64; 2], bool, bool)>>;

    fn table(stages: &[Stage]) -> Table {
        stages
            .iter()
            .map(|s| {
                s.chunks
                    .iter()
                    .map(|c| (c.virtual_stage, c.layers, c.embedding, c.head))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn plan_chunks_follow_the_schedules_layout() {
        let layout = |kind: ScheduleKind, pp: u64| Layout {
            pp,
            schedule: kind,
            virtual_stages: kind.fixed_virtual_stages().unwrap_or(2) as u64,
            ..Layout::without_pipeline(1, 1, 0, 1)
        };
        // ZB-V, PP 2, 8 layers in 4 pieces of 2: rank 0 holds pieces 0 and 3 (embedding and
        // head), rank 1 pieces 1 and 2.
        let l = layout(ScheduleKind::ZbV, 2);
        let stages = stages_for_split(&l, &[2, 2, 2, 2]);
        let want: Table = vec![
            vec![(0, [0, 2], true, false), (3, [6, 8], false, true)],
            vec![(1, [2, 4], false, false), (2, [4, 6], false, false)],
        ];
        assert_eq!(table(&stages), want);
        assert_eq!(split_of(&stages, &l, 8), Some(vec![2, 2, 2, 2]));
        // DualPipe, PP 2, 8 layers in 2 pieces of 4, each held by both ranks: rank 0's chunk 1
        // is the reverse direction's last piece, rank 1's chunk 1 its first.
        let l = layout(ScheduleKind::DualPipe, 2);
        let stages = stages_for_split(&l, &[4, 4]);
        let want: Table = vec![
            vec![(0, [0, 4], true, false), (1, [4, 8], false, true)],
            vec![(1, [4, 8], false, true), (0, [0, 4], true, false)],
        ];
        assert_eq!(table(&stages), want);
        assert_eq!(split_of(&stages, &l, 8), Some(vec![4, 4]));
        assert_eq!(l.stage_layers(&[4, 4]), vec![8, 8]);
        // A piece listed twice with different layers is no split.
        let mut bad = stages.clone();
        bad[1].chunks[1].layers = [0, 3];
        assert_eq!(split_of(&bad, &l, 8), None);
        // Interleaved keeps chunk · PP + stage.
        let l = layout(ScheduleKind::Interleaved, 2);
        let stages = stages_for_split(&l, &[2, 2, 2, 2]);
        assert_eq!(
            table(&stages)
                .iter()
                .map(|s| s.iter().map(|c| c.0).collect::<Vec<_>>())
                .collect::<Vec<_>>(),
            vec![vec![0, 2], vec![1, 3]]
        );
    }
}
