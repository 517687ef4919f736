//! `tessera plan` when no layout fits: the closest layout's memory, or why the pins allow none.

use std::process::ExitCode;

use anyhow::bail;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::search::{self, Pins, ORDERING};
use tessera_planner::{memory, units, Diagnostic};

use super::{check_written, cli_error, cluster_key, emit, pins, Format, PlanArgs};
use crate::output::memory_tables;

/// Nothing fits: explain the closest layout, or why the pins allow none.
pub(super) fn no_fit(
    args: &PlanArgs,
    model: &tessera_planner::Model,
    cluster: &tessera_planner::Cluster,
    result: &search::SearchResult,
    pins: &Pins,
) -> anyhow::Result<ExitCode> {
    let Some(miss) = &result.closest_miss else {
        // No layout could even be built: the pins (or the cluster size) rule everything out.
        // A pin that cannot take effect says most about what to change: its reasons first.
        let mut groups: Vec<_> = result.rejected.iter().collect();
        // Then the rule deepest in `Layout::check`: its layouts passed every earlier rule.
        groups.sort_by_key(|(rule, _)| {
            (
                !search::pins::RULES.contains(&rule.as_str()),
                std::cmp::Reverse(
                    tessera_planner::layout::CHECK_ORDER
                        .iter()
                        .position(|r| r == rule),
                ),
            )
        });
        let reasons: Vec<String> = groups
            .iter()
            .map(|(_, g)| g.example.clone())
            .take(3)
            .collect();
        let pinned = *pins != Pins::default();
        let problem = format!(
            "no layout of {} devices can be built: {}",
            cluster.devices,
            reasons.join("; ")
        );
        if pinned {
            // The first reason's own fix names the values that would pass, where it knows.
            let fix = groups.first().and_then(|(_, g)| g.fix.clone()).unwrap_or_else(|| {
                "change or drop the pinned values so that DP × PP × TP equals the device count and each degree divides what it splits (heads, layers, batch)".into()
            });
            return Err(cli_error(&pins::pinned_flags(args).join(" "), problem, fix));
        }
        if args.nodes.is_some() || args.devices.is_some() {
            return Err(cli_error(
                if args.nodes.is_some() { "--nodes" } else { "--devices" },
                problem,
                format!(
                    "pass a device count that the model's global batch ({}) and heads ({}) can be split over",
                    model.training.global_batch, model.architecture.heads
                ),
            ));
        }
        // The device count comes from the cluster file.
        let at = cluster_key(args, "nodes");
        return Err(anyhow::anyhow!(Diagnostic::new(
            &args.cluster,
            "nodes",
            problem,
            format!(
                "change `nodes` or `gpus_per_node` so that the model's global batch ({}) and heads ({}) can be split over the devices, or use fewer with --devices N",
                model.training.global_batch, model.architecture.heads
            ),
        )
        .at(at)));
    };
    // Layouts that fit on the device with offload but overflow the node's host tier: the
    // tier is what to change, not the device.
    for (rule, tier, fix) in [
        ("does not fit in host memory", "host memory", "a node with more host memory (the cluster's [host] memory_gib), offload to NVMe (--offload-to nvme, ZeRO-3), or more nodes (--nodes) to spread the shards"),
        ("does not fit in NVMe", "NVMe", "more NVMe per node (the cluster's [host] nvme_gib), or more nodes (--nodes) to spread the shards"),
    ] {
        if let Some(g) = result.rejected.get(rule) {
            bail!(
                "{} on {}: no layout of {} devices fits {}: {} layouts fit in device memory only by offloading, and none of them fits in the node's {tier} (e.g. {})\n  fix: {fix}",
                args.model.display(),
                args.cluster.display(),
                cluster.devices,
                model.name,
                g.count,
                g.example
            );
        }
    }
    // The split the search costed it with (whole groups of N layers under --recompute-every).
    let memory = memory::estimate_split(model, cluster, &miss.layout, &miss.split);
    let over = miss.peak_bytes as f64 - cluster.memory_bytes();
    let fully_pinned = result.evaluated == 1;
    if fully_pinned {
        if args.force {
            let plan = Plan::with_split(
                model,
                cluster,
                &miss.layout,
                &miss.split,
                SearchSummary {
                    ordering: ORDERING.into(),
                    evaluated: result.evaluated,
                    fitting: 0,
                    alternatives: vec![],
                },
            );
            check_written(&plan, args)?;
            emit(args, &plan)?;
        }
        let text = format!(
            "{} does not fit: stage {} needs {} per device, {} over the {} of a {}\n\n{}",
            miss.layout.label(),
            memory.peak_stage,
            units::bytes(miss.peak_bytes as f64),
            units::bytes(over),
            units::bytes(cluster.memory_bytes()),
            cluster.device.name,
            memory_tables(&memory, false)
        );
        if args.force {
            if args.format == Format::Table {
                println!("{text}\nwritten anyway (--force), marked infeasible");
            } else {
                eprintln!("{text}\nwritten anyway (--force), marked infeasible");
            }
            return Ok(ExitCode::SUCCESS);
        }
        eprintln!("{text}");
        bail!(Diagnostic::new(
            "<command line>",
            "pins",
            format!("the pinned layout is {} over device memory", units::bytes(over)),
            "unpin a knob (more recompute, a higher ZeRO stage, more TP or PP, a smaller micro-batch), or pass --force to write the plan marked infeasible"
        ));
    }
    bail!(
        "{} on {}: {}",
        args.model.display(),
        args.cluster.display(),
        tessera_planner::PlanError::NothingFits {
        model: model.name.clone(),
        devices: cluster.devices,
        layout: miss.layout.label(),
        need_bytes: miss.peak_bytes,
        have_bytes: cluster.memory_bytes() as u64,
        fix: format!(
            "use more devices (--nodes), devices with at least {} of memory, or a smaller global batch; of {} layouts evaluated none fits{}",
            units::bytes(miss.peak_bytes as f64),
            result.evaluated,
            super::finetune::alternatives(model, cluster, pins, miss.peak_bytes)
                .map(|s| format!("\n  fine-tuning: {s}"))
                .unwrap_or_default()
        ),
    }
    )
}
