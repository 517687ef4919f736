//! The layout space of a job under the pins: enumerated from divisor lists, and counted from
//! the same lists before anything is enumerated, so that a job with 10^12 devices or a global
//! batch of 2^63 − 1 gets a clear error instead of an endless search.
//!
//! The space is the product the search loops over: for each TP dividing the devices and each
//! PP dividing the rest (at most the layers), the micro-batches dividing the per-replica batch
//! × the schedules × the ZeRO stages (× hybrid sharding) × the recompute modes × sequence
//! parallelism. Counting it costs one step per (TP, PP) pair and one factorisation per
//! per-replica batch size, both bounded; [`MAX_LAYOUTS`] bounds what is enumerated.

use std::collections::HashMap;

use super::divisors::{self, Factors};
use super::Pins;
use crate::layout::{
    gcd, CpComm, Layout, Offload, OffloadStates, OffloadTier, Recompute, Sharding,
};
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::spec::Cluster;

/// The most layouts one search enumerates. Preset jobs stay below it: Megatron's 530B model
/// on 315 DGX A100 nodes (2520 GPUs, a snapshot) enumerates 607,797 layouts, and the largest
/// of every preset on 1 to 4096 nodes is the 310B model on 720 nodes (5760 GPUs, 2^4·3^2·5 × 8
/// has many divisors), 831,387. Measured `tessera plan` wall times (docs/reliability.md): 0.45
/// and 0.48 s for the first, 1.07 and 1.08 s for the second; beyond the cap the search asks for
/// pins instead.
pub const MAX_LAYOUTS: u64 = 1_000_000;

/// (TP, PP) pairs a count visits before it gives up on an exact number.
const MAX_PAIRS: u64 = 1 << 20;

/// Factorisations of per-replica batch sizes that divide neither the global batch nor the
/// device count and are 2^32 or more (the slow case of the factorisation) that a count may run.
const MAX_HARD_FACTORISATIONS: usize = 1024;

/// The search cannot run as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SearchError {
    /// The pins leave more layouts than one search enumerates.
    #[error(
        "the search space is too large: {} layouts of {devices} devices under the pins given, more than the {limit} one search evaluates\n  fix: narrow the search: pin {}",
        if *.complete { layouts.to_string() } else { format!("more than {layouts}") },
        narrow.join(", ")
    )]
    TooManyLayouts {
        /// Layouts counted (all of them when `complete`, else a lower bound).
        layouts: u64,
        complete: bool,
        devices: u64,
        limit: u64,
        /// The pins that would narrow it, with the values each leaves open, widest first:
        /// `--tp (208 values)`.
        narrow: Vec<String>,
    },
    /// The job's framework profile cannot build the model or does not run on its devices.
    #[error("{0}")]
    CannotBuild(crate::framework::CannotBuild),
}

fn pick<T: Copy>(pin: Option<T>, all: Vec<T>) -> Vec<T> {
    match pin {
        Some(v) => vec![v],
        None => all,
    }
}

/// Schedule and virtual-stage choices for `pp` stages. With PP = 1 the schedule does not
/// matter, so only 1F1B is tried (unless pinned); interleaving tries the v of 2 to 8 chunks
/// per stage that split the layers evenly (Megatron's default), and where none does, the v
/// that split them evenly once the embedding, or the embedding and the loss, count as a layer
/// (Megatron-Core's `account_for_embedding_in_pipeline_split` and `…_loss_…`: Llama 3's 126
/// layers on 16 × 8 chunks; the split itself is the balanced one of `assess`). Where no v is
/// left under a pinned interleaved schedule, v = 2 stands in, so that [`Layout::check`] says
/// why it cannot be built. A pinned v is tried as given.
pub(super) fn schedules(
    layers: u64,
    pp: u64,
    pins: &Pins,
    runs: &[ScheduleKind],
) -> Vec<(ScheduleKind, u64)> {
    let kinds = match pins.schedule {
        Some(k) => vec![k],
        None if pp == 1 => vec![ScheduleKind::OneFOneB],
        // The split schedules (zb-h1, zb-v, dualpipe) only where the framework runs them; the
        // others always, so that the framework's refusal says why one is not offered.
        None => ScheduleKind::ALL
            .into_iter()
            .filter(|k| !k.splits_backward() || runs.contains(k))
            .collect(),
    };
    let mut out = Vec::new();
    for kind in kinds {
        match (kind, pins.virtual_stages) {
            // A pinned --virtual-stages alone means interleaving, as before the split
            // schedules (zb-v and dualpipe run two chunks too, but only when named).
            (_, Some(_)) if pins.schedule.is_none() && kind.splits_backward() => {}
            (_, Some(v)) => out.push((kind, v)),
            (ScheduleKind::Interleaved, None) => {
                let divides =
                    |n: u64, v: &u64| pp.checked_mul(*v).is_some_and(|c| n.is_multiple_of(c));
                let mut vs: Vec<u64> = (2..=8).filter(|v| divides(layers, v)).collect();
                if vs.is_empty() {
                    vs = (2..=8)
                        .filter(|v| {
                            divides(layers.saturating_add(1), v)
                                || divides(layers.saturating_add(2), v)
                        })
                        .collect();
                }
                if vs.is_empty() && pins.schedule == Some(kind) {
                    out.push((kind, 2));
                } else {
                    out.extend(vs.into_iter().map(|v| (kind, v)));
                }
            }
            (_, None) => out.push((kind, kind.fixed_virtual_stages().unwrap_or(1) as u64)),
        }
    }
    out
}

