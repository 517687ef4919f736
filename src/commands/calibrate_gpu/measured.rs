//! The measurement `scripts/calibrate_gpu.py` prints (schema `tessera-gpu-calibration/1`), read
//! with an error that names the file and the field for anything missing or out of range.
//!
//! Each list holds one kind of kernel and nothing else: an entry may carry only its kind's
//! fields (a GEMM's `m`, `k`, `n`, `dtype`, `seconds`; an element-wise kernel's `op`, `bytes`,
//! `seconds`; …), and a label (`op`, `kind`) that names another kind of kernel (`gelu` in
//! `gemm`, `matmul` in `elementwise`) is refused, as is a GEMM with a dimension below
//! [`MIN_GEMM_DIM`] (a matrix-vector or outer product: memory-bound, not a fraction of the
//! tensor cores' peak). Whether the measurement fits the spec it calibrates (the device, the
//! dtype) is `super::check_fits`'s question.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub const SCHEMA: &str = "tessera-gpu-calibration/1";

/// The smallest GEMM dimension read: below the tensor cores' 16-wide tile cuBLAS runs a
/// matrix-vector (or element-wise outer) product, bound by memory, not by `peak_tflops`.
pub const MIN_GEMM_DIM: f64 = 16.0;

/// One GEMM: `m × k` times `k × n` in `dtype`, seconds per call.
pub struct Gemm {
    pub m: f64,
    pub k: f64,
    pub n: f64,
    /// Normalised (`bf16`, `fp16`, `fp32`, `fp8`, …; see [`dtype`]).
    pub dtype: String,
    pub seconds: f64,
}

/// One causal SDPA configuration: seconds per forward and per forward+backward call.
pub struct Attention {
    pub b: f64,
    pub heads: f64,
    pub seq: f64,
    pub dhead: f64,
    pub fwd_bwd_seconds: f64,
    /// Where the entry says (the script's are bf16 and do not say).
    pub dtype: Option<String>,
}

/// One element-wise kernel: bytes read and written, seconds per call.
pub struct Elementwise {
    pub op: String,
    pub bytes: f64,
    pub seconds: f64,
}

/// One loss kernel variant, forward+backward on `n × vocab` logits.
pub struct Loss {
    pub variant: String,
    pub n: f64,
    pub vocab: f64,
    pub dtype: String,
    pub seconds: f64,
}

pub struct Measurement {
    /// "NAME (compute capability C, PyTorch T, CUDA V)".
    pub device: String,
    /// `device.name`, as PyTorch names the GPU ("NVIDIA H100 80GB HBM3").
    pub device_name: String,
    /// `device.memory_gib`, where given.
    pub device_memory_gib: Option<f64>,
    pub gemm: Vec<Gemm>,
    /// FP8 GEMMs (`gemm_fp8`, where the GPU has FP8 tensor cores): every entry's dtype fp8.
    pub gemm_fp8: Vec<Gemm>,
    pub attention: Vec<Attention>,
    pub elementwise: Vec<Elementwise>,
    /// Tiny eager ops with autograd: how many (forward+backward each) and their wall seconds.
    pub host_ops: f64,
    pub host_seconds: f64,
    pub host_what: String,
    /// The forward's part of the host op split into dispatch and launch, where the script
    /// measured it: the forwards' wall seconds alone (`host_ops` ops) and the median host
    /// seconds of one `cudaLaunchKernel` in a profiled chain.
    pub host_split: Option<HostSplit>,
    pub loss: Vec<Loss>,
}

/// `host_op.forward_seconds` and `host_op.launch_seconds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostSplit {
    pub forward_seconds: f64,
    pub launch_seconds: f64,
}

/// Reads `path`'s measurement; `origin` names it in errors.
pub fn read(path: &Path) -> Result<Measurement> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow!("{}: cannot read the measurement: {e}", path.display()))?;
    parse(&text, &path.display().to_string())
}

