//! The oracle: every layout of the tiny model trains exactly like the single-rank run.
//!
//! Each plan starts from the same weights (initialised by global index), sees the same global
//! batches, and must give the same per-step losses and final parameters as the 1×1×1 plan,
//! within 1e-5 relative, over 5 steps of the real executor (threads as ranks).

mod tiny;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind;
use tessera_runtime::exec::TrainReport;
use tiny::layout;

const STEPS: usize = 5;

fn plan(layout: Layout) -> Plan {
    tiny::plan(&tiny::model(), &layout)
}

fn run(plan: &Plan) -> TrainReport {
    tiny::run_evaluated(plan, STEPS)
}

fn assert_same(got: &TrainReport, want: &TrainReport, what: &str) {
    tiny::assert_same_run(got, want, STEPS, what);
}

fn reference() -> TrainReport {
    let r = run(&plan(layout(
        1,
        1,
        1,
        0,
        ScheduleKind::OneFOneB,
        1,
        Recompute::None,
    )));
    let first = r.steps[0].loss;
    let last = r.steps[STEPS - 1].loss;
    assert!(last < first, "the single-rank run learns: {first} → {last}");
    r
}

#[test]
fn every_dp_pp_tp_layout_up_to_8_ranks() {
    let want = reference();
    let degrees = [1u64, 2, 4];
    for dp in degrees {
        for pp in degrees {
            for tp in degrees {
                if dp * pp * tp > 8 || dp * pp * tp == 1 {
                    continue;
                }
                let p = plan(layout(
                    dp,
                    pp,
                    tp,
                    0,
                    ScheduleKind::OneFOneB,
                    1,
                    Recompute::None,
                ));
                assert_same(&run(&p), &want, &format!("dp{dp} pp{pp} tp{tp}"));
            }
        }
    }
}

#[test]
fn zero_stages_1_to_3() {
    let want = reference();
    for zero in 1..=3u8 {
        for (dp, pp, tp) in [(2, 1, 1), (4, 1, 2), (2, 2, 2), (4, 2, 1)] {
            let p = plan(layout(
                dp,
                pp,
                tp,
                zero,
                ScheduleKind::OneFOneB,
                1,
                Recompute::None,
            ));
            assert_same(&run(&p), &want, &format!("zero{zero} dp{dp} pp{pp} tp{tp}"));
        }
    }
}

#[test]
fn every_schedule() {
    let want = reference();
    for (pp, dp, tp, kind, v) in [
        (2, 1, 1, ScheduleKind::Gpipe, 1),
        (4, 2, 1, ScheduleKind::Gpipe, 1),
        (2, 2, 2, ScheduleKind::OneFOneB, 1),
        (4, 1, 2, ScheduleKind::OneFOneB, 1),
        (2, 1, 1, ScheduleKind::Interleaved, 2),
        (2, 2, 2, ScheduleKind::Interleaved, 2),
        (2, 1, 4, ScheduleKind::Interleaved, 2),
    ] {
        let p = plan(layout(dp, pp, tp, 1, kind, v, Recompute::None));
        assert_same(
            &run(&p),
            &want,
            &format!("{kind:?}×{v} dp{dp} pp{pp} tp{tp}"),
        );
    }
}

/// Interleaved pipelines whose chunks are not all equal: the tiny model's 4 layers over PP 2 ×
/// 3 virtual stages, Llama 3's layout in small (the first chunk holds only the embedding, the
/// last only the head and loss, every other chunk one layer).
#[test]
fn uneven_interleaved_layouts() {
    let want = reference();
    for (dp, tp, zero) in [(1, 1, 0), (2, 2, 1), (1, 2, 0), (2, 1, 2)] {
        let p = plan(layout(
            dp,
            2,
            tp,
            zero,
            ScheduleKind::Interleaved,
            3,
            Recompute::None,
        ));
        let chunks: Vec<Vec<[u64; 2]>> = p
            .stages
            .iter()
            .map(|s| s.chunks.iter().map(|c| c.layers).collect())
            .collect();
        assert_eq!(
            chunks,
            vec![vec![[0, 0], [1, 2], [3, 4]], vec![[0, 1], [2, 3], [4, 4]]],
            "the plan splits the tiny model unevenly"
        );
        assert_same(
            &run(&p),
            &want,
            &format!("interleaved×3 uneven dp{dp} pp2 tp{tp} zero{zero}"),
        );
    }
}

