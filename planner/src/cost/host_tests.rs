//! The host floor, NCCL's interference and blocking pipeline sends on figures worked by hand.

use super::comm::GroupLink;
use super::pipeline::{ChunkTime, Parts};
use super::tests::job;
use super::*;
use crate::framework::HostCost;
use crate::layout::Recompute;
use crate::schedule::ScheduleKind;

fn layout(dp: u64, pp: u64, tp: u64, zero: u8, recompute: Recompute) -> Layout {
    Layout {
        recompute,
        ..super::tests::layout(dp, pp, tp, zero, ScheduleKind::OneFOneB, 1)
    }
}

/// A layer's passes of GPU work only: forward compute, backward compute and recompute.
fn chunk(fwd: f64, bwd: f64, recompute: f64) -> ChunkTime {
    ChunkTime {
        fwd: Parts {
            compute: fwd,
            ..Parts::default()
        },
        bwd: Parts {
            compute: bwd,
            recompute,
            ..Parts::default()
        },
        wgrad: 0.0,
    }
}

const NANOGPT: host::HostFloor = host::HostFloor {
    ops_forward: 22,
    ops_backward: 22,
    counts: host::HostFloor::NONE.counts,
    cost: HostCost::Dispatch,
};

/// A layer whose GPU time is below its ops' host time takes the host's time. Hand figures:
/// 22 ops at 10 µs are 220 µs; the forward's GPU work, 50 µs, leaves 170 µs of host floor. The
/// backward re-dispatches the forward's 22 ops under full recompute, 44 ops at 10 µs = 440 µs,
/// beside 100 + 30 µs of GPU work: 310 µs more.
#[test]
fn cost_host_floor_of_a_small_layer_is_its_ops_times_the_per_op_cost() {
    let (_, mut c) = job("tiny.toml", 1);
    c.calibration.host_op_us = Some(10.0);
    let mut layer = chunk(50e-6, 100e-6, 30e-6);
    NANOGPT.apply(&c, &mut layer, 1.0);
    assert!(
        (layer.fwd.host - 170e-6).abs() < 1e-12,
        "{}",
        layer.fwd.host
    );
    assert!((layer.fwd.total() - 220e-6).abs() < 1e-12);
    assert!(
        (layer.bwd.host - 310e-6).abs() < 1e-12,
        "{}",
        layer.bwd.host
    );
    assert!((layer.bwd.total() - 440e-6).abs() < 1e-12);
    // A layer longer than its ops' host time is left alone.
    let mut big = chunk(1e-3, 2e-3, 0.0);
    NANOGPT.apply(&c, &mut big, 0.0);
    assert_eq!((big.fwd.host, big.bwd.host), (0.0, 0.0));
    // Under CUDA graphs the host pays nothing per op.
    let graph = host::HostFloor {
        cost: HostCost::Graph,
        ..NANOGPT
    };
    NANOGPT.apply(&c, &mut layer, 0.0);
    let mut g = ChunkTime::default();
    graph.apply(&c, &mut g, 0.0);
    assert_eq!(g.fwd.total(), 0.0);
}

/// End to end: the tiny model's layer (hidden 64, 64 tokens: microseconds of GPU work) under
/// the nanoGPT profile with a 1 ms host per op takes exactly 22 × 1 ms = 22 ms per pass,
/// forward and backward (no recompute), and the step shows it as `host_floor`.
#[test]
fn cost_tiny_layer_under_eager_pytorch_takes_the_host_time() {
    let (m, mut c) = job("tiny.toml", 1);
    c.calibration.host_op_us = Some(1000.0);
    let l = layout(8, 1, 1, 0, Recompute::None);
    let o = Options {
        host: NANOGPT,
        ..Options::default()
    };
    let links = Links::new(&c, &l.mesh(&c));
    let t = layer_times(&m, &c, &l, &links, o);
    assert!(
        (t.layer.fwd.total() - 0.022).abs() < 1e-12,
        "{:?}",
        t.layer.fwd
    );
    assert!(
        (t.layer.bwd.total() - 0.022).abs() < 1e-12,
        "{:?}",
        t.layer.bwd
    );
    assert!(t.layer.fwd.host > 0.021);
    let e = evaluate(
        &m,
        &c,
        &l,
        &l.split_layers(m.architecture.layers),
        &links,
        &t,
        o,
    );
    let p = e.predict(&pipeline::Simulator::new().run(&e.pipeline));
    // 4 layers × 2 passes × 2 micro-batches (global 16 / DP 8) of host floor, less the GPU's.
    assert!(
        p.term("host_floor") > 4.0 * 2.0 * 2.0 * 0.021,
        "{:?}",
        p.breakdown
    );
    // The default profile (no counted ops) keeps the GPU's time.
    let t0 = layer_times(&m, &c, &l, &links, Options::default());
    assert!(t0.layer.fwd.total() < 1e-3 && t0.layer.fwd.host == 0.0);
}

