//! The model's forward alone, on one rank: logits for given token ids from given weights. The
//! same layers and order as a training rank's forward (`rank.rs`), on the whole model (TP 1, one
//! stage), so that an exported checkpoint can be compared with another implementation's
//! forward (scripts/check_hf_export.py) and a converted model can be checked against ours.

use tessera_planner::finetune::Lora;
use tessera_planner::model::Architecture;

use super::model::StageModel;
use super::RunError;
use crate::backend::{Backend, Cpu, Storage};
use crate::comm::LocalComm;
use crate::layers::{BlockActs, BlockWorkspace, Dims, Recompute};
use crate::params::ParamLayout;

/// Logits `(b·t, vocab)` (the real vocabulary, no padding rows) of `b = tokens.len() / t`
/// sequences of `t` tokens under the model `a`, whose flat parameter buffer (for the
/// single-rank layout it is handed) `params` fills.
pub fn forward_logits<P: AsRef<[f32]>>(
    a: &Architecture,
    t: usize,
    tokens: &[u32],
    params: impl FnOnce(&ParamLayout) -> Result<P, RunError>,
) -> Result<Vec<f32>, RunError> {
    forward_logits_with(a, None, t, tokens, params)
}

/// [`forward_logits`] through the LoRA adapters `lora` on the model's linears (a LoRA
/// checkpoint's model: the layout holds the frozen base and the adapters), as training runs
/// them: what PEFT's `PeftModel` computes on the base.
pub fn forward_logits_with<P: AsRef<[f32]>>(
    a: &Architecture,
    lora: Option<&Lora>,
    t: usize,
    tokens: &[u32],
    params: impl FnOnce(&ParamLayout) -> Result<P, RunError>,
) -> Result<Vec<f32>, RunError> {
    let bad = |what: String| RunError::Unsupported {
        what,
        fix: "pass whole sequences of ids below the vocabulary size".into(),
    };
    if t == 0 || tokens.is_empty() || !tokens.len().is_multiple_of(t) {
        return Err(bad(format!(
            "{} token ids are not a whole number of sequences of {t}",
            tokens.len()
        )));
    }
    if let Some(id) = tokens.iter().find(|&&id| u64::from(id) >= a.vocab) {
        return Err(bad(format!(
            "token id {id} is not below the vocabulary size {}",
            a.vocab
        )));
    }
    if let Some(w) = a.sliding_window.filter(|w| (t as u64) > *w) {
        return Err(RunError::Unsupported {
            what: format!("sequences of {t} tokens under sliding-window attention of {w} positions (model.sliding_window): the runtime has full causal attention only, the same computation only within the window"),
            fix: format!("pass --seq-len {w} or less"),
        });
    }
    let model = StageModel::whole_with(a, lora)?;
    let flat = params(&model.layout)?;
    let flat = flat.as_ref();
    if flat.len() != model.layout.len() {
        return Err(bad(format!(
            "{} parameters for a layout of {}",
            flat.len(),
            model.layout.len()
        )));
    }
    let be = Cpu;
    let comm = LocalComm::group(1).pop().expect("a group of one");
    let dims = Dims {
        b: tokens.len() / t,
        t,
    };
    let (n, c) = (dims.n(), model.cfg.hidden);
    let p = be.upload(Storage::F32, flat)?;
    let p = Cpu::view(&p);
    let (v, m) = (Cpu::view, Cpu::view_mut);
    let chunk = &model.chunks[0];
    let (Some(e), Some(head), Some(first_block)) =
        (&chunk.embedding, &chunk.head, chunk.blocks.first())
    else {
        return Err(bad("the model has no layers".into()));
    };
    let ids = be.ids(tokens.to_vec())?;
    let mut x = be.alloc(Storage::Bf16, n * c)?;
    e.wte.forward(&be, p, &ids, m(&mut x), &comm)?;
    if let Some(wpe) = &e.wpe {
        wpe.forward(&be, p, m(&mut x), t, 0)?;
    }
    let mut ws = BlockWorkspace::new(&be, first_block, dims)?;
    for blk in &chunk.blocks {
        let mut acts = BlockActs::new(&be, blk, dims, Recompute::None)?;
        let mut out = be.alloc(Storage::Bf16, n * c)?;
        blk.forward(&be, p, v(&x), m(&mut out), &mut acts, &mut ws, &comm)?;
        x = out;
    }
    let mut h = be.alloc(Storage::Bf16, n * c)?;
    let mut mean = be.alloc(Storage::F32, head.norm.mean_len(n))?;
    let mut rstd = be.alloc(Storage::F32, n)?;
    head.norm
        .forward(&be, p, v(&x), m(&mut h), m(&mut mean), m(&mut rstd))?;
    let mut logits = be.alloc(Storage::Bf16, n * model.vocab_real)?;
    head.proj.forward(&be, p, v(&h), m(&mut logits))?;
    Ok(be.download(v(&logits))?)
}