/// The divisor lists of one job: what both the count and the enumeration walk.
struct Lists<'a> {
    model: &'a Model,
    cluster: &'a Cluster,
    pins: &'a Pins,
    devices: Factors,
    batch: Factors,
    known: HashMap<u64, Factors>,
    /// Hard factorisations left (`None`: no limit).
    hard_left: Option<usize>,
}

impl<'a> Lists<'a> {
    fn new(model: &'a Model, cluster: &'a Cluster, pins: &'a Pins, limited: bool) -> Self {
        Lists {
            model,
            cluster,
            pins,
            devices: divisors::factorize(cluster.devices),
            batch: divisors::factorize(model.training.global_batch),
            known: HashMap::new(),
            hard_left: limited.then_some(MAX_HARD_FACTORISATIONS),
        }
    }

    /// The factorisation of `x`: derived from the devices' or the global batch's when `x`
    /// divides one of them, else factorised (within the budget; `None` past it).
    fn factors(&mut self, x: u64) -> Option<Factors> {
        if let Some(f) = self.known.get(&x) {
            return Some(f.clone());
        }
        let f = match divisors::factorize_divisor(&self.batch, x)
            .or_else(|| divisors::factorize_divisor(&self.devices, x))
        {
            Some(f) => f,
            None => {
                if x >= 1 << 32 {
                    if let Some(left) = self.hard_left.as_mut() {
                        *left = left.checked_sub(1)?;
                    }
                }
                divisors::factorize(x)
            }
        };
        self.known.insert(x, f.clone());
        Some(f)
    }

    fn tps(&mut self) -> Vec<u64> {
        let n = self.cluster.devices;
        let all = if self.pins.tp.is_some() {
            Vec::new()
        } else {
            divisors::up_to(&self.devices, n)
        };
        pick(self.pins.tp, all)
    }

    /// Context-parallel degrees for `tp`: 1, and where the sequence is long, every CP that
    /// splits it into 2·CP equal chunks and leaves each rank at least [`CP_MIN_TOKENS`]. A
    /// pinned exchange (`--cp-comm`) asks for CP: then only CP > 1 is tried, so that the plan
    /// runs the exchange it names.
    fn cps(&mut self, tp: u64) -> Vec<u64> {
        if let Some(cp) = self.pins.cp {
            return vec![cp];
        }
        let s = self.model.training.seq_len;
        let rest = self.cluster.devices / tp.max(1);
        let factors = if s < 2 * CP_MIN_TOKENS {
            None
        } else {
            self.factors(rest)
        };
        let mut cps = match factors {
            None => vec![1],
            Some(f) => divisors::up_to(&f, rest.min(s / CP_MIN_TOKENS))
                .into_iter()
                .filter(|&c| c == 1 || s.is_multiple_of(2 * c))
                .collect(),
        };
        if self.pins.cp_comm.is_some() {
            cps.retain(|&c| c > 1);
        }
        cps
    }

    /// How CP exchanges K and V: both ways where there is CP (unless pinned), else the ring.
    fn cp_comms(&self, cp: u64) -> Vec<CpComm> {
        // A pinned exchange is kept even at CP 1, where `pins::effective` refuses it by name.
        if cp <= 1 && self.pins.cp_comm.is_none() {
            return vec![CpComm::P2p];
        }
        pick(self.pins.cp_comm, CpComm::ALL.to_vec())
    }

