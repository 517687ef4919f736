//! The measurement `scripts/calibrate_gpu.py` prints (schema `tessera-gpu-calibration/1`), read
//! with an error that names the file and the field for anything missing or out of range.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub const SCHEMA: &str = "tessera-gpu-calibration/1";

/// One bf16 GEMM: `m × k` times `k × n`, seconds per call.
pub struct Gemm {
    pub m: f64,
    pub k: f64,
    pub n: f64,
    pub seconds: f64,
}

/// One causal SDPA configuration: seconds per forward and per forward+backward call.
pub struct Attention {
    pub b: f64,
    pub heads: f64,
    pub seq: f64,
    pub dhead: f64,
    pub fwd_bwd_seconds: f64,
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
    pub gemm: Vec<Gemm>,
    pub attention: Vec<Attention>,
    pub elementwise: Vec<Elementwise>,
    /// Tiny eager ops with autograd: how many (forward+backward each) and their wall seconds.
    pub host_ops: f64,
    pub host_seconds: f64,
    pub host_what: String,
    pub loss: Vec<Loss>,
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
    match v.get("schema").and_then(Value::as_str) {
        Some(SCHEMA) => {}
        other => bail!(
            "{origin}: field `schema`: expected \"{SCHEMA}\", found {}\n  fix: measure again with this version's scripts/calibrate_gpu.py",
            other.map_or("nothing".to_string(), |s| format!("\"{s}\""))
        ),
    }
    let d = f.get(&v, "device")?;
    let device = format!(
        "{} (compute capability {}, PyTorch {}, CUDA {})",
        f.str(d, "device.name")?,
        f.str(d, "device.capability")?,
        f.str(d, "device.torch")?,
        f.str(d, "device.cuda")?
    );
    let gemm = f
        .list(&v, "gemm")?
        .map(|(p, r)| {
            Ok(Gemm {
                m: f.count(r, &p, "m")?,
                k: f.count(r, &p, "k")?,
                n: f.count(r, &p, "n")?,
                seconds: f.positive(r, &p, "seconds")?,
            })
        })
        .collect::<Result<_>>()?;
    let attention = f
        .list(&v, "attention")?
        .map(|(p, r)| {
            if r.get("causal").and_then(Value::as_bool) != Some(true) {
                bail!("{origin}: field `{p}.causal`: must be true (the cost model's flash attention is causal)");
            }
            Ok(Attention {
                b: f.count(r, &p, "b")?,
                heads: f.count(r, &p, "heads")?,
                seq: f.count(r, &p, "seq")?,
                dhead: f.count(r, &p, "dhead")?,
                fwd_bwd_seconds: f.positive(r, &p, "fwd_bwd_seconds")?,
            })
        })
        .collect::<Result<_>>()?;
    let elementwise = f
        .list(&v, "elementwise")?
        .map(|(p, r)| {
            Ok(Elementwise {
                op: f.str(r, &format!("{p}.op"))?,
                bytes: f.count(r, &p, "bytes")?,
                seconds: f.positive(r, &p, "seconds")?,
            })
        })
        .collect::<Result<_>>()?;
    let h = f.get(&v, "host_op")?;
    let loss = f
        .list(&v, "loss")?
        .map(|(p, r)| {
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
        gemm,
        attention,
        elementwise,
        host_ops: f.count(h, "host_op", "ops")?,
        host_seconds: f.positive(h, "host_op", "seconds")?,
        host_what: f.str(h, "host_op.what")?,
        loss,
    })
}

/// Field access with errors naming the file and the dotted field.
struct Fields<'a>(&'a str);

impl Fields<'_> {
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
