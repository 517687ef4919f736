//! What changed between two plans: every key of the job (the model and cluster specs as
//! resolved) and of the layout, the stage splits, the memory of every stage term by term, and
//! the predicted step time term by term. `tessera diff` prints it; it is the review tool for
//! plan snapshots. Pure: no printing.
//!
//! The job and the layout are compared key by key over their plan.json form, so a key added to
//! either is shown without a change here (tests/diff_keys.rs checks every key of plan.json).
//! Not shown: `format` and `generator`, `parallel.vocab.reason` (prose made of the numbers beside
//! it), the stage and chunk numbers and flags (checked on load to be the layout's), the parts of
//! `predicted` that follow from the job, layout and stages, and `search` (how the layout was
//! chosen; nothing that runs or exports a plan reads it).

use std::collections::BTreeSet;

use serde_json::Value;

use super::{Plan, Stage};

/// A value that differs, shown as text.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// The row's name: the key below its section (`dp`, `model.architecture.hidden`,
    /// `stage 1`).
    pub what: String,
    /// The plan.json key that differs (`parallel.dp`, `stages[1].chunks[0].layers`).
    pub key: String,
    /// The values, `-` where the key is absent.
    pub a: String,
    pub b: String,
}

/// A number that differs (bytes, seconds, a rate).
#[derive(Debug, Clone, PartialEq)]
pub struct NumChange {
    pub what: String,
    /// The plan.json key that differs (`predicted.step_time_s`).
    pub key: String,
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
    /// `feasible`, `job.parameters` and every key of `job.model` and `job.cluster`.
    pub job: Vec<Change>,
    /// Every key of `parallel` (but the vocabulary's prose reason).
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

/// Keys of `parallel` not compared: `vocab.reason` is prose made of `vocab.model`,
/// `vocab.padded`, `vocab.multiple` and `tp`, which are.
const PARALLEL_SKIPPED: &[&str] = &["vocab.reason"];

/// The order of the layout's rows (a key not listed comes last, alphabetically).
const PARALLEL_ORDER: &[&str] = &[
    "world",
    "dp",
    "tp",
    "pp",
    "cp",
    "cp_comm",
    "mesh_order",
    "micro_batch",
    "microbatches",
    "zero_stage",
    "hybrid_shard",
    "recompute",
    "recompute_every",
    "sequence_parallel",
    "schedule",
    "virtual_stages",
    "offload",
    "offload_to",
    "offload_activations",
    "vocab",
];

fn text(out: &mut Vec<Change>, what: &str, key: &str, a: impl ToString, b: impl ToString) {
    let (a, b) = (a.to_string(), b.to_string());
    if a != b {
        out.push(Change {
            what: what.into(),
            key: key.into(),
            a,
            b,
        });
    }
}

fn num(out: &mut Vec<NumChange>, what: String, key: String, a: f64, b: f64) {
    if a != b {
        out.push(NumChange { what, key, a, b });
    }
}

/// A leaf as a table shows it: strings bare, the rest as JSON, `-` when absent.
fn shown(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

/// `prefix.k`, or `k` at the top.
fn join(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_string()
    } else {
        format!("{prefix}.{k}")
    }
}

fn object(v: Option<&Value>) -> Option<&serde_json::Map<String, Value>> {
    v.and_then(Value::as_object)
}

/// A list of records (objects), compared entry by entry.
fn records(v: Option<&Value>) -> Option<&[Value]> {
    v.and_then(Value::as_array)
        .filter(|l| l.iter().any(Value::is_object))
        .map(Vec::as_slice)
}

/// `kind` of both sides, where each side is of that kind or absent (or null) and one is of it.
fn both<'v, T>(
    a: Option<&'v Value>,
    b: Option<&'v Value>,
    kind: impl Fn(Option<&'v Value>) -> Option<T>,
) -> Option<(Option<T>, Option<T>)> {
    let absent = |v: Option<&Value>| v.is_none_or(Value::is_null);
    let (x, y) = (kind(a), kind(b));
    ((x.is_some() || absent(a)) && (y.is_some() || absent(b)) && (x.is_some() || y.is_some()))
        .then_some((x, y))
}

/// Every leaf that differs between `a` and `b` (either may be absent), named `what` below its
/// section and `key` in plan.json. Objects are compared key by key, lists of objects entry by
/// entry; a list of numbers (a curve, a range) is one value.
fn leaves(
    out: &mut Vec<Change>,
    what: &str,
    key: &str,
    a: Option<&Value>,
    b: Option<&Value>,
    skip: &[&str],
) {
    if skip.contains(&what) {
        return;
    }
    if let Some((oa, ob)) = both(a, b, object) {
        let keys: BTreeSet<&String> = oa.into_iter().chain(ob).flat_map(|m| m.keys()).collect();
        for k in keys {
            let (x, y) = (a.and_then(|v| v.get(k)), b.and_then(|v| v.get(k)));
            leaves(out, &join(what, k), &join(key, k), x, y, skip);
        }
    } else if let Some((ra, rb)) = both(a, b, records) {
        let (la, lb) = (ra.unwrap_or(&[]), rb.unwrap_or(&[]));
        for i in 0..la.len().max(lb.len()) {
            leaves(
                out,
                &format!("{what}[{i}]"),
                &format!("{key}[{i}]"),
                la.get(i),
                lb.get(i),
                skip,
            );
        }
    } else {
        text(out, what, key, shown(a), shown(b));
    }
}

/// `value` of a plan section, as plan.json has it.
fn json(value: &impl serde::Serialize) -> Value {
    serde_json::to_value(value).expect("a plan always serialises")
}

/// Each (stage, chunk)'s row name, plan.json key and layer range.
fn ranges(stages: &[Stage]) -> Vec<(String, String, String)> {
    stages
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            s.chunks.iter().enumerate().map(move |(j, c)| {
                let name = if s.chunks.len() > 1 {
                    format!("stage {} chunk {}", s.stage, c.chunk)
                } else {
                    format!("stage {}", s.stage)
                };
                (
                    name,
                    format!("stages[{i}].chunks[{j}].layers"),
                    format!("layers {}..{}", c.layers[0], c.layers[1]),
                )
            })
        })
        .collect()
}