    fn pps(&mut self, tp: u64) -> Option<Vec<u64>> {
        if let Some(pp) = self.pins.pp {
            return Some(vec![pp]);
        }
        let rest = self.cluster.devices / tp.max(1);
        let f = self.factors(rest)?;
        Some(divisors::up_to(
            &f,
            rest.min(self.model.architecture.layers),
        ))
    }

    fn dp(&self, tp: u64, pp: u64) -> u64 {
        let n = self.cluster.devices;
        self.pins
            .dp
            .unwrap_or_else(|| tp.checked_mul(pp).map_or(0, |q| n / q.max(1)))
    }

    fn per_replica(&self, dp: u64) -> u64 {
        (self.model.training.global_batch / dp.max(1)).max(1)
    }

    fn mbs(&mut self, dp: u64) -> Option<Vec<u64>> {
        if let Some(mb) = self.pins.micro_batch {
            return Some(vec![mb]);
        }
        let b = self.per_replica(dp);
        Some(divisors::up_to(&self.factors(b)?, b))
    }

    fn mb_count(&mut self, dp: u64) -> Option<u64> {
        if self.pins.micro_batch.is_some() {
            return Some(1);
        }
        let b = self.per_replica(dp);
        Some(divisors::count(&self.factors(b)?))
    }

    /// Expert-parallel degrees for `dp` × `cp` ranks: for an MoE model every EP dividing both
    /// its routed experts and DP × CP (Megatron-Core's rule, `Layout::check`); 1 for a dense
    /// model. A pinned EP is tried as given.
    fn eps(&mut self, dp: u64, cp: u64) -> Vec<u64> {
        if let Some(ep) = self.pins.ep {
            return vec![ep];
        }
        let Some(m) = &self.model.architecture.moe else {
            return vec![1];
        };
        let group = dp.saturating_mul(cp.max(1));
        let g = gcd(m.experts, group).max(1);
        match self.factors(g) {
            Some(f) => divisors::up_to(&f, g),
            None => vec![1],
        }
    }

    /// Sequence parallelism for `tp` under `ep`: EP with TP needs it (`Layout::check`), so
    /// only SP is tried there.
    fn sps_with_ep(&self, tp: u64, ep: u64) -> Vec<bool> {
        let all = self.sps(tp);
        if ep > 1 && tp > 1 && self.pins.sp.is_none() {
            return vec![true];
        }
        all
    }

    fn zeros(&self) -> Vec<u8> {
        pick(self.pins.zero, vec![0, 1, 2, 3])
    }

    fn hybrids(&self, zero: u8, dp: u64) -> Vec<bool> {
        let c = self.cluster;
        let both = zero > 0 && c.nodes > 1 && dp > c.gpus_per_node;
        pick(
            self.pins.hybrid,
            if both { vec![false, true] } else { vec![false] },
        )
    }

    /// The offloads tried at ZeRO stage `zero`: none unless pinned (the search's second pass
    /// pins each offloaded state in turn, `search_checked`); a pinned state in host memory, and
    /// under ZeRO-3 (ZeRO-Infinity's rule) on NVMe too, unless the target is pinned.
    fn offloads(&self, zero: u8) -> Vec<Offload> {
        let activations = self.pins.offload_activations.unwrap_or(false);
        let states = self.pins.offload.unwrap_or(OffloadStates::None);
        // Unpinned ZeRO: only the stages the offload runs on (`pins::effective` says why the
        // others cannot, when the stage is pinned).
        let least = match states {
            OffloadStates::None => 0,
            OffloadStates::Optimizer => 1,
            OffloadStates::Params => 3,
        };
        if self.pins.zero.is_none() && zero < least {
            return Vec::new();
        }
        let runs = &crate::framework::of(self.model, self.cluster)
            .can_run
            .offload_to;
        let tiers = match (self.pins.offload_to, states) {
            (Some(t), _) => vec![t],
            (None, OffloadStates::None) => vec![OffloadTier::Cpu],
            (None, _) if zero == 3 && self.cluster.host.nvme_gib > 0.0 => {
                [OffloadTier::Cpu, OffloadTier::Nvme]
                    .into_iter()
                    .filter(|t| runs.contains(t))
                    .collect()
            }
            (None, _) => vec![OffloadTier::Cpu],
        };
        tiers
            .into_iter()
            .map(|to| Offload {
                states,
                to,
                activations,
            })
            .collect()
    }

