//! `tessera plan`'s fine-tuning flags, and the no-fit report's walk down the seeds' decision
//! path (full → LoRA → QLoRA) with the planner's own numbers.

use clap::{Args, ValueEnum};
use tessera_planner::finetune::{Lora, Method, OptimizerStates};
use tessera_planner::search::{self, Pins, SearchOptions};
use tessera_planner::spec::FineTuneOverrides;
use tessera_planner::{units, Cluster, Model};

#[derive(Clone, Copy, ValueEnum)]
enum MethodArg {
    Full,
    Lora,
    Qlora,
}

#[derive(Clone, Copy, ValueEnum)]
enum StatesArg {
    Policy,
    #[value(name = "8bit")]
    Bit8,
}

/// How the job fine-tunes; each overrides the spec.
#[derive(Args, Default)]
pub(crate) struct FineTuneArgs {
    /// Train every parameter (`full`), or low-rank adapters on a frozen 16-bit (`lora`) or NF4
    /// (`qlora`) base (overrides `training.method`).
    #[arg(long, value_enum)]
    method: Option<MethodArg>,
    /// LoRA rank r (overrides `[lora] rank`; PEFT's default is 8).
    #[arg(long)]
    lora_rank: Option<u64>,
    /// LoRA alpha: the adapter's output is scaled by alpha / r (overrides `[lora] alpha`).
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// LoRA dropout on each adapter's input (overrides `[lora] dropout`).
    #[arg(long)]
    lora_dropout: Option<f64>,
    /// The linears that carry adapters: q,k,v,o,gate,up,down (the gpt family: qkv,o,up,down),
    /// or all (overrides `[lora] targets`).
    #[arg(long)]
    lora_targets: Option<String>,
    /// The optimizer's moments: the precision policy's own, or bitsandbytes' AdamW8bit
    /// (overrides `training.optimizer_states`).
    #[arg(long, value_enum)]
    optimizer_states: Option<StatesArg>,
}

impl FineTuneArgs {
    pub(crate) fn overrides(&self) -> FineTuneOverrides {
        FineTuneOverrides {
            method: self.method.map(|m| match m {
                MethodArg::Full => Method::Full,
                MethodArg::Lora => Method::Lora,
                MethodArg::Qlora => Method::Qlora,
            }),
            lora_rank: self.lora_rank,
            lora_alpha: self.lora_alpha,
            lora_dropout: self.lora_dropout,
            lora_targets: self.lora_targets.clone(),
            optimizer_states: self.optimizer_states.map(|s| match s {
                StatesArg::Policy => OptimizerStates::Policy,
                StatesArg::Bit8 => OptimizerStates::Bit8,
            }),
        }
    }
}

/// For a full job that fits nowhere: what LoRA and QLoRA at rank 16 on every linear would need
/// on the same devices, each from its own search (`None` for an adapter job, or a model that
/// cannot carry adapters). The job's own method never changes.
pub(super) fn alternatives(
    model: &Model,
    cluster: &Cluster,
    pins: &Pins,
    full_peak: u64,
) -> Option<String> {
    if model.training.method.adapters() {
        return None;
    }
    let mut lines = vec![format!(
        "full: {} per device",
        units::bytes(full_peak as f64)
    )];
    for method in [Method::Lora, Method::Qlora] {
        let mut m = model.clone();
        m.training.method = method;
        m.lora = Some(Lora {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: Lora::all_linear(&m.architecture),
        });
        if tessera_planner::finetune::check(&m.architecture, method, m.lora.as_ref()).is_err() {
            return None;
        }
        let options = SearchOptions {
            top: 1,
            cost: tessera_planner::cost::Options::for_model(&m, cluster),
        };
        let name = match method {
            Method::Lora => "LoRA r=16",
            _ => "QLoRA r=16",
        };
        let Ok(r) = search::search_checked(&m, cluster, pins, options) else {
            continue;
        };
        match (r.fits.first(), &r.closest_miss) {
            (Some(best), _) => lines.push(format!(
                "{name} fits at {} per device ({}; --method {} --lora-rank 16 --lora-targets all)",
                units::bytes(best.peak_bytes as f64),
                best.layout.label(),
                method.name()
            )),
            (None, Some(miss)) => lines.push(format!(
                "{name} does not fit either: {} per device",
                units::bytes(miss.peak_bytes as f64)
            )),
            (None, None) => {}
        }
    }
    Some(lines.join("; "))
}