#[test]
fn every_recompute_mode() {
    let want = reference();
    for recompute in [Recompute::Selective, Recompute::Full] {
        for (dp, pp, tp) in [(1, 1, 1), (2, 2, 2), (1, 4, 2)] {
            let p = plan(layout(dp, pp, tp, 0, ScheduleKind::OneFOneB, 1, recompute));
            assert_same(
                &run(&p),
                &want,
                &format!("{recompute:?} dp{dp} pp{pp} tp{tp}"),
            );
        }
    }
}

#[test]
fn sequence_parallel_layouts() {
    let want = reference();
    for (dp, pp, tp, zero, kind, v, recompute) in [
        (1, 1, 2, 0, ScheduleKind::OneFOneB, 1, Recompute::None),
        (1, 1, 4, 0, ScheduleKind::OneFOneB, 1, Recompute::None),
        (2, 1, 2, 1, ScheduleKind::OneFOneB, 1, Recompute::None),
        (1, 2, 2, 0, ScheduleKind::Gpipe, 1, Recompute::Selective),
        (1, 2, 4, 0, ScheduleKind::OneFOneB, 1, Recompute::Full),
        (
            2,
            2,
            2,
            2,
            ScheduleKind::Interleaved,
            2,
            Recompute::Selective,
        ),
        (2, 1, 4, 3, ScheduleKind::OneFOneB, 1, Recompute::Full),
    ] {
        let p = plan(Layout {
            sequence_parallel: true,
            ..layout(dp, pp, tp, zero, kind, v, recompute)
        });
        assert_same(
            &run(&p),
            &want,
            &format!("sp {kind:?}×{v} zero{zero} {recompute:?} dp{dp} pp{pp} tp{tp}"),
        );
    }
}

/// Context parallelism: every sequence cut over CP 2 or 4 ranks, attention as ring attention,
/// with DP, TP, PP (interleaved too), ZeRO, sequence parallelism and recompute, up to 8 ranks.
#[test]
fn context_parallel_layouts() {
    use ScheduleKind::{Interleaved, OneFOneB};
    let want = reference();
    let none = Recompute::None;
    for (dp, cp, pp, tp, zero, kind, v, recompute, sp) in [
        (1, 2, 1, 1, 0, OneFOneB, 1, none, false),
        (2, 2, 1, 1, 0, OneFOneB, 1, none, false),
        (1, 2, 1, 2, 0, OneFOneB, 1, none, false),
        (1, 2, 2, 1, 0, OneFOneB, 1, none, false),
        (1, 4, 1, 1, 0, OneFOneB, 1, none, false),
        (2, 4, 1, 1, 0, OneFOneB, 1, none, false),
        (2, 2, 1, 1, 1, OneFOneB, 1, none, false),
        (2, 2, 2, 1, 3, OneFOneB, 1, Recompute::Selective, false),
        (1, 2, 2, 2, 0, Interleaved, 2, Recompute::Full, false),
        (1, 2, 1, 4, 0, OneFOneB, 1, Recompute::Full, true),
    ] {
        let p = plan(Layout {
            cp,
            sequence_parallel: sp,
            ..layout(dp, pp, tp, zero, kind, v, recompute)
        });
        assert_eq!(p.parallel.world, dp * cp * pp * tp);
        let sp = if sp { " sp" } else { "" };
        assert_same(
            &run(&p),
            &want,
            &format!("{kind:?}×{v} zero{zero} {recompute:?}{sp} dp{dp} cp{cp} pp{pp} tp{tp}"),
        );
    }
}

