//! The search: every layout of the cluster, pruned by divisibility and memory, ranked by the
//! cost model's predicted step time.
//!
//! Each buildable layout gets its layers split over the stages (`partition`, under each stage's
//! memory cap) and a lower bound of its step time; layouts that fit are then simulated in order
//! of that bound until no unsimulated layout can enter the top K or come within 2% of the
//! fastest (branch and bound: the ranking is the one full simulation would give). Within 2% of
//! the fastest, the seeds' least-complex-first rule decides ("start with the least complex
//! strategy that addresses the actual bottleneck"); for the layouts that lost, the breakdown
//! difference says why. Every rejected layout keeps its reason. This module never formats
//! output beyond those reasons.

pub mod divisors;
pub mod pins;
mod space;
#[cfg(test)]
mod tests;
mod why;

pub use space::{
    check_size, count_layouts, searched_cps, SearchError, SpaceSize, CP_MIN_TOKENS, MAX_LAYOUTS,
};

use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

use crate::cost::comm::Links;
use crate::cost::pipeline::Simulator;
use crate::cost::{self, Evaluation, Options, Prediction};
use crate::layout::{Layout, Recompute, Rejection, MAX_SIMULATED_PASSES};
use crate::memory::StageBytes;
use crate::model::Model;
use crate::partition;
use crate::schedule::ScheduleKind;
use crate::spec::Cluster;

/// The ordering rule, stated in the output and in plan.json.
pub const ORDERING: &str = "fastest predicted step time first (simulated pipeline makespan + exposed DP sync + optimizer step); among layouts within 2% of the fastest, least-complex-first: PP=1 before PP>1, TP inside a node, smaller TP, smaller CP, smaller EP, lower ZeRO stage, less recompute, no SP, gpipe < 1f1b < interleaved, larger micro-batch";

/// Layouts whose step time is within this fraction of the fastest count as a tie.
pub const NEAR_TIE: f64 = 0.02;

/// Values the user fixed; `None` lets the search choose.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pins {
    pub dp: Option<u64>,
    pub pp: Option<u64>,
    pub tp: Option<u64>,
    /// Context parallelism (unpinned: 1, or more where the sequence is long).
    pub cp: Option<u64>,
    /// How CP exchanges K and V (unpinned: both are tried where CP > 1; pinned with `cp`
    /// unpinned: only CP > 1 is tried).
    pub cp_comm: Option<crate::layout::CpComm>,
    /// Expert parallelism (unpinned: every EP dividing both the experts and DP × CP for an
    /// MoE model, 1 for a dense one).
    pub ep: Option<u64>,
    pub micro_batch: Option<u64>,
    pub zero: Option<u8>,
    pub hybrid: Option<bool>,
    pub recompute: Option<Recompute>,
    /// With full recompute: recompute every N-th layer only (unpinned: every layer).
    pub recompute_every: Option<u64>,
    pub sp: Option<bool>,
    pub schedule: Option<ScheduleKind>,
    pub virtual_stages: Option<u64>,
    /// Offloaded states (unpinned: none, and where a layout does not fit without it, each
    /// offload its framework runs).
    pub offload: Option<crate::layout::OffloadStates>,
    /// Where offloaded states live (unpinned: host memory, and NVMe where that does not fit).
    pub offload_to: Option<crate::layout::OffloadTier>,
    /// Activation offload (unpinned: off).
    pub offload_activations: Option<bool>,
    /// Layers of the first and last pipeline stages (Megatron-Core's
    /// `--decoder-first-pipeline-num-layers` and `--decoder-last-pipeline-num-layers`).
    pub stage_layers: StageLayers,
}

/// Pinned layer counts of the end stages of a pipeline; the middle stages share the rest
/// evenly. Unpinned, the split is the search's own (see [`assess`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StageLayers {
    pub first: Option<u64>,
    pub last: Option<u64>,
}

impl StageLayers {
    pub fn is_pinned(&self) -> bool {
        self.first.is_some() || self.last.is_some()
    }
}

