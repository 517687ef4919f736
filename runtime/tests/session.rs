//! The training session (`tessera_runtime::session`), which `tessera run` calls: it trains
//! exactly as the executor does with the same settings, applies the run's overrides, says what
//! it does through its observer, stops when the observer asks, and refuses bad settings before
//! any step, naming the flag.

mod tiny;

use std::path::PathBuf;
use std::sync::Arc;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind;
use tessera_runtime::exec::{train, StepMetrics, Stop, TrainOptions};
use tessera_runtime::session::{
    DataOptions, EvalOptions, Observer, OptimOverrides, RunOptions, Session,
};

/// Records what the session says, and stops the run after `stop_after` steps.
#[derive(Default)]
struct Recorder {
    said: Vec<String>,
    warned: Vec<String>,
    steps: Vec<usize>,
    stop_after: Option<usize>,
    began: Option<u64>,
    ended: bool,
}

impl Observer for Recorder {
    fn say(&mut self, line: &str) {
        self.said.push(line.to_string());
    }
    fn warn(&mut self, line: &str) {
        self.warned.push(line.to_string());
    }
    fn begin(&mut self, steps: u64) {
        self.began = Some(steps);
    }
    fn step(&mut self, m: &StepMetrics) -> bool {
        self.steps.push(m.step);
        self.stop_after.is_none_or(|n| self.steps.len() < n)
    }
    fn end(&mut self) {
        self.ended = true;
    }
}

/// DP 2 × PP 2 × TP 1, ZeRO-1, 1F1B: the tiny model on 4 CPU ranks.
fn plan() -> Plan {
    let layout: Layout = tiny::layout(2, 2, 1, 1, ScheduleKind::OneFOneB, 1, Recompute::None);
    tiny::plan(&tiny::model(), &layout)
}

fn options(steps: u64) -> RunOptions {
    RunOptions {
        plan_file: PathBuf::from("tiny-plan.json"),
        steps,
        seed: 77,
        data: DataOptions::default(),
        checkpoint: Default::default(),
        optim: OptimOverrides::default(),
        eval: EvalOptions::default(),
        trace: false,
        gpus: None,
        fault: None,
    }
}

fn losses(steps: &[StepMetrics]) -> Vec<f64> {
    steps.iter().map(|m| m.loss).collect()
}

#[test]
fn a_session_trains_as_the_executor_does_with_the_runs_overrides() {
    let plan = plan();
    let mut opts = options(4);
    opts.optim.lr = Some(1e-3);
    opts.optim.warmup_steps = Some(1);
    let mut obs = Recorder::default();
    let session = Session::prepare(&plan, opts, &mut obs).unwrap();
    let done = session.train(Arc::new(Stop::new()), &mut obs).unwrap();

    // The executor on the bundled text, with the same seed and the overrides applied by hand:
    // the minimum learning rate keeps the plan's ratio to the peak.
    let mut optimizer = plan.job.model.optimizer.clone();
    optimizer.min_lr = optimizer.min_lr / optimizer.lr * 1e-3;
    optimizer.lr = 1e-3;
    let mut schedule = plan.job.model.schedule.clone();
    schedule.warmup_steps = 1;
    let want = train(
        &plan,
        &tiny::data(),
        &TrainOptions {
            steps: 4,
            seed: 77,
            optimizer: Some(optimizer),
            schedule: Some(schedule),
            ..TrainOptions::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(losses(&done.report.steps), losses(&want.steps));
    let lrs: Vec<f64> = done.report.steps.iter().map(|m| m.lr).collect();
    let want_lrs: Vec<f64> = want.steps.iter().map(|m| m.lr).collect();
    assert_eq!(lrs, want_lrs);
    assert_eq!(done.report.params, want.params);

    // It said what it runs, and told the observer of every step.
    assert!(
        obs.said[0].starts_with("tiny: ") && obs.said[0].contains("on 4 CPU ranks"),
        "{:?}",
        obs.said
    );
    assert!(obs.said[1].starts_with("data: the bundled examples/data/parallelism.txt"));
    assert_eq!(obs.steps, vec![0, 1, 2, 3]);
    assert_eq!((obs.began, obs.ended), (Some(4), true));
    let summary = done.summary();
    assert!(summary[0].ends_with("over 4 steps"), "{summary:?}");
    assert_eq!(done.memory().rows.len(), 4);
}

#[test]
fn an_observer_that_declines_a_step_stops_the_run_there() {
    let plan = plan();
    let mut obs = Recorder {
        stop_after: Some(2),
        ..Recorder::default()
    };
    let session = Session::prepare(&plan, options(6), &mut obs).unwrap();
    let done = session.train(Arc::new(Stop::new()), &mut obs).unwrap();
    // The steps some rank had begun when the observer declined are finished (their collectives
    // need every rank), and no later one begins.
    let ran = done.report.steps.len();
    assert!((2..=3).contains(&ran), "{ran} steps of 6");
    assert_eq!(obs.steps, (0..ran).collect::<Vec<_>>());
}

#[test]
fn settings_are_refused_before_any_step_naming_the_flag() {
    let plan = plan();
    let mut obs = Recorder::default();

    let mut opts = options(4);
    opts.optim.min_lr = Some(1.0);
    let e = Session::prepare(&plan, opts, &mut obs)
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("--min-lr: "), "{e}");
    assert!(e.contains("\n  fix: "), "{e}");

    let mut opts = options(4);
    opts.eval.eval_every = Some(2);
    let e = Session::prepare(&plan, opts, &mut obs)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("--eval-every: there is no validation data"),
        "{e}"
    );

    let mut opts = options(4);
    opts.checkpoint.resume = Some("auto".into());
    let e = Session::prepare(&plan, opts, &mut obs)
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("--resume auto: "), "{e}");
    assert!(obs.steps.is_empty() && obs.began.is_none());
}

