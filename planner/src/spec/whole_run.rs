//! The cluster spec's tables about the whole run rather than one step: `[cost]` (the price of a
//! GPU-hour), `[reliability]` (how often a job of this cluster is interrupted, and how long a
//! restart takes) and `[storage]` (the shared filesystem checkpoints are written to). Each is
//! optional; `crate::whole_run` turns them into time, cost, interruptions and a checkpoint
//! cadence.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::fields::{Field, Fields, Num};
use crate::error::Diagnostic;

/// `[cost]`: what the cluster costs. No preset states a price (prices differ by provider,
/// contract and month): the user states theirs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Cost {
    /// US dollars per GPU-hour.
    pub usd_per_gpu_hour: f64,
}

/// `[reliability]`: the interruptions a synchronous job sees. One GPU's failure stops the whole
/// job (every rank waits on its collectives), so the job's interruption rate is the sum of its
/// parts' rates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Reliability {
    /// Mean GPU-hours between job-stopping interruptions, per GPU (hardware and the software
    /// around it, as published accounts count them): a job of N GPUs is interrupted every
    /// `gpu_mtbf_hours / N` hours on average.
    pub gpu_mtbf_hours: f64,
    /// Minutes from an interruption to training again: detection, rescheduling, loading the
    /// last checkpoint, warm-up.
    pub restart_minutes: f64,
    /// Spot or preemptible capacity: preemptions per node-hour (a spot instance is a node); 0
    /// for reserved capacity.
    #[serde(default)]
    pub preemptions_per_hour: f64,
}

/// `[storage]`: the checkpoint filesystem (a shared filesystem or object store, not the
/// node-local NVMe that offload uses).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Storage {
    /// GB/s one node writes to it, all its ranks together (`tessera calibrate --storage DIR`
    /// measures a folder's).
    pub write_gbps: f64,
}

impl Cost {
    /// The `[cost]` table, as a spec states it.
    pub fn toml_table(&self, comment: &str) -> String {
        format!(
            "[cost]  # {comment}\nusd_per_gpu_hour = {}\n",
            self.usd_per_gpu_hour
        )
    }
}

impl Reliability {
    /// The `[reliability]` table, as a spec states it.
    pub fn toml_table(&self, comment: &str) -> String {
        format!(
            "[reliability]  # {comment}\ngpu_mtbf_hours = {}\nrestart_minutes = {}\npreemptions_per_hour = {}\n",
            self.gpu_mtbf_hours, self.restart_minutes, self.preemptions_per_hour
        )
    }
}

impl Storage {
    /// The `[storage]` table as `tessera calibrate --storage` writes it.
    pub fn toml_table(&self, comment: &str) -> String {
        format!("[storage]  # {comment}\nwrite_gbps = {}\n", self.write_gbps)
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCost {
    usd_per_gpu_hour: Field<Num>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReliability {
    gpu_mtbf_hours: Field<Num>,
    restart_minutes: Field<Num>,
    preemptions_per_hour: Field<Num>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStorage {
    write_gbps: Field<Num>,
}

/// A required key of a table that is present: missing, it is blamed on the table's header.
fn required(
    f: &Fields,
    table: &str,
    key: &str,
    v: &Field<Num>,
    why: &str,
) -> Result<f64, Diagnostic> {
    match f.opt_pos_num(table, key, v)? {
        Some(x) => Ok(x),
        None => Err(f
            .err(
                None,
                &format!("{table}.{key}"),
                format!("[{table}] has no `{key}`: {why}"),
                format!("add `{key} = ...` under [{table}] (specs/README.md), or remove the table"),
            )
            .at(f.src.table_header(table))),
    }
}

pub(super) fn cost(f: &Fields, raw: Option<RawCost>) -> Result<Option<Cost>, Diagnostic> {
    raw.map(|r| {
        Ok(Cost {
            usd_per_gpu_hour: required(
                f,
                "cost",
                "usd_per_gpu_hour",
                &r.usd_per_gpu_hour,
                "the price of one GPU-hour, in US dollars",
            )?,
        })
    })
    .transpose()
}

pub(super) fn reliability(
    f: &Fields,
    raw: Option<RawReliability>,
) -> Result<Option<Reliability>, Diagnostic> {
    raw.map(|r| {
        let gpu_mtbf_hours = required(
            f,
            "reliability",
            "gpu_mtbf_hours",
            &r.gpu_mtbf_hours,
            "mean GPU-hours between job-stopping interruptions, per GPU",
        )?;
        let restart_minutes = f
            .opt_nonneg_num("reliability", "restart_minutes", &r.restart_minutes)?
            .ok_or_else(|| {
                f.err(
                    None,
                    "reliability.restart_minutes",
                    "[reliability] has no `restart_minutes`: the minutes from an interruption to training again",
                    "add `restart_minutes = ...` under [reliability] (specs/README.md)",
                )
                .at(f.src.table_header("reliability"))
            })?;
        let preemptions_per_hour = f
            .opt_nonneg_num("reliability", "preemptions_per_hour", &r.preemptions_per_hour)?
            .unwrap_or(0.0);
        Ok(Reliability {
            gpu_mtbf_hours,
            restart_minutes,
            preemptions_per_hour,
        })
    })
    .transpose()
}

pub(super) fn storage(f: &Fields, raw: Option<RawStorage>) -> Result<Option<Storage>, Diagnostic> {
    raw.map(|r| {
        Ok(Storage {
            write_gbps: required(
                f,
                "storage",
                "write_gbps",
                &r.write_gbps,
                "GB/s one node writes to the checkpoint filesystem",
            )?,
        })
    })
    .transpose()
}
