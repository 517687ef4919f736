//! What a run starts from and saves: `--save-dir DIR [--save-every N] [--keep K]`,
//! `--resume DIR|auto` and `--init-from DIR`, resolved. The format, the atomic save and the
//! resharding load live in `crate::checkpoint` (docs/checkpoints.md), the Hugging Face reader
//! in `crate::hf`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_planner::plan::Plan;

use crate::checkpoint::{self, Checkpoint, Claim, SaveOptions, Survey};
use crate::exec::InitialParams;
use crate::layers::dropout::DropoutRates;

use super::{refused, Observer, SessionError};

/// `--resume auto` without `--save-dir`.
fn auto_without_save_dir() -> SessionError {
    refused(
        "--resume auto: resumes the newest checkpoint in --save-dir, and no --save-dir was given",
        "add --save-dir DIR, or pass --resume DIR",
    )
}

/// `--init-from` given a Tessera checkpoint: refused, pointing at `--resume` and the export.
fn init_from_checkpoint(dir: &Path) -> SessionError {
    refused(
        format!(
            "--init-from {}: is a Tessera checkpoint, not a Hugging Face model folder (config.json + model.safetensors)",
            dir.display()
        ),
        format!(
            "continue it with --resume {} (its optimizer state and step too), or export it first with `tessera checkpoint export {} --to hf -o DIR` and pass DIR",
            dir.display(),
            dir.display()
        ),
    )
}

/// A checkpoint the executor's checks refused, blamed on `flag`.
fn refused_run(flag: &str, e: crate::exec::RunError) -> SessionError {
    match e {
        crate::exec::RunError::Checkpoint(c) => SessionError::Checkpoint {
            context: flag.into(),
            source: Box::new(c),
        },
        e => SessionError::Run(Box::new(e)),
    }
}

/// Where a run saves, and what it resumes or starts from (`tessera run`'s checkpoint flags,
/// with the `cli` feature).
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct CheckpointOptions {
    /// Save sharded checkpoints here (DIR/step-N, and DIR/latest naming the newest): after
    /// every --save-every steps, after the last step, and when a SIGINT/SIGTERM stops the run.
    #[cfg_attr(feature = "cli", arg(long))]
    pub save_dir: Option<PathBuf>,
    /// With --save-dir: save after every N steps, or `auto`: the plan's recommended interval
    /// (`predicted.checkpoint.save_every`: Daly's optimum for the cluster's [reliability] and
    /// [storage]) [default: only after the last step]
    #[cfg_attr(feature = "cli", arg(long, requires = "save_dir", value_parser = SaveEvery::parse))]
    pub save_every: Option<SaveEvery>,
    /// With --save-dir: keep the K newest checkpoints, pruning older ones only after a save is
    /// complete [default: keep all]
    #[cfg_attr(feature = "cli", arg(long, requires = "save_dir", value_parser = clap::value_parser!(u64).range(1..=1_000_000)))]
    pub keep: Option<u64>,
    /// Continue from a checkpoint: a save directory (its newest), one step-N directory, or
    /// `auto` (the newest in --save-dir, or a fresh start if it has none). The plan may differ
    /// from the one that saved it (the state is resharded); --steps counts from step 0.
    #[cfg_attr(feature = "cli", arg(long))]
    pub resume: Option<String>,
    /// Start from a Hugging Face model folder (model.safetensors + config.json of
    /// GPT2LMHeadModel or LlamaForCausalLM, e.g. from `tessera checkpoint export`) instead of
    /// the seed's initialisation, sharded onto the plan's layout, with fresh optimizer state.
    /// The config must describe the plan's model.
    #[cfg_attr(feature = "cli", arg(long, conflicts_with = "resume"))]
    pub init_from: Option<PathBuf>,
    /// With --save-dir: write into a folder that holds checkpoints this run does not resume
    /// (their steps of the same number are replaced and `latest` moves to this run's; --keep
    /// still prunes only this run's own checkpoints) [default: such a folder is refused]
    #[cfg_attr(feature = "cli", arg(long, requires = "save_dir"))]
    pub overwrite: bool,
}