/// Parses a measurement; every error starts with `origin` and names the field.
pub fn parse(text: &str, origin: &str) -> Result<Measurement> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        anyhow!("{origin}: not a JSON document ({e})\n  fix: pass the standard output of scripts/calibrate_gpu.py")
    })?;
    let f = Fields(origin);
    f.only(&v, "", TOP_KEYS, "a measurement")?;
    match v.get("schema").and_then(Value::as_str) {
        Some(SCHEMA) => {}
        other => bail!(
            "{origin}: field `schema`: expected \"{SCHEMA}\", found {}\n  fix: measure again with this version's scripts/calibrate_gpu.py",
            other.map_or("nothing".to_string(), |s| format!("\"{s}\""))
        ),
    }
    let d = f.get(&v, "device")?;
    f.only(d, "device", DEVICE_KEYS, "the device")?;
    let device_name = f.str(d, "device.name")?;
    let device_memory_gib = match d.get("memory_gib") {
        Some(_) => Some(f.positive(d, "device", "memory_gib")?),
        None => None,
    };
    let device = format!(
        "{} (compute capability {}, PyTorch {}, CUDA {})",
        device_name,
        f.str(d, "device.capability")?,
        f.str(d, "device.torch")?,
        f.str(d, "device.cuda")?
    );
    let gemm = gemms(&f, &v, "gemm")?;
    let gemm_fp8 = match v.get("gemm_fp8") {
        None => Vec::new(),
        Some(_) => {
            let g = gemms(&f, &v, "gemm_fp8")?;
            if let Some((i, x)) = g.iter().enumerate().find(|(_, x)| x.dtype != "fp8") {
                bail!(
                    "{origin}: field `gemm_fp8[{i}].dtype` = \"{}\": `gemm_fp8` holds FP8 GEMMs only\n  fix: move the entry to `gemm`, or drop it",
                    x.dtype
                );
            }
            g
        }
    };
    let attention = f
        .list(&v, "attention")?
        .map(|(p, r)| {
            f.entry(r, &p, Kind::Attention)?;
            if r.get("causal").and_then(Value::as_bool) != Some(true) {
                bail!("{origin}: field `{p}.causal`: must be true (the cost model's flash attention is causal)");
            }
            Ok(Attention {
                b: f.count(r, &p, "b")?,
                heads: f.count(r, &p, "heads")?,
                seq: f.count(r, &p, "seq")?,
                dhead: f.count(r, &p, "dhead")?,
                fwd_bwd_seconds: f.positive(r, &p, "fwd_bwd_seconds")?,
                dtype: match r.get("dtype") {
                    Some(_) => Some(dtype(&f.str(r, &format!("{p}.dtype"))?)),
                    None => None,
                },
            })
        })
        .collect::<Result<_>>()?;
    let elementwise = f
        .list(&v, "elementwise")?
        .map(|(p, r)| {
            f.entry(r, &p, Kind::Elementwise)?;
            Ok(Elementwise {
                op: f.str(r, &format!("{p}.op"))?,
                bytes: f.count(r, &p, "bytes")?,
                seconds: f.positive(r, &p, "seconds")?,
            })
        })
        .collect::<Result<_>>()?;
    let h = f.get(&v, "host_op")?;
    f.only(h, "host_op", HOST_OP_KEYS, "the host's per-op cost")?;
    let loss = f
        .list(&v, "loss")?
        .map(|(p, r)| {
            f.entry(r, &p, Kind::Loss)?;
            Ok(Loss {
                variant: f.str(r, &format!("{p}.variant"))?,
                n: f.count(r, &p, "n")?,
                vocab: f.count(r, &p, "vocab")?,
                dtype: f.str(r, &format!("{p}.dtype"))?,
                seconds: f.positive(r, &p, "seconds")?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Measurement {
        device,
        device_name,
        device_memory_gib,
        gemm,
        gemm_fp8,
        attention,
        elementwise,
        host_ops: f.count(h, "host_op", "ops")?,
        host_seconds: f.positive(h, "host_op", "seconds")?,
        host_what: f.str(h, "host_op.what")?,
        host_split: match (h.get("forward_seconds"), h.get("launch_seconds")) {
            (None, None) => None,
            (Some(_), Some(_)) => Some(HostSplit {
                forward_seconds: f.positive(h, "host_op", "forward_seconds")?,
                launch_seconds: f.positive(h, "host_op", "launch_seconds")?,
            }),
            _ => bail!(
                "{origin}: field `host_op`: forward_seconds and launch_seconds come together, one is missing\n  fix: measure again with this version's scripts/calibrate_gpu.py, or remove both"
            ),
        },
        loss,
    })
}

/// The GEMMs of the list `name` (`gemm`, `gemm_fp8`), each checked as a GEMM.
fn gemms(f: &Fields, v: &Value, name: &'static str) -> Result<Vec<Gemm>> {
    let origin = f.0;
    f.list(v, name)?
        .map(|(p, r)| {
            f.entry(r, &p, Kind::Gemm)?;
            let g = Gemm {
                m: f.count(r, &p, "m")?,
                k: f.count(r, &p, "k")?,
                n: f.count(r, &p, "n")?,
                dtype: dtype(&f.str(r, &format!("{p}.dtype"))?),
                seconds: f.positive(r, &p, "seconds")?,
            };
            for (key, x) in [("m", g.m), ("k", g.k), ("n", g.n)] {
                if x < MIN_GEMM_DIM {
                    bail!(
                        "{origin}: field `{p}.{key}`: {x} is not a GEMM the tensor cores run ({} × {} × {}): below {MIN_GEMM_DIM} it is a matrix-vector or element-wise product, bound by memory, not by peak_tflops\n  fix: drop the entry (an element-wise kernel belongs in `elementwise`, with its bytes), or measure GEMMs with every dimension {MIN_GEMM_DIM} or more",
                        g.m, g.k, g.n
                    );
                }
            }
            Ok(g)
        })
        .collect::<Result<_>>()
}

const TOP_KEYS: &[&str] = &[
    "schema",
    "provenance",
    "device",
    "gemm",
    "gemm_fp8",
    "attention",
    "elementwise",
    "host_op",
    "loss",
];
const DEVICE_KEYS: &[&str] = &["name", "capability", "memory_gib", "torch", "cuda"];
const HOST_OP_KEYS: &[&str] = &[
    "what",
    "ops",
    "seconds",
    "forward_seconds",
    "launch_seconds",
];

/// The kinds of kernel a measurement lists, one list each.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Kind {
    Gemm,
    Attention,
    Elementwise,
    Loss,
}

impl Kind {
    fn list(self) -> &'static str {
        match self {
            Kind::Gemm => "gemm",
            Kind::Attention => "attention",
            Kind::Elementwise => "elementwise",
            Kind::Loss => "loss",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Gemm => "a GEMM",
            Kind::Attention => "an attention kernel",
            Kind::Elementwise => "an element-wise kernel",
            Kind::Loss => "a loss kernel",
        }
    }

    /// The fields an entry of this kind may carry (`op` and `kind` are labels).
    fn keys(self) -> &'static [&'static str] {
        match self {
            Kind::Gemm => &["m", "k", "n", "dtype", "seconds", "op", "kind"],
            Kind::Attention => &[
                "b",
                "heads",
                "seq",
                "dhead",
                "causal",
                "fwd_seconds",
                "fwd_bwd_seconds",
                "dtype",
                "op",
                "kind",
            ],
            Kind::Elementwise => &["op", "bytes", "seconds", "dtype", "kind"],
            Kind::Loss => &["variant", "n", "vocab", "dtype", "seconds", "kind"],
        }
    }

    /// The kind whose fields include `key` (for saying whose field a stray one is).
    fn owning(key: &str) -> Option<Kind> {
        [Kind::Gemm, Kind::Attention, Kind::Elementwise, Kind::Loss]
            .into_iter()
            .find(|k| !["op", "kind", "dtype", "seconds"].contains(&key) && k.keys().contains(&key))
    }
}

