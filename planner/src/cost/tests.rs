//! The cost model's terms against formulas written out by hand.

use super::*;
use crate::layout::{Recompute, Sharding};
use crate::schedule::ScheduleKind;
use crate::spec::{self as specs, ClusterOverrides, TrainingOverrides};
use std::path::Path;

/// A preset model on `nodes` DGX A100 nodes (shared with the other cost test modules).
pub(super) fn job(model: &str, nodes: u64) -> (Model, Cluster) {
    job_on(model, "dgx-a100-80g.toml", nodes)
}

/// A preset model on `nodes` nodes of a preset cluster (shared with the other cost test modules).
pub(super) fn job_on(model: &str, cluster: &str, nodes: u64) -> (Model, Cluster) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let m = specs::load_model(
        &root.join("models").join(model),
        TrainingOverrides::default(),
    )
    .unwrap();
    let c = specs::load_cluster(
        &root.join("clusters").join(cluster),
        ClusterOverrides {
            nodes: Some(nodes),
            devices: None,
        },
    )
    .unwrap();
    (m, c)
}

/// A layout with full recompute (shared with the other cost test modules).
pub(super) fn layout(dp: u64, pp: u64, tp: u64, zero: u8, kind: ScheduleKind, v: u64) -> Layout {
    Layout {
        dp,
        cp: 1,
        cp_comm: crate::layout::CpComm::P2p,
        ep: 1,
        pp,
        tp,
        micro_batch: 1,
        sharding: Sharding {
            zero_stage: zero,
            hybrid: false,
        },
        recompute: Recompute::Full,
        recompute_every: 1,
        sequence_parallel: false,
        schedule: kind,
        virtual_stages: v,
        offload: crate::layout::Offload::NONE,
    }
}

fn predict(m: &Model, c: &Cluster, l: &Layout, o: Options) -> (Evaluation, Prediction) {
    let links = Links::new(c, &l.mesh(c));
    let t = layer_times(m, c, l, &links, o);
    let e = evaluate(
        m,
        c,
        l,
        &l.split_layers(m.architecture.layers),
        &links,
        &t,
        o,
    );
    let p = e.predict(&pipeline::Simulator::new().run(&e.pipeline));
    (e, p)
}

/// The named terms add up to the step time, whatever the layout.
#[test]
fn cost_breakdown_sums_to_the_step_time() {
    let (m, c) = job("gpt3-175b.toml", 16);
    for l in [
        layout(16, 1, 8, 0, ScheduleKind::OneFOneB, 1),
        layout(2, 8, 8, 1, ScheduleKind::OneFOneB, 1),
        layout(2, 8, 8, 0, ScheduleKind::Interleaved, 3),
        layout(4, 4, 8, 3, ScheduleKind::Gpipe, 1),
    ] {
        let (e, p) = predict(&m, &c, &l, Options::default());
        let sum: f64 = p.breakdown.iter().map(|t| t.seconds).sum();
        assert!(
            (sum - p.step_time_s).abs() <= 1e-9 * p.step_time_s,
            "{}",
            l.label()
        );
        assert!(e.lower_bound <= p.step_time_s * (1.0 + 1e-12));
        // MFU restated from its definition.
        let mfu = p.model_flops_per_step / (p.step_time_s * 128.0 * 312e12);
        assert!((p.mfu - mfu).abs() < 1e-12);
    }
}

/// Without overlap the exposed DP term is the whole ring all-reduce of the fp32 gradients,
/// `2(n−1)/n · S/B` plus NCCL's Simple ring latency, written out here; with overlap the
/// backward hides some of it.
#[test]
fn cost_dp_all_reduce_exposed_without_overlap() {
    let (m, c) = job("gpt3-175b.toml", 16);
    let l = layout(16, 1, 8, 0, ScheduleKind::OneFOneB, 1);
    let off = Options {
        overlap_dp: false,
        ..Options::default()
    };
    let (_, p) = predict(&m, &c, &l, off);
    // DP 16 with TP 8: one rank per node, one HDR NIC at 86% of 25 GB/s; NCCL's Simple ring
    // over 16 nodes: 8.4 µs + 30 network steps of 14 µs, × 1.4 across nodes.
    let a = &m.architecture;
    let params = a.layer_params().per_tp_rank(8) * 96.0
        + a.embedding_params_at(8, true).per_tp_rank(8)
        + a.head_params_at(true, 8, true).per_tp_rank(8);
    let bytes = params * 4.0;
    let want = 2.0 * 15.0 / 16.0 * bytes / (0.86 * 25e9) + 1.4 * (8.4 + 30.0 * 14.0) * 1e-6;
    let got = p.term("dp_exposed");
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    let (_, hidden) = predict(&m, &c, &l, Options::default());
    assert!(hidden.term("dp_exposed") < got);
}