/// A layout that fits: its split, its peak memory per device and its predicted step time.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub layout: Layout,
    pub peak_bytes: u64,
    /// Layers per virtual stage, in pipeline order.
    pub split: Vec<u64>,
    /// A lower bound of the step time, from the cost model without simulation.
    pub lower_bound: f64,
    /// The simulated prediction; present for the ranked head of the list.
    pub prediction: Option<Prediction>,
    /// Why this layout ranks below the chosen one (ranks 2 and up of the ranked head).
    pub why: Option<String>,
}

impl Candidate {
    /// The predicted step time, or the lower bound where the layout was not simulated.
    pub fn step_time(&self) -> f64 {
        self.prediction
            .as_ref()
            .map_or(self.lower_bound, |p| p.step_time_s)
    }
}

/// How the search ranks: how many layouts to rank exactly, and the framework behaviour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchOptions {
    /// Layouts to rank with a simulated prediction (at least 1).
    pub top: usize,
    pub cost: Options,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            top: 10,
            cost: Options::default(),
        }
    }
}

/// Rejections of one kind: how many, and one example.
#[derive(Debug, Clone, PartialEq)]
pub struct RejectionGroup {
    pub count: u64,
    pub example: String,
    /// The example's fix, where its rule names one.
    pub fix: Option<String>,
}

/// What the search found.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// Layouts that fit, in ranking order: first those ranked by simulation (with a
    /// prediction), then the rest by their lower bound.
    pub fits: Vec<Candidate>,
    /// Layouts that were built and evaluated against memory and the cost model.
    pub evaluated: u64,
    /// Pipeline simulations run (layouts with equal op durations share one).
    pub simulated: u64,
    /// The smallest layout that was buildable but does not fit, if nothing fits.
    pub closest_miss: Option<Candidate>,
    /// Rejections grouped by reason.
    pub rejected: BTreeMap<String, RejectionGroup>,
}

/// Enumerates the layouts allowed by the pins (buildable or not), in the search's order. It
/// lists them all: [`count_layouts`] says how many first (as [`search_checked`] does).
pub fn enumerate(model: &Model, cluster: &Cluster, pins: &Pins) -> Vec<Layout> {
    let mut out = Vec::new();
    space::for_each_layout(model, cluster, pins, &mut |l| out.push(l));
    out
}

/// The ranking key of the least-complex-first rule (smaller is preferred).
fn complexity(l: &Layout, cluster: &Cluster) -> impl Ord {
    let crosses = l.tp > cluster.gpus_per_node;
    (
        l.pp,
        crosses,
        l.tp,
        (l.cp, l.cp_comm, l.ep),
        l.sharding.zero_stage,
        l.sharding.hybrid,
        l.recompute,
        l.sequence_parallel,
        l.schedule,
        l.virtual_stages,
        std::cmp::Reverse(l.micro_batch),
    )
}