    fn recomputes(&self) -> Vec<Recompute> {
        pick(self.pins.recompute, Recompute::ALL.to_vec())
    }

    fn sps(&self, tp: u64) -> Vec<bool> {
        pick(
            self.pins.sp,
            if tp > 1 {
                vec![false, true]
            } else {
                vec![false]
            },
        )
    }
}

/// Calls `f` with every layout allowed by the pins (buildable or not), in the search's order.
pub(super) fn for_each_layout(
    model: &Model,
    cluster: &Cluster,
    pins: &Pins,
    f: &mut dyn FnMut(Layout),
) {
    let mut lists = Lists::new(model, cluster, pins, false);
    let layers = model.architecture.layers;
    let runs = &crate::framework::of(model, cluster).can_run.schedules;
    let (zeros, recomputes) = (lists.zeros(), lists.recomputes());
    for tp in lists.tps() {
        for cp in lists.cps(tp) {
            let tcp = tp.saturating_mul(cp);
            let comms = lists.cp_comms(cp);
            for pp in lists.pps(tcp).unwrap_or_default() {
                let schedules = schedules(layers, pp, pins, runs);
                if schedules.is_empty() {
                    continue; // no layout (interleaving pinned, no v splits the layers)
                }
                let dp = lists.dp(tcp, pp);
                let mbs = lists.mbs(dp).unwrap_or_default();
                for ep in lists.eps(dp, cp) {
                    let sps = lists.sps_with_ep(tp, ep);
                    for &micro_batch in &mbs {
                        for &(schedule, virtual_stages) in &schedules {
                            for &zero_stage in &zeros {
                                let offloads = lists.offloads(zero_stage);
                                for (hybrid, &offload) in lists
                                    .hybrids(zero_stage, dp)
                                    .into_iter()
                                    .flat_map(|h| offloads.iter().map(move |o| (h, o)))
                                {
                                    for &recompute in &recomputes {
                                        for (&sequence_parallel, &cp_comm) in sps
                                            .iter()
                                            .flat_map(|s| comms.iter().map(move |c| (s, c)))
                                        {
                                            f(Layout {
                                                dp,
                                                cp,
                                                cp_comm,
                                                ep,
                                                pp,
                                                tp,
                                                micro_batch,
                                                sharding: Sharding { zero_stage, hybrid },
                                                recompute,
                                                recompute_every: match recompute {
                                                    Recompute::Full => {
                                                        lists.pins.recompute_every.unwrap_or(1)
                                                    }
                                                    _ => 1,
                                                },
                                                sequence_parallel,
                                                schedule,
                                                virtual_stages,
                                                offload,
                                            });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// How many layouts the pins allow, and how widely each free knob ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceSize {
    /// Layouts counted: all of them when `complete`, else a lower bound.
    pub layouts: u64,
    /// Whether the count ran to the end (it stops after 2^20 (TP, PP) pairs or 1024 hard
    /// factorisations).
    pub complete: bool,
    /// Free knobs with the most values each takes, as `(flag, values)`.
    pub knobs: Vec<(&'static str, u64)>,
}

/// Counts the layouts [`super::enumerate`] would list, without listing them: one step per
/// (TP, PP) pair, the rest from the lengths of the inner lists.
pub fn count_layouts(model: &Model, cluster: &Cluster, pins: &Pins) -> SpaceSize {
    let mut lists = Lists::new(model, cluster, pins, true);
    let layers = model.architecture.layers;
    let runs = &crate::framework::of(model, cluster).can_run.schedules;
    let tps = lists.tps();
    let zeros = lists.zeros();
    let recomputes = lists.recomputes().len() as u64;
    let (mut layouts, mut pairs, mut complete) = (0u64, 0u64, true);
    let mut most = [0u64; 4]; // PP, micro-batch, schedule, hybrid
    let mut any_tp_above_1 = false;
    let mut most_cp = 1u64;
    let mut most_ep = 1u64;
    'count: for &tp in &tps {
        let cps = lists.cps(tp);
        most_cp = most_cp.max(cps.len() as u64);
        for cp in cps {
            let comms = lists.cp_comms(cp).len() as u64;
            let tcp = tp.saturating_mul(cp);
            let Some(pps) = lists.pps(tcp) else {
                complete = false;
                break 'count;
            };
            most[0] = most[0].max(pps.len() as u64);
            for pp in pps {
                pairs += 1;
                if pairs > MAX_PAIRS {
                    complete = false;
                    break 'count;
                }
                let dp = lists.dp(tcp, pp);
                let Some(mbs) = lists.mb_count(dp) else {
                    complete = false;
                    break 'count;
                };
                let schedules = schedules(layers, pp, pins, runs).len() as u64;
                let hybrids: Vec<u64> = zeros
                    .iter()
                    .map(|z| (lists.hybrids(*z, dp).len() * lists.offloads(*z).len()) as u64)
                    .collect();
                let eps = lists.eps(dp, cp);
                most_ep = most_ep.max(eps.len() as u64);
                let ep_sps: u64 = eps
                    .iter()
                    .map(|&ep| lists.sps_with_ep(tp, ep).len() as u64)
                    .sum();
                most[1] = most[1].max(mbs);
                most[2] = most[2].max(schedules);
                most[3] = most[3].max(hybrids.iter().copied().max().unwrap_or(1));
                any_tp_above_1 |= tp > 1;
                let here = [schedules, hybrids.iter().sum(), recomputes, ep_sps]
                    .iter()
                    .fold(mbs.saturating_mul(comms), |a, x| a.saturating_mul(*x));
                layouts = layouts.saturating_add(here);
            }
        }
    }
    let p = pins;
    let knobs = [
        ("--tp", p.tp.is_none(), tps.len() as u64),
        ("--cp", p.cp.is_none(), most_cp),
        ("--ep", p.ep.is_none(), most_ep),
        ("--pp", p.pp.is_none(), most[0]),
        ("--micro-batch", p.micro_batch.is_none(), most[1]),
        (
            if p.schedule.is_none() {
                "--schedule"
            } else {
                "--virtual-stages"
            },
            p.schedule.is_none() || p.virtual_stages.is_none(),
            most[2],
        ),
        ("--zero", p.zero.is_none(), 4),
        ("--recompute", p.recompute.is_none(), 3),
        ("--sp or --no-sp", p.sp.is_none() && any_tp_above_1, 2),
        (
            "--hybrid-shard or --no-hybrid-shard",
            p.hybrid.is_none(),
            most[3],
        ),
    ];
    let mut knobs: Vec<(&'static str, u64)> = knobs
        .into_iter()
        .filter(|(_, free, values)| *free && *values > 1)
        .map(|(flag, _, values)| (flag, values))
        .collect();
    knobs.sort_by_key(|(_, values)| std::cmp::Reverse(*values));
    SpaceSize {
        layouts,
        complete,
        knobs,
    }
}

/// `Ok` when the pins leave at most [`MAX_LAYOUTS`] layouts, else the error naming the pins
/// that would narrow them.
pub fn check_size(model: &Model, cluster: &Cluster, pins: &Pins) -> Result<SpaceSize, SearchError> {
    let size = count_layouts(model, cluster, pins);
    if size.complete && size.layouts <= MAX_LAYOUTS {
        return Ok(size);
    }
    let mut narrow: Vec<String> = size
        .knobs
        .iter()
        .map(|(flag, values)| format!("{flag} ({values} values)"))
        .collect();
    if narrow.is_empty() {
        narrow.push("fewer devices (--nodes/--devices) or a smaller global batch".into());
    }
    Err(SearchError::TooManyLayouts {
        layouts: size.layouts,
        complete: size.complete,
        devices: cluster.devices,
        limit: MAX_LAYOUTS,
        narrow,
    })
}

/// The CP degrees above 1 the search tries when `--cp` is not pinned, at the pinned TP (at TP
/// 1 otherwise, which leaves the most): empty where the sequence is too short for CP or no
/// degree both splits it and divides the devices.
pub fn searched_cps(model: &Model, cluster: &Cluster, pins: &Pins) -> Vec<u64> {
    let free = Pins {
        cp: None,
        cp_comm: Some(CpComm::P2p),
        ..*pins
    };
    Lists::new(model, cluster, &free, true).cps(pins.tp.unwrap_or(1))
}

/// The fewest tokens per rank the search leaves under context parallelism: Llama 3 trained at
/// 131,072 tokens with CP 16, 8,192 per rank (Dubey et al. 2024, Table 4), and at 8,192
/// tokens without CP. Shorter sequences are searched without CP; a pinned `--cp` is tried as
/// given.
pub const CP_MIN_TOKENS: u64 = 8192;