/// `--save-every`: a step count, or the plan's recommended one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveEvery {
    Steps(u64),
    Auto,
}

impl SaveEvery {
    /// `auto`, or a step count from 1 to 10^9.
    pub fn parse(s: &str) -> Result<SaveEvery, String> {
        if s == "auto" {
            return Ok(SaveEvery::Auto);
        }
        match s.parse::<u64>() {
            Ok(n) if (1..=1_000_000_000).contains(&n) => Ok(SaveEvery::Steps(n)),
            _ => Err(format!(
                "`{s}` is neither a step count from 1 to 1000000000 nor `auto`"
            )),
        }
    }

    /// The step count for `plan`: `auto` takes the plan's recommended interval, and is refused
    /// when the plan has none, naming the cluster spec's missing table.
    pub fn steps(self, plan: &Plan) -> Result<u64, SessionError> {
        match self {
            SaveEvery::Steps(n) => Ok(n),
            SaveEvery::Auto => match &plan.predicted.checkpoint {
                Some(c) => Ok(c.save_every),
                None => {
                    let c = &plan.job.cluster;
                    let missing = match (c.reliability.is_some(), c.storage.is_some()) {
                        (false, false) => "[reliability] and [storage] tables",
                        (false, true) => "[reliability] table",
                        _ => "[storage] table",
                    };
                    Err(refused(
                        format!(
                            "--save-every auto: the plan's cluster spec ({}) has no {missing}, so the plan has no checkpoint interval (predicted.checkpoint)",
                            c.name
                        ),
                        "add [reliability] (gpu_mtbf_hours, restart_minutes) and [storage] (write_gbps; `tessera calibrate --storage DIR` measures it) to the cluster spec and plan again, or pass --save-every N",
                    ))
                }
            },
        }
    }
}

impl CheckpointOptions {
    /// What can be refused before anything is read or written (and, under `tessera launch`,
    /// before any rank starts): a `--save-dir` that is a file, that cannot be written, or that
    /// holds checkpoints this run does not continue (without `--overwrite`); `--resume auto`
    /// without `--save-dir`; a `--resume` or `--init-from` path that is not there; a Tessera
    /// checkpoint given to `--init-from`.
    pub fn check(&self) -> Result<(), SessionError> {
        let cwd = || {
            std::env::current_dir()
                .map(|d| format!(" (relative paths start in {})", d.display()))
                .unwrap_or_default()
        };
        if let Some(dir) = &self.save_dir {
            if dir.exists() && !dir.is_dir() {
                return Err(refused(
                    format!("--save-dir {}: is not a directory", dir.display()),
                    "pass a directory (it is created if missing)",
                ));
            }
            // The nearest folder that exists must take a new file.
            let mut at = dir.as_path();
            while !at.exists() {
                match at.parent() {
                    Some(p) if !p.as_os_str().is_empty() => at = p,
                    _ => {
                        at = Path::new(".");
                        break;
                    }
                }
            }
            let probe = at.join(format!(".tessera-probe-{}", std::process::id()));
            match std::fs::File::create(&probe) {
                Ok(_) => {
                    std::fs::remove_file(&probe).ok();
                }
                Err(e) => {
                    return Err(refused(
                        format!(
                            "--save-dir {}: cannot write in {}: {e}",
                            dir.display(),
                            at.display()
                        ),
                        "pass a --save-dir in a folder this user may write",
                    ))
                }
            }
            let survey = Survey::of(dir);
            let continues = match self.resume.as_deref() {
                Some("auto") => true,
                Some(p) => {
                    let canon = |p: &Path| std::fs::canonicalize(p).ok();
                    let r = Path::new(p);
                    let d = canon(dir);
                    d.is_some() && (canon(r) == d || r.parent().and_then(canon) == d)
                }
                None => false,
            };
            if survey.holds_checkpoints() && !continues && !self.overwrite {
                // The same refusal as the claim's, before anything starts.
                let e = checkpoint::refuse_foreign(dir, &survey, self.resume.as_deref());
                return Err(refused(
                    format!("--save-dir {}: {}", dir.display(), e.0),
                    e.1,
                ));
            }
        }
        if let (Some("auto"), None) = (self.resume.as_deref(), &self.save_dir) {
            return Err(auto_without_save_dir());
        }
        if let Some(p) = self.resume.as_deref().filter(|p| *p != "auto") {
            if !Path::new(p).exists() {
                return Err(refused(
                    format!("--resume {p}: no such checkpoint or folder{}", cwd()),
                    "pass a save directory or one of its step-N directories",
                ));
            }
        }
        if let Some(dir) = &self.init_from {
            if dir.join(checkpoint::INDEX).is_file() || dir.join(checkpoint::LATEST).is_file() {
                return Err(init_from_checkpoint(dir));
            }
            if !dir.is_dir() {
                return Err(refused(
                    format!("--init-from {}: no such folder{}", dir.display(), cwd()),
                    "pass a Hugging Face model folder (config.json + model.safetensors)",
                ));
            }
        }
        Ok(())
    }