/// A layout split over its stages and costed up to the pipeline simulation.
#[derive(Debug)]
pub struct Assessed {
    pub split: Vec<u64>,
    /// Peak bytes per device; for a layout that does not fit, that of the even split.
    pub peak_bytes: u64,
    pub fits: bool,
    /// A layout that offloads and fits on the device but not in its host tier: the tier,
    /// the bytes per node it needs and has.
    pub host_overflow: Option<(&'static str, u64, u64)>,
    /// Present when the layout fits.
    pub evaluation: Option<Evaluation>,
}

/// Splits `layout`'s layers over its stages and costs it (no pinned end stages: see
/// [`assess_pinned`]).
pub fn assess(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    links: &Links,
    options: Options,
) -> Assessed {
    assess_pinned(
        model,
        cluster,
        layout,
        links,
        options,
        StageLayers::default(),
    )
}

/// Splits `layout`'s layers over its stages and costs it.
///
/// - Pinned end stages ([`StageLayers`]) fix the first and last stage; the middle stages
///   share the rest evenly ([`pins::stage_layers`]).
/// - Interleaved layouts whose layers divide into the chunks keep Megatron's equal chunks
///   (`--num-layers-per-virtual-pipeline-stage`, what the published runs used).
/// - Otherwise the stages get the balanced split of `partition` under each stage's memory
///   cap, the embedding's time on the first stage and the head's on the last. Interleaved,
///   each stage then spreads its layers over its chunks ([`Layout::chunk_split`]), the first
///   chunk of the first stage and the last of the last the ones left short: where the
///   chunks outnumber the layers, they hold only the embedding and the head (Llama 3).
pub fn assess_pinned(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    links: &Links,
    options: Options,
    ends: StageLayers,
) -> Assessed {
    let layers = model.architecture.layers;
    let pp = layout.pp as usize;
    let v = layout.virtual_stages;
    let capacity = cluster.memory_bytes();
    let mem = StageBytes::new(model, cluster, layout);
    let times = cost::layer_times(model, cluster, layout, links, options);
    // Under full recompute of every N-th layer, chunks hold whole groups of N layers, so that
    // each recomputes what the plan charges (`pins::unit`; 1 otherwise).
    let unit = pins::unit(model, layout).unwrap_or(1);
    let pinned = if ends.is_pinned() {
        pins::stage_layers(model, layout, ends).ok()
    } else {
        None
    };
    let even: Vec<u64> = match &pinned {
        Some(per) => layout.chunk_split(per),
        None => layout
            .split_layers(layers / unit)
            .into_iter()
            .map(|n| n * unit)
            .collect(),
    };
    let per_stage = |split: &[u64]| layout.stage_layers(split);
    let fits_as_is = |split: &[u64]| {
        let per = per_stage(split);
        mem.peak(&per) <= capacity && (0..pp).all(|s| per[s] <= mem.max_layers(s, capacity))
    };
    let equal_chunks = layout.pieces().is_some_and(|c| layers.is_multiple_of(c));
    // ZB-V and DualPipe keep the even split: their chunks are not Megatron's interleaving that
    // the balance below spreads over (`Layout::chunk_split` still places ZB-V's remainder).
    let fixed_chunks = v > 1 && layout.schedule != ScheduleKind::Interleaved;
    let split = if pinned.is_some() || (v > 1 && equal_chunks) || fixed_chunks || pp == 1 {
        fits_as_is(&even).then(|| even.clone())
    } else {
        let mut extra = vec![0.0; pp];
        extra[0] += times.embedding.fwd.total() + times.embedding.bwd.total();
        extra[pp - 1] += times.head.fwd.total() + times.head.bwd.total();
        // Interleaved, a middle stage holds at least one layer per chunk and an end stage
        // one fewer (its end chunk may hold only the embedding or the head).
        let least: Vec<u64> = (0..pp)
            .map(|s| {
                if v == 1 {
                    1
                } else {
                    v - u64::from(s == 0 || s == pp - 1)
                }
            })
            .collect();
        let layer_time = times.per_layer() * unit as f64;
        partition::balance_at_least(
            &partition::Problem {
                layers: layers / unit,
                layer_time: vec![layer_time; pp],
                extra_time: extra,
                max_layers: (0..pp)
                    .map(|s| mem.max_layers(s, capacity) / unit)
                    .collect(),
            },
            &least.iter().map(|n| n.div_ceil(unit)).collect::<Vec<_>>(),
        )
        .map(|per| {
            let per: Vec<u64> = per.into_iter().map(|n| n * unit).collect();
            if v == 1 {
                per
            } else {
                layout.chunk_split(&per)
            }
        })
        .filter(|split| v == 1 || fits_as_is(split))
    };
    match split {
        None => Assessed {
            peak_bytes: mem.peak(&per_stage(&even)).ceil() as u64,
            split: even,
            fits: false,
            host_overflow: None,
            evaluation: None,
        },
        // A layout that offloads must fit its host tier too (`host_split` is `None` without
        // offload); the report is built once.
        Some(split)
            if let Some(overflow) = crate::memory::host_split(model, cluster, layout, &split)
                .and_then(|h| h.overflow()) =>
        {
            Assessed {
                peak_bytes: mem.peak(&per_stage(&split)).ceil() as u64,
                split,
                fits: false,
                host_overflow: Some(overflow),
                evaluation: None,
            }
        }
        Some(split) => {
            let e = cost::evaluate(model, cluster, layout, &split, links, &times, options);
            Assessed {
                peak_bytes: mem.peak(&per_stage(&split)).ceil() as u64,
                split,
                fits: true,
                host_overflow: None,
                evaluation: Some(e),
            }
        }
    }
}

/// A layout's split, peak memory and simulated prediction, whether or not it fits (a layout
/// that does not fit keeps the even split): what `Plan::new` and the validation need.
///
/// Bounded for any layout: one whose pipeline is too long to simulate gets its lower bound as
/// the makespan. A layout with a zero degree, more than [`MAX_SIMULATED_PASSES`] chunks or
/// more ranks than a u64 counts cannot even be costed: it gets an infinite step time and
/// peak, an empty split and no evaluation. Use [`try_predict_layout`] to have it rejected.
pub fn predict_layout(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    options: Options,
) -> (Assessed, Prediction) {
    let l = layout;
    let chunks = l.chunks().unwrap_or(u64::MAX);
    let ranks = l.dp.checked_mul(l.pp).and_then(|x| x.checked_mul(l.tp));
    if l.dp == 0 || l.tp == 0 || chunks == 0 || chunks > MAX_SIMULATED_PASSES || ranks.is_none() {
        return unbuildable();
    }
    let links = Links::new(cluster, &layout.mesh(cluster));
    let mut a = assess(model, cluster, layout, &links, options);
    let e = a.evaluation.take().unwrap_or_else(|| {
        let times = cost::layer_times(model, cluster, layout, &links, options);
        cost::evaluate(model, cluster, layout, &a.split, &links, &times, options)
    });
    let p = e.predict(&Simulator::new().run(&e.pipeline));
    a.evaluation = Some(e);
    (a, p)
}

/// [`predict_layout`] for a layout that passes [`Layout::check`]; the rejection otherwise.
pub fn try_predict_layout(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    options: Options,
) -> Result<(Assessed, Prediction), Rejection> {
    layout.check(model, cluster)?;
    Ok(predict_layout(model, cluster, layout, options))
}

/// What [`predict_layout`] gives a layout that cannot be costed at all.
fn unbuildable() -> (Assessed, Prediction) {
    let a = Assessed {
        split: Vec::new(),
        peak_bytes: u64::MAX,
        fits: false,
        host_overflow: None,
        evaluation: None,
    };
    let p = Prediction {
        step_time_s: f64::INFINITY,
        breakdown: Vec::new(),
        tokens_per_s: 0.0,
        tokens_per_s_per_device: 0.0,
        mfu: 0.0,
        model_flops_per_step: 0.0,
        bottleneck_stage: 0,
    };
    (a, p)
}

/// Runs the search with the default options (see [`search_with`]).
pub fn search(model: &Model, cluster: &Cluster, pins: &Pins) -> SearchResult {
    search_with(model, cluster, pins, SearchOptions::default())
}

/// Runs the search. A space too large to search ([`SearchError`]) gives no layout, with the
/// error's message as its only rejection (under the rule [`TOO_MANY_LAYOUTS`], counting the
/// layouts); [`search_checked`] returns the error instead.
pub fn search_with(
    model: &Model,
    cluster: &Cluster,
    pins: &Pins,
    options: SearchOptions,
) -> SearchResult {
    match search_checked(model, cluster, pins, options) {
        Ok(r) => r,
        Err(e) => {
            let (rule, count) = match &e {
                SearchError::TooManyLayouts { layouts, .. } => (TOO_MANY_LAYOUTS, *layouts),
                SearchError::CannotBuild(_) => (crate::framework::CANNOT_BUILD, 1),
            };
            let group = RejectionGroup {
                count,
                example: e.to_string(),
                fix: None,
            };
            SearchResult {
                fits: Vec::new(),
                evaluated: 0,
                simulated: 0,
                closest_miss: None,
                rejected: BTreeMap::from([(rule.to_string(), group)]),
            }
        }
    }
}

/// The rejection rule under which [`search_with`] reports a space too large to search.
pub const TOO_MANY_LAYOUTS: &str = "too many layouts to search";

/// Runs the search, after counting the layouts the pins allow: more than [`MAX_LAYOUTS`] is
/// an error that names the pins that would narrow them, so that any job (10^12 devices, a
/// global batch of 2^63 − 1) is answered in bounded time.
pub fn search_checked(
    model: &Model,
    cluster: &Cluster,
    pins: &Pins,
    options: SearchOptions,
) -> Result<SearchResult, SearchError> {
    let model = &*crate::precision::for_device(model, cluster);
    let profile = crate::framework::of(model, cluster);
    crate::framework::builds(profile, model, cluster).map_err(SearchError::CannotBuild)?;
    space::check_size(model, cluster, pins)?;
    let mut fits = Vec::new();
    let mut rejected: BTreeMap<String, RejectionGroup> = BTreeMap::new();
    let mut evaluated = 0;
    let mut closest_miss: Option<Candidate> = None;
    let mut links: HashMap<(u64, u64, u64, u64), Links> = HashMap::new();
    // The example is written only for the first layout of each group.
    let mut reject = |key: &str, example: &dyn Fn() -> String, fix: Option<&String>| {
        let g = rejected
            .entry(key.to_string())
            .or_insert_with(|| RejectionGroup {
                count: 0,
                example: example(),
                fix: fix.cloned(),
            });
        g.count += 1;
    };
    // The first pass offloads nothing unless offload is pinned. Where no layout fits, a second
    // pass tries each offload the framework runs: an offloaded layout computes what its twin
    // without offload does and adds its copies and the host's step, so offload is chosen only
    // where nothing fits without it (issue 38; the seeds' "use offloading when memory is the
    // hard limit").
    let first = Pins {
        offload: Some(pins.offload.unwrap_or_default()),
        ..*pins
    };
    let mut passes = vec![first];
    // Visits one pass's layouts; returns how many fit so far.
    let mut visit = |pass: &Pins| -> usize {
        // Checked layouts first (cheap, in order), then assessed on every core: the assessment
        // is pure and dominates the search (issue 41's zero-bubble schedules nearly doubled the
        // space). The results are folded in enumeration order, so the outcome is the serial one.
        let mut checked = Vec::new();
        space::for_each_layout(model, cluster, pass, &mut |layout| {
            if let Err(why) = layout
                .check(model, cluster)
                .and_then(|()| pins::effective(&layout, model, cluster))
                .and_then(|()| crate::framework::admits(profile, &layout))
                .and_then(|()| {
                    if pins.stage_layers.is_pinned() {
                        pins::stage_layers(model, &layout, pins.stage_layers).map(|_| ())
                    } else {
                        Ok(())
                    }
                })
            {
                reject(
                    why.rule,
                    &|| format!("{}: {why}", layout.label()),
                    why.fix.as_ref(),
                );
                return;
            }
            links
                .entry((layout.dp, layout.pp, layout.tp, layout.ep))
                .or_insert_with(|| Links::new(cluster, &layout.mesh(cluster)));
            checked.push(layout);
        });
        let assessed: Vec<Assessed> = checked
            .par_iter()
            .map(|layout| {
                let l = &links[&(layout.dp, layout.pp, layout.tp, layout.ep)];
                assess_pinned(model, cluster, layout, l, options.cost, pins.stage_layers)
            })
            .collect();
        for (layout, a) in checked.into_iter().zip(assessed) {
            evaluated += 1;
            let c = Candidate {
                layout,
                peak_bytes: a.peak_bytes,
                split: a.split,
                lower_bound: a
                    .evaluation
                    .as_ref()
                    .map_or(f64::INFINITY, |e| e.lower_bound),
                prediction: None,
                why: None,
            };
            if a.fits {
                fits.push(c);
            } else if let Some((tier, needs, has)) = a.host_overflow {
                let rule = if tier == "NVMe" {
                    "does not fit in NVMe"
                } else {
                    "does not fit in host memory"
                };
                reject(
                    rule,
                    &|| {
                        format!(
                            "{}: needs {} of {tier} per node, has {}",
                            c.layout.label(),
                            crate::units::bytes(needs as f64),
                            crate::units::bytes(has as f64)
                        )
                    },
                    None,
                );
            } else {
                reject(
                    "does not fit in device memory",
                    &|| {
                        format!(
                            "{}: needs {} per device, has {}",
                            c.layout.label(),
                            crate::units::bytes(c.peak_bytes as f64),
                            crate::units::bytes(cluster.memory_bytes())
                        )
                    },
                    None,
                );
                if closest_miss
                    .as_ref()
                    .is_none_or(|m| c.peak_bytes < m.peak_bytes)
                {
                    closest_miss = Some(c);
                }
            }
        }
        fits.len()
    };
    let fitting = visit(&passes[0]);
    if fitting == 0 && pins.offload.is_none() {
        passes = profile
            .can_run
            .offload
            .iter()
            .filter(|o| **o != crate::layout::OffloadStates::None)
            .map(|&o| Pins {
                offload: Some(o),
                ..*pins
            })
            .collect();
        for pass in &passes {
            space::check_size(model, cluster, pass)?;
            visit(pass);
        }
    }
    let simulated = rank(model, cluster, &mut fits, &mut links, options);
    Ok(SearchResult {
        fits,
        evaluated,
        simulated,
        closest_miss,
        rejected,
    })
}

/// Simulates the fitting layouts in order of their lower bound until none left can matter,
/// then orders them: the near-tie group least-complex-first, then by step time, then the
/// unsimulated rest by bound. Returns the number of simulations run.
fn rank(
    model: &Model,
    cluster: &Cluster,
    fits: &mut [Candidate],
    links: &mut HashMap<(u64, u64, u64, u64), Links>,
    options: SearchOptions,
) -> u64 {
    fits.sort_by(|a, b| {
        a.lower_bound
            .total_cmp(&b.lower_bound)
            .then_with(|| complexity(&a.layout, cluster).cmp(&complexity(&b.layout, cluster)))
    });
    let top = options.top.max(1);
    let mut sim = Simulator::new();
    let mut times: Vec<f64> = Vec::new();
    let mut done = 0;
    for c in fits.iter_mut() {
        if let Some(&best) = times.first() {
            let kth = if times.len() >= top {
                times[top - 1]
            } else {
                f64::INFINITY
            };
            if c.lower_bound > kth.max(best * (1.0 + NEAR_TIE)) {
                break;
            }
        }
        let l = links
            .entry((c.layout.dp, c.layout.pp, c.layout.tp, c.layout.ep))
            .or_insert_with(|| Links::new(cluster, &c.layout.mesh(cluster)));
        let e = cost::evaluate(
            model,
            cluster,
            &c.layout,
            &c.split,
            l,
            &cost::layer_times(model, cluster, &c.layout, l, options.cost),
            options.cost,
        );
        let p = e.predict(&sim.run(&e.pipeline));
        let at = times.partition_point(|t| *t <= p.step_time_s);
        times.insert(at, p.step_time_s);
        c.prediction = Some(p);
        done += 1;
    }
    let best = times.first().copied().unwrap_or(f64::INFINITY);
    let head = &mut fits[..done];
    head.sort_by(|a, b| {
        let (ta, tb) = (a.step_time(), b.step_time());
        let (na, nb) = (ta <= best * (1.0 + NEAR_TIE), tb <= best * (1.0 + NEAR_TIE));
        nb.cmp(&na).then_with(|| {
            if na && nb {
                complexity(&a.layout, cluster).cmp(&complexity(&b.layout, cluster))
            } else {
                ta.total_cmp(&tb)
            }
        })
    });
    if let Some((chosen, others)) = head.split_first_mut() {
        for c in others.iter_mut().take(top) {
            c.why = Some(why::lost(chosen, c, cluster, model));
        }
    }
    sim.runs
}
