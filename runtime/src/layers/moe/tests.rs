//! The MoE layer against an f64 reference written from the definitions (transformers'
//! Mixtral / Qwen2-MoE / DeepSeek-V3 forward, Megatron's load-balancing loss), its gradients
//! against central differences of that reference, and the all-to-all it travels by.

use tessera_planner::model::{Moe, RouterScoring};

use super::*;
use crate::backend::Cpu;
use crate::comm::LocalComm;
use crate::layers::{Activation, NormKind};

const C: usize = 8;
const N: usize = 10;
const AUX_SCALE: f64 = 0.7;

fn cfg(act: Activation, bias: bool) -> BlockConfig {
    BlockConfig {
        hidden: C,
        heads: 2,
        kv_heads: 2,
        head_dim: 4,
        ffn_hidden: 16,
        activation: act,
        norm: NormKind::LayerNorm,
        rope_theta: None,
        rope_scaling: None,
        bias,
        qkv_bias: bias,
        norm_eps: 1e-5,
        init_std: 0.4,
        proj_init_std: 0.4,
    }
}

fn moe(experts: u64, k: u64) -> Moe {
    Moe {
        experts,
        experts_per_token: k,
        moe_ffn_hidden: 6,
        first_dense_layers: 0,
        moe_layer_frequency: 1,
        moe_layers: None,
        shared_experts: 0,
        shared_expert_ffn_hidden: 6,
        shared_expert_gate: false,
        capacity_factor: None,
        router_aux_loss_coef: 1.0,
        router_scoring: RouterScoring::Softmax,
        router_score_bias: false,
        normalize_top_k: true,
        routed_scaling_factor: 1.0,
        expert_groups: 1,
        expert_groups_per_token: 1,
    }
}

/// The layer (EP 1, TP 1) with its flat parameters, biases made non-zero.
fn build(cfg: &BlockConfig, m: &Moe) -> (MoeMlp, ParamLayout, Vec<f32>) {
    let mut layout = ParamLayout::new();
    let mut experts = ParamLayout::new();
    let mut layer = MoeMlp::new(
        &mut layout,
        &mut experts,
        "h.0.mlp",
        cfg,
        m,
        TpShard::SINGLE,
        EpShard::SINGLE,
    )
    .unwrap();
    layer.expert_base = layout.append(experts).unwrap();
    layer.aux_scale = AUX_SCALE;
    let mut p = layout.init(7);
    for e in layout.entries() {
        if matches!(e.init, Init::Const(_)) && !e.name.contains("ln") {
            // Biases and the score bias: small distinct values.
            for (i, v) in e.param_ref().of_mut(&mut p).iter_mut().enumerate() {
                *v = 0.05 * ((i * 7 + e.offset) % 11) as f32 - 0.25;
            }
        }
    }
    (layer, layout, p)
}

/// The reference: global tensors by name, everything in f64, one token at a time.
struct Reference<'a> {
    layout: &'a ParamLayout,
    m: &'a Moe,
    act: Activation,
}