/// The kind of kernel a label names (`"gelu"`, `"F.layer_norm"`, `"qkv"`, `"sdpa"`), where it
/// names one this module knows.
pub fn kind_of(label: &str) -> Option<Kind> {
    let lower = label.trim().to_lowercase();
    let mut rest = lower.as_str();
    for prefix in ["torch.", "nn.", "functional.", "f."] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let l: String = rest.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    let l = l.as_str();
    const GEMM_EXACT: &[&str] = &[
        "mm", "bmm", "addmm", "linear", "qkv", "proj", "outproj", "fc1", "fc2", "lmhead", "gemm",
        "matmul", "gemv",
    ];
    const GEMM_PART: &[&str] = &["matmul", "gemm", "cublas"];
    const ATTENTION_PART: &[&str] = &["sdpa", "attention", "attn", "flash"];
    const LOSS_PART: &[&str] = &["crossentropy", "loss", "nll"];
    const ELEMENTWISE_EXACT: &[&str] = &[
        "copy", "add", "mul", "sub", "div", "exp", "tanh", "relu", "bias", "residual", "fill",
        "memcpy", "dropout", "sigmoid", "norm", "adam", "adamw", "cast",
    ];
    const ELEMENTWISE_PART: &[&str] = &[
        "gelu",
        "silu",
        "swiglu",
        "geglu",
        "layernorm",
        "rmsnorm",
        "softmax",
        "elementwise",
        "pointwise",
        "rope",
        "rotary",
        "dropout",
        "memcpy",
    ];
    let has = |parts: &[&str]| parts.iter().any(|p| l.contains(p));
    if GEMM_EXACT.contains(&l) || has(GEMM_PART) {
        Some(Kind::Gemm)
    } else if has(ATTENTION_PART) {
        Some(Kind::Attention)
    } else if has(LOSS_PART) {
        Some(Kind::Loss)
    } else if ELEMENTWISE_EXACT.contains(&l) || has(ELEMENTWISE_PART) {
        Some(Kind::Elementwise)
    } else {
        None
    }
}

