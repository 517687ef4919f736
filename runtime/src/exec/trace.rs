//! The executed schedule as Chrome trace events: the planner's format (`tessera_planner::trace`),
//! one track per rank, so measured and predicted timelines load side by side in Perfetto.
//!
//! A run writes its trace however it ends: the whole document when its steps finish (or stop at
//! a step boundary), and, when it ends early (a failure, a second signal), a document that is
//! still closed JSON, with the ops it could collect (possibly none) and why it stopped under
//! `otherData.stopped` (Perfetto shows `otherData` as the trace's metadata).

pub use tessera_planner::trace::{op_label, TraceEvent};

/// The Chrome trace JSON document of a run's executed ops.
pub fn chrome_trace(events: &[TraceEvent]) -> String {
    tessera_planner::trace::chrome_trace(events, "measured", "rank")
}

/// The document of a run that ended before its trace was complete: `events` (what was
/// collected) and `why` under `otherData.stopped`.
pub fn chrome_trace_stopped(events: &[TraceEvent], why: &str) -> String {
    let mut doc: serde_json::Value =
        serde_json::from_str(&chrome_trace(events)).expect("the planner writes valid JSON");
    doc["otherData"] = serde_json::json!({ "stopped": why });
    serde_json::to_string(&doc).expect("a trace always serialises") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_cut_short_is_closed_json_that_says_why() {
        let doc = chrome_trace_stopped(&[], "stopped at once by a second SIGINT");
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        assert!(v["traceEvents"].is_array());
        assert_eq!(
            v["otherData"]["stopped"],
            "stopped at once by a second SIGINT"
        );
        assert!(doc.ends_with("}\n"));
    }
}
