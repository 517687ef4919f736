//! The router's arithmetic on host f32 rows: scores, (group-limited) top-k, the weights the
//! experts' outputs are combined with, capacity dropping, the load-balancing statistics, and
//! the backward of all of it. Pure functions: no parameters, no communication.
//!
//! The forward follows transformers' classes: Mixtral / Qwen2-MoE (softmax over all experts,
//! top-k, `norm_topk_prob`), DeepSeek-V3 (sigmoid scores, `e_score_correction_bias` added only
//! to choose, groups ranked by the sum of their two best scores, the losing groups' scores set
//! to 0, `routed_scaling_factor`). Ties go to the lower expert index. The load-balancing loss
//! is Megatron-Core's `switch_load_balancing_loss_func`: `coef · E · Σ_i f_i · P_i`, `f_i` the
//! fraction of routed slots that chose expert `i` (before any dropping), `P_i` the mean of the
//! router's probabilities (the softmax scores, or for sigmoid scoring each token's scores
//! divided by their sum, as Megatron's `compute_routing_scores_for_aux_loss`).

use tessera_planner::model::RouterScoring;

/// What the router does, resolved from the model's `Moe`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec {
    pub experts: usize,
    pub top_k: usize,
    pub scoring: RouterScoring,
    pub normalize: bool,
    pub scaling: f32,
    pub groups: usize,
    pub groups_per_token: usize,
    /// Token dropping: each expert keeps at most `ceil(factor · n · k / E)` of a call's `n`
    /// tokens, the earliest in token order (Megatron's `drop_policy = "position"`).
    pub capacity_factor: Option<f64>,
}

/// One call's routing of `n` tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Routing {
    pub n: usize,
    /// `(n, E)` the scores (softmax or sigmoid), without the score bias.
    pub scores: Vec<f32>,
    /// `(n, k)` the chosen experts, best first.
    pub experts: Vec<usize>,
    /// `(n, k)` the combine weights (normalised, scaled).
    pub weights: Vec<f32>,
    /// `(n, k)` whether the slot survived the capacity (all true when dropless).
    pub kept: Vec<bool>,
    /// `(E)` slots that chose each expert, before dropping.
    pub counts: Vec<f32>,
    /// `(E)` Σ over the tokens of the router probability of each expert.
    pub prob_sums: Vec<f32>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The indices of the `k` largest of `v`, largest first, ties to the lower index.
fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.truncate(k);
    idx
}

impl RouterSpec {
    /// Expert capacity for a call of `n` tokens, if tokens are dropped.
    pub fn capacity(&self, n: usize) -> Option<usize> {
        self.capacity_factor
            .map(|f| (f * (n * self.top_k) as f64 / self.experts as f64).ceil() as usize)
    }

    /// The router probabilities the load-balancing loss averages, of one token's scores.
    fn aux_probs(&self, s: &[f32]) -> Vec<f32> {
        match self.scoring {
            RouterScoring::Softmax => s.to_vec(),
            RouterScoring::Sigmoid => {
                let sum: f32 = s.iter().sum();
                s.iter().map(|x| x / sum).collect()
            }
        }
    }