/// The SM share's slowdown: f = 27 CTAs / 108 SMs = 0.25. A 2 ms collective beside 3 ms of
/// compute: the compute loses 2 × 0.25 = 0.5 ms (it ends 0.5 ms later). An 8 ms collective
/// beside 1 ms of compute: the compute runs at 0.75 throughout, 1/0.75 = 1.333 ms, 0.333 ms more.
#[test]
fn cost_overlapped_collectives_slow_compute_by_nccls_sm_share() {
    let (_, mut c) = job("gpt3-175b.toml", 16);
    c.calibration.nccl_ctas = Some(27.0);
    let f = interference::sm_share(&c);
    assert!((f - 0.25).abs() < 1e-15);
    assert!((interference::slowdown(3e-3, 2e-3, f) - 0.5e-3).abs() < 1e-15);
    assert!((interference::slowdown(1e-3, 8e-3, f) - 1e-3 / 3.0).abs() < 1e-15);
    // ZeRO-3 over 128 ranks: the layer's gather beside its forward's compute. Its parameters
    // (12 h² + 13 h for h = 12288, TP 1) in bf16 gathered over DP: the slowdown is 0.25 × the
    // gather where the compute outlasts it.
    let mut l = layout(128, 1, 1, 3, Recompute::Full);
    l.micro_batch = 4;
    let links = Links::new(&c, &l.mesh(&c));
    let h = 12288.0_f64;
    let params = 12.0 * h * h + 13.0 * h;
    let gather = links.dp.all_gather(params * 2.0);
    let o = Options {
        overlap_slows_compute: true,
        ..Options::default()
    };
    let (m, _) = job("gpt3-175b.toml", 16);
    let t = layer_times(&m, &c, &l, &links, o);
    assert!(gather * 0.25 < t.layer.fwd.compute * 0.25 / 0.75);
    assert!(
        (t.layer.fwd.interference - 0.25 * gather).abs() <= 1e-12 * gather,
        "{} vs {}",
        t.layer.fwd.interference,
        0.25 * gather
    );
    let off = layer_times(&m, &c, &l, &links, Options::default());
    assert_eq!(off.layer.fwd.interference, 0.0);
}

