//! The architecture of one transformer block, and its mapping from the planner's resolved
//! model (`tessera_planner::model::Architecture`), so the runtime builds exactly the model the
//! plan describes. Must not decide parallel layout (the TP degree is passed separately).

use tessera_planner::model::{self, Architecture, RopeScaling};

use super::{Activation, LayerError, NormKind};

/// Architecture of one block (global sizes).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockConfig {
    pub hidden: usize,
    pub heads: usize,
    /// Equal to `heads` for plain multi-head attention; divides `heads` (GQA).
    pub kv_heads: usize,
    /// Usually `hidden / heads`, but free (q/k/v project to `heads · head_dim`).
    pub head_dim: usize,
    pub ffn_hidden: usize,
    pub activation: Activation,
    pub norm: NormKind,
    /// `Some(θ)` (e.g. 10000) for RoPE; `None` when positions are learned (added at the input).
    pub rope_theta: Option<f64>,
    /// RoPE frequency scaling (Llama 3.1's `llama3`); `None`: plain RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on every linear (GPT-2).
    pub bias: bool,
    /// Biases on q, k, v only (Qwen2); implied by `bias`.
    pub qkv_bias: bool,
    pub norm_eps: f32,
    /// Std of the q/k/v, fc/gate/up weights (GPT-2: 0.02).
    pub init_std: f32,
    /// Std of the residual projections `o` and `proj` (GPT-2: 0.02 / √(2·layers)).
    pub proj_init_std: f32,
}

/// RoPE base when the model spec names none.
pub const DEFAULT_ROPE_THETA: f64 = model::DEFAULT_ROPE_THETA;

impl BlockConfig {
    /// The block of a resolved planner model, with GPT-2 initialisation (std 0.02, residual
    /// projections 0.02/√(2·layers)), and the model's norm ε (`norm_eps`, default 1e-5), RoPE θ
    /// (`rope_theta`, default [`DEFAULT_ROPE_THETA`]) and RoPE scaling.
    pub fn from_architecture(a: &Architecture) -> Result<Self, LayerError> {
        let us = |v: u64, what: &str| {
            usize::try_from(v)
                .map_err(|_| LayerError::Config(format!("{what} = {v} does not fit in memory")))
        };
        if a.layers == 0 {
            return Err(LayerError::Config(
                "a model needs at least one layer".into(),
            ));
        }
        Ok(Self {
            hidden: us(a.hidden, "hidden")?,
            heads: us(a.heads, "heads")?,
            kv_heads: us(a.kv_heads, "kv_heads")?,
            head_dim: us(a.head_dim, "head_dim")?,
            ffn_hidden: us(a.ffn_hidden, "ffn_hidden")?,
            activation: match a.activation {
                model::Activation::Gelu => Activation::Gelu,
                model::Activation::Swiglu => Activation::SwiGlu,
            },
            norm: match a.norm {
                model::Norm::Layernorm => NormKind::LayerNorm,
                model::Norm::Rmsnorm => NormKind::RmsNorm,
            },
            rope_theta: match a.position {
                model::Position::Learned => None,
                model::Position::Rope => Some(a.rope_theta),
            },
            rope_scaling: match a.position {
                model::Position::Learned => None,
                model::Position::Rope => a.rope_scaling,
            },
            bias: a.bias,
            qkv_bias: a.qkv_bias || a.bias,
            norm_eps: a.norm_eps as f32,
            init_std: 0.02,
            proj_init_std: 0.02 / (2.0 * a.layers as f32).sqrt(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{TpShard, TransformerBlock};
    use crate::params::ParamLayout;

    /// The model's RoPE θ, scaling and norm ε reach the block; the defaults are the values the
    /// runtime used before the keys existed (θ 10000, ε 1e-5 as f32), so earlier runs stay
    /// bit-identical.
    #[test]
    fn rope_and_norm_keys_reach_the_block() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let load = |p: &str| {
            tessera_planner::spec::load_model(&dir.join(p), Default::default())
                .unwrap()
                .architecture
        };
        let plain =
            BlockConfig::from_architecture(&load("tests/fixtures/tiny-llama.toml")).unwrap();
        assert_eq!(plain.rope_theta, Some(10_000.0));
        assert_eq!(plain.norm_eps.to_bits(), 1e-5f32.to_bits());
        assert_eq!(plain.rope_scaling, None);
        let set =
            BlockConfig::from_architecture(&load("tests/fixtures/tiny-llama-rope.toml")).unwrap();
        assert_eq!(set.rope_theta, Some(1e6));
        assert_eq!(set.norm_eps, 1e-6f32);
        assert_eq!(set.rope_scaling.map(|s| s.original_max_positions), Some(64));
        let gpt = BlockConfig::from_architecture(&load("specs/models/tiny.toml")).unwrap();
        assert_eq!((gpt.rope_theta, gpt.norm_eps), (None, 1e-5f32));
    }

    /// The runtime's block registers exactly the parameters the planner counts, split the same
    /// way between TP-sharded and replicated, for real presets.
    #[test]
    fn block_parameters_match_the_planner_count() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/models");
        for preset in ["tiny", "gpt2-124m", "llama3-8b"] {
            let path = dir.join(format!("{preset}.toml"));
            let model = tessera_planner::spec::load_model(&path, Default::default())
                .unwrap_or_else(|e| panic!("{preset}: {e:?}"));
            let arch = &model.architecture;
            let cfg = BlockConfig::from_architecture(arch).unwrap();
            let want = arch.layer_params();
            for t in [1, 2, 4] {
                let mut layout = ParamLayout::new();
                TransformerBlock::new(&mut layout, "h.0", &cfg, TpShard::new(t - 1, t)).unwrap();
                let count = |sharded: bool| {
                    let e = layout.entries().iter().filter(|e| e.tp_sharded == sharded);
                    e.map(|e| e.len as u64).sum::<u64>()
                };
                let (sh, rep) = if t == 1 {
                    (0, count(false))
                } else {
                    (count(true), count(false))
                };
                if t == 1 {
                    assert_eq!(rep, want.total(), "{preset}");
                } else {
                    assert_eq!(sh * t as u64, want.sharded, "{preset} t={t} sharded");
                    assert_eq!(rep, want.replicated, "{preset} t={t} replicated");
                }
            }
        }
    }
}