/// TP 16 spans two nodes: its collectives take the inter-node latency on each ring step and
/// the NICs' aggregate bandwidth, so a layer's TP time grows by more than the 15/7 of the ring.
#[test]
fn cost_tp_across_nodes_costs_more_than_inside_one() {
    let (m, c) = job("gpt3-175b.toml", 16);
    let inside = layout(16, 1, 8, 0, ScheduleKind::OneFOneB, 1);
    let across = layout(8, 1, 16, 0, ScheduleKind::OneFOneB, 1);
    let t = |l: &Layout| {
        let links = Links::new(&c, &l.mesh(&c));
        (
            links.tp.crosses_nodes(),
            layer_times(&m, &c, l, &links, Options::default()),
        )
    };
    let ((x8, a), (x16, b)) = (t(&inside), t(&across));
    assert!(!x8 && x16);
    // Per rank, a ring all-reduce moves 2(n−1)/n of the buffer: 14/8 for TP 8, 30/16 for 16.
    let ratio = b.layer.fwd.tp / a.layer.fwd.tp;
    assert!(ratio > (30.0 / 16.0) / (14.0 / 8.0), "{ratio}");
}

/// ZeRO-3's per-layer gathers cost nothing while compute hides them, and show once compute is
/// shorter than the gather (fewer tokens per micro-batch on a slower network).
#[test]
fn cost_zero3_gathers_show_only_when_compute_cannot_hide_them() {
    let (m, c) = job("gpt3-175b.toml", 16);
    let mut big = layout(128, 1, 1, 3, ScheduleKind::OneFOneB, 1);
    big.micro_batch = 4;
    let links = Links::new(&c, &big.mesh(&c));
    let t = layer_times(&m, &c, &big, &links, Options::default());
    assert_eq!(t.layer.fwd.zero3, 0.0);
    let mut slow = c.clone();
    slow.inter_node.bandwidth_gbps = 0.5;
    let links = Links::new(&slow, &big.mesh(&slow));
    let t = layer_times(&m, &slow, &big, &links, Options::default());
    let params = m.architecture.layer_params().per_tp_rank(1);
    let gather = links.dp.all_gather(params * 2.0);
    let compute = t.layer.fwd.compute + t.layer.fwd.tp;
    assert!((t.layer.fwd.zero3 - (gather - compute)).abs() <= 1e-9 * gather);
}

/// Ranks sharing cores (the CPU backend's threads): the step is the stages' mean busy time
/// plus the tail, or the makespan at a whole core per rank where that is longer; the terms
/// still add up to it. Without `shared_cores` (or with a core per rank) nothing changes.
#[test]
fn cost_ranks_sharing_cores_fill_each_others_bubbles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let m =
        specs::load_model(&root.join("models/tiny.toml"), TrainingOverrides::default()).unwrap();
    let mut c = specs::load_cluster(
        &root.join("clusters/cpu-8.toml"),
        ClusterOverrides::default(),
    )
    .unwrap();
    let mut l = layout(2, 2, 2, 1, ScheduleKind::OneFOneB, 1);
    l.recompute = Recompute::None;
    let (e, own) = predict(&m, &c, &l, Options::default());
    let sim = pipeline::Simulator::new().run(&e.pipeline);
    let (tail, _) = e.tail();
    assert!((own.step_time_s - (sim.makespan + tail)).abs() < 1e-15);
    // 8 ranks on 2 cores: 4 ranks per core.
    c.device.shared_cores = Some(2);
    let (e2, shared) = predict(&m, &c, &l, Options::default());
    let mean = (sim.busy[0] + sim.busy[1]) / 2.0;
    let want = mean.max(sim.makespan / 4.0) + tail;
    assert!(
        (shared.step_time_s - want).abs() < 1e-15,
        "{} vs {want}",
        shared.step_time_s
    );
    assert!(shared.step_time_s < own.step_time_s);
    let sum: f64 = shared.breakdown.iter().map(|t| t.seconds).sum();
    assert!((sum - shared.step_time_s).abs() <= 1e-9 * shared.step_time_s);
    assert!(shared.breakdown.iter().all(|t| t.seconds >= 0.0));
    assert!(e2.lower_bound <= shared.step_time_s * (1.0 + 1e-12));
    // 8 cores for 8 ranks: every rank has its own.
    c.device.shared_cores = Some(8);
    let (_, whole) = predict(&m, &c, &l, Options::default());
    assert_eq!(whole.step_time_s, own.step_time_s);
}

