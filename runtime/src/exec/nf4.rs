//! QLoRA's NF4 base on a rank: quantized from the run's starting weights, and written to and
//! read from checkpoints.
//!
//! Every rank quantizes the GLOBAL tensor of each NF4 linear part it holds, exactly as the
//! single rank does (and as bitsandbytes quantizes a whole `nn.Linear` weight), then keeps
//! its box of it ([`crate::quant::shard`]); the global tensor is a setup transient. The
//! starting weights are the seed's initialisation (by global index, like every tensor), the
//! `--init-from` model's, or a resumed checkpoint's NF4 state as it was saved.
//!
//! A checkpoint stores the NF4 base itself, not an f32 copy: no rank holds the f32 weights
//! after quantizing, and quantizing the dequantized values again would not give the same
//! block scales (the double quantization's offset is the mean of the original absmax values),
//! so a resume would not continue bit-identically. Per weight `W` it holds, as f32 tensors of
//! the `tessera.checkpoint/v1` format (so a reshard is the format's own):
//! - `W.nf4_codes`, W's shape: each element's 4-bit code, sharded as `W` is;
//! - `W.absmax` (one per block of 64: its 8-bit code), `W.nested_absmax` (one per 256
//!   blocks) and `W.nested_offset` (one), bitsandbytes' `QuantState` names, replicated.
//!
//! Their moments are zero, as every frozen tensor's (docs/checkpoints.md).

use std::collections::BTreeMap;

use super::model::StageModel;
use super::{RunError, TrainOptions};
use crate::checkpoint::{Checkpoint, Piece, SliceMeta};
use crate::params::{Init, ParamInfo, ParamSpec, Shard};
use crate::quant::{Nf4Shard, Nf4State, Nf4Tensor};

/// The checkpoint tensors of an NF4 weight: its codes, then its state's three.
const CODES: &str = "nf4_codes";
const STATE: [&str; 3] = ["absmax", "nested_absmax", "nested_offset"];

fn refused(what: String) -> RunError {
    RunError::Unsupported {
        what,
        fix: "start QLoRA from weights of the plan's model (or a checkpoint of a QLoRA run of it)"
            .into(),
    }
}

/// `info`'s whole tensor, as its shard's own description (box = everything).
fn whole(info: &ParamInfo) -> ParamInfo {
    let n = info.global_shape.iter().product();
    ParamInfo {
        shard_start: vec![0; info.global_shape.len()],
        shard_shape: info.global_shape.clone(),
        offset: 0,
        len: n,
        tp_sharded: false,
        ..info.clone()
    }
}

/// Quantizes (or, resuming, reads) the NF4 weights of `model` and fills their slots.
pub(super) fn load_base(model: &StageModel, opts: &TrainOptions) -> Result<(), RunError> {
    for w in model.nf4_weights() {
        let shards = w
            .parts
            .iter()
            .map(|p| match &opts.resume {
                Some(ck) => from_checkpoint(ck, p),
                None => {
                    let g = match &opts.init {
                        Some(init) => from_init(init, p)?,
                        None => {
                            let mut g = vec![0.0; p.global_shape.iter().product()];
                            whole(p).init_shard(opts.seed, &mut g);
                            g
                        }
                    };
                    let t = Nf4Tensor::quantize(&g, &p.global_shape, true)
                        .map_err(|e| refused(format!("{}: {e}", p.name)))?;
                    Ok(Nf4Shard::of(&t, p).map_err(crate::layers::LayerError::from)?)
                }
            })
            .collect::<Result<Vec<_>, RunError>>()?;
        w.load(shards)?;
    }
    Ok(())
}

fn from_init(
    init: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    p: &ParamInfo,
) -> Result<Vec<f32>, RunError> {
    match init.get(&p.name) {
        Some((shape, v)) if *shape == p.global_shape && v.len() == p.len_global() => Ok(v.clone()),
        Some((shape, _)) => Err(refused(format!(
            "initial tensor {} is {shape:?}; the plan's model has {:?}",
            p.name, p.global_shape
        ))),
        None => Err(refused(format!(
            "the initial weights lack tensor {}",
            p.name
        ))),
    }
}