/// Context parallelism with RoPE (tables at each rank's global positions) and GQA (2 kv heads
/// for 4 query heads, no biases): the tiny model so changed, TP, PP and CP layouts against its
/// own single-rank run.
#[test]
fn context_parallel_with_rope_and_gqa() {
    let mut model = tiny::model();
    model.architecture.position = tessera_planner::model::Position::Rope;
    model.architecture.kv_heads = 2;
    // No biases, as Llama: under RoPE a key bias's gradient is near zero but not zero, and Adam
    // turns its rounding noise into 2e-5 differences under TP 2 alone.
    model.architecture.bias = false;
    model.architecture.qkv_bias = false;
    let base = |cp, tp, pp| Layout {
        cp,
        ..layout(1, pp, tp, 0, ScheduleKind::OneFOneB, 1, Recompute::None)
    };
    let want = run(&tiny::plan(&model, &base(1, 1, 1)));
    for (cp, tp, pp) in [
        (1, 2, 1),
        (1, 1, 2),
        (2, 1, 1),
        (4, 1, 1),
        (2, 2, 1),
        (2, 1, 2),
    ] {
        let got = run(&tiny::plan(&model, &base(cp, tp, pp)));
        assert_same(&got, &want, &format!("rope gqa cp{cp} tp{tp} pp{pp}"));
    }
}

#[test]
fn sequence_parallel_needs_tp_to_divide_the_micro_batch_rows() {
    let mut p = plan(Layout {
        sequence_parallel: true,
        ..Layout::without_pipeline(1, 2, 0, 1)
    });
    assert!(tessera_runtime::exec::check_supported(&p).is_ok());
    // A hand-edited plan: 1 × 63 tokens do not split over TP 2.
    p.job.model.training.seq_len = 63;
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("63") && err.contains("--no-sp"), "{err}");
}

/// A layout of the MoE tests: `ep` expert-parallel ranks cut from DP × CP, sequence
/// parallelism with TP (Megatron-LM requires it with EP).
fn moe_layout(
    dp: u64,
    cp: u64,
    pp: u64,
    tp: u64,
    ep: u64,
    zero: u8,
    recompute: Recompute,
) -> Layout {
    Layout {
        cp,
        ep,
        sequence_parallel: tp > 1,
        ..layout(dp, pp, tp, zero, ScheduleKind::OneFOneB, 1, recompute)
    }
}

/// Runs `model` under each layout against its own single-rank run.
fn moe_parity(model: &tessera_planner::model::Model, what: &str, layouts: &[Layout]) {
    let want = run(&tiny::plan(
        model,
        &moe_layout(1, 1, 1, 1, 1, 0, Recompute::None),
    ));
    let (first, last) = (want.steps[0].loss, want.steps[STEPS - 1].loss);
    assert!(
        last < first,
        "{what}: the single-rank run learns: {first} → {last}"
    );
    for l in layouts {
        let got = run(&tiny::plan(model, l));
        let label = format!("{what} {}", l.label());
        assert_same(&got, &want, &label);
        // The margins, for the record (`--nocapture`): docs/moe.md quotes them.
        let loss = got
            .steps
            .iter()
            .zip(&want.steps)
            .map(|(a, b)| ((a.loss - b.loss) / b.loss).abs())
            .fold(0.0, f64::max);
        let param = want
            .params
            .iter()
            .map(|(name, w)| {
                let g = &got.params[name];
                let d: f64 = g.iter().zip(w).map(|(a, b)| f64::from(a - b).powi(2)).sum();
                let n: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum();
                (d / n.max(f64::MIN_POSITIVE)).sqrt()
            })
            .fold(0.0, f64::max);
        eprintln!("{label}: loss rel diff {loss:.2e}, parameter rel diff {param:.2e}");
    }
}

/// Mixture of experts with expert parallelism (tiny-moe: 4 experts, top-2, softmax, Switch
/// load-balancing loss, a dense first layer): EP 2 and 4 over DP (and CP), with TP + SP, PP,
/// ZeRO-1/2/3 and recompute, against the single-rank run.
#[test]
fn expert_parallel_layouts() {
    let none = Recompute::None;
    moe_parity(
        &tiny::moe_model(),
        "moe top-2",
        &[
            moe_layout(2, 1, 1, 1, 1, 0, none),
            moe_layout(2, 1, 1, 1, 2, 0, none),
            moe_layout(4, 1, 1, 1, 4, 0, none),
            moe_layout(4, 1, 1, 1, 2, 0, none),
            moe_layout(2, 1, 1, 2, 2, 0, none),
            moe_layout(2, 1, 2, 1, 2, 0, none),
            moe_layout(2, 1, 1, 1, 2, 1, none),
            moe_layout(4, 1, 1, 1, 2, 2, none),
            moe_layout(2, 1, 1, 1, 2, 3, none),
            moe_layout(2, 1, 2, 2, 2, 3, none),
            moe_layout(2, 1, 1, 1, 2, 0, Recompute::Full),
            moe_layout(2, 1, 1, 2, 2, 0, Recompute::Selective),
            moe_layout(1, 2, 1, 1, 2, 0, none),
            moe_layout(2, 2, 1, 1, 4, 1, none),
        ],
    );
}

