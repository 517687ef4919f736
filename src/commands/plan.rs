//! `tessera plan MODEL CLUSTER`: search the layouts, print the ranking, write plan.json.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Args, ValueEnum};
use tessera_planner::plan::{Alternative, Plan, SearchSummary};
use tessera_planner::precision::Policy;
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::search::{self, Pins, SearchOptions, ORDERING};
use tessera_planner::spec::{self, ClusterOverrides, TrainingOverrides};
use tessera_planner::{Cluster, Diagnostic, Layout, Model, Recompute};

use crate::files::{check_outputs, named, write_output};
use crate::output::{gib, memory_tables, table};

pub(super) mod batch;
mod finetune;
mod no_fit;
mod pins;

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum Format {
    Table,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum RecomputeArg {
    None,
    Selective,
    Full,
}

#[derive(Clone, Copy, ValueEnum)]
enum CpCommArg {
    P2p,
    AllGather,
}

#[derive(Clone, Copy, ValueEnum)]
enum ScheduleArg {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
    Interleaved,
    #[value(name = "zb-h1")]
    ZbH1,
    #[value(name = "zb-v")]
    ZbV,
    #[value(name = "dualpipe")]
    DualPipe,
}

#[derive(Args)]
pub struct PlanArgs {
    /// Model spec: a TOML spec (specs/models/) or a Hugging Face config.json.
    model: PathBuf,
    /// Cluster spec (specs/clusters/).
    cluster: PathBuf,
    /// Number of nodes (overrides the spec's `nodes`).
    #[arg(long, conflicts_with = "devices")]
    nodes: Option<u64>,
    /// Plan for the first N devices of the cluster (may be fewer than one node).
    #[arg(long)]
    devices: Option<u64>,
    /// How many ranked layouts to print.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Write the chosen plan to this file.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Human table, or the plan.json document on stdout.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Sequence length (required for a Hugging Face config; overrides the spec).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Sequences per optimizer step (required for a Hugging Face config; overrides the spec).
    #[arg(long)]
    global_batch: Option<u64>,
    /// The whole run's token budget (`training.tokens`): `15T`, `300B`, `2.5e12`. `plan` then
    /// prints the days, GPU-hours and cost to it, and `run` takes its step count from it.
    #[arg(long, value_parser = parse_tokens)]
    tokens: Option<u64>,
    /// The budget in optimizer steps instead (tokens = steps × global batch × sequence).
    #[arg(long)]
    steps: Option<u64>,
    #[command(flatten)]
    degrees: DegreePins,
    #[command(flatten)]
    finetune: finetune::FineTuneArgs,
    /// Predict for this framework (a profile of specs/frameworks/: megatron-core, torchtitan,
    /// deepspeed, pytorch-eager, ...; overrides the spec's `training.framework`): the search
    /// offers only what it can run, and its loss, host dispatch and memory are charged.
    #[arg(long)]
    framework: Option<String>,
    /// Predict the framework under torch.compile: its profile's compiled variant
    /// (pytorch-eager → pytorch-compile, torchtitan → torchtitan-compile; a compiled profile
    /// stays). Applies to --framework, else the spec's `training.framework`; a profile without
    /// a variant is refused, naming the ones that have one.
    #[arg(long)]
    compile: bool,
    /// FP8 GEMMs in the block's linears (overrides `training.fp8`): `tensorwise` or `rowwise`
    /// (torchao's dynamic scaling), `delayed` (Transformer Engine's), `blockwise` (DeepSeek-V3's
    /// 1×128 / 128×128 tiles), or `none`. The search never turns it on; `plan` shows what FP8
    /// would change for the chosen layout either way.
    #[arg(long, value_name = "RECIPE", value_parser = parse_fp8)]
    fp8: Option<tessera_planner::fp8::Recipe>,
    /// TP collectives overlapped with the GEMMs they feed or follow (sets
    /// `training.tp_comm_overlap`): Megatron-Core's --tp-comm-overlap, torchtitan's async TP.
    /// Counted under sequence parallelism, for a framework profile that has it.
    #[arg(long)]
    tp_comm_overlap: bool,
    /// Pin hybrid sharding on: ZeRO states sharded within a node only (HYBRID_SHARD).
    #[arg(long, conflicts_with = "no_hybrid_shard")]
    hybrid_shard: bool,
    /// Pin hybrid sharding off: ZeRO states sharded over the whole DP group.
    #[arg(long)]
    no_hybrid_shard: bool,
    /// Pin activation recompute.
    #[arg(long, value_enum)]
    recompute: Option<RecomputeArg>,
    /// With `--recompute full`: recompute every N-th layer only (layers N, 2N, …), keeping the
    /// others' activations (torchtitan's `selective_ac_option = "N"`).
    #[arg(long, requires = "recompute", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    recompute_every: Option<u64>,
    /// Pin sequence parallelism on.
    #[arg(long, conflicts_with = "no_sp")]
    sp: bool,
    /// Pin sequence parallelism off.
    #[arg(long)]
    no_sp: bool,
    /// Pin the pipeline schedule.
    #[arg(long, value_enum)]
    schedule: Option<ScheduleArg>,
    /// Pin the model chunks per stage (interleaved schedule; zb-v and dualpipe run 2).
    #[arg(long)]
    virtual_stages: Option<u64>,
    /// Pin how context parallelism exchanges keys and values: `p2p` (ring attention, overlapped)
    /// or `all-gather` (Llama 3's, exposed). Without `--cp`, the search then tries CP > 1 only.
    #[arg(long, value_enum)]
    cp_comm: Option<CpCommArg>,
    /// Pin the layers of the first pipeline stage; the middle stages share the rest evenly
    /// (Megatron-Core's `--decoder-first-pipeline-num-layers`). Interleaved, a stage one layer
    /// per chunk short leaves its first chunk only the embedding (Llama 3's layout).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    first_stage_layers: Option<u64>,
    /// Pin the layers of the last pipeline stage (Megatron-Core's
    /// `--decoder-last-pipeline-num-layers`); interleaved, its last chunk may hold only the
    /// output layer and loss.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000))]
    last_stage_layers: Option<u64>,
    /// Pin offload: `none`, `optimizer` (fp32 master weights, Adam moments and the step in
    /// host memory, ZeRO-Offload) or `params` (the sharded weights too, ZeRO-3; ZeRO-Infinity,
    /// FSDP's CPUOffload). Unpinned, the search offloads only layouts that do not fit without.
    #[arg(long)]
    offload: Option<tessera_planner::layout::OffloadStates>,
    /// Pin where offloaded states live: `cpu` (pinned host memory) or `nvme` (node-local NVMe,
    /// ZeRO-Infinity; needs ZeRO-3).
    #[arg(long)]
    offload_to: Option<tessera_planner::layout::OffloadTier>,
    /// Offload saved activations to host memory during the forward (torchtune's activation
    /// offloading, DeepSpeed's cpu_checkpointing), where the framework offers it.
    #[arg(long)]
    offload_activations: bool,
    /// Write the plan even if the layout does not fit (marked infeasible).
    #[arg(long)]
    force: bool,
    /// Write the predicted timeline of one step (Chrome trace, one track per pipeline stage),
    /// in the format `tessera run --trace` writes.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write a picture of the plan (SVG): the summary; per pipeline stage, the device memory as
    /// a stacked bar of every named term against the device's capacity; and one step's
    /// predicted time per stage (compute, exposed communication, bubble, optimizer).
    #[arg(long, value_name = "FILE.svg")]
    svg: Option<PathBuf>,
}

/// The degree pins `plan` and `replan` share.
#[derive(Args)]
pub(crate) struct DegreePins {
    /// Pin the tensor-parallel degree.
    #[arg(long)]
    pub tp: Option<u64>,
    /// Pin the pipeline-parallel degree.
    #[arg(long)]
    pub pp: Option<u64>,
    /// Pin the context-parallel degree: each sequence split over CP ranks by ring attention
    /// (Megatron-Core's `--context-parallel-size`).
    #[arg(long)]
    pub cp: Option<u64>,
    /// Pin the expert-parallel degree of an MoE model: each MoE layer's routed experts split
    /// over EP ranks cut from the DP × CP ranks (Megatron-Core's
    /// `--expert-model-parallel-size`).
    #[arg(long)]
    pub ep: Option<u64>,
    /// Pin the data-parallel degree.
    #[arg(long)]
    pub dp: Option<u64>,
    /// Pin the micro-batch size (sequences).
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Pin the ZeRO stage (0-3).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
}

impl DegreePins {
    /// These pins, every other one left to the search.
    pub(crate) fn pins(&self) -> Pins {
        Pins {
            dp: self.dp,
            pp: self.pp,
            tp: self.tp,
            cp: self.cp,
            ep: self.ep,
            micro_batch: self.micro_batch,
            zero: self.zero,
            ..Pins::default()
        }
    }
}

impl PlanArgs {
    fn pins(&self) -> Pins {
        Pins {
            hybrid: if self.hybrid_shard {
                Some(true)
            } else if self.no_hybrid_shard {
                Some(false)
            } else {
                None
            },
            recompute: self.recompute.map(|r| match r {
                RecomputeArg::None => Recompute::None,
                RecomputeArg::Selective => Recompute::Selective,
                RecomputeArg::Full => Recompute::Full,
            }),
            recompute_every: self.recompute_every,
            sp: if self.sp {
                Some(true)
            } else if self.no_sp {
                Some(false)
            } else {
                None
            },
            schedule: self.schedule.map(|s| match s {
                ScheduleArg::Gpipe => ScheduleKind::Gpipe,
                ScheduleArg::OneFOneB => ScheduleKind::OneFOneB,
                ScheduleArg::Interleaved => ScheduleKind::Interleaved,
                ScheduleArg::ZbH1 => ScheduleKind::ZbH1,
                ScheduleArg::ZbV => ScheduleKind::ZbV,
                ScheduleArg::DualPipe => ScheduleKind::DualPipe,
            }),
            virtual_stages: self.virtual_stages,
            cp_comm: self.cp_comm.map(|c| match c {
                CpCommArg::P2p => tessera_planner::layout::CpComm::P2p,
                CpCommArg::AllGather => tessera_planner::layout::CpComm::AllGather,
            }),
            stage_layers: tessera_planner::search::StageLayers {
                first: self.first_stage_layers,
                last: self.last_stage_layers,
            },
            offload: self.offload,
            offload_to: self.offload_to,
            offload_activations: self.offload_activations.then_some(true),
            ..self.degrees.pins()
        }
    }
}

/// The job's framework profile builds the model and runs on the cluster's devices, or the
/// refusal names where the profile came from: `--framework`, the spec's `training.framework`,
/// or the device's default.
fn check_framework_builds(args: &PlanArgs, model: &Model, cluster: &Cluster) -> anyhow::Result<()> {
    let profile = tessera_planner::framework::of(model, cluster);
    let Err(e) = tessera_planner::framework::builds(profile, model, cluster) else {
        return Ok(());
    };
    let (problem, fix) = (e.problem(), e.why.fix.clone());
    Err(if args.framework.is_some() {
        cli_error("--framework", problem, fix)
    } else if tessera_planner::framework::stated(model) {
        anyhow::anyhow!(Diagnostic::new(
            &args.model,
            "training.framework",
            problem,
            fix
        ))
    } else {
        anyhow::anyhow!(
            "{} on {}: {problem} (the default profile of this cluster's devices)\n  fix: {fix}",
            args.model.display(),
            args.cluster.display(),
        )
    })
}

fn cli_error(field: &str, problem: String, fix: String) -> anyhow::Error {
    anyhow::anyhow!(Diagnostic::new("<command line>", field, problem, fix))
}

pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    let mut outputs = Vec::new();
    if let Some(p) = &args.output {
        outputs.push(named("-o/--output", p));
    }
    if let Some(p) = &args.trace {
        outputs.push(named("--trace", p));
    }
    if let Some(p) = &args.svg {
        outputs.push(named("--svg", p));
    }
    check_outputs(
        &[named("MODEL", &args.model), named("CLUSTER", &args.cluster)],
        &outputs,
    )?;
    let over = TrainingOverrides {
        seq_len: args.seq_len,
        global_batch: args.global_batch,
        tokens: args.tokens,
        steps: args.steps,
    };
    let mut model = spec::load_model(&args.model, over)?;
    args.finetune.overrides().apply(&mut model)?;
    let cluster = spec::load_cluster(
        &args.cluster,
        ClusterOverrides {
            nodes: args.nodes,
            devices: args.devices,
        },
    )?;
    // A device that states its precision policy (the CPU backend's fp32) runs only that one:
    // every number below, the no-fit report's included, is the plan's own.
    let mut model = tessera_planner::precision::for_device(&model, &cluster).into_owned();
    if let Some(name) = &args.framework {
        if tessera_planner::framework::by_name(name).is_none() {
            return Err(cli_error(
                "--framework",
                format!("unknown framework profile \"{name}\""),
                format!(
                    "pass one of: {} (specs/frameworks/)",
                    tessera_planner::framework::names().join(" | ")
                ),
            ));
        }
        model.training.framework = Some(name.clone());
    }
    if args.compile {
        let profile = tessera_planner::framework::of(&model, &cluster);
        let compiled = tessera_planner::framework::compiled(profile)
            .map_err(|e| cli_error("--compile", e.problem(), e.fix()))?;
        model.training.framework = Some(compiled.name.clone());
    }
    check_framework_builds(&args, &model, &cluster)?;
    if let Some(r) = args.fp8 {
        model.training.fp8 = r;
    }
    tessera_planner::fp8::check(&model, &cluster, &args.model, &args.cluster).map_err(|d| {
        let at = cluster_key(&args, "device.peak_tflops");
        match d.field.as_str() {
            "device.peak_tflops_fp8" => anyhow::anyhow!(d.at(at)),
            _ if args.fp8.is_some() => cli_error("--fp8", d.problem, d.fix),
            _ => anyhow::anyhow!(d),
        }
    })?;
    if args.tp_comm_overlap {
        model.training.tp_comm_overlap = true;
    }
    tessera_planner::cost::tp_overlap::check(&model, &cluster, &args.model).map_err(|d| {
        if args.tp_comm_overlap {
            cli_error("--tp-comm-overlap", d.problem, d.fix)
        } else {
            anyhow::anyhow!(d)
        }
    })?;
    let mut pins = args.pins();
    if args.force && pins.offload.is_none() {
        // --force writes the one pinned layout as it is: no offload pass in its place.
        pins.offload = Some(Default::default());
    }
    for (flag, v) in [
        ("--tp", pins.tp),
        ("--pp", pins.pp),
        ("--dp", pins.dp),
        ("--cp", pins.cp),
        ("--ep", pins.ep),
        ("--micro-batch", pins.micro_batch),
        ("--virtual-stages", pins.virtual_stages),
    ] {
        if v == Some(0) {
            return Err(cli_error(
                flag,
                "must be at least 1, found 0".into(),
                format!("pass {flag} 1 or more"),
            ));
        }
    }
    let n = cluster.devices;
    for (flag, v) in [
        ("--tp", pins.tp),
        ("--pp", pins.pp),
        ("--dp", pins.dp),
        ("--cp", pins.cp),
    ] {
        if let Some(v) = v.filter(|v| n % v != 0) {
            let divisors = tessera_planner::search::divisors::listed(n);
            return Err(cli_error(
                flag,
                format!("{flag} {v} does not divide the {n} devices of the plan (DP × CP × PP × TP must equal the device count)"),
                format!("pass {flag} as a divisor of {n}: {divisors}, or change --nodes/--devices"),
            ));
        }
    }
    pins::check(&args, &model, &cluster)?;
    let options = SearchOptions {
        top: args.top.max(1),
        cost: tessera_planner::cost::Options::for_model(&model, &cluster),
    };
    let result = search::search_checked(&model, &cluster, &pins, options).map_err(|e| {
        anyhow::anyhow!(
            "{} on {}: {e}",
            args.model.display(),
            args.cluster.display()
        )
    })?;
    if args.force && result.evaluated > 1 {
        return Err(cli_error(
            "--force",
            format!(
                "--force writes one pinned layout that does not fit, and the pins leave {} layouts to search",
                result.evaluated
            ),
            format!(
                "pin every knob (--tp --pp --dp --micro-batch --zero --recompute --sp|--no-sp --schedule, and --hybrid-shard|--no-hybrid-shard on several nodes; pinned now: {}), or drop --force",
                match pins::pinned_flags(&args).join(" ") {
                    p if p.is_empty() => "none".to_string(),
                    p => p,
                }
            ),
        ));
    }
    let params = model.architecture.param_count();
    let Some(plan) = chosen_plan(&model, &cluster, &result, args.top) else {
        return no_fit::no_fit(&args, &model, &cluster, &result, &pins);
    };
    check_written(&plan, &args)?;
    super::run::check_runnable(&plan, &args.model)?;
    emit(&args, &plan)?;
    if args.format == Format::Table {
        // The plan's own: a device that states its policy (the CPU's fp32) replaces the spec's.
        let policy = Policy::by_name(&plan.job.model.training.precision).expect("validated");
        println!(
            "{}: {} parameters ({:.2}B) on {} × {} ({} devices, {} GiB each)",
            model.name,
            params,
            params as f64 / 1e9,
            cluster.name,
            cluster.device.name,
            cluster.devices,
            cluster.device.memory_gib
        );
        println!("precision policy \"{}\": {}", policy.name, policy.summary);
        let profile = tessera_planner::framework::of(&model, &cluster);
        println!(
            "framework profile \"{}\" ({}): {}",
            profile.name,
            if tessera_planner::framework::stated(&model) {
                "stated"
            } else {
                "the default; --framework or training.framework predicts another"
            },
            profile.summary
        );
        // The budget: `training.tokens`, or `--tokens` / `--steps`.
        batch::print(&args, &model, model.training.tokens.map(|t| t as f64));
        println!(
            "{} layouts evaluated, {} fit, {} pipeline simulations; ranked {}\n",
            result.evaluated,
            result.fits.len(),
            result.simulated,
            ORDERING
        );
        let shown = &result.fits[..result.fits.len().min(args.top.max(1))];
        // A CP column only where a shown layout has context parallelism.
        let with_cp = shown.iter().any(|c| c.layout.cp > 1);
        // An EP column only for a mixture-of-experts model.
        let with_ep = model.architecture.moe.is_some();
        let mut head = vec!["#", "dp"];
        if with_cp {
            head.push("cp");
        }
        if with_ep {
            head.push("ep");
        }
        head.extend([
            "tp",
            "pp",
            "mb",
            "m",
            "zero",
            "recompute",
            "sp",
            "schedule",
            "step s",
            "tokens/s/GPU",
            "MFU",
            "peak GiB",
            "% of mem",
        ]);
        let right: Vec<usize> = (0..head.len())
            .filter(|&i| !matches!(head[i], "recompute" | "sp" | "schedule"))
            .collect();
        let mut t = table(&head, &right);
        for (i, c) in shown.iter().enumerate() {
            let l = &c.layout;
            let (step, tokens, mfu) = match &c.prediction {
                Some(p) => (
                    format!("{:.3}", p.step_time_s),
                    format!("{:.0}", p.tokens_per_s_per_device),
                    format!("{:.1}%", 100.0 * p.mfu),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let mut row = vec![(i + 1).to_string(), l.dp.to_string()];
            if with_cp {
                row.push(match (l.cp, l.cp_comm) {
                    (1, _) => "1".into(),
                    (cp, tessera_planner::layout::CpComm::P2p) => cp.to_string(),
                    (cp, tessera_planner::layout::CpComm::AllGather) => format!("{cp} ag"),
                });
            }
            if with_ep {
                row.push(l.ep.to_string());
            }
            row.extend([
                l.tp.to_string(),
                l.pp.to_string(),
                l.micro_batch.to_string(),
                l.microbatches(&model).to_string(),
                format!(
                    "{}{}",
                    l.sharding.zero_stage,
                    if l.sharding.hybrid { "-hybrid" } else { "" }
                ),
                l.recompute.name().to_string(),
                if l.sequence_parallel { "yes" } else { "no" }.to_string(),
                schedule_label(l),
                step,
                tokens,
                mfu,
                gib(c.peak_bytes),
                format!(
                    "{:.0}%",
                    100.0 * c.peak_bytes as f64 / cluster.memory_bytes()
                ),
            ]);
            t.add_row(row);
        }
        println!("{t}\n");
        print_prediction(&plan);
        print_fp8(&plan);
        print_alternatives(&plan.search.alternatives);
        print!("{}", memory_tables(&plan.predicted.memory, false));
        print_rejections(&result);
        if let Some(path) = &args.output {
            println!("\nwrote {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The plan of the search's chosen layout (the first that fits), with the `top` ranked
/// alternatives and why each lost; `None` when nothing fits.
pub(crate) fn chosen_plan(
    model: &Model,
    cluster: &Cluster,
    result: &search::SearchResult,
    top: usize,
) -> Option<Plan> {
    let best = result.fits.first()?;
    let fastest = result
        .fits
        .iter()
        .filter(|c| c.prediction.is_some())
        .map(|c| c.step_time())
        .fold(f64::INFINITY, f64::min);
    let top: Vec<Alternative> = result
        .fits
        .iter()
        .take(top.max(1))
        .filter_map(|c| c.prediction.as_ref().map(|p| (c, p)))
        .enumerate()
        .map(|(i, (c, p))| Alternative {
            rank: i as u64 + 1,
            layout: c.layout.label(),
            peak_bytes: c.peak_bytes,
            step_time_s: p.step_time_s,
            tokens_per_s: p.tokens_per_s,
            mfu: p.mfu,
            breakdown: p.breakdown.clone(),
            why: c
                .why
                .clone()
                .unwrap_or_else(|| chosen_why(p.step_time_s, fastest)),
        })
        .collect();
    let summary = SearchSummary {
        ordering: ORDERING.to_string(),
        evaluated: result.evaluated,
        fitting: result.fits.len() as u64,
        alternatives: top,
    };
    Some(Plan::with_split(
        model,
        cluster,
        &best.layout,
        &best.split,
        summary,
    ))
}

/// Why the chosen layout (rank 1) is chosen.
fn chosen_why(step: f64, fastest: f64) -> String {
    if step <= fastest {
        "chosen: the fastest predicted step".into()
    } else {
        format!(
            "chosen: {:.1}% slower than the fastest, within {:.0}%, and the least complex",
            100.0 * (step / fastest - 1.0),
            100.0 * search::NEAR_TIE
        )
    }
}

/// The chosen layout's predicted step time, throughput, MFU and breakdown.
fn print_prediction(plan: &Plan) {
    let p = &plan.predicted;
    println!(
        "chosen: {}\npredicted step {:.3} s, {:.0} tokens/s ({:.0} per GPU), MFU {:.1}% (bottleneck stage {})",
        plan.parallel.layout().label(),
        p.step_time_s,
        p.tokens_per_s,
        p.tokens_per_s_per_device,
        100.0 * p.mfu,
        p.bottleneck_stage
    );
    println!("MFU counts {}", p.flop_convention);
    if let Some(v) = &plan.parallel.vocab {
        println!("vocabulary: {}", v.reason);
    }
    println!();
    let mut t = table(&["term", "seconds", "% of step", "why"], &[1, 2]);
    for term in &p.breakdown {
        t.add_row(vec![
            term.name.clone(),
            format!("{:.3}", term.seconds),
            format!("{:.1}%", 100.0 * term.seconds / p.step_time_s),
            term.reason.clone(),
        ]);
    }
    t.add_row(vec![
        "step".to_string(),
        format!("{:.3}", p.step_time_s),
        "100.0%".to_string(),
        "the sum of the terms".to_string(),
    ]);
    println!("{t}\n");
    for c in &p.caveats {
        println!("caveat ({}): {}", c.id, c.text);
    }
    if !p.caveats.is_empty() {
        println!();
    }
    print_whole_run(plan);
}

/// The whole-run summary (`tessera_planner::whole_run`), where the job or cluster states any
/// of it, with a blank line after.
pub(crate) fn print_whole_run(plan: &Plan) {
    let lines = tessera_planner::whole_run::report::lines(
        &plan.job.model,
        &plan.job.cluster,
        &plan.predicted,
    );
    if !lines.is_empty() {
        println!("{}\n", lines.join("\n"));
    }
}

/// What FP8 (GPU devices with an FP8 peak) and TP communication overlap (TP with SP, under a
/// framework that overlaps) change for the chosen layout, each with a blank line after.
pub(crate) fn print_fp8(plan: &Plan) {
    if let Some(c) = &plan.predicted.fp8 {
        let capacity = plan.job.cluster.memory_bytes() as u64;
        let lines = tessera_planner::fp8::report::lines(c, capacity);
        println!("{}\n", lines.join("\n"));
    }
    if let Some(c) = &plan.predicted.tp_overlap {
        let lines = tessera_planner::cost::tp_overlap::lines(c);
        println!("{}\n", lines.join("\n"));
    }
}

/// Why each ranked alternative lost to the chosen layout.
fn print_alternatives(alternatives: &[Alternative]) {
    if alternatives.len() < 2 {
        return;
    }
    println!("why the alternatives lost:");
    let mut t = table(&["#", "layout", "step s", "why"], &[0, 2]);
    for a in alternatives.iter().skip(1) {
        t.add_row(vec![
            a.rank.to_string(),
            a.layout.clone(),
            format!("{:.3}", a.step_time_s),
            a.why.clone(),
        ]);
    }
    println!("{t}\n");
}

fn schedule_label(l: &Layout) -> String {
    if l.pp == 1 {
        "-".into()
    } else if l.virtual_stages > 1 {
        format!("{}×{}", l.schedule.name(), l.virtual_stages)
    } else {
        l.schedule.name().into()
    }
}

/// Line and column of `key` in the cluster file, for an error about a value read from it.
fn cluster_key(args: &PlanArgs, key: &str) -> Option<(usize, usize)> {
    tessera_planner::source::Source::read(&args.cluster)
        .ok()?
        .toml_key(key)
}

/// A plan is written only if its reader would accept it. The job, the layout and the split
/// were checked on the way in and `predicted` is derived from them, so the one thing left that
/// `Plan::load` could refuse is a prediction that is not a finite number (a cluster whose peak
/// or bandwidth is vanishingly small: JSON has no infinity).
fn check_written(plan: &Plan, args: &PlanArgs) -> anyhow::Result<()> {
    let p = &plan.predicted;
    if !(p.step_time_s.is_finite() && p.tokens_per_s.is_finite() && p.mfu.is_finite()) {
        let at = cluster_key(args, "device.peak_tflops");
        bail!(Diagnostic::new(
            &args.cluster,
            "device",
            format!(
                "the cluster's rates give a predicted step time of {} s, which is not a number a plan can hold",
                p.step_time_s
            ),
            "check device.peak_tflops, device.memory_bandwidth_gbps and the links' bandwidth_gbps: each is a rate in TFLOP/s or GB/s",
        )
        .at(at));
    }
    Ok(())
}

fn emit(args: &PlanArgs, plan: &Plan) -> anyhow::Result<()> {
    let json = plan.to_json();
    if let Some(path) = &args.output {
        write_output(path, json.as_bytes())?;
    }
    if let Some(path) = &args.trace {
        let events = tessera_planner::trace::predicted(
            &plan.job.model,
            &plan.job.cluster,
            &plan.parallel.layout(),
        )
        .map_err(|e| anyhow::anyhow!("cannot simulate the schedule: {e}"))?;
        write_output(
            path,
            tessera_planner::trace::chrome_trace(&events, "predicted", "stage").as_bytes(),
        )?;
    }
    if let Some(path) = &args.svg {
        let picture =
            tessera_planner::picture::plan_svg(plan, &tessera_planner::picture::headline(plan))?;
        write_output(path, picture.as_bytes())?;
    }
    if args.format == Format::Json {
        print!("{json}");
    }
    Ok(())
}

fn print_rejections(result: &search::SearchResult) {
    if result.rejected.is_empty() {
        return;
    }
    println!("\nrejected layouts, by reason:");
    let mut t = table(&["count", "reason", "example"], &[0]);
    for (reason, g) in &result.rejected {
        t.add_row(vec![g.count.to_string(), reason.clone(), g.example.clone()]);
    }
    println!("{t}");
}

/// `--fp8`: a recipe name, the spec's `training.fp8` values.
fn parse_fp8(s: &str) -> Result<tessera_planner::fp8::Recipe, String> {
    tessera_planner::fp8::Recipe::by_name(s).ok_or_else(|| {
        let names: Vec<&str> = tessera_planner::fp8::RECIPES
            .iter()
            .map(|(n, _)| *n)
            .collect();
        format!("unknown FP8 recipe `{s}`: use one of {}", names.join(" | "))
    })
}

/// `--tokens`: a count with an optional K, M, B (or G) or T suffix, or a number like `2.5e12`.
fn parse_tokens(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, scale) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let scale = match c.to_ascii_uppercase() {
                'K' => 1e3,
                'M' => 1e6,
                'B' | 'G' => 1e9,
                'T' => 1e12,
                _ => {
                    return Err(format!(
                        "unknown suffix `{c}`: use K, M, B or T (15T, 300B)"
                    ))
                }
            };
            (&t[..i], scale)
        }
        _ => (t, 1.0),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a token count: write 15T, 300B or 2.5e12"))?;
    let n = x * scale;
    if !n.is_finite() || !(1.0..9.2e18).contains(&n) {
        return Err(format!(
            "a token budget must be between 1 and 9.2e18 tokens, found {s}"
        ));
    }
    Ok(n.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_tokens;

    #[test]
    fn token_counts_take_the_suffixes_people_write() {
        assert_eq!(parse_tokens("15T"), Ok(15_000_000_000_000));
        assert_eq!(parse_tokens("300B"), Ok(300_000_000_000));
        assert_eq!(parse_tokens("2.5e12"), Ok(2_500_000_000_000));
        assert_eq!(parse_tokens("1.5k"), Ok(1_500));
        assert!(parse_tokens("15X").is_err());
        assert!(parse_tokens("0").is_err());
        assert!(parse_tokens("-3T").is_err());
    }
}
