//! Stage partitioning: how many consecutive layers each pipeline stage holds.
//!
//! The goal is the pipeline's steady state: the slowest stage sets the pace, so the split
//! minimises the largest stage time, where a stage's time is its layers' time plus what it holds
//! besides layers (the embedding on the first stage, the head and loss on the last), and each
//! stage holds no more layers than fit in its memory. Layer counts may be uneven.
//!
//! Two exact algorithms:
//! - [`balance`] for identical layers (every transformer this planner reads): stage `s` with `n`
//!   layers takes `n · t_s + e_s` (per-stage `t_s` also covers devices of different speeds), so
//!   the smallest feasible bottleneck `T` is the least `T` with `Σ min(cap_s, ⌊(T − e_s)/t_s⌋) ≥ L`,
//!   found by bisection and snapped to the stage time it is made of. O(stages · 64).
//! - [`balance_dp`] for layers of different cost: the classic dynamic program over prefixes,
//!   O(stages · L²), with an arbitrary memory test per (stage, layer range).
//!
//! Both are checked against brute force on small instances, and [`balance`] against an integer
//! program solved by good_lp on large ones (tests/partition_milp.rs). Memory caps here do not
//! depend on time, and contiguous splits are a DP's home ground, so the planner itself needs no
//! LP solver; good_lp is the test oracle. This module knows nothing of models or clusters: the
//! caller supplies times and caps.

/// A split problem over identical layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Layers to place; every stage gets at least one.
    pub layers: u64,
    /// Time of one layer on each stage (one entry per stage).
    pub layer_time: Vec<f64>,
    /// Time each stage spends besides its layers (embedding on the first, head on the last).
    pub extra_time: Vec<f64>,
    /// The most layers each stage can hold (its memory cap).
    pub max_layers: Vec<u64>,
}

impl Problem {
    fn stages(&self) -> usize {
        self.layer_time.len()
    }

    /// Time of stage `s` holding `n` layers.
    pub fn stage_time(&self, s: usize, n: u64) -> f64 {
        n as f64 * self.layer_time[s] + self.extra_time[s]
    }

    /// The largest stage time of a split.
    pub fn bottleneck(&self, split: &[u64]) -> f64 {
        split
            .iter()
            .enumerate()
            .map(|(s, &n)| self.stage_time(s, n))
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// Layers each stage can take within bottleneck `t` (at least 1 where it fits at all).
    fn capacity(&self, s: usize, t: f64) -> u64 {
        let room = (t - self.extra_time[s]) / self.layer_time[s];
        // A relative epsilon so that a stage time equal to `t` counts as within it.
        let n = (room * (1.0 + 1e-12) + 1e-12).floor();
        (n.max(0.0) as u64).min(self.max_layers[s])
    }
}

/// The split of identical layers with the smallest bottleneck, or `None` if the layers do not
/// fit (fewer layers than stages, or more than the caps allow). Among optimal splits it takes
/// the flattest: starting from each stage's room under the bottleneck, it removes surplus layers
/// one by one from the currently slowest stage (the earliest on a tie, which also holds the most
/// activations under 1F1B).
///
/// Bounded for any layer count: sums saturate, and the surplus left by the bisection (a few
/// layers per stage, more only when huge counts lose precision in f64) goes through a heap.
pub fn balance(p: &Problem) -> Option<Vec<u64>> {
    let stages = p.stages();
    let room = p.max_layers.iter().fold(0u64, |a, c| a.saturating_add(*c));
    let fits = stages > 0
        && p.layers >= stages as u64
        && p.max_layers.iter().all(|&c| c >= 1)
        && room >= p.layers
        && p.layer_time.iter().all(|t| *t > 0.0 && t.is_finite());
    if !fits {
        return None;
    }
    // Layers stage `s` takes at level `t`: its room under `t`, but at least one.
    let take = |s: usize, t: f64| p.capacity(s, t).max(1);
    let covered = |t: f64| (0..stages).fold(0u64, |a, s| a.saturating_add(take(s, t)));
    // Bisection for the least level that places every layer: lo does not, hi does. Stages
    // whose one layer already exceeds the level keep one, so the bottleneck is
    // max(level, slowest single-layer stage), which no split can beat.
    let (mut lo, mut hi) = (
        0.0,
        (0..stages)
            .map(|s| p.stage_time(s, p.max_layers[s].min(p.layers)))
            .fold(0.0, f64::max),
    );
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if covered(mid) >= p.layers {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let mut split: Vec<u64> = (0..stages).map(|s| take(s, hi)).collect();
    let total = |split: &[u64]| split.iter().fold(0u64, |a, n| a.saturating_add(*n));
    if total(&split) - p.layers > BULK_SURPLUS {
        lower_to_level(p, &mut split);
    }
    let surplus = total(&split) - p.layers;
    remove_surplus(p, &mut split, surplus);
    Some(split)
}

/// [`balance`] with at least `least[s]` layers on stage `s` (every entry ≥ 1):
/// stage `s` is given `least[s] − 1` layers up front, as extra time, and the balance places
/// the rest with at least one each.
pub fn balance_at_least(p: &Problem, least: &[u64]) -> Option<Vec<u64>> {
    let upfront: Vec<u64> = least.iter().map(|n| n.saturating_sub(1)).collect();
    let given = upfront.iter().try_fold(0u64, |a, n| a.checked_add(*n))?;
    let q = Problem {
        layers: p.layers.checked_sub(given)?,
        layer_time: p.layer_time.clone(),
        extra_time: (0..least.len())
            .map(|s| p.extra_time[s] + upfront[s] as f64 * p.layer_time[s])
            .collect(),
        max_layers: (0..least.len())
            .map(|s| p.max_layers[s].saturating_sub(upfront[s]))
            .collect(),
    };
    let split = balance(&q)?;
    Some(split.iter().zip(&upfront).map(|(n, u)| n + u).collect())
}

/// A surplus above this many layers (only with layer counts beyond f64's precision) is first
/// cut in bulk by [`lower_to_level`]; normal jobs never get there.
const BULK_SURPLUS: u64 = 1 << 16;

/// Removes `surplus` layers one by one, each from the currently slowest stage holding more than
/// one (the earliest on a tie), with a heap: O(surplus · log stages).
fn remove_surplus(p: &Problem, split: &mut [u64], mut surplus: u64) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    #[derive(PartialEq)]
    struct Key(f64, Reverse<usize>);
    impl Eq for Key {}
    impl PartialOrd for Key {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Key {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0).then(self.1.cmp(&o.1))
        }
    }
    let mut heap: BinaryHeap<Key> = (0..split.len())
        .filter(|&s| split[s] > 1)
        .map(|s| Key(p.stage_time(s, split[s]), Reverse(s)))
        .collect();
    while surplus > 0 {
        let Key(_, Reverse(s)) = heap
            .pop()
            .expect("the surplus is above one layer per stage");
        split[s] -= 1;
        surplus -= 1;
        if split[s] > 1 {
            heap.push(Key(p.stage_time(s, split[s]), Reverse(s)));
        }
    }
}