fn gelu(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl Reference<'_> {
    fn get<'p>(&self, p: &'p [f64], name: &str) -> Option<&'p [f64]> {
        self.layout
            .get(name)
            .map(|e| &p[e.offset..e.offset + e.len])
    }

    /// `W x (+ b)` for `W (out, C)`.
    fn linear(&self, p: &[f64], name: &str, x: &[f64]) -> Vec<f64> {
        let w = self.get(p, &format!("{name}.weight")).unwrap();
        let cols = x.len();
        let mut y: Vec<f64> = w
            .chunks(cols)
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect();
        if let Some(b) = self.get(p, &format!("{name}.bias")) {
            y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
        y
    }

    fn mlp(&self, p: &[f64], prefix: &str, x: &[f64]) -> Vec<f64> {
        let a: Vec<f64> = match self.act {
            Activation::Gelu => self
                .linear(p, &format!("{prefix}.fc"), x)
                .into_iter()
                .map(gelu)
                .collect(),
            Activation::SwiGlu => {
                let g = self.linear(p, &format!("{prefix}.gate"), x);
                let u = self.linear(p, &format!("{prefix}.up"), x);
                g.iter().zip(&u).map(|(g, u)| g * sigmoid(*g) * u).collect()
            }
        };
        self.linear(p, &format!("{prefix}.proj"), &a)
    }

    /// The outputs `(n, C)` and the load-balancing loss of `x (n, C)`.
    fn forward(&self, p: &[f64], x: &[f64]) -> (Vec<f64>, f64) {
        let m = self.m;
        let (e, k) = (m.experts as usize, m.experts_per_token as usize);
        let n = x.len() / C;
        let mut out = vec![0.0; n * C];
        let (mut counts, mut probs) = (vec![0.0; e], vec![0.0; e]);
        let mut chosen_all = Vec::new();
        for t in 0..n {
            let xt = &x[t * C..(t + 1) * C];
            let logits = self.linear(p, "h.0.mlp.router", xt);
            let s: Vec<f64> = match m.router_scoring {
                RouterScoring::Softmax => {
                    let z: f64 = logits.iter().map(|l| l.exp()).sum();
                    logits.iter().map(|l| l.exp() / z).collect()
                }
                RouterScoring::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
            };
            let mut choice = s.clone();
            if let Some(b) = self.get(p, "h.0.mlp.router.score_bias") {
                choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
            }
            let groups = m.expert_groups as usize;
            if groups > 1 && (m.expert_groups_per_token as usize) < groups {
                let size = e / groups;
                let mut gs: Vec<(f64, usize)> = (0..groups)
                    .map(|g| {
                        let mut v = choice[g * size..(g + 1) * size].to_vec();
                        v.sort_by(|a, b| b.total_cmp(a));
                        (v.iter().take(2).sum(), g)
                    })
                    .collect();
                gs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let keep: Vec<usize> = gs
                    .iter()
                    .take(m.expert_groups_per_token as usize)
                    .map(|g| g.1)
                    .collect();
                for (i, c) in choice.iter_mut().enumerate() {
                    if !keep.contains(&(i / size)) {
                        *c = 0.0;
                    }
                }
            }
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            let chosen = &order[..k];
            let total: f64 = chosen.iter().map(|&i| s[i]).sum();
            for &i in chosen {
                counts[i] += 1.0;
            }
            let ssum: f64 = s.iter().sum();
            for i in 0..e {
                probs[i] += match m.router_scoring {
                    RouterScoring::Softmax => s[i],
                    RouterScoring::Sigmoid => s[i] / ssum,
                };
            }
            let weights: Vec<f64> = chosen
                .iter()
                .map(|&i| {
                    let w = if m.normalize_top_k {
                        s[i] / total
                    } else {
                        s[i]
                    };
                    w * m.routed_scaling_factor
                })
                .collect();
            chosen_all.push((chosen.to_vec(), weights));
        }
        // Capacity: each expert keeps its first tokens in token order.
        let cap = m
            .capacity_factor
            .map(|f| (f * (n * k) as f64 / e as f64).ceil() as usize);
        let mut taken = vec![0usize; e];
        for (t, (chosen, weights)) in chosen_all.iter().enumerate() {
            let xt = &x[t * C..(t + 1) * C];
            let o = &mut out[t * C..(t + 1) * C];
            for (&i, w) in chosen.iter().zip(weights) {
                taken[i] += 1;
                if cap.is_some_and(|c| taken[i] > c) {
                    continue;
                }
                let y = self.mlp(p, &format!("h.0.mlp.experts.{i}"), xt);
                o.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
            }
            if m.shared_experts > 0 {
                let mut sh = vec![0.0; C];
                for s in 0..m.shared_experts {
                    let y = self.mlp(p, &format!("h.0.mlp.shared_experts.{s}"), xt);
                    sh.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
                }
                let g = match self.get(p, "h.0.mlp.shared_expert_gate.weight") {
                    Some(w) => sigmoid(w.iter().zip(xt).map(|(a, b)| a * b).sum()),
                    None => 1.0,
                };
                o.iter_mut().zip(&sh).for_each(|(o, s)| *o += g * s);
            }
        }
        let (kk, nn) = (k as f64, n as f64);
        let aux: f64 = m.router_aux_loss_coef * e as f64 / (kk * nn * nn)
            * counts.iter().zip(&probs).map(|(c, p)| c * p).sum::<f64>();
        (out, aux)
    }

    /// The test's loss: `Σ out ⊙ r + scale · aux`.
    fn loss(&self, p: &[f64], x: &[f64], r: &[f64]) -> f64 {
        let (out, aux) = self.forward(p, x);
        out.iter().zip(r).map(|(a, b)| a * b).sum::<f64>() + AUX_SCALE * aux
    }
}

