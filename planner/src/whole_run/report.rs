//! The whole-run summary `tessera plan` and `explain` print (and the picture draws above its
//! charts): time and cost to the budget, interruptions, the checkpoint cadence and goodput.

use crate::model::Model;
use crate::plan::Predicted;
use crate::spec::Cluster;
use crate::units;

/// A count with thousands separators.
fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Tokens in the largest unit that reads at least 1 (15T, 2.1B).
pub fn tokens(n: u64) -> String {
    let x = n as f64;
    for (unit, scale) in [("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)] {
        if x >= scale {
            let n = format!("{:.3}", x / scale);
            return format!("{}{unit}", n.trim_end_matches('0').trim_end_matches('.'));
        }
    }
    n.to_string()
}

/// Hours as days where a run takes more than two days.
fn duration(hours: f64) -> String {
    if hours >= 48.0 {
        format!("{:.1} days", hours / 24.0)
    } else if hours >= 1.0 {
        format!("{hours:.1} h")
    } else {
        format!("{:.1} min", hours * 60.0)
    }
}

/// GPU-hours, shortened.
fn gpu_hours(h: f64) -> String {
    if h >= 1e6 {
        format!("{:.2}M GPU-hours", h / 1e6)
    } else if h >= 1e3 {
        format!("{:.1}k GPU-hours", h / 1e3)
    } else {
        format!("{h:.1} GPU-hours")
    }
}

fn dollars(x: f64) -> String {
    if x >= 1e6 {
        format!("${:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("${:.1}k", x / 1e3)
    } else {
        format!("${x:.2}")
    }
}

/// The summary's lines (no trailing newline); empty when the plan has neither a budget nor a
/// cadence and the cluster states no whole-run table.
pub fn lines(model: &Model, cluster: &Cluster, p: &Predicted) -> Vec<String> {
    let mut out = Vec::new();
    let stated = p.whole_run.is_some()
        || cluster.reliability.is_some()
        || cluster.storage.is_some()
        || cluster.cost.is_some();
    if !stated {
        return out;
    }
    if let Some(w) = &p.whole_run {
        out.push(format!(
            "whole run: {} tokens = {} steps of {} tokens (global batch {} × sequence {})",
            tokens(w.tokens),
            count(w.steps),
            count(w.tokens_per_step),
            model.training.global_batch,
            model.training.seq_len
        ));
        out.push(format!(
            "  compute: {} at {:.3} s per step, {} (no interruption, no save)",
            duration(w.compute_hours),
            p.step_time_s,
            gpu_hours(w.compute_hours * cluster.devices as f64)
        ));
    }
    match (cluster.reliability, crate::whole_run::interruption_rate(cluster)) {
        (Some(r), Some(rate)) => {
            let mut why = format!(
                "{} GPUs / gpu_mtbf_hours {}",
                cluster.devices, r.gpu_mtbf_hours
            );
            if r.preemptions_per_hour > 0.0 {
                why += &format!(
                    " + {} nodes × preemptions_per_hour {}",
                    cluster.nodes, r.preemptions_per_hour
                );
            }
            let expect = p
                .whole_run
                .as_ref()
                .and_then(|w| w.interruptions)
                .map(|n| format!("; expect {n:.0} over the run"))
                .unwrap_or_default();
            out.push(format!(
                "  interruptions: one every {} ({why}), restart {} min{expect}",
                duration(1.0 / rate),
                r.restart_minutes
            ));
        }
        _ => out.push(
            "  interruptions: not predicted: the cluster spec has no [reliability] (gpu_mtbf_hours, restart_minutes)".into(),
        ),
    }
    match (&p.checkpoint, cluster.storage) {
        (Some(c), Some(s)) => {
            out.push(format!(
                "  checkpoint: a save writes {} ({} on the busiest node) in {:.1} s at {} GB/s per node",
                units::bytes(c.save_bytes),
                units::bytes(c.node_bytes),
                c.save_s,
                s.write_gbps,
            ));
            out.push(format!(
                "  cadence: save every {} steps (Daly's optimum, {:.0} s of compute between saves); goodput {:.1}%",
                count(c.save_every),
                c.interval_s,
                100.0 * c.goodput
            ));
        }
        (_, None) => out.push(
            "  checkpoint: no cadence: the cluster spec has no [storage] write_gbps (`tessera calibrate --storage DIR` measures a folder's)".into(),
        ),
        (None, Some(_)) => out.push(
            "  checkpoint: no cadence without [reliability]: the interval depends on the interruption rate".into(),
        ),
    }
    if let Some(w) = &p.whole_run {
        let stalled = p.checkpoint.as_ref().is_some_and(|c| c.goodput <= 0.0);
        let mut line = if stalled {
            "  wall clock: never finishes: interruptions come faster than a restart and a save (goodput 0)".to_string()
        } else {
            format!(
                "  wall clock: {}, {}",
                duration(w.wall_hours),
                gpu_hours(w.gpu_hours)
            )
        };
        match (w.cost_usd, cluster.cost) {
            (Some(x), Some(c)) if !stalled => {
                line += &format!(", {} at ${}/GPU-hour", dollars(x), c.usd_per_gpu_hour)
            }
            (_, None) => line += "; no cost: the cluster spec has no [cost] usd_per_gpu_hour",
            _ => {}
        }
        out.push(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_tokens_read_as_people_write_them() {
        assert_eq!(count(3_576_279), "3,576,279");
        assert_eq!(count(999), "999");
        assert_eq!(tokens(15_000_000_000_000), "15T");
        assert_eq!(tokens(2_100_000_000), "2.1B");
        assert_eq!(tokens(1_000), "1K");
    }
}
