//! Framework profiles: what a training framework can run (a search space) and how it runs it
//! (its kernels' costs and its memory), as data in `specs/frameworks/*.toml`.
//!
//! The planner recommends with `megatron-core` (on GPUs) or `tessera` (on CPUs) when the model
//! spec names no framework; a spec's `training.framework` (or `--framework`) makes it predict the
//! run a user will launch on that framework instead: the search offers only the layouts the
//! profile can run, and the cost and memory models charge its loss, its host dispatch, its
//! sharding policy and its pipeline transfers. Every value in a profile names its source in the
//! file beside it.

mod profile;

pub use profile::{
    Allocator, AttentionKernel, CanRun, HostCost, LossKind, Memory, Profile, Reports, Runs,
    SelectiveKind, Sharding as ShardingPolicy, Unbuildable, Zero3Fetch,
};

use crate::fp8::recipe::Fp8Engine;

use std::sync::OnceLock;

use crate::layout::{Layout, Rejection};
use crate::model::Model;
use crate::spec::{Cluster, DeviceKind};

/// The built-in profiles, as shipped in specs/frameworks/ (embedded, so a plan made anywhere
/// reads the same data).
const FILES: &[(&str, &str)] = &[
    (
        "megatron-core",
        include_str!("../../../specs/frameworks/megatron-core.toml"),
    ),
    (
        "megatron-zb",
        include_str!("../../../specs/frameworks/megatron-zb.toml"),
    ),
    (
        "megatron-lm-2022",
        include_str!("../../../specs/frameworks/megatron-lm-2022.toml"),
    ),
    (
        "megatron-legacy",
        include_str!("../../../specs/frameworks/megatron-legacy.toml"),
    ),
    (
        "deepspeed",
        include_str!("../../../specs/frameworks/deepspeed.toml"),
    ),
    (
        "torchtitan",
        include_str!("../../../specs/frameworks/torchtitan.toml"),
    ),
    (
        "pytorch-eager",
        include_str!("../../../specs/frameworks/pytorch-eager.toml"),
    ),
    (
        "pytorch-compile",
        include_str!("../../../specs/frameworks/pytorch-compile.toml"),
    ),
    (
        "torchtitan-compile",
        include_str!("../../../specs/frameworks/torchtitan-compile.toml"),
    ),
    (
        "torchtitan-compile-blocks",
        include_str!("../../../specs/frameworks/torchtitan-compile-blocks.toml"),
    ),
    (
        "llm-foundry",
        include_str!("../../../specs/frameworks/llm-foundry.toml"),
    ),
    (
        "llm.c",
        include_str!("../../../specs/frameworks/llm.c.toml"),
    ),
    (
        "tessera",
        include_str!("../../../specs/frameworks/tessera.toml"),
    ),
];

/// The profile a GPU plan uses when the spec names none: today's recommending behaviour.
pub const DEFAULT_GPU: &str = "megatron-core";
/// The profile a CPU plan uses when the spec names none: Tessera's own CPU backend.
pub const DEFAULT_CPU: &str = "tessera";

fn all_parsed() -> &'static [Profile] {
    static ALL: OnceLock<Vec<Profile>> = OnceLock::new();
    ALL.get_or_init(|| {
        FILES
            .iter()
            .map(|(name, text)| {
                let p: Profile = toml::from_str(text).unwrap_or_else(|e| {
                    // The files are part of the build; `tests::every_profile_parses` keeps them
                    // valid, so this is a build defect, not bad user input.
                    panic!("specs/frameworks/{name}.toml does not parse: {e}")
                });
                assert_eq!(p.name, *name, "specs/frameworks/{name}.toml names itself");
                p
            })
            .collect()
    })
}

/// Every built-in profile.
pub fn all() -> &'static [Profile] {
    all_parsed()
}

/// The names of the built-in profiles, for messages.
pub fn names() -> Vec<&'static str> {
    FILES.iter().map(|(n, _)| *n).collect()
}

/// A built-in profile by name.
pub fn by_name(name: &str) -> Option<&'static Profile> {
    all().iter().find(|p| p.name == name)
}

/// The name of the profile a model on a cluster runs under: the spec's `training.framework`,
/// else the default for the cluster's device kind.
pub fn name_for<'a>(model: &'a Model, cluster: &Cluster) -> &'a str {
    match &model.training.framework {
        Some(n) => n.as_str(),
        None if cluster.device.kind == DeviceKind::Cpu => DEFAULT_CPU,
        None => DEFAULT_GPU,
    }
}

/// The profile a model on a cluster runs under. An unknown name (a plan.json edited by hand;
/// specs are checked when read) falls back to the device's default profile.
pub fn of(model: &Model, cluster: &Cluster) -> &'static Profile {
    let fallback = || {
        let d = if cluster.device.kind == DeviceKind::Cpu {
            DEFAULT_CPU
        } else {
            DEFAULT_GPU
        };
        by_name(d).expect("the default profiles are built in")
    };
    by_name(name_for(model, cluster)).unwrap_or_else(fallback)
}

