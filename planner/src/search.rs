//! The feasibility search: every layout of the cluster, pruned by divisibility and memory.
//!
//! Until the cost model exists, layouts that fit are ordered by the least-complex-first rule of
//! the seeds ("start with the least complex strategy that addresses the actual bottleneck"):
//! no pipeline before pipeline, smaller TP before larger, no ZeRO before ZeRO, activation
//! recompute before heavier sharding at the same ZeRO stage, then simpler schedules, then larger
//! micro-batches. Every rejected layout keeps its reason. This module never formats output.

use std::collections::BTreeMap;

use crate::layout::{Layout, Recompute, Sharding};
use crate::memory;
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::spec::Cluster;

/// The ordering rule, stated in the output and in plan.json.
pub const ORDERING: &str = "least-complex-first: PP=1 before PP>1, then smaller TP, then lower ZeRO stage, then less recompute, then no SP, then gpipe < 1f1b < interleaved, then larger micro-batch (no cost model yet)";

/// Values the user fixed; `None` lets the search choose.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pins {
    pub dp: Option<u64>,
    pub pp: Option<u64>,
    pub tp: Option<u64>,
    pub micro_batch: Option<u64>,
    pub zero: Option<u8>,
    pub hybrid: Option<bool>,
    pub recompute: Option<Recompute>,
    pub sp: Option<bool>,
    pub schedule: Option<ScheduleKind>,
    pub virtual_stages: Option<u64>,
}

/// A layout that fits, with its peak memory per device.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub layout: Layout,
    pub peak_bytes: u64,
}

/// Rejections of one kind: how many, and one example.
#[derive(Debug, Clone, PartialEq)]
pub struct RejectionGroup {
    pub count: u64,
    pub example: String,
}

/// What the search found.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// Layouts that fit, in ranking order.
    pub fits: Vec<Candidate>,
    /// Layouts that were built and evaluated against memory (fitting or not).
    pub evaluated: u64,
    /// The smallest layout that was buildable but does not fit, if nothing fits.
    pub closest_miss: Option<Candidate>,
    /// Rejections grouped by reason.
    pub rejected: BTreeMap<String, RejectionGroup>,
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn pick<T: Copy>(pin: Option<T>, all: Vec<T>) -> Vec<T> {
    match pin {
        Some(v) => vec![v],
        None => all,
    }
}

/// Enumerates the layouts allowed by the pins (buildable or not).
pub fn enumerate(model: &Model, cluster: &Cluster, pins: &Pins) -> Vec<Layout> {
    let n = cluster.devices;
    let a = &model.architecture;
    let mut out = Vec::new();
    for tp in pick(pins.tp, divisors(n)) {
        for pp in pick(
            pins.pp,
            divisors(n / tp.max(1))
                .into_iter()
                .filter(|p| *p <= a.layers)
                .collect(),
        ) {
            let dp = pins.dp.unwrap_or(n / (tp * pp).max(1));
            let per_replica = model.training.global_batch / dp.max(1);
            let mbs = pick(pins.micro_batch, divisors(per_replica.max(1)));
            let schedules = schedules(a.layers, pp, pins);
            let zeros = pick(pins.zero, vec![0, 1, 2, 3]);
            let sps = pick(
                pins.sp,
                if tp > 1 {
                    vec![false, true]
                } else {
                    vec![false]
                },
            );
            for &micro_batch in &mbs {
                for &(schedule, virtual_stages) in &schedules {
                    for &zero_stage in &zeros {
                        let hybrids = pick(
                            pins.hybrid,
                            if zero_stage > 0 && cluster.nodes > 1 && dp > cluster.gpus_per_node {
                                vec![false, true]
                            } else {
                                vec![false]
                            },
                        );
                        for &hybrid in &hybrids {
                            for recompute in pick(pins.recompute, Recompute::ALL.to_vec()) {
                                for &sequence_parallel in &sps {
                                    out.push(Layout {
                                        dp,
                                        pp,
                                        tp,
                                        micro_batch,
                                        sharding: Sharding { zero_stage, hybrid },
                                        recompute,
                                        sequence_parallel,
                                        schedule,
                                        virtual_stages,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Schedule and virtual-stage choices for `pp` stages. With PP = 1 the schedule does not
/// matter, so only 1F1B is tried (unless pinned); interleaving tries v chunks that split the
/// layers evenly.
fn schedules(layers: u64, pp: u64, pins: &Pins) -> Vec<(ScheduleKind, u64)> {
    let kinds = match pins.schedule {
        Some(k) => vec![k],
        None if pp == 1 => vec![ScheduleKind::OneFOneB],
        None => ScheduleKind::ALL.to_vec(),
    };
    let mut out = Vec::new();
    for kind in kinds {
        match (kind, pins.virtual_stages) {
            (_, Some(v)) => out.push((kind, v)),
            (ScheduleKind::Interleaved, None) => out.extend(
                (2..=8)
                    .filter(|v| layers.is_multiple_of(pp * v))
                    .map(|v| (kind, v)),
            ),
            (_, None) => out.push((kind, 1)),
        }
    }
    out
}

/// The ranking key of the least-complex-first rule (smaller is preferred).
fn complexity(l: &Layout, cluster: &Cluster) -> impl Ord {
    let crosses = l.tp > cluster.gpus_per_node;
    (
        l.pp,
        crosses,
        l.tp,
        l.sharding.zero_stage,
        l.sharding.hybrid,
        l.recompute,
        l.sequence_parallel,
        l.schedule,
        l.virtual_stages,
        std::cmp::Reverse(l.micro_batch),
    )
}

/// Runs the search.
pub fn search(model: &Model, cluster: &Cluster, pins: &Pins) -> SearchResult {
    let mut fits = Vec::new();
    let mut rejected: BTreeMap<String, RejectionGroup> = BTreeMap::new();
    let mut evaluated = 0;
    let mut closest_miss: Option<Candidate> = None;
    let capacity = cluster.memory_bytes() as u64;
    let mut reject = |key: &str, example: String| {
        let g = rejected
            .entry(key.to_string())
            .or_insert(RejectionGroup { count: 0, example });
        g.count += 1;
    };
    for layout in enumerate(model, cluster, pins) {
        if let Err(why) = layout.check(model, cluster) {
            reject(why.rule, format!("{}: {why}", layout.label()));
            continue;
        }
        evaluated += 1;
        let peak_bytes = memory::peak_bytes(model, cluster, &layout);
        let c = Candidate { layout, peak_bytes };
        if peak_bytes <= capacity {
            fits.push(c);
        } else {
            reject(
                "does not fit in device memory",
                format!(
                    "{}: needs {:.1} GiB per device, has {:.1} GiB",
                    c.layout.label(),
                    peak_bytes as f64 / crate::spec::GIB,
                    cluster.device.memory_gib
                ),
            );
            if closest_miss
                .as_ref()
                .is_none_or(|m| c.peak_bytes < m.peak_bytes)
            {
                closest_miss = Some(c);
            }
        }
    }
    fits.sort_by_key(|c| complexity(&c.layout, cluster));
    SearchResult {
        fits,
        evaluated,
        closest_miss,
        rejected,
    }
}
