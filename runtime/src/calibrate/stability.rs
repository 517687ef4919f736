//! Whether a calibration can be trusted: each figure repeated until its runs agree (or a cap),
//! with the spread it ended at, and whether other work shared the host while it measured.
//!
//! - [`repeat`] times a phase at least [`KEEP`] times and stops once the [`KEEP`] fastest runs
//!   are within [`STABLE_SPREAD`] of each other, or after [`MAX_RUNS`] runs or
//!   [`PHASE_BUDGET_S`] seconds; the figure is the median of those fastest runs (one lucky run
//!   does not set it, and the slow runs a neighbour caused are not in it).
//! - [`CpuTimes`] reads the host's and this process's CPU time (Linux `/proc/stat` and
//!   `/proc/self/stat`) before and after; [`Load`] is the share of the host's CPU time that
//!   other processes took in between. A share above [`LOADED_SHARE`] is a calibration under
//!   load: its rates are what this host gave while it was shared, not what it gives a training
//!   run alone.
//!
//! This module measures nothing itself and prints nothing.

use std::time::Instant;

/// Runs kept: the figure is the median of the fastest `KEEP`, and their spread is the
/// stability test. Also the fewest runs taken.
pub const KEEP: usize = 3;

/// The fastest [`KEEP`] runs agreeing within this fraction ((slowest − fastest) / fastest) is
/// a stable figure.
pub const STABLE_SPREAD: f64 = 0.05;

/// The most runs of one phase.
pub const MAX_RUNS: usize = 10;

/// Seconds after which a phase stops repeating (once it has [`KEEP`] runs), stable or not.
pub const PHASE_BUDGET_S: f64 = 5.0;

/// Other processes taking more than this share of the host's CPU time while it measured: the
/// calibration was under load.
pub const LOADED_SHARE: f64 = 0.10;

/// How one figure's repeated runs agreed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Timed runs taken.
    pub runs: usize,
    /// (slowest − fastest) / fastest of the [`KEEP`] fastest runs.
    pub spread: f64,
}

impl Spread {
    pub fn stable(&self) -> bool {
        self.spread <= STABLE_SPREAD
    }

    /// "2.1% over 3 runs".
    pub fn describe(&self) -> String {
        format!("{:.1}% over {} runs", self.spread * 100.0, self.runs)
    }
}

/// Seconds of a phase: `once()` (one timed run, seconds) repeated as the module says, with the
/// spread it ended at; `budget_s` bounds the repeating.
pub fn repeat(budget_s: f64, mut once: impl FnMut() -> f64) -> (f64, Spread) {
    let start = Instant::now();
    let mut times: Vec<f64> = Vec::new();
    loop {
        times.push(once());
        if times.len() < KEEP {
            continue;
        }
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        let kept = &sorted[..KEEP];
        let spread = if kept[0] > 0.0 {
            (kept[KEEP - 1] - kept[0]) / kept[0]
        } else {
            0.0
        };
        let s = Spread {
            runs: times.len(),
            spread,
        };
        if s.stable() || times.len() >= MAX_RUNS || start.elapsed().as_secs_f64() >= budget_s {
            return (kept[KEEP / 2], s);
        }
    }
}

/// The host's CPU time (all cores) and this process's (all its threads), in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuTimes {
    /// Every core's time, busy or idle.
    pub total: u64,
    /// Every core's busy time (not idle, not waiting on I/O).
    pub busy: u64,
    /// This process's user and system time.
    pub own: u64,
}

