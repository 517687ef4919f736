//! Writing a checkpoint as an HF folder: one consolidated `model.safetensors` (f32, through
//! the `safetensors` crate) and `config.json`, written to a temporary folder beside the target
//! and renamed into place, so the target is either absent or whole.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::{config, family, mapping, Family, HfError, CONFIG, WEIGHTS};
use crate::checkpoint::Checkpoint;

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    pub family: Family,
    pub dir: PathBuf,
    pub tensors: usize,
    /// Elements of every stored tensor.
    pub params: u64,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
}

/// One HF tensor, ready to store.
pub(super) struct Out {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// Writes checkpoint `ck` to the folder `out` (which must not exist, or be empty). A LoRA
/// checkpoint is refused: the base alone would drop what was trained, so the caller chooses
/// [`export_merged`](super::export_merged) or [`export_peft`](super::export_peft).
pub fn export(ck: &Checkpoint, out: &Path) -> Result<ExportSummary, HfError> {
    refuse_nf4(ck)?;
    if ck.index().lora.is_some() {
        return Err(HfError::Invalid {
            path: ck.dir().display().to_string(),
            problem: "holds LoRA adapters on a frozen base; the base alone would leave out what the run trained".into(),
            fix: "pass --merge to write the model with the adapters merged into its weights, or export the adapters with --to peft".into(),
        });
    }
    let globals = ck.params().map(|(n, s, v)| (n, (s, v))).collect();
    export_globals(ck, &globals, out)
}

/// A Tessera global tensor: shape and values.
pub(super) type Tensor<'a> = (&'a [usize], &'a [f32]);

/// Tessera's global tensors by name.
pub(super) type Globals<'a> = BTreeMap<&'a str, Tensor<'a>>;

/// Writes `globals` (checkpoint `ck`'s tensors, or tensors made from them) as `ck`'s model in
/// HF's layout to the folder `out`.
pub(super) fn export_globals(
    ck: &Checkpoint,
    globals: &Globals,
    out: &Path,
) -> Result<ExportSummary, HfError> {
    let a = &ck.index().model;
    let fam = family(a)?;
    check_target(out)?;
    refuse_nf4(ck)?;
    let damaged = damaged(ck);
    let vocab = a.vocab as usize;
    let mut used = BTreeSet::new();
    let mut tensors = Vec::new();
    for m in mapping(a, fam) {
        let mut rows = 0;
        let mut cols = None;
        let mut values = Vec::new();
        for name in &m.ours {
            let (shape, v) = globals.get(name.as_str()).ok_or_else(|| {
                damaged(format!(
                    "holds no tensor {name}, which {} needs for {}",
                    fam.class(),
                    m.hf
                ))
            })?;
            used.insert(name.clone());
            let r = if m.vocab {
                vocab.min(shape[0])
            } else {
                shape[0]
            };
            let c: usize = shape[1..].iter().product();
            if m.vocab && shape[0] < vocab || cols.is_some_and(|cc| cc != c) {
                return Err(damaged(format!(
                    "{name} has shape {shape:?}, which does not fit {}",
                    m.hf
                )));
            }
            cols = Some(c);
            rows += r;
            values.extend_from_slice(&v[..r * c]);
        }
        let cols = cols.unwrap_or(1);
        let one_d = globals
            .get(m.ours[0].as_str())
            .is_some_and(|(s, _)| s.len() == 1);
        let (shape, values) = match (m.conv1d, one_d) {
            (_, true) => (vec![rows], values),
            (false, false) => (vec![rows, cols], values),
            (true, false) => (vec![cols, rows], transpose(&values, rows, cols)),
        };
        tensors.push(Out {
            name: m.hf,
            shape,
            values,
        });
    }
    if let Some(extra) = globals.keys().find(|n| !used.contains(**n)) {
        return Err(HfError::Inexpressible {
            field: "architecture".into(),
            value: format!("a model with tensor {extra}"),
            why: format!("{} has no place for it", fam.class()),
            fix: "export a model of the GPT-2 or Llama shape".into(),
        });
    }
    let max_positions = ck.index().training.seq_len;
    let cfg = config(a, fam, max_positions);
    write_folder(out, (WEIGHTS, &tensors), (CONFIG, &cfg)).map(|bytes| ExportSummary {
        family: fam,
        dir: out.to_path_buf(),
        tensors: tensors.len(),
        params: tensors.iter().map(|t| t.values.len() as u64).sum(),
        bytes,
    })
}

/// The error of a checkpoint whose tensors do not fit its own model.
pub(super) fn damaged(ck: &Checkpoint) -> impl Fn(String) -> HfError {
    let index = ck.dir().join(crate::checkpoint::INDEX);
    move |problem| HfError::Invalid {
        path: index.display().to_string(),
        problem,
        fix: "export a checkpoint written by `tessera run --save-dir`".into(),
    }
}

/// `(rows, cols)` row-major to `(cols, rows)`.
pub(crate) fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Refuses a target that is a file or a folder with anything in it.
pub(super) fn check_target(out: &Path) -> Result<(), HfError> {
    let refuse = |problem: &str| {
        Err(HfError::Invalid {
            path: out.display().to_string(),
            problem: problem.into(),
            fix: "name a new folder (it is created), or remove this one first".into(),
        })
    };
    match fs::symlink_metadata(out) {
        Err(_) => Ok(()),
        Ok(m) if !m.is_dir() => refuse("exists and is not a folder"),
        Ok(_) => match fs::read_dir(out).map(|mut d| d.next().is_some()) {
            Ok(false) => Ok(()),
            Ok(true) => refuse("is a folder that is not empty; an export never overwrites"),
            Err(e) => Err(HfError::io(out, "list", e)),
        },
    }
}

/// Writes the folder atomically: `weights` is a safetensors file's name and its tensors,
/// `config` a JSON file's name and content; returns the safetensors file's size.
pub(super) fn write_folder(
    out: &Path,
    weights: (&str, &[Out]),
    config: (&str, &serde_json::Value),
) -> Result<u64, HfError> {
    let (weights, tensors) = weights;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = out
        .file_name()
        .map_or("export".into(), |n| n.to_string_lossy().into_owned());
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    let result = (|| {
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).map_err(|e| HfError::io(&tmp, "create the folder", e))?;
        let blobs: Vec<Vec<u8>> = tensors
            .iter()
            .map(|t| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views = tensors
            .iter()
            .zip(&blobs)
            .map(|(t, b)| {
                TensorView::new(Dtype::F32, t.shape.clone(), b).map(|v| (t.name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| HfError::Invalid {
                path: tmp.display().to_string(),
                problem: format!("cannot describe a tensor: {e}"),
                fix: "report this as a bug".into(),
            })?;
        let meta = [("format".to_string(), "pt".to_string())];
        let weights = tmp.join(weights);
        let bytes = safetensors::tensor::serialize(views, Some(meta.into_iter().collect()))
            .map_err(|e| HfError::Invalid {
                path: weights.display().to_string(),
                problem: format!("cannot serialise: {e}"),
                fix: "report this as a bug".into(),
            })?;
        write_synced(&weights, &bytes)?;
        let mut text = serde_json::to_string_pretty(config.1).expect("a JSON value serialises");
        text.push('\n');
        write_synced(&tmp.join(config.0), text.as_bytes())?;
        fsync_dir(&tmp)?;
        // Replaces nothing but an empty folder (`check_target`); rename(2) does that in one step.
        fs::rename(&tmp, out)
            .map_err(|e| HfError::io(out, "rename the finished folder into", e))?;
        fsync_dir(&parent)?;
        Ok(bytes.len() as u64)
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), HfError> {
    let mut f = fs::File::create(path).map_err(|e| HfError::io(path, "create", e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| HfError::io(path, "write", e))
}

fn fsync_dir(dir: &Path) -> Result<(), HfError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| HfError::io(dir, "fsync the folder", e))
}

/// A QLoRA checkpoint has no Hugging Face weights to write: its base is NF4.
pub(super) fn refuse_nf4(ck: &Checkpoint) -> Result<(), HfError> {
    if ck.index().nf4_base {
        // Writing the dequantized base would pass it off as the model that was fine-tuned
        // from; the NF4 codes are not a Hugging Face checkpoint either.
        return Err(HfError::Invalid {
            path: ck.dir().join(crate::checkpoint::INDEX).display().to_string(),
            problem: "the checkpoint is a QLoRA run's: its base is stored in NF4 (nf4_base), not as the f32 weights a Hugging Face model holds".into(),
            fix: "export the adapters with --to peft and apply them to the model the QLoRA run started from (its --init-from folder), or fine-tune with --method lora".into(),
        });
    }
    Ok(())
}
