//! End-to-end composition check: a tiny GPT assembled from the public pieces (vocab-parallel
//! embedding + learned positions, blocks split over pipeline stages, final norm, column-parallel
//! LM head, vocab-parallel cross-entropy, DP gradient all-reduce, TP/PP-aware clipping, AdamW)
//! trains for a few steps under several DP×PP×TP layouts; losses and parameters must equal the
//! single-rank run within 1e-5. Ranks are threads, grouped by the planner's `Mesh`. The schedule
//! is the simplest one (all forwards, then all backwards); the real executor comes later.

use crate::backend::Cpu;
use crate::comm::{all_reduce_f64, local_groups, Comm, LocalComm};
use crate::layers::testkit::{assert_globals_close, gather};
use crate::layers::*;
use crate::optim::{clip_scale, grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::params::ParamLayout;
use crate::rng;

const V: usize = 32;
const T: usize = 6;
const GLOBAL_B: usize = 4;
const LAYERS: usize = 2;
const STEPS: usize = 3;

fn config(llama: bool) -> BlockConfig {
    BlockConfig {
        hidden: if llama { 32 } else { 16 },
        heads: if llama { 8 } else { 4 },
        kv_heads: 4,
        head_dim: 4,
        ffn_hidden: 32,
        activation: if llama {
            Activation::SwiGlu
        } else {
            Activation::Gelu
        },
        norm: if llama {
            NormKind::RmsNorm
        } else {
            NormKind::LayerNorm
        },
        rope_theta: llama.then_some(10000.0),
        rope_scaling: None,
        bias: !llama,
        qkv_bias: !llama,
        norm_eps: 1e-5,
        init_std: 0.2,
        proj_init_std: 0.1,
    }
}

/// Token `i` of sequence `b` (targets are the next token); the same batch every step, so the
/// loss must fall.
fn token(b: usize, i: usize) -> u32 {
    (rng::hash3(42, 7, (b * (T + 1) + i) as u64) % V as u64) as u32
}

struct Stage {
    layout: ParamLayout,
    embed: Option<(VocabParallelEmbedding, Option<PositionEmbedding>)>,
    blocks: Vec<TransformerBlock>,
    head: Option<(Norm, ColumnParallelLinear)>,
}

fn build(cfg: &BlockConfig, tp: TpShard, stage: usize, stages: usize) -> Stage {
    let mut layout = ParamLayout::new();
    let c = cfg.hidden;
    let embed = (stage == 0).then(|| {
        let wte = VocabParallelEmbedding::new(&mut layout, "wte", V, c, tp, 0.2).unwrap();
        let wpe = cfg
            .rope_theta
            .is_none()
            .then(|| PositionEmbedding::new(&mut layout, "wpe", T, c, 0.1).unwrap());
        (wte, wpe)
    });
    let per = LAYERS / stages;
    let blocks = (stage * per..(stage + 1) * per)
        .map(|l| TransformerBlock::new(&mut layout, &format!("h.{l}"), cfg, tp).unwrap())
        .collect();
    let head = (stage + 1 == stages).then(|| {
        let ln = Norm::new(&mut layout, "ln_f", cfg.norm, c, 1e-5).unwrap();
        let lm = ColumnParallelLinear::new(&mut layout, "lm_head", c, V, false, tp, 0.2).unwrap();
        (ln, lm)
    });
    Stage {
        layout,
        embed,
        blocks,
        head,
    }
}

/// One rank's training run: per-step mean loss (last stage only), final (layout, params).
fn train(
    cfg: &BlockConfig,
    dp: usize,
    (tpc, dpc, ppc): (&LocalComm, &LocalComm, &LocalComm),
) -> (Vec<f64>, ParamLayout, Vec<f32>) {
    let tp = TpShard::of(tpc);
    let (stage, stages) = (ppc.rank(), ppc.size());
    let st = build(cfg, tp, stage, stages);
    let (c, d) = (cfg.hidden, Dims { b: 1, t: T });
    let n = d.n();
    let mut p = st.layout.init(1234);
    let mut g = st.layout.zeros();
    let mut opt = AdamW::new(AdamWConfig::default(), &st.layout, 0..st.layout.len());
    let sched = LrSchedule {
        max_lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 1,
        total_steps: STEPS,
        decay: crate::optim::Decay::Cosine,
    };
    let mut ws = BlockWorkspace::new(&Cpu, &st.blocks[0], d).unwrap();
    let micro = GLOBAL_B / dp; // micro-batches of one sequence per DP replica
    let mut acts: Vec<Vec<BlockActs<Cpu>>> = (0..micro)
        .map(|_| {
            st.blocks
                .iter()
                .map(|b| BlockActs::new(&Cpu, b, d, Recompute::Selective).unwrap())
                .collect()
        })
        .collect();
    let v_local = V / tp.size;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let seqs: Vec<usize> = (dpc.rank() * micro..(dpc.rank() + 1) * micro).collect();
        let toks = |b: usize, off: usize| (0..T).map(|i| token(b, i + off)).collect::<Vec<u32>>();
        let mut head_saved = Vec::new(); // per micro-batch: (ln_f out, mean, rstd, logits, max, sumexp, x)
        let mut loss_sum = 0.0f64;
        for (m, &b) in seqs.iter().enumerate() {
            let mut x = vec![0.0; n * c];
            if let Some((wte, wpe)) = &st.embed {
                wte.forward(&Cpu, &p, &toks(b, 0), &mut x, tpc).unwrap();
                if let Some(wpe) = wpe {
                    wpe.forward(&Cpu, &p, &mut x, T, 0).unwrap();
                }
            } else {
                ppc.recv(&mut x, stage - 1).unwrap();
            }
            for (blk, a) in st.blocks.iter().zip(acts[m].iter_mut()) {
                let mut out = vec![0.0; n * c];
                blk.forward(&Cpu, &p, &x, &mut out, a, &mut ws, tpc)
                    .unwrap();
                x = out;
            }
            if let Some((ln, lm)) = &st.head {
                let (mut h, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
                ln.forward(&Cpu, &p, &x, &mut h, &mut mean, &mut rstd)
                    .unwrap();
                let mut logits = vec![0.0; n * v_local];
                lm.forward(&Cpu, &p, &h, &mut logits).unwrap();
                let (mut l, mut mx, mut se) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                let start = tp.rank * v_local;
                let mut both = vec![0.0; 2 * n];
                vocab_parallel_cross_entropy_forward(
                    &Cpu,
                    &mut l,
                    &mut mx,
                    &mut se,
                    &mut both,
                    &logits,
                    &toks(b, 1),
                    start,
                    tpc,
                )
                .unwrap();
                loss_sum += l.iter().map(|&v| f64::from(v)).sum::<f64>();
                head_saved.push((h, mean, rstd, logits, mx, se, x));
            } else {
                ppc.send(&x, stage + 1).unwrap();
            }
        }
        for (m, &b) in seqs.iter().enumerate().rev() {
            let mut dx = vec![0.0; n * c];
            if let Some((ln, lm)) = &st.head {
                let (h, mean, rstd, mut logits, mx, se, x) = head_saved.pop().unwrap();
                let dl = vec![1.0 / (GLOBAL_B * T) as f32; n];
                vocab_parallel_cross_entropy_backward(
                    &Cpu,
                    &mut logits,
                    &mx,
                    &se,
                    &toks(b, 1),
                    &dl,
                    tp.rank * v_local,
                )
                .unwrap();
                let mut dh = vec![0.0; n * c];
                lm.backward(&Cpu, &p, &mut g, &h, &logits, &mut dh, tpc)
                    .unwrap();
                ln.backward(&Cpu, &p, &mut g, &dh, &x, &mean, &rstd, &mut dx)
                    .unwrap();
            } else {
                ppc.recv(&mut dx, stage + 1).unwrap();
            }
            for (blk, a) in st.blocks.iter().zip(acts[m].iter()).rev() {
                let mut din = vec![0.0; n * c];
                blk.backward(&Cpu, &p, &mut g, &dx, &mut din, a, &mut ws, tpc)
                    .unwrap();
                dx = din;
            }
            if let Some((wte, wpe)) = &st.embed {
                wte.backward(&Cpu, &mut g, &toks(b, 0), &dx).unwrap();
                if let Some(wpe) = wpe {
                    wpe.backward(&Cpu, &mut g, &dx, T).unwrap();
                }
            } else {
                ppc.send(&dx, stage - 1).unwrap();
            }
        }
        dpc.all_reduce_sum(&mut g).unwrap();
        let sum = |x: f64| all_reduce_f64(ppc, all_reduce_f64(tpc, x)?);
        let norm = grad_norm(&st.layout, &g, 0..g.len(), tp.rank, &sum).unwrap();
        opt.step(&mut p, &g, sched.lr(step), clip_scale(norm, 1.0));
        g.fill(0.0);
        if st.head.is_some() {
            losses.push(all_reduce_f64(dpc, loss_sum).unwrap() / (GLOBAL_B * T) as f64);
        }
    }
    (losses, st.layout, p)
}

/// Runs (dp, pp, tp) on dp·pp·tp threads; returns the losses and the global parameters.
fn run(
    cfg: &BlockConfig,
    dp: usize,
    pp: usize,
    tp: usize,
) -> (Vec<f64>, std::collections::BTreeMap<String, Vec<f32>>) {
    let groups = local_groups(&tessera_planner::Mesh::new(
        dp as u64, pp as u64, tp as u64, 8,
    ))
    .unwrap();
    let out: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| s.spawn(move || train(cfg, dp, (&g.tp, &g.dp, &g.pp))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let losses = out.iter().find(|o| !o.0.is_empty()).unwrap().0.clone();
    let params = gather(&out.iter().map(|o| (&o.1, &o.2[..])).collect::<Vec<_>>());
    (losses, params)
}

#[test]
fn every_layout_trains_like_the_single_rank_run() {
    for llama in [false, true] {
        let cfg = config(llama);
        let (want_loss, want_params) = run(&cfg, 1, 1, 1);
        assert!(
            want_loss[STEPS - 1] < want_loss[0],
            "training lowers the loss: {want_loss:?}"
        );
        for (dp, pp, tp) in [
            (1, 1, 2),
            (1, 1, 4),
            (2, 1, 2),
            (1, 2, 2),
            (2, 2, 1),
            (4, 1, 1),
        ] {
            let what = format!("llama={llama} dp={dp} pp={pp} tp={tp}");
            let (loss, params) = run(&cfg, dp, pp, tp);
            for (a, b) in loss.iter().zip(&want_loss) {
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{what}: loss {a} vs {b}");
            }
            assert_globals_close(&params, &want_params, 1e-5, &what);
        }
    }
}