impl CpuTimes {
    /// Now, where `/proc` can be read.
    pub fn now() -> Option<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        CpuTimes::parse(&stat, &own)
    }

    /// From the texts of `/proc/stat` and `/proc/self/stat`.
    pub fn parse(stat: &str, own: &str) -> Option<CpuTimes> {
        let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let f: Vec<u64> = cpu
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        if f.len() < 5 {
            return None;
        }
        let total: u64 = f.iter().sum();
        let busy = total - f[3] - f[4];
        // After the command's ")": state is field 3, utime 14 and stime 15.
        let rest = &own[own.rfind(')')? + 1..];
        let g: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = g.get(11)?.parse().ok()?;
        let stime: u64 = g.get(12)?.parse().ok()?;
        Some(CpuTimes {
            total,
            busy,
            own: utime + stime,
        })
    }
}

/// What else ran on the host while it measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// The share of the host's CPU time (all cores) that other processes took.
    pub others: f64,
    /// The 1-minute load average when the measurement started, where it can be read.
    pub load_before: Option<f64>,
}

impl Load {
    /// From CPU times before and after the measurement.
    pub fn between(before: CpuTimes, after: CpuTimes, load_before: Option<f64>) -> Option<Load> {
        let total = after.total.checked_sub(before.total)?;
        if total == 0 {
            return None;
        }
        let busy = after.busy.saturating_sub(before.busy);
        let own = after.own.saturating_sub(before.own);
        let others = (busy.saturating_sub(own) as f64 / total as f64).clamp(0.0, 1.0);
        Some(Load {
            others,
            load_before,
        })
    }

    pub fn loaded(&self) -> bool {
        self.others > LOADED_SHARE
    }
}

/// The 1-minute load average (`/proc/loadavg`), where it can be read.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs go on until the fastest three agree within 5%, and the figure is their median.
    #[test]
    fn repeats_until_the_fastest_runs_agree() {
        let mut seq = [1.0, 2.0, 1.5, 1.02, 1.01, 9.0].into_iter();
        let (t, s) = repeat(1e9, || seq.next().unwrap());
        assert_eq!((t, s.runs), (1.01, 5));
        assert!(s.stable() && (s.spread - 0.02).abs() < 1e-12, "{s:?}");
        // A quiet phase stops at three runs.
        let (t, s) = repeat(1e9, || 1.0);
        assert_eq!((t, s.runs, s.spread), (1.0, KEEP, 0.0));
    }

    /// A phase that never settles stops at the cap (or the time budget) and says its spread.
    #[test]
    fn an_unstable_phase_stops_at_the_cap_with_its_spread() {
        let mut x = 1.0;
        let (_, s) = repeat(1e9, || {
            x *= 1.5;
            x
        });
        assert_eq!(s.runs, MAX_RUNS);
        assert!(!s.stable() && (s.spread - 1.25).abs() < 1e-9, "{s:?}");
        let mut x = 1.0;
        let (_, s) = repeat(0.0, || {
            x *= 1.5;
            x
        });
        assert_eq!(s.runs, KEEP);
    }

    /// Other processes' share is the host's busy time less this process's, over all time.
    #[test]
    fn load_is_the_others_share_of_the_hosts_cpu_time() {
        let stat = |user: u64, idle: u64| {
            format!("cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
        };
        let own = |ticks: u64| format!("42 (tessera (x)) R 1 2 3 4 5 6 7 8 9 10 {ticks} 0 0 0");
        let a = CpuTimes::parse(&stat(100, 100), &own(10)).unwrap();
        assert_eq!((a.total, a.busy, a.own), (200, 100, 10));
        // 200 ticks pass: 150 busy, 100 of them ours: others took 50 of 200.
        let b = CpuTimes::parse(&stat(250, 150), &own(110)).unwrap();
        let l = Load::between(a, b, Some(1.5)).unwrap();
        assert_eq!(l.others, 0.25);
        assert!(l.loaded());
        // All of it ours: quiet.
        let c = CpuTimes::parse(&stat(300, 100), &own(210)).unwrap();
        assert_eq!(Load::between(a, c, None).unwrap().others, 0.0);
        assert!(Load::between(a, a, None).is_none());
        assert!(CpuTimes::parse("nonsense", "1 (x) R").is_none());
    }
}
