//! Generation from a checkpoint (`exec::generate`): the forward it runs is the model the
//! executor trained (its loss on a step's batch is the loss the run reports for that step), and
//! a trained model predicts the training text better than the untrained one.

use std::path::Path;

use tessera_planner::layout::Layout;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_runtime::checkpoint::{Checkpoint, SaveOptions};
use tessera_runtime::data::{Sampler, Tokens};
use tessera_runtime::exec::generate::Generator;
use tessera_runtime::exec::{train, TrainOptions};

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tiny model as DP 2 × TP 2 (the checkpoint is resharded onto one rank to sample).
fn plan() -> Plan {
    let model = load_model(
        &root().join("specs/models/tiny.toml"),
        TrainingOverrides::default(),
    )
    .unwrap();
    let cluster = load_cluster(
        &root().join("specs/clusters/cpu-8.toml"),
        ClusterOverrides {
            nodes: None,
            devices: Some(4),
        },
    )
    .unwrap();
    let layout = Layout::without_pipeline(2, 2, 1, 2);
    Plan::new(&model, &cluster, &layout, SearchSummary::pinned())
}

#[test]
fn a_checkpoint_samples_the_model_the_run_trained() {
    const STEPS: usize = 60;
    let dir = std::env::temp_dir().join(format!("tessera-generate-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let (plan, data) = (
        plan(),
        Tokens::load(&root().join("examples/data/parallelism.txt")).unwrap(),
    );
    let opts = TrainOptions {
        steps: STEPS,
        save: Some(SaveOptions {
            dir: dir.clone(),
            every: STEPS - 1,
            keep: None,
            lineage: None,
        }),
        ..TrainOptions::default()
    };
    let report = train(&plan, &data, &opts, &mut |_| {}).unwrap();
    let ck = Checkpoint::open(&dir.join(format!("step-{}", STEPS - 1))).unwrap();
    let g = Generator::from_checkpoint(&ck).unwrap();

    // The loss the run reported for its last step is the generator's mean cross-entropy on
    // that step's batch under the weights saved before it.
    let t = &plan.job.model.training;
    let sampler = Sampler {
        seed: opts.seed,
        seq_len: t.seq_len as usize,
        global_batch: t.global_batch as usize,
    };
    let (x, y) = sampler.sequences(&data, (STEPS - 1) as u64, 0, t.global_batch as usize);
    let n = t.seq_len as usize;
    let mean: f64 = x
        .chunks(n)
        .zip(y.chunks(n))
        .map(|(x, y)| g.cross_entropy(x, y).unwrap())
        .sum::<f64>()
        / t.global_batch as f64;
    let reported = report.steps.last().unwrap().loss;
    assert!(
        (mean - reported).abs() <= 1e-5 * reported,
        "generator {mean} vs the run's {reported}"
    );

    // The trained model's greedy continuation of a training phrase is more likely under it
    // than the untrained model's own greedy continuation is under the untrained model, and
    // the training text itself is far more likely under the trained one.
    let untrained = Generator::initialised(&ck.index().model, opts.seed, g.window()).unwrap();
    let prompt: Vec<u32> = "Pipeline parallelism".bytes().map(u32::from).collect();
    let text: Vec<u32> = data.head(400);
    let (trained_text, untrained_text) = (g.loss(&text).unwrap(), untrained.loss(&text).unwrap());
    assert!(
        trained_text < untrained_text - 1.0,
        "training text: {trained_text} trained vs {untrained_text} untrained"
    );
    let greedy = |g: &Generator| {
        let out = g.generate(&prompt, 40, 0.0, 0).unwrap();
        let all: Vec<u32> = prompt.iter().chain(&out).copied().collect();
        (g.loss(&all).unwrap(), untrained.loss(&all).unwrap(), out)
    };
    let (under_trained, _, out) = greedy(&g);
    let (_, under_untrained, _) = greedy(&untrained);
    assert!(
        under_trained < under_untrained,
        "greedy continuation: {under_trained} trained vs {under_untrained} untrained"
    );
    // Deterministic for a seed; different seeds draw different text.
    assert_eq!(g.generate(&prompt, 40, 0.0, 9).unwrap(), out);
    let a = g.generate(&prompt, 40, 1.0, 5).unwrap();
    assert_eq!(a, g.generate(&prompt, 40, 1.0, 5).unwrap());
    assert_ne!(a, g.generate(&prompt, 40, 1.0, 6).unwrap());
    std::fs::remove_dir_all(&dir).ok();
}
