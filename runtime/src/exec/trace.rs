//! The executed schedule as Chrome trace events: the planner's format (`tessera_planner::trace`),
//! one track per rank, so measured and predicted timelines load side by side in Perfetto.

pub use tessera_planner::trace::{op_label, TraceEvent};

/// The Chrome trace JSON document of a run's executed ops.
pub fn chrome_trace(events: &[TraceEvent]) -> String {
    tessera_planner::trace::chrome_trace(events, "measured", "rank")
}