/// DeepSpeed's blocking sends: the whole activation, b·s·h·2 = 1 × 1024 × 512 × 2 =
/// 1 048 576 B, over a 1 GB/s link with 10 µs latency is 1.048576 ms + 0.01 ms = 1.058576 ms,
/// inside the sender's op (stage 0's forward, stage 1's backward), none on the edges.
#[test]
fn cost_blocking_p2p_sends_whole_activations_inside_the_sender() {
    let link = GroupLink {
        ranks: 2,
        nodes: 1,
        bandwidth: 1e9,
        latency: 10e-6,
        nccl: None,
    };
    let mut chunks = vec![ChunkTime::default(); 2];
    let edges = blocking::whole_activation_sends(&[link, link], 1048576.0, 2, 1, &mut chunks);
    assert_eq!(edges, vec![0.0, 0.0]);
    assert!((chunks[0].fwd.p2p - 1.058576e-3).abs() < 1e-15);
    assert_eq!(chunks[0].bwd.p2p, 0.0);
    assert_eq!(chunks[1].fwd.p2p, 0.0);
    assert!((chunks[1].bwd.p2p - 1.058576e-3).abs() < 1e-15);
    // In the model: GPT-3 175B at TP 8, PP 2 over 2 nodes sends 1 × 2048 × 12288 × 2 =
    // 50 331 648 B whole, where Megatron's scatter/gather sends 1/8 of it.
    let (m, c) = job("gpt3-175b.toml", 2);
    let l = layout(1, 2, 8, 0, Recompute::Full);
    let links = Links::new(&c, &l.mesh(&c));
    let o = Options {
        blocking_p2p: true,
        ..Options::default()
    };
    let split = l.split_layers(m.architecture.layers);
    let t = layer_times(&m, &c, &l, &links, o);
    let e = evaluate(&m, &c, &l, &split, &links, &t, o);
    let whole = links.pp_next[0].p2p(50331648.0);
    assert!((e.pipeline.chunks[0].fwd.p2p - whole).abs() <= 1e-12 * whole);
    assert_eq!(e.pipeline.p2p_next, vec![0.0, 0.0]);
    // Megatron's: 1/8 of it, all-gathered again inside the receiving node (no SP here).
    let e0 = evaluate(&m, &c, &l, &split, &links, &t, Options::default());
    let sliced = links.pp_next[0].p2p(50331648.0 / 8.0) + links.tp.all_gather(50331648.0);
    assert!((e0.pipeline.p2p_next[0] - sliced).abs() <= 1e-12 * sliced);
    let p = e.predict(&pipeline::Simulator::new().run(&e.pipeline));
    assert!(p.term("pp_p2p_blocking") > 0.0);
}

/// The host floor from a profiler-counted layer: the megatron-core profile's counts as recorded
/// (scripts/host_layer_trace.py: 49 dispatches and 18 launches forward, 46 and 33 backward) on
/// the tiny GPT's layer, whose GPU work is a few µs. At 10 µs per dispatch and 3 µs per launch
/// the forward is 49 × 10 + 18 × 3 = 544 µs and the backward 46 × 10 + 33 × 3 = 559 µs; full
/// recompute dispatches the forward again inside the backward: 559 + 544 = 1103 µs. The A100
/// preset's own costs, 6.8 µs per dispatch (pytorch/pytorch#41383) and 2.55 µs per launch:
/// 49 × 6.8 + 18 × 2.55 = 379.1 µs forward, 46 × 6.8 + 33 × 2.55 = 396.95 µs backward.
#[test]
fn cost_host_floor_of_a_profiler_counted_layer_is_dispatches_and_launches_by_hand() {
    let (m, mut c) = job("tiny.toml", 1);
    let o = Options::of(crate::framework::by_name("megatron-core").unwrap());
    let times = |c: &Cluster, recompute| {
        let l = layout(8, 1, 1, 0, recompute);
        layer_times(&m, c, &l, &Links::new(c, &l.mesh(c)), o).layer
    };
    let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    let t = times(&c, Recompute::None);
    close(t.fwd.total(), 379.1e-6);
    close(t.bwd.total(), 396.95e-6);
    assert!(
        t.fwd.host > 0.9 * t.fwd.total(),
        "the host's time binds: {:?}",
        t.fwd
    );
    c.calibration.host_dispatch_us = Some(10.0);
    c.calibration.host_launch_us = Some(3.0);
    let t = times(&c, Recompute::None);
    close(t.fwd.total(), 544e-6);
    close(t.bwd.total(), 559e-6);
    close(times(&c, Recompute::Full).bwd.total(), 1103e-6);
    // Without host_launch_us a launch costs the device's kernel_launch_us; host_op_us (the
    // bare-op measure) is not read for a counted profile.
    c.calibration.host_launch_us = None;
    c.device.kernel_launch_us = 3.0;
    c.calibration.host_op_us = Some(1000.0);
    close(times(&c, Recompute::None).fwd.total(), 544e-6);
}
