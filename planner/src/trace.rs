//! Chrome trace events (Perfetto-readable) of a pipeline schedule: one track per rank or stage.
//!
//! The planner writes its predicted timeline (the event simulation of the schedule's op lists)
//! and the runtime writes what it executed, in this one format, so the two load side by side.
//! This module only formats; it neither simulates nor measures.

use std::time::Duration;

use crate::cost::Options;
use crate::layout::Layout;
use crate::model::Model;
use crate::schedule::{self, Op, ScheduleError, SimCosts};
use crate::search::predict_layout;
use crate::spec::Cluster;

/// One complete ("X") event.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    /// The track: a rank (measured) or a pipeline stage (predicted).
    pub track: usize,
    pub step: usize,
    pub name: String,
    pub cat: &'static str,
    pub start_us: f64,
    pub dur_us: f64,
}

impl TraceEvent {
    pub fn named(
        track: usize,
        step: usize,
        name: &str,
        cat: &'static str,
        start: Duration,
        end: Duration,
    ) -> Self {
        TraceEvent {
            track,
            step,
            name: name.to_string(),
            cat,
            start_us: start.as_secs_f64() * 1e6,
            dur_us: end.saturating_sub(start).as_secs_f64() * 1e6,
        }
    }

    pub fn op(track: usize, step: usize, op: &Op, start: Duration, end: Duration) -> Self {
        let (name, cat) = op_label(op);
        Self::named(track, step, &name, cat, start, end)
    }
}

/// A short label and category for an op: `F3.1` is the forward of micro-batch 3, chunk 1.
pub fn op_label(op: &Op) -> (String, &'static str) {
    match *op {
        Op::Forward { mb, chunk } => (format!("F{mb}.{chunk}"), "forward"),
        Op::Backward { mb, chunk } => (format!("B{mb}.{chunk}"), "backward"),
        Op::BackwardInput { mb, chunk } => (format!("Bi{mb}.{chunk}"), "backward"),
        Op::BackwardWeight { mb, chunk } => (format!("W{mb}.{chunk}"), "backward"),
        Op::SendActivation { mb, chunk, peer } => {
            (format!("send act {mb}.{chunk} → {peer}"), "p2p")
        }
        Op::RecvActivation { mb, chunk, peer } => {
            (format!("recv act {mb}.{chunk} ← {peer}"), "p2p")
        }
        Op::SendGrad { mb, chunk, peer } => (format!("send grad {mb}.{chunk} → {peer}"), "p2p"),
        Op::RecvGrad { mb, chunk, peer } => (format!("recv grad {mb}.{chunk} ← {peer}"), "p2p"),
    }
}

/// The Chrome trace JSON document for `events`. `process` names the timeline ("measured",
/// "predicted") and `track` names a track ("rank", "stage").
pub fn chrome_trace(events: &[TraceEvent], process: &str, track: &str) -> String {
    let mut items: Vec<serde_json::Value> = Vec::with_capacity(events.len() + 8);
    items.push(
        serde_json::json!({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}),
    );
    let mut tracks: Vec<usize> = events.iter().map(|e| e.track).collect();
    tracks.sort_unstable();
    tracks.dedup();
    for t in tracks {
        items.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": format!("{track} {t}")}}));
    }
    for e in events {
        items.push(serde_json::json!({
            "name": e.name, "cat": e.cat, "ph": "X", "pid": 0, "tid": e.track,
            "ts": e.start_us, "dur": e.dur_us, "args": {"step": e.step}
        }));
    }
    serde_json::to_string(&serde_json::json!({ "traceEvents": items, "displayTimeUnit": "ms" }))
        .expect("a trace always serialises")
        + "\n"
}

/// The predicted timeline of one step of `layout`: the schedule's op lists simulated with the
/// cost model's per-chunk durations, one track per pipeline stage (every rank of a stage runs
/// the same ops). Sends cost nothing on the sender; a receive waits for the message.
pub fn predicted(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
) -> Result<Vec<TraceEvent>, ScheduleError> {
    let (assessed, _) = predict_layout(model, cluster, layout, Options::for_model(model, cluster));
    let p = &assessed
        .evaluation
        .expect("predict_layout always evaluates")
        .pipeline;
    let sched = schedule::build(p.kind, p.pp, p.microbatches, p.virtual_stages)?;
    let fwd = |s: usize, c: usize| p.chunk(s, c).fwd.total();
    let bwd = |s: usize, c: usize| p.chunk(s, c).bwd.total();
    let bwd_in = |s: usize, c: usize| p.backward_input(s, c);
    let bwd_w = |s: usize, c: usize| p.backward_weight(s, c);
    let overlap = |s: usize, f: usize, b: usize| p.overlap(s, f, b);
    let p2p = |a: usize, b: usize| p.p2p(a, b);
    let sim = schedule::simulate(
        &sched,
        &SimCosts {
            forward: &fwd,
            backward: &bwd,
            backward_input: &bwd_in,
            backward_weight: &bwd_w,
            overlap: &overlap,
            p2p: &p2p,
        },
    )?;
    let secs = Duration::from_secs_f64;
    Ok(sim
        .timeline
        .iter()
        .enumerate()
        .flat_map(|(stage, ops)| {
            ops.iter()
                .map(move |(op, start, end)| TraceEvent::op(stage, 0, op, secs(*start), secs(*end)))
        })
        .collect())
}
