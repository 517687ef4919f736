//! Chrome trace events (Perfetto-readable) of the executed schedule, one track per rank.
//!
//! The planner writes its predicted timeline in the same format, so the two load side by side.

use std::time::Duration;

use tessera_planner::schedule::Op;

/// One complete ("X") event.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEvent {
    pub rank: usize,
    pub step: usize,
    pub name: String,
    pub cat: &'static str,
    pub start_us: f64,
    pub dur_us: f64,
}

impl TraceEvent {
    pub fn named(
        rank: usize,
        step: usize,
        name: &str,
        cat: &'static str,
        start: Duration,
        end: Duration,
    ) -> Self {
        TraceEvent {
            rank,
            step,
            name: name.to_string(),
            cat,
            start_us: start.as_secs_f64() * 1e6,
            dur_us: (end - start).as_secs_f64() * 1e6,
        }
    }

    pub fn op(rank: usize, step: usize, op: &Op, start: Duration, end: Duration) -> Self {
        let (name, cat) = op_label(op);
        Self::named(rank, step, &name, cat, start, end)
    }
}

/// A short label and category for an op: `F3.1` is the forward of micro-batch 3, chunk 1.
pub fn op_label(op: &Op) -> (String, &'static str) {
    match *op {
        Op::Forward { mb, chunk } => (format!("F{mb}.{chunk}"), "forward"),
        Op::Backward { mb, chunk } => (format!("B{mb}.{chunk}"), "backward"),
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

/// The Chrome trace JSON document for `events`; `process` names the timeline (e.g. "measured").
pub fn chrome_trace(events: &[TraceEvent], process: &str) -> String {
    let mut items: Vec<serde_json::Value> = Vec::with_capacity(events.len() + 8);
    items.push(
        serde_json::json!({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}),
    );
    let mut ranks: Vec<usize> = events.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in ranks {
        items.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": format!("rank {r}")}}));
    }
    for e in events {
        items.push(serde_json::json!({
            "name": e.name, "cat": e.cat, "ph": "X", "pid": 0, "tid": e.rank,
            "ts": e.start_us, "dur": e.dur_us, "args": {"step": e.step}
        }));
    }
    serde_json::to_string(&serde_json::json!({ "traceEvents": items, "displayTimeUnit": "ms" }))
        .expect("trace serialises")
        + "\n"
}
