//! The exhaustive search's speed on the two largest jobs of issue 3: Megatron's 1T model on
//! 3072 A100s and Llama 3.1 405B on 16,384 H100s, every knob free. Prints, per job, the layouts
//! enumerated, those built and costed, those that fit, the pipeline simulations run, and the
//! wall time (median of 5 runs, after one warm-up). The 1T job runs twice: under the default
//! profile (megatron-core), and under tessera's, whose space also holds the zero-bubble
//! schedules zb-h1 and zb-v (issue 41). docs/performance.md records a run of it:
//! `cargo bench -p tessera-planner --bench search`.

use std::path::Path;
use std::time::Instant;

use tessera_planner::search::{self, Pins};
use tessera_planner::spec::{self, ClusterOverrides, TrainingOverrides};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let jobs = [
        ("megatron-1t.toml", "dgx-a100-80g.toml", 384, None),
        (
            "megatron-1t.toml",
            "dgx-a100-80g.toml",
            384,
            Some("tessera"),
        ),
        ("llama3.1-405b.toml", "dgx-h100-80g.toml", 2048, None),
    ];
    println!(
        "{:<20} {:<14} {:>7} {:>10} {:>9} {:>6} {:>10} {:>9}  chosen",
        "model", "cluster", "GPUs", "enumerated", "evaluated", "fit", "simulated", "time"
    );
    for (model, cluster, nodes, framework) in jobs {
        let mut model = spec::load_model(
            &root.join("specs/models").join(model),
            TrainingOverrides::default(),
        )
        .expect("preset loads");
        if let Some(f) = framework {
            model.training.framework = Some(f.to_string());
        }
        let cluster = spec::load_cluster(
            &root.join("specs/clusters").join(cluster),
            ClusterOverrides {
                nodes: Some(nodes),
                devices: None,
            },
        )
        .expect("preset loads");
        let pins = Pins::default();
        let _ = search::search(&model, &cluster, &pins);
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..5 {
            let start = Instant::now();
            let r = search::search(&model, &cluster, &pins);
            times.push(start.elapsed().as_secs_f64());
            last = Some(r);
        }
        times.sort_by(f64::total_cmp);
        let r = last.expect("ran");
        let enumerated = search::enumerate(&model, &cluster, &pins).len();
        println!(
            "{:<20} {:<14} {:>7} {:>10} {:>9} {:>6} {:>10} {:>8.3}s  {}",
            format!(
                "{}{}",
                model.name,
                framework.map_or(String::new(), |f| format!(" ({f})"))
            ),
            cluster.name,
            cluster.devices,
            enumerated,
            r.evaluated,
            r.fits.len(),
            r.simulated,
            times[2],
            r.fits.first().map_or("-".into(), |c| format!(
                "{} ({:.2} s/step)",
                c.layout.label(),
                c.step_time()
            ))
        );
    }
}