/// Top-1 routing (Switch) with a sigmoid-gated shared expert (Qwen2-MoE) and SwiGLU experts
/// without biases, unnormalised weights: EP 2 and 4, with TP + SP and PP.
#[test]
fn expert_parallel_top1_with_a_shared_expert() {
    let mut model = tiny::moe_model();
    model.architecture.activation = tessera_planner::model::Activation::Swiglu;
    model.architecture.bias = false;
    model.architecture.qkv_bias = false;
    let m = model.architecture.moe.as_mut().unwrap();
    m.experts_per_token = 1;
    m.shared_experts = 1;
    m.shared_expert_ffn_hidden = 32;
    m.shared_expert_gate = true;
    m.normalize_top_k = false;
    let none = Recompute::None;
    moe_parity(
        &model,
        "moe top-1 shared",
        &[
            moe_layout(2, 1, 1, 1, 2, 0, none),
            moe_layout(4, 1, 1, 1, 4, 1, none),
            moe_layout(2, 1, 1, 2, 2, 0, none),
            moe_layout(2, 1, 2, 1, 2, 0, none),
        ],
    );
}

/// DeepSeek-V3's router (sigmoid scores, the score bias choosing, 2 groups of which each token
/// uses 1, scaled weights) on 4 experts, and token dropping at capacity factor 1.0: EP 2 and 4.
#[test]
fn expert_parallel_sigmoid_groups_and_capacity() {
    let mut model = tiny::moe_model();
    let m = model.architecture.moe.as_mut().unwrap();
    m.router_scoring = tessera_planner::model::RouterScoring::Sigmoid;
    m.router_score_bias = true;
    m.expert_groups = 2;
    m.expert_groups_per_token = 1;
    m.routed_scaling_factor = 2.5;
    m.capacity_factor = Some(1.0);
    let none = Recompute::None;
    moe_parity(
        &model,
        "moe sigmoid groups capacity",
        &[
            moe_layout(2, 1, 1, 1, 2, 0, none),
            moe_layout(4, 1, 1, 1, 4, 3, none),
            moe_layout(2, 1, 1, 2, 2, 0, Recompute::Full),
        ],
    );
}

/// What the runtime does not compute is refused before a run, naming the field.
#[test]
fn mla_qk_norm_and_dense_ep_are_refused() {
    let base = plan(layout(
        1,
        1,
        1,
        0,
        ScheduleKind::OneFOneB,
        1,
        Recompute::None,
    ));
    let mut p = base.clone();
    p.job.model.architecture.qk_norm = true;
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("architecture.qk_norm") && err.contains("fix"),
        "{err}"
    );
    let mut p = base.clone();
    p.job.model.architecture.mla = Some(tessera_planner::model::Mla {
        q_lora_rank: None,
        kv_lora_rank: 32,
        qk_nope_head_dim: 8,
        qk_rope_head_dim: 8,
        v_head_dim: 16,
    });
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("architecture.mla") && err.contains("fix"),
        "{err}"
    );
    let mut p = base.clone();
    p.parallel.ep = 2;
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parallel.ep") && err.contains("--ep 1"),
        "{err}"
    );
    let mut p = tiny::plan(
        &tiny::moe_model(),
        &moe_layout(1, 2, 1, 1, 1, 0, Recompute::None),
    );
    p.job
        .model
        .architecture
        .moe
        .as_mut()
        .unwrap()
        .capacity_factor = Some(1.0);
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("architecture.capacity_factor"), "{err}");
}
