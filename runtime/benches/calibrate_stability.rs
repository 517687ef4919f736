//! How stable is the CPU calibration? Five calibrations of this host, one after the other, as
//! `tessera calibrate specs/clusters/cpu-8.toml` makes them (8 ranks at once), each turned into
//! the README tiny job's predicted step time (DP 2 × TP 2 × PP 2, 1F1B, ZeRO-1, micro-batch 2);
//! printed with each calibration's own verdict (its unstable figures, the share of the host's
//! CPU time other processes took while it measured), then the largest prediction over the
//! smallest. docs/calibration-cpu.md records a run:
//! `cargo bench -p tessera-runtime --bench calibrate_stability`.

use std::path::Path;
use std::time::Instant;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{self, ClusterOverrides, TrainingOverrides};
use tessera_runtime::calibrate::{calibrated, measure, memory_gib_per_rank, threads_per_rank};

const CALIBRATIONS: usize = 5;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let layout = Layout {
        pp: 2,
        recompute: Recompute::None,
        schedule: ScheduleKind::OneFOneB,
        ..Layout::without_pipeline(2, 2, 1, 2)
    };
    let ranks = (layout.dp * layout.pp * layout.tp) as usize;
    let model = spec::load_model(
        &root.join("specs/models/tiny.toml"),
        TrainingOverrides::default(),
    )
    .expect("preset loads");
    let nominal = spec::load_cluster(
        &root.join("specs/clusters/cpu-8.toml"),
        ClusterOverrides::default(),
    )
    .expect("preset loads");
    println!(
        "{:>3} {:>14} {:>8} {:>14} {:>8}  unstable figures",
        "#", "predicted s", "took s", "others' CPU", "load avg"
    );
    let mut predicted = Vec::new();
    for i in 1..=CALIBRATIONS {
        let start = Instant::now();
        let m = measure(ranks, threads_per_rank(ranks));
        let took = start.elapsed().as_secs_f64();
        let memory = memory_gib_per_rank(ranks, nominal.device.memory_gib);
        let cluster = calibrated(&nominal, &m, memory);
        let plan = Plan::new(&model, &cluster, &layout, SearchSummary::pinned());
        let p = plan.predicted.step_time_s;
        predicted.push(p);
        let unstable: Vec<String> = m
            .unstable()
            .iter()
            .map(|(n, s)| format!("{n} {:.0}%", s.spread * 100.0))
            .collect();
        println!(
            "{i:>3} {p:>14.5} {took:>8.1} {:>14} {:>8}  {}",
            m.load
                .map_or("?".into(), |l| format!("{:.0}%", l.others * 100.0)),
            m.load
                .and_then(|l| l.load_before)
                .map_or("?".into(), |a| format!("{a:.2}")),
            if unstable.is_empty() {
                "none".to_string()
            } else {
                unstable.join(", ")
            }
        );
    }
    let max = predicted.iter().copied().fold(f64::MIN, f64::max);
    let min = predicted.iter().copied().fold(f64::MAX, f64::min);
    println!(
        "predicted step: {min:.5} s to {max:.5} s, largest over smallest {:.3} ({} cores)",
        max / min,
        tessera_runtime::calibrate::host_cores()
    );
}
