//! What changed between two plans: the job, the layout, the stage splits, the memory of every
//! stage term by term, and the predicted step time term by term. `tessera diff` prints it; it
//! is the review tool for plan snapshots. Pure: no printing.

use std::collections::BTreeSet;

use super::{Plan, Stage};

/// A value that differs, shown as text.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub what: String,
    pub a: String,
    pub b: String,
}

/// A number that differs (bytes, seconds, a rate).
#[derive(Debug, Clone, PartialEq)]
pub struct NumChange {
    pub what: String,
    pub a: f64,
    pub b: f64,
}

impl NumChange {
    /// b relative to a (`None` when a is zero).
    pub fn relative(&self) -> Option<f64> {
        (self.a != 0.0).then(|| self.b / self.a - 1.0)
    }
}

/// Everything that differs between plan a and plan b.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlanDiff {
    pub job: Vec<Change>,
    pub layout: Vec<Change>,
    /// Layer ranges of each (stage, chunk).
    pub stages: Vec<Change>,
    /// Bytes per device: `stage N term`, `stage N total`, `peak`.
    pub memory: Vec<NumChange>,
    /// Seconds per step by breakdown term, then `step_time_s`; tokens/s and MFU.
    pub time: Vec<NumChange>,
}

impl PlanDiff {
    pub fn is_empty(&self) -> bool {
        self.job.is_empty()
            && self.layout.is_empty()
            && self.stages.is_empty()
            && self.memory.is_empty()
            && self.time.is_empty()
    }
}

fn text(out: &mut Vec<Change>, what: &str, a: impl ToString, b: impl ToString) {
    let (a, b) = (a.to_string(), b.to_string());
    if a != b {
        out.push(Change {
            what: what.into(),
            a,
            b,
        });
    }
}

fn num(out: &mut Vec<NumChange>, what: String, a: f64, b: f64) {
    if a != b {
        out.push(NumChange { what, a, b });
    }
}

fn ranges(stages: &[Stage]) -> Vec<(String, String)> {
    stages
        .iter()
        .flat_map(|s| {
            s.chunks.iter().map(move |c| {
                let name = if s.chunks.len() > 1 {
                    format!("stage {} chunk {}", s.stage, c.chunk)
                } else {
                    format!("stage {}", s.stage)
                };
                (name, format!("layers {}..{}", c.layers[0], c.layers[1]))
            })
        })
        .collect()
}

/// Compares plan `a` with plan `b`.
pub fn diff(a: &Plan, b: &Plan) -> PlanDiff {
    let mut d = PlanDiff::default();
    let (ja, jb) = (&a.job, &b.job);
    text(&mut d.job, "model", &ja.model.name, &jb.model.name);
    text(&mut d.job, "parameters", ja.parameters, jb.parameters);
    text(
        &mut d.job,
        "seq_len",
        ja.model.training.seq_len,
        jb.model.training.seq_len,
    );
    text(
        &mut d.job,
        "global_batch",
        ja.model.training.global_batch,
        jb.model.training.global_batch,
    );
    text(&mut d.job, "cluster", &ja.cluster.name, &jb.cluster.name);
    text(
        &mut d.job,
        "devices",
        ja.cluster.devices,
        jb.cluster.devices,
    );
    text(
        &mut d.job,
        "device",
        &ja.cluster.device.name,
        &jb.cluster.device.name,
    );
    text(&mut d.job, "feasible", a.feasible, b.feasible);

    let (pa, pb) = (&a.parallel, &b.parallel);
    let l = &mut d.layout;
    text(l, "dp", pa.dp, pb.dp);
    text(l, "tp", pa.tp, pb.tp);
    text(l, "pp", pa.pp, pb.pp);
    text(l, "micro_batch", pa.micro_batch, pb.micro_batch);
    text(l, "microbatches", pa.microbatches, pb.microbatches);
    text(l, "zero_stage", pa.zero_stage, pb.zero_stage);
    text(l, "hybrid_shard", pa.hybrid_shard, pb.hybrid_shard);
    text(l, "recompute", pa.recompute.name(), pb.recompute.name());
    text(
        l,
        "sequence_parallel",
        pa.sequence_parallel,
        pb.sequence_parallel,
    );
    text(l, "schedule", pa.schedule.name(), pb.schedule.name());
    text(l, "virtual_stages", pa.virtual_stages, pb.virtual_stages);

    let (ra, rb) = (ranges(&a.stages), ranges(&b.stages));
    let names: BTreeSet<&String> = ra.iter().chain(&rb).map(|(n, _)| n).collect();
    for n in names {
        let find = |r: &[(String, String)]| {
            r.iter()
                .find(|(m, _)| m == n)
                .map_or("-".to_string(), |(_, v)| v.clone())
        };
        text(&mut d.stages, n, find(&ra), find(&rb));
    }

    let (ma, mb) = (&a.predicted.memory, &b.predicted.memory);
    let stages = ma.per_stage.len().max(mb.per_stage.len());
    for s in 0..stages {
        let (sa, sb) = (ma.per_stage.get(s), mb.per_stage.get(s));
        let terms: BTreeSet<&str> = sa
            .iter()
            .chain(sb.iter())
            .flat_map(|st| st.terms.iter().map(|t| t.name.as_str()))
            .collect();
        let bytes = |st: Option<&crate::memory::StageMemory>, name: &str| {
            st.and_then(|st| st.terms.iter().find(|t| t.name == name))
                .map_or(0.0, |t| t.bytes as f64)
        };
        for t in terms {
            num(
                &mut d.memory,
                format!("stage {s} {t}"),
                bytes(sa, t),
                bytes(sb, t),
            );
        }
        let total =
            |st: Option<&crate::memory::StageMemory>| st.map_or(0.0, |st| st.total_bytes as f64);
        num(
            &mut d.memory,
            format!("stage {s} total"),
            total(sa),
            total(sb),
        );
    }
    num(
        &mut d.memory,
        "peak".into(),
        ma.peak_bytes as f64,
        mb.peak_bytes as f64,
    );

    let (qa, qb) = (&a.predicted, &b.predicted);
    let terms: Vec<&str> = {
        let mut seen = Vec::new();
        for t in qa.breakdown.iter().chain(&qb.breakdown) {
            if !seen.contains(&t.name.as_str()) {
                seen.push(t.name.as_str());
            }
        }
        seen
    };
    let secs = |p: &super::Predicted, name: &str| {
        p.breakdown
            .iter()
            .find(|t| t.name == name)
            .map_or(0.0, |t| t.seconds)
    };
    for t in terms {
        num(&mut d.time, t.to_string(), secs(qa, t), secs(qb, t));
    }
    num(
        &mut d.time,
        "step_time_s".into(),
        qa.step_time_s,
        qb.step_time_s,
    );
    num(
        &mut d.time,
        "tokens_per_s".into(),
        qa.tokens_per_s,
        qb.tokens_per_s,
    );
    num(&mut d.time, "mfu".into(), qa.mfu, qb.mfu);
    d
}