/// A term found (index, value) in plan a, plan b or both: its index (plan a's where it has
/// it) and both values, 0 where absent.
fn term(x: Option<(usize, f64)>, y: Option<(usize, f64)>) -> (usize, f64, f64) {
    let value = |v: Option<(usize, f64)>| v.map_or(0.0, |(_, v)| v);
    (x.or(y).map_or(0, |(i, _)| i), value(x), value(y))
}

/// Compares plan `a` with plan `b`.
pub fn diff(a: &Plan, b: &Plan) -> PlanDiff {
    let mut d = PlanDiff::default();
    text(&mut d.job, "feasible", "feasible", a.feasible, b.feasible);
    let (ja, jb) = (json(&a.job), json(&b.job));
    for part in ["model", "cluster"] {
        let key = format!("job.{part}");
        leaves(&mut d.job, part, &key, ja.get(part), jb.get(part), &[]);
    }
    text(
        &mut d.job,
        "parameters",
        "job.parameters",
        a.job.parameters,
        b.job.parameters,
    );

    // plan.json leaves `recompute_every`, `cp`, `cp_comm` and the offload keys out at their
    // defaults; their rows
    // show the value, not "-".
    let layout = |p: &super::Parallel| {
        let mut v = json(p);
        v["recompute_every"] = p.recompute_every.into();
        v["cp"] = p.cp.into();
        v["cp_comm"] = p.cp_comm.name().into();
        v["offload"] = p.offload.name().into();
        v["offload_to"] = p.offload_to.name().into();
        v["offload_activations"] = p.offload_activations.into();
        v
    };
    let (pa, pb) = (layout(&a.parallel), layout(&b.parallel));
    leaves(
        &mut d.layout,
        "",
        "parallel",
        Some(&pa),
        Some(&pb),
        PARALLEL_SKIPPED,
    );
    let rank = |c: &Change| {
        let top = c.what.split(['.', '[']).next().unwrap_or_default();
        PARALLEL_ORDER
            .iter()
            .position(|k| *k == top)
            .unwrap_or(PARALLEL_ORDER.len())
    };
    d.layout.sort_by_key(|c| rank(c));

    let (ra, rb) = (ranges(&a.stages), ranges(&b.stages));
    let names: BTreeSet<&String> = ra.iter().chain(&rb).map(|(n, _, _)| n).collect();
    for n in names {
        let find = |r: &[(String, String, String)]| r.iter().find(|(m, _, _)| m == n).cloned();
        let (x, y) = (find(&ra), find(&rb));
        let key = x
            .as_ref()
            .or(y.as_ref())
            .map(|r| r.1.clone())
            .unwrap_or_default();
        let range = |r: Option<(String, String, String)>| r.map_or("-".to_string(), |r| r.2);
        text(&mut d.stages, n, &key, range(x), range(y));
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
        let find = |st: Option<&crate::memory::StageMemory>, name: &str| {
            st.and_then(|st| {
                (st.terms.iter().enumerate())
                    .find(|(_, t)| t.name == name)
                    .map(|(i, t)| (i, t.bytes as f64))
            })
        };
        for t in terms {
            let (i, x, y) = term(find(sa, t), find(sb, t));
            num(
                &mut d.memory,
                format!("stage {s} {t}"),
                format!("predicted.memory.per_stage[{s}].terms[{i}].bytes"),
                x,
                y,
            );
        }
        let total =
            |st: Option<&crate::memory::StageMemory>| st.map_or(0.0, |st| st.total_bytes as f64);
        num(
            &mut d.memory,
            format!("stage {s} total"),
            format!("predicted.memory.per_stage[{s}].total_bytes"),
            total(sa),
            total(sb),
        );
    }
    num(
        &mut d.memory,
        "peak".into(),
        "predicted.memory.peak_bytes".into(),
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
    let find = |p: &super::Predicted, name: &str| {
        (p.breakdown.iter().enumerate())
            .find(|(_, t)| t.name == name)
            .map(|(i, t)| (i, t.seconds))
    };
    for t in terms {
        let (i, x, y) = term(find(qa, t), find(qb, t));
        num(
            &mut d.time,
            t.to_string(),
            format!("predicted.breakdown[{i}].seconds"),
            x,
            y,
        );
    }
    for (what, x, y) in [
        ("step_time_s", qa.step_time_s, qb.step_time_s),
        ("tokens_per_s", qa.tokens_per_s, qb.tokens_per_s),
        ("mfu", qa.mfu, qb.mfu),
    ] {
        num(&mut d.time, what.into(), format!("predicted.{what}"), x, y);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(a: Value, b: Value) -> Vec<(String, String, String, String)> {
        let mut out = Vec::new();
        leaves(&mut out, "", "p", Some(&a), Some(&b), &["x.skipped"]);
        out.into_iter().map(|c| (c.what, c.key, c.a, c.b)).collect()
    }

    /// Objects key by key (absent on one side: `-`), lists of numbers as one value, lists of
    /// records entry by entry, skipped keys never.
    #[test]
    fn leaves_compare_key_by_key() {
        let a = serde_json::json!({"n": 1, "s": "x", "x": {"k": 1, "skipped": "a"}, "curve": [[1, 2]], "l": [{"v": 1}]});
        let b = serde_json::json!({"n": 1, "s": "y", "x": {"skipped": "b"}, "curve": [[1, 3]], "l": [{"v": 1}, {"v": 2}], "new": {"q": true}, "r": [{"w": 3}]});
        let got = rows(a, b);
        let want = [
            ("curve", "p.curve", "[[1,2]]", "[[1,3]]"),
            ("l[1].v", "p.l[1].v", "-", "2"),
            ("new.q", "p.new.q", "-", "true"),
            ("r[0].w", "p.r[0].w", "-", "3"),
            ("s", "p.s", "x", "y"),
            ("x.k", "p.x.k", "1", "-"),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(w, k, a, b)| (w.to_string(), k.to_string(), a.to_string(), b.to_string()))
            .collect();
        assert_eq!(got, want);
        assert!(rows(serde_json::json!({"a": [1]}), serde_json::json!({"a": [1]})).is_empty());
    }
}
