//! Does a calibrated CPU cluster spec predict `tessera run`'s step time? For each job: measure
//! this host for the job's rank count (`calibrate::measure`, what `tessera calibrate` writes),
//! plan the job on the calibrated spec, train it, and print the predicted over the measured step
//! time (mean of the steps after the first). docs/calibration-cpu.md records a run:
//! `cargo bench -p tessera-runtime --bench calibrated`.

use std::path::Path;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{self, ClusterOverrides, TrainingOverrides};
use tessera_runtime::calibrate::{calibrated, measure, memory_gib_per_rank, threads_per_rank};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, TrainOptions};

struct Job {
    name: &'static str,
    model: &'static str,
    seq_len: Option<u64>,
    global_batch: Option<u64>,
    layout: Layout,
    steps: usize,
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = Tokens::load(&root.join("examples/data/parallelism.txt")).expect("data loads");
    let jobs = [
        Job {
            name: "README tiny job",
            model: "tiny.toml",
            seq_len: None,
            global_batch: None,
            layout: Layout {
                pp: 2,
                recompute: Recompute::None,
                schedule: ScheduleKind::OneFOneB,
                ..Layout::without_pipeline(2, 2, 1, 2)
            },
            steps: 30,
        },
        Job {
            name: "GPT-2 124M, 1 rank",
            model: "gpt2-124m.toml",
            seq_len: Some(256),
            global_batch: Some(8),
            layout: Layout::without_pipeline(1, 1, 0, 8),
            steps: 4,
        },
        Job {
            name: "GPT-2 124M, DP 2",
            model: "gpt2-124m.toml",
            seq_len: Some(256),
            global_batch: Some(8),
            layout: Layout::without_pipeline(2, 1, 1, 4),
            steps: 4,
        },
    ];
    println!(
        "{:<20} {:>5} {:>14} {:>14} {:>10}",
        "job", "ranks", "measured s", "predicted s", "pred/meas"
    );
    for job in jobs {
        let l = &job.layout;
        let ranks = (l.dp * l.pp * l.tp) as usize;
        let model = spec::load_model(
            &root.join("specs/models").join(job.model),
            TrainingOverrides {
                seq_len: job.seq_len,
                global_batch: job.global_batch,
                ..Default::default()
            },
        )
        .expect("preset loads");
        let nominal = spec::load_cluster(
            &root.join("specs/clusters/cpu-8.toml"),
            ClusterOverrides {
                nodes: None,
                devices: Some(ranks as u64),
            },
        )
        .expect("preset loads");
        let threads = threads_per_rank(ranks);
        let m = measure(ranks, threads);
        let memory = memory_gib_per_rank(ranks, nominal.device.memory_gib);
        let cluster = calibrated(&nominal, &m, memory);
        let plan = Plan::new(&model, &cluster, l, SearchSummary::pinned());
        let opts = TrainOptions {
            steps: job.steps,
            threads_per_rank: threads,
            ..TrainOptions::default()
        };
        let report = train(&plan, &data, &opts, &mut |_| {}).expect("trains");
        let timed: Vec<f64> = report.steps[1..].iter().map(|s| s.step_time_s).collect();
        let measured = timed.iter().sum::<f64>() / timed.len() as f64;
        let predicted = plan.predicted.step_time_s;
        println!(
            "{:<20} {:>5} {:>14.4} {:>14.4} {:>10.2}",
            job.name,
            ranks,
            measured,
            predicted,
            predicted / measured
        );
    }
}
