//! Optimizer offload (`parallel.offload = "optimizer"`) on the emulated device: the f32 master
//! weights and Adam moments live in host memory and the runtime's own AdamW steps them there
//! (`exec/offload.rs`). The device's AdamW kernel computes the same f32 operations in the same
//! order, and the host rounds the updated weights to bf16 as the kernel does, so the run with
//! offload must equal the run without bit for bit: every loss, every gradient norm, every
//! final weight. And the emulated device must hold exactly the master copy and the moments
//! less. The runs are plans for a GPU cluster with a `[host]` tier, as the planner makes them.
//!
//! The emulator tests skip, with the reason printed, where there is no C++ compiler for it.

#[allow(dead_code)]
mod emu;
#[allow(dead_code)]
mod exec_common;

use std::sync::{Arc, Mutex};

use exec_common::{data, on_device, on_device_with, opts, plan_on, STEPS};
use tessera_planner::layout::{Layout, Offload, OffloadStates, OffloadTier};
use tessera_planner::plan::Plan;
use tessera_planner::spec::{Cluster, Host};
use tessera_runtime::checkpoint::{Checkpoint, SaveOptions};
use tessera_runtime::exec::{self, RunError, Stop, TrainOptions, TrainReport};

const TINY: &str = "specs/models/tiny.toml";

/// A GPU cluster of `devices` with a stated host tier (the planner refuses offload without one).
fn gpu_cluster(devices: u64) -> Cluster {
    let mut c = exec_common::cluster("specs/clusters/h100-pcie-80g.toml", devices);
    c.host = Host {
        memory_gib: 512.0,
        link_gbps: 25.0,
        nvme_gbps: 6.0,
        nvme_gib: 1000.0,
        adamw_gparams_per_s: 1.0,
    };
    c
}

/// The tiny model on DP `dp` with ZeRO `zero` and `offload`, checked as `Plan::load` checks a
/// plan file (`Layout::check`, then every knob takes effect: `pins::effective`).
fn plan(dp: u64, zero: u8, offload: Offload) -> Plan {
    let cluster = gpu_cluster(dp);
    let layout = Layout {
        offload,
        ..Layout::without_pipeline(dp, 1, zero, 2)
    };
    let p = plan_on(TINY, cluster.clone(), &layout);
    tessera_planner::search::pins::effective(&layout, &p.job.model, &cluster)
        .unwrap_or_else(|e| panic!("{}: {e}", layout.label()));
    p
}

fn optimizer_offload() -> Offload {
    Offload {
        states: OffloadStates::Optimizer,
        ..Offload::NONE
    }
}

/// Every step's loss and gradient norm, and every final weight, bit for bit.
fn assert_identical(got: &TrainReport, want: &TrainReport, what: &str) {
    assert!(!want.steps.is_empty(), "{what}: steps to compare");
    for (g, w) in got.steps.iter().zip(&want.steps) {
        assert_eq!(g.step, w.step, "{what}: the same steps");
        assert_eq!(
            (g.loss.to_bits(), g.grad_norm.to_bits()),
            (w.loss.to_bits(), w.grad_norm.to_bits()),
            "{what}: step {}: loss {} and gradient norm {}, want {} and {}",
            g.step,
            g.loss,
            g.grad_norm,
            w.loss,
            w.grad_norm
        );
    }
    assert_eq!(got.steps.len(), want.steps.len(), "{what}: the same steps");
    assert_eq!(
        got.params.keys().collect::<Vec<_>>(),
        want.params.keys().collect::<Vec<_>>(),
        "{what}: the same tensors"
    );
    for (name, w) in &want.params {
        let g = &got.params[name];
        let differ = g
            .iter()
            .zip(w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: {name}: {differ} of {} final weights differ from the run without offload",
            w.len()
        );
    }
    let losses: Vec<f64> = got.steps.iter().map(|s| s.loss).collect();
    eprintln!("{what}: identical bit for bit: losses {losses:?}");
}