    /// Routes `n` tokens from their router logits `(n, E)`; `bias (E)` is the score bias.
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>) -> Routing {
        let (e, k) = (self.experts, self.top_k);
        let n = logits.len() / e;
        let mut r = Routing {
            n,
            scores: vec![0.0; n * e],
            experts: Vec::with_capacity(n * k),
            weights: Vec::with_capacity(n * k),
            kept: vec![true; n * k],
            counts: vec![0.0; e],
            prob_sums: vec![0.0; e],
        };
        for t in 0..n {
            let l = &logits[t * e..(t + 1) * e];
            let s = &mut r.scores[t * e..(t + 1) * e];
            match self.scoring {
                RouterScoring::Softmax => {
                    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for (o, &x) in s.iter_mut().zip(l) {
                        *o = (x - max).exp();
                        sum += *o;
                    }
                    s.iter_mut().for_each(|o| *o /= sum);
                }
                RouterScoring::Sigmoid => {
                    for (o, &x) in s.iter_mut().zip(l) {
                        *o = sigmoid(x);
                    }
                }
            }
            let s = &r.scores[t * e..(t + 1) * e];
            let mut choice: Vec<f32> = match bias {
                Some(b) => s.iter().zip(b).map(|(x, b)| x + b).collect(),
                None => s.to_vec(),
            };
            if self.groups > 1 && self.groups_per_token < self.groups {
                let size = e / self.groups;
                let group_score: Vec<f32> = choice
                    .chunks(size)
                    .map(|g| {
                        let best = top_indices(g, 2.min(size));
                        best.iter().map(|&i| g[i]).sum()
                    })
                    .collect();
                let keep = top_indices(&group_score, self.groups_per_token);
                for (gi, g) in choice.chunks_mut(size).enumerate() {
                    if !keep.contains(&gi) {
                        g.fill(0.0);
                    }
                }
            }
            let chosen = top_indices(&choice, k);
            let mut w: Vec<f32> = chosen.iter().map(|&i| s[i]).collect();
            if self.normalize {
                let sum: f32 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= sum);
            }
            w.iter_mut().for_each(|x| *x *= self.scaling);
            for &i in &chosen {
                r.counts[i] += 1.0;
            }
            for (ps, p) in r.prob_sums.iter_mut().zip(self.aux_probs(s)) {
                *ps += p;
            }
            r.experts.extend(chosen);
            r.weights.extend(w);
        }
        if let Some(cap) = self.capacity(n) {
            let mut taken = vec![0usize; e];
            for (slot, &x) in r.experts.iter().enumerate() {
                r.kept[slot] = taken[x] < cap;
                taken[x] += 1;
            }
        }
        r
    }

    /// The load-balancing loss from the statistics of all `tokens` tokens of a micro-batch:
    /// `counts` and `prob_sums` summed over every rank holding some of them.
    pub fn aux_loss(&self, coef: f64, counts: &[f32], prob_sums: &[f32], tokens: usize) -> f64 {
        let (e, k, t) = (self.experts as f64, self.top_k as f64, tokens as f64);
        let dot: f64 = counts
            .iter()
            .zip(prob_sums)
            .map(|(&c, &p)| f64::from(c) * f64::from(p))
            .sum();
        coef * e * dot / (k * t * t)
    }

    /// `dlogits (n, E)` (overwritten) from the gradient of the combine weights `dweights (n, k)`
    /// and, for the load-balancing loss, `dprob (E)`: the gradient of every token's router
    /// probability of expert `i` (`scale · coef · E · counts_i / (k · T²)`).
    pub fn backward(
        &self,
        r: &Routing,
        dweights: &[f32],
        dprob: Option<&[f32]>,
        dlogits: &mut [f32],
    ) {
        let (e, k) = (self.experts, self.top_k);
        let mut ds = vec![0.0f32; e];
        for t in 0..r.n {
            let s = &r.scores[t * e..(t + 1) * e];
            let idx = &r.experts[t * k..(t + 1) * k];
            let dw = &dweights[t * k..(t + 1) * k];
            ds.fill(0.0);
            // w_j = scaling · s_j (/ Σ_i s_i).
            if self.normalize {
                let sum: f32 = idx.iter().map(|&i| s[i]).sum();
                let dot: f32 = idx.iter().zip(dw).map(|(&i, &g)| g * s[i]).sum();
                for (&i, &g) in idx.iter().zip(dw) {
                    ds[i] += self.scaling * (g / sum - dot / (sum * sum));
                }
            } else {
                for (&i, &g) in idx.iter().zip(dw) {
                    ds[i] += self.scaling * g;
                }
            }
            if let Some(dp) = dprob {
                match self.scoring {
                    RouterScoring::Softmax => {
                        ds.iter_mut().zip(dp).for_each(|(d, g)| *d += g);
                    }
                    RouterScoring::Sigmoid => {
                        // p_i = s_i / S.
                        let sum: f32 = s.iter().sum();
                        let dot: f32 = dp.iter().zip(s).map(|(g, x)| g * x).sum();
                        for (d, g) in ds.iter_mut().zip(dp) {
                            *d += g / sum - dot / (sum * sum);
                        }
                    }
                }
            }
            let dl = &mut dlogits[t * e..(t + 1) * e];
            match self.scoring {
                RouterScoring::Softmax => {
                    let dot: f32 = s.iter().zip(&ds).map(|(x, d)| x * d).sum();
                    for ((o, x), d) in dl.iter_mut().zip(s).zip(&ds) {
                        *o = x * (d - dot);
                    }
                }
                RouterScoring::Sigmoid => {
                    for ((o, x), d) in dl.iter_mut().zip(s).zip(&ds) {
                        *o = d * x * (1.0 - x);
                    }
                }
            }
        }
    }
}