    /// The save settings of a run of `steps` steps, whose checkpoints record `lineage`.
    pub fn save(&self, steps: u64, lineage: Option<String>) -> Option<SaveOptions> {
        self.save_dir.as_ref().map(|dir| SaveOptions {
            dir: dir.clone(),
            every: match self.save_every {
                Some(SaveEvery::Steps(n)) => n,
                // Resolved against the plan in `Session::prepare`; unresolved, the last step.
                _ => steps,
            } as usize,
            keep: self.keep.map(|k| k as usize),
            lineage,
        })
    }

    /// Claims `--save-dir` for this run before its first step (`checkpoint::claim`: created,
    /// writable, locked against other runs, and not holding checkpoints this run does not
    /// continue unless `--overwrite`); without it, says plainly that a resumed run keeps
    /// nothing.
    pub fn claim(
        &self,
        plan_file: &Path,
        resumed: Option<&Checkpoint>,
        obs: &mut dyn Observer,
    ) -> Result<Option<Claim>, SessionError> {
        let Some(dir) = &self.save_dir else {
            if let Some(ck) = resumed {
                obs.warn(&format!(
                    "--resume {}: this run has no --save-dir, so it saves no checkpoint: the steps it trains after step {} are not kept (add --save-dir DIR to keep them)",
                    self.resume.as_deref().unwrap_or_default(),
                    ck.step()
                ));
            }
            return Ok(None);
        };
        let job = std::env::var("TESSERA_JOB_TOKEN")
            .map(|t| format!(", job token {t}"))
            .unwrap_or_default();
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let owner = format!(
            "pid {} (tessera run {}{job}), since unix time {since}",
            std::process::id(),
            plan_file.display()
        );
        checkpoint::claim(dir, resumed, self.overwrite, &owner)
            .map(Some)
            .map_err(|e| match e {
                checkpoint::CheckpointError::Invalid { path, problem, fix } => {
                    refused(format!("--save-dir {path}: {problem}"), fix)
                }
                e => SessionError::Checkpoint {
                    context: "--save-dir".into(),
                    source: Box::new(e),
                },
            })
    }