/// How the model's framework runs FP8 linears: its profile's, or the GPU default's (FP8 runs
/// only on devices with an FP8 peak, none of them a CPU).
pub fn fp8_engine(model: &Model) -> Fp8Engine {
    let name = model.training.framework.as_deref().unwrap_or(DEFAULT_GPU);
    by_name(name)
        .or_else(|| by_name(DEFAULT_GPU))
        .map_or_else(Fp8Engine::default, |p| p.runs.fp8_engine())
}

/// [`fp8_engine`] on `layout`: under ZeRO-3 the weights are gathered for each layer's pass and
/// freed after it, so no FP8 copy outlives a micro-batch (TE turns its weight cache off under
/// FSDP2, `is_fsdp2`; Megatron-FSDP drops the FP8 transpose cache unless
/// `keep_fp8_transpose_cache` is set).
pub fn fp8_engine_on(model: &Model, layout: &Layout) -> Fp8Engine {
    let e = fp8_engine(model);
    Fp8Engine {
        weight_cache: e.weight_cache && layout.sharding.zero_stage < 3,
        ..e
    }
}

/// Whether the model's framework was stated (spec or flag) rather than defaulted.
pub fn stated(model: &Model) -> bool {
    model.training.framework.is_some()
}

/// A profile without a compiled variant, asked for one (`tessera plan --compile`, a
/// groundtruth run's `parallel.compile = true`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}\n  fix: {}", self.problem(), self.fix())]
pub struct NoCompiledVariant {
    pub profile: String,
}

impl NoCompiledVariant {
    /// What is wrong, naming the profile and its file: the message without the fix.
    pub fn problem(&self) -> String {
        format!(
            "framework profile \"{p}\" has no compiled variant (specs/frameworks/{p}.toml names no `compiled` profile: torch.compile applies to PyTorch-based frameworks)",
            p = self.profile
        )
    }

    /// The profiles that have a variant, as `eager → compiled`.
    pub fn fix(&self) -> String {
        let pairs: Vec<String> = all()
            .iter()
            .filter_map(|p| {
                let c = p.compiled.as_deref()?;
                (c != p.name).then(|| format!("{} → {c}", p.name))
            })
            .collect();
        format!(
            "drop --compile (a groundtruth run: `parallel.compile`), or name a profile that has a compiled variant: {}",
            pairs.join(", ")
        )
    }
}

/// The compiled variant of `profile` (its `compiled` key): `pytorch-eager` → `pytorch-compile`,
/// `torchtitan` → `torchtitan-compile`; a compiled profile is its own. The one mapping that
/// `tessera plan --compile` and the groundtruth replay's `parallel.compile` use.
pub fn compiled(profile: &Profile) -> Result<&'static Profile, NoCompiledVariant> {
    profile
        .compiled
        .as_deref()
        .and_then(by_name)
        .ok_or_else(|| NoCompiledVariant {
            profile: profile.name.clone(),
        })
}

/// The rule a layout breaks when its framework cannot run it.
pub const CANNOT_RUN: &str = "the framework cannot run this layout";

/// The rule a job breaks when its framework cannot build the model or run on its devices.
pub const CANNOT_BUILD: &str = "the framework cannot build this model or run on these devices";

/// Whether `profile` can run `layout`; the rejection names the profile and the knob.
pub fn admits(profile: &Profile, layout: &Layout) -> Result<(), Rejection> {
    match profile.can_run.refuses(layout) {
        None => Ok(()),
        Some((what, fix)) => Err(Rejection::new(
            CANNOT_RUN,
            format!("{} cannot run {what}", profile.name),
        )
        .with_fix(fix)),
    }
}

/// A profile that cannot build the model, or does not run on the cluster's devices: the whole
/// job is outside its `[can_run]`, whatever the layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}\n  fix: {}", self.problem(), .why.fix)]
pub struct CannotBuild {
    pub profile: String,
    pub why: Unbuildable,
}

impl CannotBuild {
    /// What is wrong, naming the profile, its file and the key: the message without the fix.
    pub fn problem(&self) -> String {
        format!(
            "framework profile \"{p}\" cannot build this job: {} (specs/frameworks/{p}.toml), and {}",
            self.why.key,
            self.why.found,
            p = self.profile
        )
    }
}

/// Whether `profile` builds `model` and runs on `cluster`'s devices (its `can_run`
/// `devices`, `architectures`, `moe` and `gqa`); the refusal names the profile and the key.
pub fn builds(profile: &Profile, model: &Model, cluster: &Cluster) -> Result<(), CannotBuild> {
    match profile.can_run.refuses_job(model, cluster) {
        None => Ok(()),
        Some(why) => Err(CannotBuild {
            profile: profile.name.clone(),
            why,
        }),
    }
}

#[cfg(test)]
mod tests;
