//! Keep what you train: N steps straight equal N/2 steps + save + resume + N/2 steps bit for
//! bit on the CPU backend, under every kind of layout; a checkpoint resumes on another layout
//! (within the parity tolerance of parity.rs); a damaged checkpoint is a clear error.

mod tiny;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind;
use tessera_runtime::checkpoint::{Checkpoint, SaveOptions};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, Stop, TrainOptions, TrainReport};

/// Steps of the whole run; the interrupted run stops (and saves) after `HALF`.
const STEPS: usize = 6;
const HALF: usize = 3;

#[derive(Clone, Copy, Debug)]
struct L {
    dp: u64,
    pp: u64,
    tp: u64,
    zero: u8,
    schedule: ScheduleKind,
    v: u64,
    recompute: Recompute,
    sp: bool,
}

const fn l(dp: u64, pp: u64, tp: u64, zero: u8) -> L {
    L {
        dp,
        pp,
        tp,
        zero,
        schedule: ScheduleKind::OneFOneB,
        v: 1,
        recompute: Recompute::None,
        sp: false,
    }
}

fn plan(l: L) -> Plan {
    let layout = Layout {
        sequence_parallel: l.sp,
        ..tiny::layout(l.dp, l.pp, l.tp, l.zero, l.schedule, l.v, l.recompute)
    };
    tiny::plan(&tiny::model(), &layout)
}

/// A fresh, empty directory for one test's checkpoints.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-ckpt-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A stop that lets exactly `steps` steps run (what a signal after step `steps` does).
fn stop_after(steps: usize) -> Arc<Stop> {
    let stop = Stop::new();
    for s in 0..steps {
        assert!(stop.may_start(s));
    }
    stop.request();
    Arc::new(stop)
}

fn opts() -> TrainOptions {
    TrainOptions {
        steps: STEPS,
        ..TrainOptions::default()
    }
}

fn run(plan: &Plan, opts: &TrainOptions) -> TrainReport {
    train(plan, &tiny::data(), opts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{}: {e}", plan.parallel.layout().label()))
}

/// Trains `plan` for `HALF` of `STEPS` steps, saving into `dir` every 2 steps and at the stop.
fn first_half(plan: &Plan, dir: &Path) -> TrainReport {
    let o = TrainOptions {
        stop: Some(stop_after(HALF)),
        save: Some(SaveOptions {
            dir: dir.to_path_buf(),
            every: 2,
            keep: Some(1),
            lineage: None,
        }),
        ..opts()
    };
    let r = run(plan, &o);
    assert_eq!(r.steps.len(), HALF);
    r
}

/// Resumes `plan` from the latest checkpoint in `dir` and trains to `STEPS`.
fn second_half(plan: &Plan, dir: &Path) -> TrainReport {
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ck.step(), HALF);
    // The data order and seeds are the checkpoint's, whatever seed the resumed run is given.
    let o = TrainOptions {
        resume: Some(Arc::new(ck)),
        seed: opts().seed + 1,
        ..opts()
    };
    let r = run(plan, &o);
    assert_eq!(
        r.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        (HALF..STEPS).collect::<Vec<_>>()
    );
    r
}

/// The halves `a` then `b` of a resumed run lose and end as the `straight` run, bit for bit.
fn assert_resumed_is_straight(
    a: &TrainReport,
    b: &TrainReport,
    straight: &TrainReport,
    what: &str,
) {
    let losses = |r: &TrainReport| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    let mut resumed = losses(a);
    resumed.extend(losses(b));
    assert_eq!(resumed, losses(straight), "{what}: losses differ");
    assert!(
        bits(&b.params) == bits(&straight.params),
        "{what}: final parameters differ"
    );
}