/// One rank with ZeRO-1 (offload needs ZeRO), DP 2 with ZeRO-1, ZeRO-2 and ZeRO-3: the run with
/// the optimizer offloaded equals the run without, bit for bit. A planted bug that skips
/// copying the last updated tensor of each range back to the device fails it at the second
/// step's loss (5.312653 against 5.312537).
#[test]
fn optimizer_offload_trains_bit_for_bit_like_the_device_step() {
    let Some(emu) = emu::or_skip() else { return };
    for (dp, zero) in [(1, 1), (2, 1), (2, 2), (2, 3)] {
        let what = format!("DP {dp} ZeRO-{zero}");
        let on = |p: &Plan| on_device(p, &|_| Ok::<_, RunError>(emu.clone()));
        let device = on(&plan(dp, zero, Offload::NONE));
        let offloaded = on(&plan(dp, zero, optimizer_offload()));
        assert_identical(&offloaded, &device, &what);
        let l: Vec<f64> = offloaded.steps.iter().map(|s| s.loss).collect();
        assert_eq!(l.len(), STEPS, "{what}: every step reports");
        assert!(
            l[STEPS - 1] < l[0],
            "{what}: the offloaded run learns: {l:?}"
        );
    }
}

/// A run stopped after its first step and resumed from the checkpoint it saved: with offload
/// the checkpoint's master weights and moments come from host memory and go back there. The
/// resumed run, offloaded or not, continues the straight run bit for bit (DP 2 ZeRO-1: each
/// rank saves and restores its shard). A planted bug that resumes the host moments at zero
/// fails it at the third step's loss (5.211139 against 5.178360).
#[test]
fn an_offloaded_run_saves_and_resumes_bit_for_bit() {
    let Some(emu) = emu::or_skip() else { return };
    let launcher = |_| Ok::<_, RunError>(emu.clone());
    let offloaded = plan(2, 1, optimizer_offload());
    let straight = on_device(&offloaded, &launcher);
    let dir = std::env::temp_dir().join(format!("tessera-offload-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let stop = Stop::new();
    assert!(stop.may_start(0));
    stop.request();
    let first = TrainOptions {
        stop: Some(Arc::new(stop)),
        save: Some(SaveOptions {
            dir: dir.clone(),
            every: 1,
            keep: None,
            lineage: None,
        }),
        ..opts()
    };
    assert_eq!(on_device_with(&offloaded, &launcher, &first).steps.len(), 1);
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(ck.step(), 1);
    for (p, what) in [
        (&offloaded, "resumed with offload"),
        (&plan(2, 1, Offload::NONE), "resumed without offload"),
    ] {
        let o = TrainOptions {
            resume: Some(ck.clone()),
            ..opts()
        };
        let resumed = on_device_with(p, &launcher, &o);
        let want = TrainReport {
            steps: straight.steps[1..].to_vec(),
            ..straight.clone()
        };
        assert_identical(&resumed, &want, what);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Each rank's peak device bytes over the run, every rank on an emulator of its own.
fn peaks(plan: &Plan) -> Vec<usize> {
    let world = plan.parallel.world as usize;
    let launchers: Mutex<Vec<Option<emu::EmuLauncher>>> = Mutex::new(vec![None; world]);
    on_device(plan, &|r| {
        let l = emu::launcher().map_err(|why| RunError::Unsupported {
            what: why,
            fix: "install a C++ compiler".into(),
        })?;
        launchers.lock().unwrap()[r] = Some(l.clone());
        Ok(l)
    });
    let launchers = launchers.into_inner().unwrap();
    launchers
        .iter()
        .map(|l| l.as_ref().expect("every rank ran").peak_device_bytes())
        .collect()
}

/// With the optimizer offloaded, each rank's peak device memory is lower by exactly what the
/// device path keeps for the optimizer: the f32 master copy (4 bytes for each element of the
/// rank's flat buffer: the device path keeps it whole, also under ZeRO) and the two f32 Adam
/// moments of the rank's ZeRO shard (8 bytes per element of it). The tiny model on one stage
/// has no frozen or duplicated tensor, so the flat buffer holds the parameters once each, and
/// ZeRO shards it in DP equal parts (the last one shorter). A planted bug that leaves a master
/// copy on the device under offload fails it (1764352 bytes saved of 2646528 on one rank).
#[test]
fn optimizer_offload_frees_the_master_copy_and_the_moments_on_the_device() {
    if emu::or_skip().is_none() {
        return;
    }
    for dp in [1u64, 2] {
        let device = peaks(&plan(dp, 1, Offload::NONE));
        let offloaded = peaks(&plan(dp, 1, optimizer_offload()));
        let params = param_count();
        let share = params.div_ceil(dp as usize);
        for r in 0..dp as usize {
            let shard = params.min((r + 1) * share) - params.min(r * share);
            let want = 4 * params + 8 * shard;
            let saved = device[r] - offloaded[r];
            eprintln!(
                "DP {dp} rank {r}: peak device bytes {} without offload, {} with: {saved} less; master {} + moments {} = {want}",
                device[r], offloaded[r], 4 * params, 8 * shard
            );
            assert_eq!(
                saved, want,
                "DP {dp} rank {r}: device bytes saved by offload"
            );
        }
    }
}

/// The tiny model's parameters, counted from the tensors of a run of no steps on the CPU.
fn param_count() -> usize {
    let p = exec_common::plan(1, 1, 1, 0, tessera_planner::layout::Recompute::None);
    let opts = exec::TrainOptions { steps: 0, ..opts() };
    let report = exec::train(&p, &data(), &opts, &mut |_| {}).unwrap();
    report.params.values().map(Vec::len).sum()
}

fn refusal(r: Result<TrainReport, RunError>) -> String {
    match r {
        Ok(_) => panic!("the run was not refused"),
        Err(e) => e.to_string(),
    }
}

/// The CPU backend refuses offload: its device memory is the host's. (`Plan::load` refuses a
/// plan file for a CPU cluster with offload already: `pins::effective`; this is a plan made in
/// code, which the runtime checks itself.)
#[test]
fn the_cpu_backend_refuses_offload() {
    let layout = Layout {
        offload: optimizer_offload(),
        ..Layout::without_pipeline(1, 1, 1, 2)
    };
    let p = plan_on(
        TINY,
        exec_common::cluster("specs/clusters/cpu-8.toml", 1),
        &layout,
    );
    let e = refusal(exec::train(&p, &data(), &opts(), &mut |_| {}));
    assert!(
        e.contains("parallel.offload \"optimizer\"")
            && e.contains("on the CPU backend the device memory is the host's")
            && e.contains("without --offload"),
        "{e}"
    );
}

/// Offload the runtime does not run yet is refused before anything starts, on every backend
/// (`exec::check_supported`, which `tessera run` calls), naming the key and the fix.
#[test]
fn parameter_nvme_and_activation_offload_are_refused() {
    let cases = [
        (
            Offload {
                states: OffloadStates::Params,
                ..Offload::NONE
            },
            "parallel.offload \"params\"",
        ),
        (
            Offload {
                to: OffloadTier::Nvme,
                ..optimizer_offload()
            },
            "parallel.offload_to \"nvme\"",
        ),
        (
            Offload {
                activations: true,
                ..Offload::NONE
            },
            "parallel.offload_activations",
        ),
    ];
    for (offload, key) in cases {
        let p = plan(2, 3, offload);
        let e = match exec::check_supported(&p) {
            Ok(()) => panic!("{key}: not refused"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains(key) && e.contains("not built yet") && e.contains("--offload optimizer"),
            "{key}: {e}"
        );
        // And the run itself, before any step.
        let e = refusal(exec::train_on(
            &p,
            &data(),
            &opts(),
            &mut |_| {},
            &|_| Ok(tessera_runtime::backend::Cpu),
            &|_, c| Ok(c),
        ));
        assert!(e.contains(key), "{key}: {e}");
    }
    assert!(exec::check_supported(&plan(2, 1, optimizer_offload())).is_ok());
}