fn pseudo(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    crate::rng::fill_normal(&mut v, seed, 3, 0, 1.0);
    v
}

/// Forward and backward of the layer against the f64 reference and its central differences.
fn check(m: &Moe, act: Activation, bias: bool) {
    let cfg = cfg(act, bias);
    let (layer, layout, p) = build(&cfg, m);
    let x = pseudo(N * C, 11);
    let r = pseudo(N * C, 12);
    let mut ws = MoeWorkspace::<Cpu>::single();
    let mut s = MoeSaved::<Cpu>::default();
    let mut out = vec![0.0f32; N * C];
    layer
        .forward(&Cpu, &p, &x, &mut s, Some(&mut out), &mut ws)
        .unwrap();
    let reference = Reference {
        layout: &layout,
        m,
        act,
    };
    let p64: Vec<f64> = p.iter().map(|&v| f64::from(v)).collect();
    let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let r64: Vec<f64> = r.iter().map(|&v| f64::from(v)).collect();
    let (want, aux) = reference.forward(&p64, &x64);
    let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(*a) - b).abs() <= 1e-5 * scale,
            "{m:?}: output {i}: {a} vs {b}"
        );
    }
    assert!(
        (s.aux - aux).abs() <= 1e-6 * aux.abs().max(1e-3),
        "aux {} vs {aux}",
        s.aux
    );
    let mut g = vec![0.0f32; p.len()];
    let mut dx = vec![0.0f32; N * C];
    let mut no_tp = |_: &mut [f32]| Ok(());
    layer
        .backward(&Cpu, &p, &mut g, &x, &s, &r, &mut dx, &mut ws, &mut no_tp)
        .unwrap();
    let h = 1e-6;
    let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
    let gmax = g.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for e in layout.entries() {
        for i in e.offset..e.offset + e.len {
            let want = fd(&|d| {
                let mut q = p64.clone();
                q[i] += d;
                reference.loss(&q, &x64, &r64)
            });
            // The score bias only chooses: no gradient, by definition.
            let want = if e.name.contains("score_bias") {
                0.0
            } else {
                want
            };
            assert!(
                (f64::from(g[i]) - want).abs() <= 2e-3 * f64::from(gmax),
                "{m:?}: d {}[{}]: {} vs {want}",
                e.name,
                i - e.offset,
                g[i]
            );
        }
    }
    let dmax = dx.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    for i in 0..x.len() {
        let want = fd(&|d| {
            let mut y = x64.clone();
            y[i] += d;
            reference.loss(&p64, &y, &r64)
        });
        assert!(
            (f64::from(dx[i]) - want).abs() <= 2e-3 * f64::from(dmax),
            "{m:?}: dx[{i}]: {} vs {want}",
            dx[i]
        );
    }
}

#[test]
fn mixtral_top2_softmax_matches_the_reference() {
    check(&moe(4, 2), Activation::Gelu, true);
}

#[test]
fn switch_top1_with_a_gated_shared_expert_matches_the_reference() {
    let mut m = moe(4, 1);
    m.shared_experts = 1;
    m.shared_expert_gate = true;
    m.normalize_top_k = false;
    check(&m, Activation::SwiGlu, false);
}

#[test]
fn deepseek_sigmoid_groups_and_score_bias_match_the_reference() {
    let mut m = moe(8, 2);
    m.router_scoring = RouterScoring::Sigmoid;
    m.router_score_bias = true;
    m.expert_groups = 4;
    m.expert_groups_per_token = 2;
    m.routed_scaling_factor = 2.5;
    m.shared_experts = 2;
    check(&m, Activation::SwiGlu, false);
}

#[test]
fn capacity_drops_the_latest_tokens_as_the_reference() {
    let mut m = moe(4, 2);
    m.capacity_factor = Some(0.6);
    let spec = build(&cfg(Activation::Gelu, true), &m).0.spec;
    // 10 tokens × top-2 / 4 experts × 0.6 = 3 slots per expert.
    assert_eq!(spec.capacity(N), Some(3));
    check(&m, Activation::Gelu, true);
}

