//! Which linears of a transformer block carry LoRA adapters, and their names: the runtime's
//! linear names with PEFT's suffixes (`h.3.attn.qkv.lora_A.weight` is GPT-2's
//! `h.3.attn.c_attn.lora_A.weight`, `h.3.attn.o` its `attn.c_proj`, `h.3.mlp.fc` its `mlp.c_fc`,
//! `h.3.mlp.proj` its `mlp.c_proj`; `h.3.attn.o` and `h.3.mlp.proj` are Llama's `o_proj` and
//! `down_proj`).

use tessera_planner::finetune::Target;

use crate::params::ParamLayout;

use super::block::{Mlp, TransformerBlock};
use super::lora::{Adapter, LoraSettings};
use super::{Activation, LayerError};

fn unsupported(t: Target, why: &str) -> LayerError {
    LayerError::Config(format!(
        "a LoRA adapter on {}: {why}; the runtime trains adapters on qkv (fused), o, up (a GeLU MLP's fc) and down",
        t.name()
    ))
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
    let tp = b.tp;
    let mut targets = s.targets.clone();
    targets.sort();
    targets.dedup();
    for t in targets {
        match t {
            Target::Qkv => {
                let name = format!("{prefix}.attn.qkv");
                let a = Adapter::column(layout, &name, cfg.hidden, &[q, kv, kv], s, tp)?;
                b.attn.qkv.lora = Some(Box::new(a));
            }
            Target::O => {
                let name = format!("{prefix}.attn.o");
                let a = Adapter::row(layout, &name, q, cfg.hidden, s, tp)?;
                b.attn.proj.lora = Some(Box::new(a));
            }
            Target::Up | Target::Down => {
                let Mlp::Dense(mlp) = &mut b.mlp else {
                    return Err(unsupported(t, "the block's MLP is a mixture of experts"));
                };
                if t == Target::Down {
                    let name = format!("{prefix}.mlp.proj");
                    let (f, c) = (cfg.ffn_hidden, cfg.hidden);
                    mlp.proj.lora = Some(Box::new(Adapter::row(layout, &name, f, c, s, tp)?));
                } else if cfg.activation == Activation::Gelu {
                    let name = format!("{prefix}.mlp.fc");
                    let parts = [cfg.ffn_hidden];
                    let a = Adapter::column(layout, &name, cfg.hidden, &parts, s, tp)?;
                    mlp.fc.lora = Some(Box::new(a));
                } else {
                    return Err(unsupported(
                        t,
                        "SwiGLU fuses gate and up into one projection and adapters on one of its parts are not implemented yet",
                    ));
                }
            }
            Target::Q | Target::K | Target::V | Target::Gate => {
                return Err(unsupported(
                    t,
                    "the runtime fuses it with its sibling projections and adapters on one part of a fused projection are not implemented yet",
                ))
            }
        }
    }
    Ok(())
}

/// The adapters of block `b`.
pub fn adapters(b: &TransformerBlock) -> impl Iterator<Item = &Adapter> {
    let mlp = b.mlp.dense();
    [
        b.attn.qkv.lora.as_deref(),
        b.attn.proj.lora.as_deref(),
        mlp.and_then(|m| m.fc.lora.as_deref()),
        mlp.and_then(|m| m.proj.lora.as_deref()),
    ]
    .into_iter()
    .flatten()
}