fn bits(params: &BTreeMap<String, Vec<f32>>) -> BTreeMap<&String, Vec<u32>> {
    params
        .iter()
        .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn resume_is_bit_identical_under_every_kind_of_layout() {
    let interleaved = L {
        schedule: ScheduleKind::Interleaved,
        v: 2,
        ..l(1, 2, 1, 0)
    };
    let layouts = [
        l(1, 1, 1, 0),
        l(2, 1, 1, 0),
        l(2, 1, 2, 3),
        L {
            zero: 1,
            ..interleaved
        },
        L {
            dp: 2,
            tp: 2,
            zero: 2,
            ..interleaved
        },
        L {
            sp: true,
            recompute: Recompute::Selective,
            ..l(1, 1, 2, 0)
        },
        L {
            sp: true,
            recompute: Recompute::Full,
            ..l(2, 2, 2, 3)
        },
    ];
    for (i, layout) in layouts.into_iter().enumerate() {
        let what = format!("{layout:?}");
        let p = plan(layout);
        let straight = run(&p, &opts());
        let dir = scratch(&format!("same-{i}"));
        let a = first_half(&p, &dir);
        // Saved at step 2, then at the stop (step 3); keep 1 pruned step 2.
        let latest = std::fs::read_to_string(dir.join("latest")).unwrap();
        assert_eq!(latest.trim(), "step-3", "{what}");
        assert!(!dir.join("step-2").exists(), "{what}: keep 1 prunes step-2");
        let b = second_half(&p, &dir);
        assert_resumed_is_straight(&a, &b, &straight, &what);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn a_checkpoint_resumes_on_another_layout() {
    let straight = run(&plan(l(1, 1, 1, 0)), &opts());
    let interleaved = L {
        schedule: ScheduleKind::Interleaved,
        v: 2,
        ..l(1, 2, 2, 2)
    };
    // (saved under, resumed under): the examples, the other ZeRO stages and the
    // interleaved schedule, and back from one rank and from DP 8 ZeRO-3.
    let pairs = [
        (l(2, 2, 2, 1), l(1, 2, 4, 1)),
        (l(2, 2, 2, 1), l(8, 1, 1, 3)),
        (l(2, 2, 2, 1), l(1, 1, 1, 0)),
        (l(2, 2, 2, 1), l(4, 1, 1, 0)),
        (l(2, 2, 2, 1), l(2, 1, 4, 3)),
        (l(2, 2, 2, 1), interleaved),
        (l(1, 1, 1, 0), l(2, 2, 2, 1)),
        (l(8, 1, 1, 3), l(2, 2, 2, 1)),
    ];
    for (i, (from, to)) in pairs.into_iter().enumerate() {
        let what = format!("{from:?} → {to:?}");
        let dir = scratch(&format!("reshard-{i}"));
        let a = first_half(&plan(from), &dir);
        let b = second_half(&plan(to), &dir);
        assert_resharded(&a, &b, &straight, &what);
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A two-rank checkpoint at step `HALF` in a fresh directory, and its step directory.
fn saved(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    first_half(&plan(l(2, 1, 1, 1)), &dir);
    let step = dir.join("step-3");
    assert!(step.join("index.json").is_file());
    (dir, step)
}

fn open_err(path: &Path) -> String {
    match Checkpoint::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_damaged_checkpoint_is_a_clear_error() {
    let (dir, step) = saved("damaged");
    let shard = step.join("rank-00001.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    let index = std::fs::read_to_string(step.join("index.json")).unwrap();

    // Truncated shard.
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // One byte of a tensor changed, the length kept: the index's SHA-256 refuses it.
    let mut flipped = bytes.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    std::fs::write(&shard, &flipped).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("SHA-256"),
        "{e}"
    );
    // The same length, but not a safetensors file.
    std::fs::write(&shard, vec![0xffu8; bytes.len()]).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("safetensors"),
        "{e}"
    );
    // Another rank's tensors in its place.
    let other = std::fs::read(step.join("rank-00000.safetensors")).unwrap();
    std::fs::write(&shard, &other).unwrap();
    let patched = index.replacen(
        &format!("\"bytes\": {}", bytes.len()),
        &format!("\"bytes\": {}", other.len()),
        1,
    );
    std::fs::write(step.join("index.json"), &patched).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("tensor"),
        "{e}"
    );
    std::fs::write(step.join("index.json"), &index).unwrap();
    // Missing shard.
    std::fs::remove_file(&shard).unwrap();
    let e = open_err(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("read"),
        "{e}"
    );
    std::fs::write(&shard, &bytes).unwrap();
    assert!(Checkpoint::open(&dir).is_ok(), "restored");

    // Bad index JSON.
    std::fs::write(step.join("index.json"), &index[..index.len() / 3]).unwrap();
    let e = open_err(&dir);
    assert!(e.contains("index.json") && e.contains("JSON"), "{e}");
    std::fs::write(
        step.join("index.json"),
        index.replace("tessera.checkpoint/v1", "x/v9"),
    )
    .unwrap();
    let e = open_err(&dir);
    assert!(e.contains("index.json") && e.contains("x/v9"), "{e}");
    std::fs::write(step.join("index.json"), &index).unwrap();

    // Wrong architecture: a plan of another model is refused, naming the field.
    let ck = Arc::new(Checkpoint::open(&dir).unwrap());
    let mut other = plan(l(1, 1, 1, 0));
    other.job.model.architecture.ffn_hidden = 128;
    let e = ck
        .check_compatible(&other, &tiny::data())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("index.json") && e.contains("model.ffn_hidden"),
        "{e}"
    );
    let o = TrainOptions {
        resume: Some(ck.clone()),
        ..opts()
    };
    let e = train(&other, &tiny::data(), &o, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.ffn_hidden"), "{e}");
    // Other data.
    let text = Tokens::from_text(&"another corpus entirely. ".repeat(40));
    let e = ck
        .check_compatible(&plan(l(1, 1, 1, 0)), &text)
        .unwrap_err()
        .to_string();
    assert!(e.contains("data."), "{e}");
    // Not a checkpoint at all.
    let e = open_err(&dir.join("nowhere"));
    assert!(e.contains("nowhere"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint() {
    let (dir, step) = saved("interrupted");
    // What a save killed half-way leaves: a temporary directory with part of its files, and
    // (killed after its rename, before `latest` moved) a complete step-5 not yet the latest.
    let tmp = dir.join(".tmp-step-5-999-1-0");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join("rank-00000.safetensors"), b"partial").unwrap();
    std::fs::write(dir.join(".tmp-latest-999-2-0"), b"step-5").unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.dir(), step);
    // The next save removes the leftovers, and moves `latest` only once complete.
    let p = plan(l(2, 1, 1, 1));
    let o = TrainOptions {
        resume: Some(Arc::new(ck)),
        save: Some(SaveOptions {
            dir: dir.clone(),
            every: 1,
            keep: Some(2),
            lineage: None,
        }),
        stop: Some(stop_after(5)),
        ..opts()
    };
    run(&p, &o);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step-4", "step-5"]);
    assert_eq!(Checkpoint::open(&dir).unwrap().step(), 5);
    // Pointing at a step directory opens that one.
    assert_eq!(Checkpoint::open(&dir.join("step-4")).unwrap().step(), 4);
    std::fs::remove_dir_all(&dir).ok();
}

/// The child of [`a_kill_at_any_instant_of_a_save_leaves_a_loadable_checkpoint`]: trains one
/// rank, saving every step into `$TESSERA_CKPT_CHILD` (resuming from it when it holds a
/// checkpoint), until killed. Does nothing in a normal test run.
#[test]
fn save_loop_child() {
    let Some(dir) = std::env::var_os("TESSERA_CKPT_CHILD") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let resume = Checkpoint::open(&dir).ok().map(Arc::new);
    let o = TrainOptions {
        steps: 1_000_000,
        save: Some(SaveOptions {
            dir,
            every: 1,
            keep: Some(2),
            lineage: None,
        }),
        resume,
        ..TrainOptions::default()
    };
    run(&plan(l(1, 1, 1, 0)), &o);
}

#[test]
fn a_kill_at_any_instant_of_a_save_leaves_a_loadable_checkpoint() {
    let dir = scratch("kill");
    let mut last = 0;
    for i in 0..12u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["save_loop_child", "--exact", "--test-threads", "1"])
            .env("TESSERA_CKPT_CHILD", &dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for this child's first save, then kill it (SIGKILL) a varying time later.
        let start = std::time::Instant::now();
        while Checkpoint::open(&dir).map_or(0, |c| c.step()) <= last {
            assert!(start.elapsed().as_secs() < 60, "the child never saved");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        std::thread::sleep(std::time::Duration::from_micros(1 + (i * 7919) % 40_000));
        child.kill().unwrap();
        child.wait().unwrap();
        let ck = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("after kill {i}: {e}"));
        assert!(
            ck.step() > last,
            "after kill {i}: step {} ≤ {last}",
            ck.step()
        );
        last = ck.step();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A run saved as `a` and resumed on another layout as `b` gives `single`'s losses and
/// parameters within the parity tolerance.
fn assert_resharded(a: &TrainReport, b: &TrainReport, single: &TrainReport, what: &str) {
    for (got, want) in a.steps.iter().chain(&b.steps).zip(&single.steps) {
        assert!(
            (got.loss - want.loss).abs() <= 1e-5 * want.loss.abs(),
            "{what}: step {} loss {} vs {}",
            got.step,
            got.loss,
            want.loss
        );
    }
    tiny::assert_params_close(&b.params, &single.params, what);
}

/// The MoE model (specs/models/tiny-moe.toml) with expert parallelism: a checkpoint saved
/// under EP resumes bit for bit on its own layout, and on one rank and on another EP within
/// the parity tolerance (expert tensors are written by their EP shards and regathered).
#[test]
fn an_moe_checkpoint_resumes_on_its_layout_and_across_ep() {
    let moe = |dp: u64, ep: u64, zero: u8| {
        let layout = Layout {
            ep,
            ..tiny::layout(dp, 1, 1, zero, ScheduleKind::OneFOneB, 1, Recompute::None)
        };
        tiny::plan(&tiny::moe_model(), &layout)
    };
    let single = run(&moe(1, 1, 0), &opts());
    let losses = |r: &TrainReport| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    // Saved and resumed under DP 4 × EP 2 with ZeRO-1: bit-identical to the run never stopped.
    let p = moe(4, 2, 1);
    let straight = run(&p, &opts());
    let dir = scratch("moe-same");
    let a = first_half(&p, &dir);
    let b = second_half(&p, &dir);
    let mut resumed = losses(&a);
    resumed.extend(losses(&b));
    assert_eq!(resumed, losses(&straight), "EP 2: losses differ");
    assert!(
        bits(&b.params) == bits(&straight.params),
        "EP 2: parameters differ"
    );
    std::fs::remove_dir_all(&dir).ok();
    // Saved under EP 2, resumed on one rank and under EP 4: the single-rank run's numbers.
    for (i, to) in [moe(1, 1, 0), moe(4, 4, 0)].iter().enumerate() {
        let dir = scratch(&format!("moe-reshard-{i}"));
        let a = first_half(&moe(2, 2, 0), &dir);
        let b = second_half(to, &dir);
        assert_resharded(&a, &b, &single, &format!("EP 2 → {i}"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The tiny model fine-tuned with LoRA (r 4, alpha 8, on qkv, o, up, down) under `l`.
fn lora_plan(l: L) -> Plan {
    let mut m = tiny::model();
    m.training.method = tessera_planner::finetune::Method::Lora;
    m.lora = Some(tessera_planner::finetune::Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: {
            use tessera_planner::finetune::Target::*;
            vec![Qkv, O, Up, Down]
        },
    });
    let layout = Layout {
        sequence_parallel: l.sp,
        ..tiny::layout(l.dp, l.pp, l.tp, l.zero, l.schedule, l.v, l.recompute)
    };
    tiny::plan(&m, &layout)
}

/// A LoRA run's checkpoint holds the adapters with their moments and the frozen base (its
/// weights, zero moments): N/2 + save + resume + N/2 equals N straight bit for bit, and a full
/// plan refuses to resume it.
#[test]
fn a_lora_run_resumes_bit_identically() {
    let layouts = [
        l(1, 1, 1, 0),
        l(2, 1, 2, 3),
        L {
            sp: true,
            recompute: Recompute::Full,
            ..l(2, 2, 2, 1)
        },
    ];
    for (i, layout) in layouts.into_iter().enumerate() {
        let what = format!("lora {layout:?}");
        let p = lora_plan(layout);
        let straight = run(&p, &opts());
        let dir = scratch(&format!("lora-{i}"));
        let a = first_half(&p, &dir);
        let b = second_half(&p, &dir);
        assert_resumed_is_straight(&a, &b, &straight, &what);
        if i == 0 {
            let ck = Checkpoint::open(&dir).unwrap();
            let err = ck
                .check_compatible(&plan(l(1, 1, 1, 0)), &tiny::data())
                .unwrap_err()
                .to_string();
            assert!(err.contains("lora"), "{err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// LoRA on attention over the MoE model, its routed experts frozen: saved under DP 4 × EP 2, the
/// checkpoint holds every expert (each written by its expert-DP group's first rank) and resumes
/// bit for bit on its own layout, and on one rank and under EP 4 within the parity tolerance.
#[test]
fn a_lora_run_on_a_moe_base_resumes_across_ep() {
    let moe = |dp: u64, ep: u64, zero: u8| {
        let layout = Layout {
            ep,
            ..tiny::layout(dp, 1, 1, zero, ScheduleKind::OneFOneB, 1, Recompute::None)
        };
        let mut m = tiny::moe_model();
        m.training.method = tessera_planner::finetune::Method::Lora;
        m.lora = Some(tessera_planner::finetune::Lora {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec![
                tessera_planner::finetune::Target::Qkv,
                tessera_planner::finetune::Target::O,
            ],
        });
        tiny::plan(&m, &layout)
    };
    let p = moe(4, 2, 1);
    let straight = run(&p, &opts());
    let dir = scratch("lora-moe-same");
    let a = first_half(&p, &dir);
    let b = second_half(&p, &dir);
    assert_resumed_is_straight(&a, &b, &straight, "lora moe dp4 ep2 zero1");
    std::fs::remove_dir_all(&dir).ok();
    let single = run(&moe(1, 1, 0), &opts());
    for (i, to) in [moe(1, 1, 0), moe(4, 4, 0)].iter().enumerate() {
        let dir = scratch(&format!("lora-moe-reshard-{i}"));
        let a = first_half(&moe(2, 2, 0), &dir);
        let b = second_half(to, &dir);
        assert_resharded(&a, &b, &single, &format!("lora EP 2 → {i}"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A run with dropout resumes bit for bit: its masks are drawn from the step and the data
/// seed, which the checkpoint keeps, not from a generator's state it would have to save.
#[test]
fn a_run_with_dropout_resumes_bit_identically() {
    let layouts = [
        l(1, 1, 1, 0),
        L {
            sp: true,
            recompute: Recompute::Full,
            ..l(2, 2, 2, 1)
        },
    ];
    for (i, layout) in layouts.into_iter().enumerate() {
        let what = format!("dropout {layout:?}");
        let mut m = tiny::model();
        m.training.dropout = 0.1;
        let l = layout;
        let p = tiny::plan(
            &m,
            &Layout {
                sequence_parallel: l.sp,
                ..tiny::layout(l.dp, l.pp, l.tp, l.zero, l.schedule, l.v, l.recompute)
            },
        );
        let straight = run(&p, &opts());
        let dir = scratch(&format!("dropout-{i}"));
        let a = first_half(&p, &dir);
        let b = second_half(&p, &dir);
        assert_resumed_is_straight(&a, &b, &straight, &what);
        std::fs::remove_dir_all(&dir).ok();
    }
}