#[test]
fn routing_drops_by_token_order_and_counts_before_dropping() {
    let spec = RouterSpec {
        experts: 2,
        top_k: 1,
        scoring: RouterScoring::Softmax,
        normalize: false,
        scaling: 1.0,
        groups: 1,
        groups_per_token: 1,
        capacity_factor: Some(1.0),
    };
    // Four tokens, all preferring expert 1: capacity 2 keeps tokens 0 and 1.
    let logits = [0.0, 1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0];
    let r = spec.route(&logits, None);
    assert_eq!(r.experts, vec![1, 1, 1, 1]);
    assert_eq!(r.kept, vec![true, true, false, false]);
    assert_eq!(r.counts, vec![0.0, 4.0]);
}

/// Variable parts, empty ones included, arrive from every rank in rank order.
#[test]
fn all_to_all_v_delivers_variable_parts() {
    let n = 3;
    // Rank s sends (s + d) % 3 elements to rank d, each the value 10·s + d.
    let count = |s: usize, d: usize| (s + d) % 3;
    let got = LocalComm::run(n, |c| {
        let me = Comm::rank(&c);
        let send_counts: Vec<usize> = (0..n).map(|d| count(me, d)).collect();
        let input: Vec<f32> = (0..n)
            .flat_map(|d| std::iter::repeat_n((10 * me + d) as f32, count(me, d)))
            .collect();
        let recv_counts: Vec<usize> = (0..n).map(|s| count(s, me)).collect();
        let mut output = vec![0.0f32; recv_counts.iter().sum()];
        Comm::all_to_all_v(&c, &input, &send_counts, &mut output, &recv_counts).unwrap();
        // A mismatched count is refused, not a hang.
        let bad = Comm::all_to_all_v(&c, &input, &send_counts[..2], &mut output, &recv_counts);
        assert!(bad.is_err());
        output
    });
    for (me, out) in got.iter().enumerate() {
        let want: Vec<f32> = (0..n)
            .flat_map(|s| std::iter::repeat_n((10 * s + me) as f32, count(s, me)))
            .collect();
        assert_eq!(out, &want, "rank {me}");
    }
}

/// An MoE block registers exactly what the planner counts (`moe_layer_params`): the common
/// part (attention, norms, router, shared experts) split between TP-sharded and replicated as
/// counted, and E/EP routed experts per rank.
#[test]
fn moe_block_parameters_match_the_planner_count() {
    use crate::layers::TransformerBlock;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/models");
    for preset in ["tiny-moe", "mixtral-8x7b"] {
        let path = dir.join(format!("{preset}.toml"));
        let model = tessera_planner::spec::load_model(&path, Default::default()).unwrap();
        let a = &model.architecture;
        let (m, want) = (a.moe.as_ref().unwrap(), a.moe_layer_params().unwrap());
        let cfg = BlockConfig::from_architecture(a).unwrap();
        for (t, ep) in [(1usize, 1usize), (2, 2)] {
            let (mut layout, mut experts) = (ParamLayout::new(), ParamLayout::new());
            TransformerBlock::new_moe(
                &mut layout,
                &mut experts,
                "h.1",
                &cfg,
                m,
                TpShard::new(t - 1, t),
                EpShard {
                    rank: ep - 1,
                    size: ep,
                },
            )
            .unwrap();
            let count = |l: &ParamLayout, sharded: bool| -> u64 {
                l.entries()
                    .iter()
                    .filter(|e| e.tp_sharded == sharded || t == 1)
                    .map(|e| e.len as u64)
                    .sum()
            };
            if t == 1 {
                assert_eq!(count(&layout, false), want.common.total(), "{preset}");
            } else {
                assert_eq!(
                    count(&layout, true) * t as u64,
                    want.common.sharded,
                    "{preset}"
                );
                assert_eq!(count(&layout, false), want.common.replicated, "{preset}");
            }
            let all: u64 = experts.entries().iter().map(|e| e.len as u64).sum();
            // A layout holds shapes only: Mixtral's experts are counted, not allocated.
            let per_rank = want.expert.sharded / t as u64 + want.expert.replicated;
            assert_eq!(
                all,
                want.experts / ep as u64 * per_rank,
                "{preset} t={t} ep={ep}"
            );
        }
    }
}
