//! Terminal tables shared by the subcommands (file writes: `crate::files`).

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use tessera_planner::memory::MemoryReport;
use tessera_planner::spec::GIB;
use tessera_planner::units;

/// An aligned, borderless table; numeric columns (by index) are right-aligned.
pub fn table(header: &[&str], right: &[usize]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING)
        .set_header(header.iter().map(|h| h.to_string()));
    for &i in right {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

pub fn gib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / GIB)
}

/// Per-stage totals by kind, then every term of the peak stage with its reason.
/// The unit is the one in which the peak reads at least 1 (GiB for real models, KiB or MiB
/// for the tiny ones), so no row reads 0.00.
pub fn memory_tables(m: &MemoryReport, all_terms: bool) -> String {
    let (unit, size) = units::unit_for(m.peak_bytes as f64);
    // Every byte column in the unit chosen above.
    let shown = |b: u64| format!("{:.2}", b as f64 / size);
    let mut t = table(
        &[
            "stage",
            "layers",
            "in flight",
            &format!("states {unit}"),
            &format!("activations {unit}"),
            &format!("overhead {unit}"),
            &format!("total {unit}"),
        ],
        &[0, 1, 2, 3, 4, 5, 6],
    );
    let sum = |s: &tessera_planner::memory::StageMemory, kind: &str| -> u64 {
        s.terms
            .iter()
            .filter(|t| t.kind == kind)
            .map(|t| t.bytes)
            .sum()
    };
    for s in &m.per_stage {
        t.add_row(vec![
            s.stage.to_string(),
            s.layers.to_string(),
            s.in_flight.to_string(),
            shown(sum(s, "model_states")),
            shown(sum(s, "activations")),
            shown(sum(s, "overhead")),
            shown(s.total_bytes),
        ]);
    }
    let mut out = format!("{t}\n");
    let stages: Vec<_> = if all_terms {
        m.per_stage.iter().collect()
    } else {
        m.per_stage.get(m.peak_stage as usize).into_iter().collect()
    };
    for s in stages {
        out += &format!(
            "\nstage {} ({} layers, {} params per rank):\n",
            s.stage, s.layers, s.params_per_rank
        );
        let mut t = table(&["term", unit, "why"], &[1]);
        for term in &s.terms {
            t.add_row(vec![
                term.name.clone(),
                shown(term.bytes),
                term.reason.clone(),
            ]);
        }
        t.add_row(vec![
            "total".to_string(),
            shown(s.total_bytes),
            format!("of {} per device", units::bytes(m.capacity_bytes as f64)),
        ]);
        out += &format!("{t}\n");
    }
    if let Some(h) = &m.host {
        out += &host_tables(h, stages_shown(m, all_terms));
    }
    out
}

fn stages_shown(m: &MemoryReport, all_terms: bool) -> Vec<u64> {
    if all_terms {
        m.per_stage.iter().map(|s| s.stage).collect()
    } else {
        vec![m.peak_stage]
    }
}

/// The host tier of a layout that offloads: per rank of each stage, the node's total against
/// its capacity, and the terms of the stages shown.
fn host_tables(h: &tessera_planner::memory::offload::HostReport, stages: Vec<u64>) -> String {
    let most = h.host_bytes_per_node.max(h.nvme_bytes_per_node).max(1);
    let (unit, size) = units::unit_for(most as f64);
    let shown = |b: u64| format!("{:.2}", b as f64 / size);
    let mut out = format!(
        "\nhost tier, per node: host memory {} of {}, NVMe {} of {}\n",
        units::bytes(h.host_bytes_per_node as f64),
        units::bytes(h.host_capacity_bytes as f64),
        units::bytes(h.nvme_bytes_per_node as f64),
        units::bytes(h.nvme_capacity_bytes as f64),
    );
    for s in h.per_stage.iter().filter(|s| stages.contains(&s.stage)) {
        out += &format!("\nstage {} off the device, per rank:\n", s.stage);
        let mut t = table(&["term", "tier", unit, "why"], &[2]);
        for term in &s.terms {
            t.add_row(vec![
                term.name.clone(),
                term.kind.clone(),
                shown(term.bytes),
                term.reason.clone(),
            ]);
        }
        t.add_row(vec![
            "total".to_string(),
            String::new(),
            shown(s.host_bytes + s.nvme_bytes),
            format!(
                "host {} + NVMe {} per rank",
                units::bytes(s.host_bytes as f64),
                units::bytes(s.nvme_bytes as f64)
            ),
        ]);
        out += &format!("{t}\n");
    }
    out
}