/// The shard of `p` from a checkpoint's NF4 tensors.
fn from_checkpoint(ck: &Checkpoint, p: &ParamInfo) -> Result<Nf4Shard, RunError> {
    let get = |suffix: &str| {
        let name = format!("{}.{suffix}", p.name);
        ck.param(&name).ok_or_else(|| {
            refused(format!(
                "the checkpoint {} holds no tensor {name}: it is not a QLoRA checkpoint of this model",
                ck.dir().display()
            ))
        })
    };
    let (_, global_codes) = get(CODES)?;
    let mut codes = vec![0.0; p.len];
    p.copy_global_to_shard(global_codes, &mut codes);
    let (_, absmax) = get(STATE[0])?;
    let codes8 = absmax
        .iter()
        .map(|&c| (c.fract() == 0.0 && (0.0..256.0).contains(&c)).then_some(c as u8))
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(|| {
            refused(format!(
                "{}.absmax holds a value that is not an 8-bit code",
                p.name
            ))
        })?;
    let state = Nf4State {
        codes: codes8,
        absmax2: get(STATE[1])?.1.to_vec(),
        offset: get(STATE[2])?.1.first().copied().unwrap_or(0.0),
    };
    let blocks = p.len_global().div_ceil(crate::quant::BLOCKSIZE);
    if state.codes.len() != blocks
        || state.absmax2.len() != blocks.div_ceil(crate::quant::NESTED_BLOCKSIZE)
    {
        return Err(refused(format!(
            "{}: the checkpoint's block scales do not cover its {blocks} blocks",
            p.name
        )));
    }
    Ok(Nf4Shard::from_codes(&codes, state).map_err(crate::layers::LayerError::from)?)
}

/// The names and global shapes a checkpoint holds for an NF4 weight part `p` (for the check
/// of a checkpoint's tensors against its model): replicated specs.
pub(super) fn checkpoint_specs(p: &ParamInfo) -> Vec<ParamSpec> {
    let blocks = p.len_global().div_ceil(crate::quant::BLOCKSIZE);
    let shapes = [
        (CODES, p.global_shape.clone()),
        (STATE[0], vec![blocks]),
        (
            STATE[1],
            vec![blocks.div_ceil(crate::quant::NESTED_BLOCKSIZE)],
        ),
        (STATE[2], vec![1]),
    ];
    shapes
        .into_iter()
        .map(|(suffix, global_shape)| ParamSpec {
            name: format!("{}.{suffix}", p.name),
            global_shape,
            shard: Shard::Replicated,
            decay: false,
            init: Init::Const(0.0),
        })
        .collect()
}

/// The pieces a rank saves of its NF4 weights: the codes of its boxes, and on TP rank 0 the
/// (replicated) states.
pub(super) fn pieces(model: &StageModel, tp_rank: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut push = |meta: SliceMeta, param: Vec<f32>| {
        let zeros = vec![0.0; param.len()];
        out.push(Piece {
            meta,
            param,
            exp_avg: zeros.clone(),
            exp_avg_sq: zeros,
        });
    };
    for w in model.nf4_weights() {
        let Some(shards) = w.shards() else { continue };
        for (s, p) in shards.iter().zip(&w.parts) {
            let codes = (0..p.len).map(|i| f32::from(s.code(i))).collect();
            push(
                SliceMeta {
                    name: format!("{}.{CODES}", p.name),
                    global_shape: p.global_shape.clone(),
                    offsets: p.shard_start.clone(),
                    shape: p.shard_shape.clone(),
                    elements: 0..p.len,
                },
                codes,
            );
            if tp_rank != 0 {
                continue;
            }
            let st = &s.state;
            let values = [
                st.codes.iter().map(|&c| f32::from(c)).collect(),
                st.absmax2.clone(),
                vec![st.offset],
            ];
            for (suffix, v) in STATE.iter().zip(values) {
                let n = v.len();
                push(
                    SliceMeta {
                        name: format!("{}.{suffix}", p.name),
                        global_shape: vec![n],
                        offsets: vec![0],
                        shape: vec![n],
                        elements: 0..n,
                    },
                    v,
                );
            }
        }
    }
    out
}

/// The NF4 weights' dequantized shards, as `(box, values)` (what the forward computes with),
/// for the run's report.
pub(super) fn dequantized(model: &StageModel) -> Result<Vec<(ParamInfo, Vec<f32>)>, RunError> {
    let mut out = Vec::new();
    for w in model.nf4_weights() {
        let all = w.dequantize()?;
        let mut at = 0;
        for p in &w.parts {
            let info = ParamInfo {
                offset: 0,
                ..p.clone()
            };
            out.push((info, all[at..at + p.len].to_vec()));
            at += p.len;
        }
    }
    Ok(out)
}
