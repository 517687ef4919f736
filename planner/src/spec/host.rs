//! The cluster spec's `[host]` table: each node's host memory, its host↔device link and its
//! NVMe, and how fast its CPUs run AdamW — the second memory tier that offload uses
//! (`layout::Offload`, Calculon's offload model: a tier with its own capacity and bandwidth).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::fields::{Field, Fields, Num};
use crate::error::Diagnostic;

/// One node's host tier. Every value is per node except `link_gbps` (per GPU); 0 means the
/// spec does not state it, and then nothing can be offloaded to that part.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Host DRAM per node (GiB).
    pub memory_gib: f64,
    /// Host↔device bandwidth of each GPU, GB/s in one direction (PCIe is full duplex: a copy
    /// down and a copy up run at once), as pinned copies reach it.
    pub link_gbps: f64,
    /// Node-local NVMe: GB/s the node's drives read or write together.
    pub nvme_gbps: f64,
    /// Node-local NVMe capacity (GiB).
    pub nvme_gib: f64,
    /// Billions of parameters per second the node's CPUs update with AdamW (fp32 master,
    /// moments and gradient), all its cores together (DeepSpeed's CPU-Adam, or the runtime's
    /// own AdamW as `tessera calibrate --host` measures it).
    pub adamw_gparams_per_s: f64,
}

impl Host {
    /// Whether the spec states the tier at all (a `[host]` table with its memory).
    pub fn stated(&self) -> bool {
        self.memory_gib > 0.0
    }

    pub fn memory_bytes(&self) -> f64 {
        self.memory_gib * crate::units::GIB
    }

    pub fn nvme_bytes(&self) -> f64 {
        self.nvme_gib * crate::units::GIB
    }

    /// The `[host]` table as `tessera calibrate` writes it.
    pub fn toml_table(&self, comment: &str) -> String {
        format!(
            "[host]  # {comment}\nmemory_gib = {}\nlink_gbps = {}\nnvme_gbps = {}\nnvme_gib = {}\nadamw_gparams_per_s = {}\n",
            self.memory_gib, self.link_gbps, self.nvme_gbps, self.nvme_gib, self.adamw_gparams_per_s
        )
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHost {
    memory_gib: Field<Num>,
    link_gbps: Field<Num>,
    nvme_gbps: Field<Num>,
    nvme_gib: Field<Num>,
    adamw_gparams_per_s: Field<Num>,
}

/// Resolves `[host]`: every key optional, ≥ 0, 0 when absent. A table that gives NVMe
/// bandwidth without capacity (or the reverse) is refused: half a tier cannot be planned.
pub(super) fn host(f: &Fields, raw: Option<RawHost>) -> Result<Host, Diagnostic> {
    const T: &str = "host";
    let h = raw.unwrap_or_default();
    let get = |key: &str, v: &Field<Num>| -> Result<f64, Diagnostic> {
        Ok(f.opt_nonneg_num(T, key, v)?.unwrap_or(0.0))
    };
    let host = Host {
        memory_gib: get("memory_gib", &h.memory_gib)?,
        link_gbps: get("link_gbps", &h.link_gbps)?,
        nvme_gbps: get("nvme_gbps", &h.nvme_gbps)?,
        nvme_gib: get("nvme_gib", &h.nvme_gib)?,
        adamw_gparams_per_s: get("adamw_gparams_per_s", &h.adamw_gparams_per_s)?,
    };
    let pairs = [
        (
            "nvme_gib",
            &h.nvme_gib,
            host.nvme_gib,
            "nvme_gbps",
            host.nvme_gbps,
        ),
        (
            "nvme_gbps",
            &h.nvme_gbps,
            host.nvme_gbps,
            "nvme_gib",
            host.nvme_gib,
        ),
    ];
    for (key, v, x, other, y) in pairs {
        if x > 0.0 && y == 0.0 {
            return Err(f.err(
                v.as_ref().map(|s| s.span()),
                &format!("host.{key}"),
                format!("[host] gives {key} = {x} but no {other}: the NVMe tier needs both its capacity and its bandwidth"),
                format!("add {other} under [host] (or remove {key})"),
            ));
        }
    }
    if host.stated() {
        for (key, v, x) in [
            ("link_gbps", &h.link_gbps, host.link_gbps),
            (
                "adamw_gparams_per_s",
                &h.adamw_gparams_per_s,
                host.adamw_gparams_per_s,
            ),
        ] {
            if x == 0.0 {
                let d = f.err(
                    v.as_ref().map(|s| s.span()),
                    &format!("host.{key}"),
                    format!("[host] gives memory_gib but {key} is missing or 0: offload to host memory is costed by it"),
                    format!("add {key} under [host] (specs/README.md; `tessera calibrate --host` measures it)"),
                );
                // A missing key: point at the table it belongs in.
                return Err(match v {
                    Some(_) => d,
                    None => d.at(f.src.table_header("host")),
                });
            }
        }
    }
    Ok(host)
}