/// On GPUs a plan with dropout (or LoRA dropout) is refused before anything starts: the CUDA
/// backend has no dropout and would train without it. The same plan prepares on the CPU.
#[test]
fn dropout_on_gpus_is_refused_not_trained_without() {
    let mut m = tiny::model();
    m.training.dropout = 0.1;
    let layout = tiny::layout(1, 1, 1, 0, ScheduleKind::OneFOneB, 1, Recompute::None);
    let plan = tiny::plan(&m, &layout);
    let mut obs = Recorder::default();
    let mut opts = options(2);
    opts.gpus = Some(tessera_runtime::session::Gpus {
        visible: 1,
        collectives: tessera_runtime::session::Collectives::Auto,
    });
    let e = Session::prepare(&plan, opts, &mut obs)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("training.dropout 0.1") && e.contains("CPU backend only"),
        "{e}"
    );
    assert!(e.contains("dropout = 0.0"), "the fix: {e}");
    assert!(Session::prepare(&plan, options(2), &mut obs).is_ok());
}

/// A QLoRA plan trains on the CPU backend (runtime/tests/qlora_parity.rs), and is refused on
/// GPUs before anything starts: the CUDA backend has no NF4 storage (a LoRA plan trains there:
/// runtime/tests/executor_emulated_lora.rs).
#[test]
fn a_qlora_plan_is_refused_on_gpus_naming_the_method() {
    let mut model = tiny::model();
    model.training.method = tessera_planner::finetune::Method::Qlora;
    model.lora = Some(tessera_planner::finetune::Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: vec![tessera_planner::finetune::Target::Qkv],
    });
    let layout = tiny::layout(1, 1, 1, 0, ScheduleKind::OneFOneB, 1, Recompute::None);
    let plan = tiny::plan(&model, &layout);
    let mut opts = options(1);
    opts.gpus = Some(tessera_runtime::session::Gpus {
        visible: 1,
        collectives: tessera_runtime::session::Collectives::Staged,
    });
    let Err(e) = Session::prepare(&plan, opts, &mut Recorder::default()) else {
        panic!("a QLoRA plan is not prepared for GPUs");
    };
    let e = e.to_string();
    assert!(
        e.contains("training.method = qlora") && e.contains("NF4"),
        "{e}"
    );
    let mut obs = Recorder::default();
    let session = Session::prepare(&plan, options(2), &mut obs).unwrap();
    let done = session.train(Arc::new(Stop::new()), &mut obs).unwrap();
    assert_eq!(done.report.steps.len(), 2);
    assert!(done.report.nf4_bytes[0] > 0, "the base is held in NF4");
}
