//! Never refuse a run that ran: every replayed published run must be predicted to fit on its
//! GPU under its framework's profile. The section lists the runs by how close the predicted
//! peak comes to the device's memory, and any that the memory model would refuse.

use std::fmt::Write;

use super::{Row, Validation};

/// Every replayed run (scored or not), by predicted peak over device memory, tightest first.
pub fn rows(v: &Validation) -> Vec<&Row> {
    let mut all: Vec<&Row> = v.scored.iter().chain(&v.unscored).collect();
    all.sort_by(|a, b| share(b).total_cmp(&share(a)));
    all
}

fn share(r: &Row) -> f64 {
    r.predicted_memory_gib / r.capacity_gib
}

/// The runs that ran and that the memory model predicts not to fit.
pub fn refused(v: &Validation) -> Vec<&Row> {
    rows(v).into_iter().filter(|r| !r.fits).collect()
}

/// The report's section.
pub fn section(out: &mut String, v: &Validation) {
    let all = rows(v);
    let refused: Vec<&&Row> = all.iter().filter(|r| !r.fits).collect();
    let _ = writeln!(
        out,
        "\n## Feasibility: every run that ran fits\n\n\
         Each replayed run trained on its GPUs, so its layout must be predicted to fit under its \
         framework's profile; a planner that refuses a layout that demonstrably runs sends its \
         user to a worse one. No blanket margin is added (the presets' former assumed 5% fragmentation \
         is gone): a framework that reports its reserved bytes is charged one segment of the \
         stage's largest transient block (`allocator_reserved`, \
         planner/src/memory/allocator.rs), the others no slack, as a steady step reuses each \
         cached block; what the model leaves out (blocks split by varying shapes, \
         `expandable_segments`) is named in `tessera explain`.\n\n\
         - Runs replayed: {}; predicted to fit: {} (target: all).\n",
        all.len(),
        all.len() - refused.len()
    );
    for r in &refused {
        let _ = writeln!(
            out,
            "- **Refused although it ran**: `{}` ({}), {:.1} GiB predicted of {:.0} GiB.",
            r.id, r.profile, r.predicted_memory_gib, r.capacity_gib
        );
    }
    out.push_str("\nThe ten tightest, predicted peak against the device's memory:\n\n| run | profile | layout | predicted peak GiB | device GiB | share |\n|---|---|---|---:|---:|---:|\n");
    for r in all.iter().take(10) {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.1} | {:.0} | {:.0}% |",
            r.id,
            r.profile,
            r.layout_cell(),
            r.predicted_memory_gib,
            r.capacity_gib,
            100.0 * share(r)
        );
    }
}