/// Lowers every stage to the least level `T` (by bisection, without the capacity's rounding
/// slack) at which the stages, each cut to `min(split, ⌊(T − e)/t⌋)` but kept at one layer or
/// more, still hold every layer: removing layers from the slowest stage first passes through
/// these cuts, so the bulk cut changes nothing but the time it takes.
fn lower_to_level(p: &Problem, split: &mut [u64]) {
    let cut = |s: usize, t: f64| -> u64 {
        let n = ((t - p.extra_time[s]) / p.layer_time[s]).floor().max(0.0) as u64;
        n.clamp(1, split[s].max(1))
    };
    let held = |t: f64| (0..split.len()).fold(0u64, |a, s| a.saturating_add(cut(s, t)));
    // Above every stage's time, so that `held(hi)` keeps the whole split.
    let (mut lo, mut hi) = (0.0, 2.0 * p.bottleneck(split) + 1.0);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        if held(mid) >= p.layers {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if held(hi) >= p.layers {
        let lowered: Vec<u64> = (0..split.len()).map(|s| cut(s, hi)).collect();
        split.copy_from_slice(&lowered);
    }
}

/// The split of layers with individual costs `layer_cost` (on a reference device) into
/// `speed.len()` contiguous stages minimising the largest stage time, where stage `s` takes
/// `Σ cost / speed[s] + extra[s]`, and `fits(s, start, end)` says whether layers `start..end`
/// fit in stage `s`'s memory. Exact (dynamic programming over prefixes); ties go to the split
/// whose earlier stages are smaller. `None` if no split fits.
pub fn balance_dp(
    layer_cost: &[f64],
    speed: &[f64],
    extra: &[f64],
    fits: &dyn Fn(usize, usize, usize) -> bool,
) -> Option<Vec<u64>> {
    let (l, p) = (layer_cost.len(), speed.len());
    if p == 0 || l < p || extra.len() != p {
        return None;
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(layer_cost.iter().scan(0.0, |acc, c| {
            *acc += c;
            Some(*acc)
        }))
        .collect();
    let time = |s: usize, a: usize, b: usize| (prefix[b] - prefix[a]) / speed[s] + extra[s];
    // best[s][i]: smallest bottleneck placing layers 0..i on stages 0..=s; cut[s][i]: start of s.
    let mut best = vec![vec![f64::INFINITY; l + 1]; p];
    let mut cut = vec![vec![usize::MAX; l + 1]; p];
    for i in 1..=l {
        if fits(0, 0, i) {
            best[0][i] = time(0, 0, i);
            cut[0][i] = 0;
        }
    }
    for s in 1..p {
        for i in s + 1..=l {
            for j in s..i {
                if best[s - 1][j].is_infinite() || !fits(s, j, i) {
                    continue;
                }
                let t = best[s - 1][j].max(time(s, j, i));
                // `<` keeps the smallest j on ties: earlier stages smaller.
                if t < best[s][i] {
                    best[s][i] = t;
                    cut[s][i] = j;
                }
            }
        }
    }
    if best[p - 1][l].is_infinite() {
        return None;
    }
    let mut split = vec![0u64; p];
    let mut end = l;
    for s in (0..p).rev() {
        let start = cut[s][end];
        split[s] = (end - start) as u64;
        end = start;
    }
    Some(split)
}

/// The first layer of each chunk of `split` (layers per virtual stage, pipeline order): the
/// running sum before it.
pub fn chunk_starts(split: &[u64]) -> Vec<u64> {
    split
        .iter()
        .scan(0, |acc, n| {
            let s = *acc;
            *acc += n;
            Some(s)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of `layers` into `stages` parts of at least one, by enumeration.
    fn all_splits(layers: u64, stages: usize) -> Vec<Vec<u64>> {
        if stages == 1 {
            return vec![vec![layers]];
        }
        let mut out = Vec::new();
        for first in 1..=layers.saturating_sub(stages as u64 - 1) {
            for mut rest in all_splits(layers - first, stages - 1) {
                rest.insert(0, first);
                out.push(rest);
            }
        }
        out
    }

    fn brute(p: &Problem) -> Option<f64> {
        all_splits(p.layers, p.layer_time.len())
            .into_iter()
            .filter(|s| s.iter().zip(&p.max_layers).all(|(n, c)| n <= c))
            .map(|s| p.bottleneck(&s))
            .min_by(f64::total_cmp)
    }

    /// A deterministic pseudo-random sequence for the instances (no external crate needed).
    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn partition_balance_matches_brute_force() {
        let mut seed = 7;
        for case in 0..400 {
            let stages = 1 + case % 5;
            let layers = stages as u64 + (case as u64 * 7) % 9;
            let p = Problem {
                layers,
                layer_time: (0..stages).map(|_| 0.5 + lcg(&mut seed)).collect(),
                extra_time: (0..stages).map(|_| 2.0 * lcg(&mut seed)).collect(),
                max_layers: (0..stages)
                    .map(|_| 1 + (lcg(&mut seed) * 6.0) as u64)
                    .collect(),
            };
            match (balance(&p), brute(&p)) {
                (None, None) => {}
                (Some(split), Some(want)) => {
                    assert_eq!(split.iter().sum::<u64>(), layers, "{p:?}");
                    assert!(split
                        .iter()
                        .zip(&p.max_layers)
                        .all(|(n, c)| *n >= 1 && n <= c));
                    let got = p.bottleneck(&split);
                    assert!((got - want).abs() <= 1e-9 * want, "{p:?}: {got} vs {want}");
                }
                (got, want) => panic!("{p:?}: balance {got:?}, brute force {want:?}"),
            }
        }
    }

    #[test]
    fn partition_dp_matches_brute_force_with_uneven_layers_and_speeds() {
        let mut seed = 11;
        for case in 0..300 {
            let stages = 1 + case % 4;
            let layers = stages + case % 6;
            let cost: Vec<f64> = (0..layers).map(|_| 0.2 + lcg(&mut seed)).collect();
            let speed: Vec<f64> = (0..stages).map(|_| 0.5 + lcg(&mut seed)).collect();
            let extra: Vec<f64> = (0..stages).map(|_| lcg(&mut seed)).collect();
            let cap: Vec<usize> = (0..stages)
                .map(|_| 1 + (lcg(&mut seed) * 5.0) as usize)
                .collect();
            let fits = |s: usize, a: usize, b: usize| b - a <= cap[s];
            let time = |split: &[u64]| {
                let mut start = 0usize;
                let mut worst = f64::NEG_INFINITY;
                for (s, &n) in split.iter().enumerate() {
                    let end = start + n as usize;
                    let t = cost[start..end].iter().sum::<f64>() / speed[s] + extra[s];
                    worst = worst.max(t);
                    start = end;
                }
                worst
            };
            let want = all_splits(layers as u64, stages)
                .into_iter()
                .filter(|sp| sp.iter().zip(&cap).all(|(n, c)| *n as usize <= *c))
                .map(|sp| time(&sp))
                .min_by(f64::total_cmp);
            let got = balance_dp(&cost, &speed, &extra, &fits);
            match (got, want) {
                (None, None) => {}
                (Some(split), Some(want)) => {
                    assert_eq!(split.iter().sum::<u64>(), layers as u64);
                    assert!((time(&split) - want).abs() <= 1e-9 * want);
                }
                (got, want) => panic!("case {case}: dp {got:?}, brute force {want:?}"),
            }
        }
    }

    #[test]
    fn partition_fast_path_agrees_with_the_dp_on_identical_layers() {
        let mut seed = 3;
        for case in 0..200 {
            let stages = 1 + case % 8;
            let layers = stages as u64 * (1 + case as u64 % 5) + case as u64 % 3;
            let t = 1.0 + lcg(&mut seed);
            let speed: Vec<f64> = (0..stages).map(|_| 0.6 + 0.4 * lcg(&mut seed)).collect();
            let extra: Vec<f64> = (0..stages)
                .map(|s| {
                    if s == 0 || s == stages - 1 {
                        3.0 * lcg(&mut seed)
                    } else {
                        0.0
                    }
                })
                .collect();
            let cap: Vec<u64> = (0..stages).map(|_| layers).collect();
            let p = Problem {
                layers,
                layer_time: speed.iter().map(|v| t / v).collect(),
                extra_time: extra.clone(),
                max_layers: cap,
            };
            let fast = balance(&p).unwrap();
            let dp =
                balance_dp(&vec![t; layers as usize], &speed, &extra, &|_, _, _| true).unwrap();
            let (a, b) = (p.bottleneck(&fast), p.bottleneck(&dp));
            assert!(
                (a - b).abs() <= 1e-9 * b,
                "{p:?}: fast {fast:?} {a}, dp {dp:?} {b}"
            );
        }
    }

    #[test]
    fn partition_moves_layers_off_the_head_stage() {
        // 8 layers of 1 s on 4 stages; the last stage's head costs 1.5 layers. Even would be
        // 2,2,2,2 with the last at 3.5 s; the best bottleneck is 3 s: 3,2,2,1 or similar.
        let p = Problem {
            layers: 8,
            layer_time: vec![1.0; 4],
            extra_time: vec![0.2, 0.0, 0.0, 1.5],
            max_layers: vec![8; 4],
        };
        let split = balance(&p).unwrap();
        assert_eq!(split.iter().sum::<u64>(), 8);
        assert!((p.bottleneck(&split) - 3.0).abs() < 1e-12, "{split:?}");
        assert_eq!(split[3], 1);
    }

    /// Layer counts near 2^63: no overflow, no per-layer loop, and still a valid split.
    #[test]
    fn partition_balance_is_bounded_for_huge_layer_counts() {
        for (layers, stages) in [
            (i64::MAX as u64, 3usize),
            (1u64 << 62, 1000),
            (u64::MAX / 2, 7),
        ] {
            let p = Problem {
                layers,
                layer_time: (0..stages)
                    .map(|s| 1e-9 * (1.0 + s as f64 / 10.0))
                    .collect(),
                extra_time: (0..stages).map(|s| s as f64).collect(),
                max_layers: vec![u64::MAX; stages],
            };
            let start = std::time::Instant::now();
            let split = balance(&p).expect("fits");
            assert!(start.elapsed().as_secs_f64() < 5.0);
            assert_eq!(
                split.iter().fold(0u128, |a, n| a + *n as u128),
                layers as u128
            );
            assert!(split.iter().all(|n| *n >= 1));
        }
        // Caps that overflow a u64 sum still fit.
        let p = Problem {
            layers: 10,
            layer_time: vec![1.0; 3],
            extra_time: vec![0.0; 3],
            max_layers: vec![u64::MAX; 3],
        };
        let split = balance(&p).expect("fits");
        assert_eq!((split.iter().sum::<u64>(), p.bottleneck(&split)), (10, 4.0));
    }

    #[test]
    fn partition_respects_memory_caps_and_reports_no_fit() {
        let mut p = Problem {
            layers: 10,
            layer_time: vec![1.0; 3],
            extra_time: vec![0.0; 3],
            max_layers: vec![2, 6, 6],
        };
        let split = balance(&p).unwrap();
        assert!(split[0] <= 2);
        assert_eq!(p.bottleneck(&split), 4.0);
        p.max_layers = vec![2, 3, 4];
        assert_eq!(balance(&p), None, "9 layers of room for 10");
        p.max_layers = vec![0, 6, 6];
        assert_eq!(balance(&p), None, "a stage that fits no layer");
    }
}