/// A dtype's usual name: `bfloat16` and `torch.bfloat16` are `bf16`, `float32` is `fp32`, …
pub fn dtype(s: &str) -> String {
    let l = s.trim().to_lowercase();
    let l = l.strip_prefix("torch.").unwrap_or(&l);
    match l {
        "bfloat16" | "bf16" => "bf16".into(),
        "float16" | "half" | "fp16" => "fp16".into(),
        "float32" | "float" | "fp32" | "f32" => "fp32".into(),
        "float64" | "double" | "fp64" => "fp64".into(),
        x if x.starts_with("float8")
            || x.starts_with("fp8")
            || x.starts_with("e4m3")
            || x.starts_with("e5m2") =>
        {
            "fp8".into()
        }
        x => x.to_string(),
    }
}

/// Field access with errors naming the file and the dotted field.
struct Fields<'a>(&'a str);

impl Fields<'_> {
    /// Refuses any key of object `v` (at `at`) that is not in `keys`.
    fn only(&self, v: &Value, at: &str, keys: &[&str], what: &str) -> Result<()> {
        let Some(obj) = v.as_object() else {
            bail!(
                "{}: field `{}`: must be an object, found {v}\n  fix: pass the standard output of scripts/calibrate_gpu.py",
                self.0,
                if at.is_empty() { "-" } else { at }
            );
        };
        for (k, x) in obj {
            if !keys.contains(&k.as_str()) {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                bail!(
                    "{}: field `{path}` = {x}: not a field of {what} in {SCHEMA} (it has {})\n  fix: remove it, or measure again with this version's scripts/calibrate_gpu.py",
                    self.0,
                    keys.join(", ")
                );
            }
        }
        Ok(())
    }

    /// Checks that list entry `r` at `at` is a measurement of `kind`: only its kind's fields,
    /// and labels (`op`, `kind`) that name no other kind of kernel.
    fn entry(&self, r: &Value, at: &str, kind: Kind) -> Result<()> {
        let Some(obj) = r.as_object() else {
            bail!(
                "{}: field `{at}`: must be an object, found {r}\n  fix: pass the standard output of scripts/calibrate_gpu.py",
                self.0
            );
        };
        for (k, x) in obj {
            if kind.keys().contains(&k.as_str()) {
                continue;
            }
            let whose = match Kind::owning(k) {
                Some(other) => format!(", it is {}'s (`{}`)", other.what(), other.list()),
                None => String::new(),
            };
            bail!(
                "{}: field `{at}.{k}` = {x}: {} in `{}` has no such field{whose}\n  fix: move an entry of another kind of kernel to its own list, or drop the field; {}'s fields are {}",
                self.0,
                kind.what(),
                kind.list(),
                kind.what(),
                kind.keys().join(", ")
            );
        }
        for label in ["op", "kind"] {
            let Some(v) = r.get(label) else { continue };
            let Some(name) = v.as_str() else {
                bail!(
                    "{}: field `{at}.{label}`: must be a string, found {v}",
                    self.0
                );
            };
            let found = kind_of(name);
            let wrong = match found {
                Some(k) => k != kind,
                // A `kind` must name the list's kind; an `op` may be any other label (a
                // layer's GEMM is `qkv`, `fc1`, …).
                None => label == "kind" && name != kind.list(),
            };
            if wrong {
                let is = found.map_or("no kind of kernel this schema has".to_string(), |k| {
                    format!("{} (whose list is `{}`)", k.what(), k.list())
                });
                bail!(
                    "{}: field `{at}.{label}` = \"{name}\": names {is}, not {}, the only kind `{}` holds\n  fix: move the entry to the list of its kind, or drop it: its time would set {}",
                    self.0,
                    kind.what(),
                    kind.list(),
                    match kind {
                        Kind::Gemm => "matmul_efficiency",
                        Kind::Attention => "flash_attention_efficiency",
                        Kind::Elementwise => "memory_efficiency",
                        Kind::Loss => "the loss comments",
                    }
                );
            }
        }
        Ok(())
    }

    fn get<'v>(&self, v: &'v Value, field: &str) -> Result<&'v Value> {
        v.get(field).ok_or_else(|| {
            anyhow!(
                "{}: field `{field}` is missing\n  fix: pass the standard output of scripts/calibrate_gpu.py",
                self.0
            )
        })
    }

    /// A non-empty array's elements with their dotted paths (`gemm[3]`).
    fn list<'v>(
        &self,
        v: &'v Value,
        field: &'v str,
    ) -> Result<impl Iterator<Item = (String, &'v Value)>> {
        match self.get(v, field)?.as_array() {
            Some(a) if !a.is_empty() => Ok(a
                .iter()
                .enumerate()
                .map(move |(i, r)| (format!("{field}[{i}]"), r))),
            _ => bail!(
                "{}: field `{field}`: must be a non-empty list of measurements",
                self.0
            ),
        }
    }

    /// The string at `dotted`'s last key.
    fn str(&self, v: &Value, dotted: &str) -> Result<String> {
        let key = dotted.rsplit('.').next().unwrap_or(dotted);
        match v.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => bail!(
                "{}: field `{dotted}`: must be a string, found {other}",
                self.0
            ),
            None => bail!("{}: field `{dotted}` is missing", self.0),
        }
    }

    /// A finite number above zero.
    fn positive(&self, v: &Value, at: &str, key: &str) -> Result<f64> {
        match v.get(key) {
            Some(x) => match x.as_f64() {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                _ => bail!(
                    "{}: field `{at}.{key}`: must be a number above 0, found {x}",
                    self.0
                ),
            },
            None => bail!("{}: field `{at}.{key}` is missing", self.0),
        }
    }

    /// A whole number of at least 1.
    fn count(&self, v: &Value, at: &str, key: &str) -> Result<f64> {
        let x = self.positive(v, at, key)?;
        if x.fract() != 0.0 {
            bail!(
                "{}: field `{at}.{key}`: must be a whole number, found {x}",
                self.0
            );
        }
        Ok(x)
    }
}