/// TP collectives overlapped with their GEMMs (`training.tp_comm_overlap`, `tp_overlap`), on
/// Llama 3 70B's layer with sequence parallelism, one sequence of 8,192 tokens per micro-batch.
/// On DGX A100 in 16 bits every GEMM outlasts its collective (TP 8: QKV's 2·8192·8192·1280 FLOP
/// take ~0.7 ms, gathering its 8192 × 8192 × 2 B over 7 of 8 ranks ~0.5 ms), so each pass keeps
/// exactly one ring step of each collective exposed: 1/TP of the unoverlapped time, at TP 2 and
/// at TP 8. On DGX H100 with FP8 GEMMs (twice the rate and more), attention's GEMMs at TP 8 no
/// longer cover their collectives: more than one step in eight stays exposed, less than all,
/// and less in the backward, whose GEMMs are twice the forward's. The split GEMMs add compute.
/// Without sequence parallelism (all-reduces) nothing is overlapped. A model that hides
/// everything (no ring step left), that ignores the GEMMs' cover, or that overlaps the
/// all-reduces fails here.
#[test]
fn tp_comm_overlap_keeps_one_ring_step_behind_long_gemms() {
    let (a100_model, a100) = job("llama3-70b.toml", 8);
    let (_, h100) = job_on("llama3-70b.toml", "dgx-h100-80g.toml", 8);
    let mut fp8_model = a100_model.clone();
    fp8_model.training.fp8 = crate::fp8::Recipe::Tensorwise;
    let times = |m: &Model, c: &Cluster, tp: u64, sp: bool, overlap: bool| {
        let mut m = m.clone();
        m.training.tp_comm_overlap = overlap;
        let mut l = layout(64 / tp, 1, tp, 1, ScheduleKind::OneFOneB, 1);
        l.recompute = Recompute::None;
        l.sequence_parallel = sp;
        let links = Links::new(c, &l.mesh(c));
        layer_times(&m, c, &l, &links, Options::default()).layer
    };
    let rel = |a: f64, b: f64| (a / b - 1.0).abs();
    let mut splits = Vec::new();
    for tp in [2, 8] {
        let (v, o) = (
            times(&a100_model, &a100, tp, true, false),
            times(&a100_model, &a100, tp, true, true),
        );
        let t = tp as f64;
        assert!(rel(o.fwd.tp, v.fwd.tp / t) < 1e-9, "TP {tp}: {o:?}");
        assert!(rel(o.bwd.tp, v.bwd.tp / t) < 1e-9, "TP {tp}: {o:?}");
        let split = o.fwd.compute / v.fwd.compute - 1.0;
        assert!(o.bwd.compute > v.bwd.compute, "TP {tp}: {o:?}");
        splits.push(split);
    }
    // The pieces' wave quantisation: 4,096-row pieces at TP 2 lose little; 1,024-row pieces at
    // TP 8 fill only part of a wave of large tiles (QKV's 1024 × 1280 is 40 tiles of 256 × 128
    // on 108 SMs), which the tile model charges in full.
    assert!(splits[0] > 0.0 && splits[0] < 0.02, "{splits:?}");
    assert!(splits[1] > 2.0 * splits[0], "{splits:?}");
    let (v, o) = (
        times(&fp8_model, &h100, 8, true, false),
        times(&fp8_model, &h100, 8, true, true),
    );
    assert!(o.fwd.tp > v.fwd.tp / 8.0 * 1.05, "{o:?} against {v:?}");
    assert!(o.fwd.tp < v.fwd.tp * 0.9, "{o:?} against {v:?}");
    assert!(o.bwd.tp < o.fwd.tp, "{o:?}");
    assert_eq!(
        times(&a100_model, &a100, 8, false, true),
        times(&a100_model, &a100, 8, false, false)
    );
}
