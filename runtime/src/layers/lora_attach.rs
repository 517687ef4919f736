//! Which linears of a transformer block carry LoRA adapters, and their names: the runtime's
//! linear names with PEFT's suffixes (`h.3.attn.qkv.lora_A.weight` is GPT-2's
//! `h.3.attn.c_attn.lora_A.weight`, `h.3.attn.o` its `attn.c_proj`, `h.3.mlp.fc` its `mlp.c_fc`,
//! `h.3.mlp.proj` its `mlp.c_proj`; `h.3.attn.q`, `.k`, `.v`, `.o` are Llama's `q_proj`,
//! `k_proj`, `v_proj`, `o_proj`, and `h.3.mlp.gate`, `.up`, `.proj` its `gate_proj`, `up_proj`,
//! `down_proj`). The runtime fuses Llama's q/k/v and gate/up into one projection each; an
//! adapter on one of those parts adds to that part's columns of the fused output
//! ([`Adapter::column_part`]), which is PEFT's adapter on the unfused module.

use tessera_planner::finetune::Target;

use crate::params::ParamLayout;

use super::block::{Mlp, TransformerBlock};
use super::lora::{Adapter, LoraSettings};
use super::{Activation, LayerError};

fn unsupported(t: Target, why: &str) -> LayerError {
    LayerError::Config(format!("a LoRA adapter on {}: {why}", t.name()))
}

/// Registers (trainable) the adapters `s` asks for on block `b` (named under `prefix`, e.g.
/// `h.3`), in [`Target`] order.
pub fn attach(
    layout: &mut ParamLayout,
    b: &mut TransformerBlock,
    prefix: &str,
    s: &LoraSettings,
) -> Result<(), LayerError> {
    let cfg = b.cfg.clone();
    let (q, kv) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
    let (c, f) = (cfg.hidden, cfg.ffn_hidden);
    let tp = b.tp;
    let mut targets = s.targets.clone();
    targets.sort();
    targets.dedup();
    for t in targets {
        let attn = format!("{prefix}.attn");
        let qkv = [q, kv, kv];
        let adapter = match t {
            Target::Qkv => Adapter::column(layout, &format!("{attn}.qkv"), c, &qkv, s, tp)?,
            Target::Q | Target::K | Target::V => {
                let i = match t {
                    Target::Q => 0,
                    Target::K => 1,
                    _ => 2,
                };
                let name = format!("{attn}.{}", t.name());
                Adapter::column_part(layout, &name, c, &qkv, i, s, tp)?
            }
            Target::O => Adapter::row(layout, &format!("{attn}.o"), q, c, s, tp)?,
            Target::Gate | Target::Up | Target::Down => {
                let Mlp::Dense(mlp) = &mut b.mlp else {
                    return Err(unsupported(t, "the block's MLP is a mixture of experts"));
                };
                let name = format!("{prefix}.mlp");
                let a = match (t, cfg.activation) {
                    (Target::Down, _) => {
                        Adapter::row(layout, &format!("{name}.proj"), f, c, s, tp)?
                    }
                    (Target::Gate, Activation::Gelu) => {
                        return Err(unsupported(t, "a GeLU MLP has no gate: target up"))
                    }
                    (_, Activation::Gelu) => {
                        Adapter::column(layout, &format!("{name}.fc"), c, &[f], s, tp)?
                    }
                    // SwiGLU's fused projection is `[gate; up]`.
                    (_, Activation::SwiGlu) => {
                        let i = usize::from(t == Target::Up);
                        let name = format!("{name}.{}", t.name());
                        Adapter::column_part(layout, &name, c, &[f, f], i, s, tp)?
                    }
                };
                match t {
                    Target::Down => mlp.proj.lora.push(a),
                    _ => mlp.fc.lora.push(a),
                }
                continue;
            }
        };
        match t {
            Target::O => b.attn.proj.lora.push(adapter),
            _ => b.attn.qkv.lora.push(adapter),
        }
    }
    Ok(())
}

/// The adapters of block `b`.
pub fn adapters(b: &TransformerBlock) -> impl Iterator<Item = &Adapter> {
    let mlp = b.mlp.dense();
    [
        Some(&b.attn.qkv.lora),
        Some(&b.attn.proj.lora),
        mlp.map(|m| &m.fc.lora),
        mlp.map(|m| &m.proj.lora),
    ]
    .into_iter()
    .flatten()
    .flatten()
}