    /// The checkpoint to resume, opened and checked (every shard against its index, the index
    /// against itself and its tensors), or `None` for a fresh start. Refuses a checkpoint at
    /// or past `steps` (the run would train nothing). Called after [`Self::check`].
    pub(super) fn resume(
        &self,
        steps: u64,
        obs: &mut dyn Observer,
    ) -> Result<Option<Arc<Checkpoint>>, SessionError> {
        let path = match self.resume.as_deref() {
            None => return Ok(None),
            Some("auto") => {
                let Some(dir) = &self.save_dir else {
                    return Err(auto_without_save_dir());
                };
                let survey = Survey::of(dir);
                if !survey.holds_checkpoints() {
                    obs.warn(&format!(
                        "--resume auto: no checkpoint in {} yet; starting from step 0",
                        dir.display()
                    ));
                    return Ok(None);
                }
                match (survey.latest_problem(), survey.newest()) {
                    (None, _) => dir.clone(),
                    (Some(problem), Some(n)) => {
                        obs.warn(&format!(
                            "--resume auto: in {}, {problem}; resuming the newest complete checkpoint there, step-{n}",
                            dir.display()
                        ));
                        dir.join(checkpoint::step_dir_name(n))
                    }
                    (Some(problem), None) => {
                        return Err(refused(
                            format!(
                                "--resume auto: in {}, {problem}, and no complete checkpoint is there",
                                dir.display()
                            ),
                            format!(
                                "pass --resume with a checkpoint you have, or remove {} to start from step 0",
                                dir.join(checkpoint::LATEST).display()
                            ),
                        ))
                    }
                }
            }
            Some(p) => {
                let path = PathBuf::from(p);
                // A save directory whose `latest` is missing or dangling: the load takes the
                // newest complete checkpoint; say so.
                let survey = Survey::of(&path);
                if let (false, Some(problem), Some(n)) = (
                    path.join(checkpoint::INDEX).is_file(),
                    survey.latest_problem(),
                    survey.newest(),
                ) {
                    obs.warn(&format!(
                        "--resume {p}: {problem}; resuming the newest complete checkpoint there, step-{n}"
                    ));
                }
                path
            }
        };
        let ck = Checkpoint::open(&path).map_err(|e| SessionError::Checkpoint {
            context: "--resume".into(),
            source: Box::new(e),
        })?;
        crate::exec::check_checkpoint(&ck).map_err(|e| refused_run("--resume", e))?;
        if ck.step() as u64 >= steps {
            return Err(refused(
                format!(
                    "--resume {}: the checkpoint has done {} steps and --steps is {steps}: the run would train nothing",
                    path.display(),
                    ck.step()
                ),
                format!(
                    "pass --steps greater than {} (--steps counts from step 0)",
                    ck.step()
                ),
            ));
        }
        obs.say(&format!(
            "resuming from {} after step {}",
            path.display(),
            ck.step()
        ));
        Ok(Some(Arc::new(ck)))
    }

    /// The weights of `--init-from`, read and checked against the plan's model, with the
    /// dropout rates of its config.json, or `None`. Called after [`Self::check`] (which
    /// refuses a Tessera checkpoint here).
    ///
    /// The config's rates are applied, site by site, in place of the plan's
    /// `training.dropout` (a fine-tune of an HF model trains as transformers would train it):
    /// the run says which, and says so where they differ from the plan's.
    pub(super) fn init_from(
        &self,
        plan: &Plan,
        obs: &mut dyn Observer,
    ) -> Result<Option<(Arc<InitialParams>, DropoutRates)>, SessionError> {
        let Some(dir) = &self.init_from else {
            return Ok(None);
        };
        let w =
            crate::hf::load(dir, &plan.job.model.architecture).map_err(SessionError::InitFrom)?;
        obs.say(&format!(
            "starting from the {} weights in {}",
            w.family.class(),
            dir.display()
        ));
        let planned = plan.job.model.training.dropout as f32;
        let r = w.dropout.rates;
        let differs = [r.embedding, r.attention, r.residual]
            .iter()
            .any(|&p| p != planned);
        obs.say(&format!(
            "dropout from {}'s config.json: {}{}",
            dir.display(),
            w.dropout.sites.join(", "),
            match differs {
                true => format!(" (in place of the plan's training.dropout {planned})"),
                false => String::new(),
            }
        ));
        if !w.set_aside.is_empty() {
            obs.warn(&format!(
                "--init-from {}: config.json sets {}, which this run does not apply (the causal LM does not read it)",
                dir.display(),
                w.set_aside.join(", ")
            ));
        }
        Ok(Some((Arc::new(w.tensors), r)))
    }
}
