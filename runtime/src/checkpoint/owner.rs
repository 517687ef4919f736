//! Who may write a save directory. A save directory belongs to one run's lineage (a fresh run
//! and the runs that resume it): a run that would write into a folder holding checkpoints it
//! does not continue is refused unless told to overwrite them, `--keep` prunes only its own
//! lineage's checkpoints, and an advisory lock (`.tessera-lock`, naming the owning process and
//! job) keeps two runs out of one folder at once. What the folder holds and what `latest`
//! names is surveyed first, so that a missing or dangling `latest` is said, not guessed past.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::{complete_step, step_dir_name, Checkpoint, CheckpointError, INDEX, LATEST};

/// The lock file of a save directory: held (flock) by the run that writes there; its text names
/// that run.
pub const LOCK: &str = ".tessera-lock";

/// What a save directory holds: its complete checkpoints by step (with their lineage) and
/// what its `latest` pointer says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survey {
    /// Complete checkpoints (a `step-N` with its index), oldest first: (step, lineage).
    pub complete: Vec<(usize, Option<String>)>,
    /// The text of `latest`, trimmed, if the file is there.
    pub latest: Option<String>,
}

/// The lineage recorded in the index of `dir/step-N`, if any (a checkpoint written before
/// lineages were recorded has none).
fn lineage_of(step_dir: &Path) -> Option<String> {
    let text = fs::read(step_dir.join(INDEX)).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    v.get("lineage")?.as_str().map(str::to_string)
}

impl Survey {
    /// Surveys `dir` (an absent folder holds nothing).
    pub fn of(dir: &Path) -> Survey {
        let mut complete: Vec<(usize, Option<String>)> = fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| complete_step(dir, e.file_name().to_str()?))
                    .map(|s| (s, lineage_of(&dir.join(step_dir_name(s)))))
                    .collect()
            })
            .unwrap_or_default();
        complete.sort();
        let latest = fs::read_to_string(dir.join(LATEST))
            .ok()
            .map(|s| s.trim().to_string());
        Survey { complete, latest }
    }

    /// The newest complete checkpoint's step.
    pub fn newest(&self) -> Option<usize> {
        self.complete.last().map(|c| c.0)
    }

    /// Whether the folder holds anything a run's saves would replace or move: a complete
    /// checkpoint, or a `latest` pointer.
    pub fn holds_checkpoints(&self) -> bool {
        !self.complete.is_empty() || self.latest.is_some()
    }

    /// Whether `latest` names a complete checkpoint of this folder.
    pub fn latest_is_whole(&self) -> bool {
        self.latest
            .as_deref()
            .is_some_and(|l| self.complete.iter().any(|c| step_dir_name(c.0) == l))
    }

    /// What is wrong with `latest`, when it is missing (with checkpoints beside it) or names
    /// no complete checkpoint: a phrase such as "`latest` names step-7, which is not a
    /// complete checkpoint".
    pub fn latest_problem(&self) -> Option<String> {
        match &self.latest {
            _ if self.latest_is_whole() => None,
            None if self.complete.is_empty() => None,
            None => Some(format!("there is no `{LATEST}` pointer")),
            Some(l) => Some(format!(
                "`{LATEST}` names {l:?}, which is not a complete checkpoint"
            )),
        }
    }
}

/// A save directory claimed by one run, for as long as this value lives: the lock is released
/// when it is dropped (or the process ends).
#[derive(Debug)]
pub struct Claim {
    _lock: File,
    /// The lineage this run's checkpoints record, and the only one `--keep` prunes.
    pub lineage: String,
    /// The folder, as given.
    pub dir: PathBuf,
}

/// A new lineage: unique to this process and instant.
fn new_lineage() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = format!("{}-{nanos}", std::process::id());
    format!("{:016x}", crate::rng::fnv1a64(seed.as_bytes()))
}

/// Whether `ck` lies in the save directory `dir` (`dir/step-N`).
fn lies_in(ck: &Checkpoint, dir: &Path) -> bool {
    let (Ok(parent), Ok(dir)) = (
        ck.dir()
            .parent()
            .map_or_else(|| Ok(PathBuf::new()), fs::canonicalize),
        fs::canonicalize(dir),
    ) else {
        return false;
    };
    parent == dir
}

fn refused(dir: &Path, problem: String, fix: &str) -> CheckpointError {
    CheckpointError::Invalid {
        path: dir.display().to_string(),
        problem,
        fix: fix.into(),
    }
}

/// Why a run may not write into `dir`, which holds what `survey` found and which the run does
/// not continue (it resumes `resumed`, or nothing): the problem and the fix.
pub fn refuse_foreign(dir: &Path, survey: &Survey, resumed: Option<&str>) -> (String, String) {
    let held = match survey.newest() {
        Some(n) => format!(
            "{} checkpoint{} (the newest step-{n})",
            survey.complete.len(),
            if survey.complete.len() == 1 { "" } else { "s" }
        ),
        None => format!(
            "a `{LATEST}` pointer ({:?})",
            survey.latest.as_deref().unwrap_or_default()
        ),
    };
    let what = match resumed {
        Some(r) => format!("resumes {r}, which is not one of them"),
        None => "does not resume from them".to_string(),
    };
    (
        format!("holds {held}, and this run {what}: its saves would replace them, move `{LATEST}` to its own, and with --keep prune them"),
        format!(
            "continue them with --resume {} (or --resume auto), pass another --save-dir, or add --overwrite to write here anyway (--keep then still prunes only this run's checkpoints)",
            dir.display()
        ),
    )
}

/// Claims `dir` for a run that resumes `resumed` (or starts fresh), before its first step:
/// creates the folder, takes its lock (refusing while another run holds it, naming that run),
/// and refuses a folder holding checkpoints this run does not continue unless `overwrite`.
/// `owner` describes this run in the lock file (its pid, command and job).
pub fn claim(
    dir: &Path,
    resumed: Option<&Checkpoint>,
    overwrite: bool,
    owner: &str,
) -> Result<Claim, CheckpointError> {
    let unwritable = "pass a --save-dir in a folder this user may write";
    fs::create_dir_all(dir).map_err(|e| {
        refused(
            dir,
            format!("cannot create the save directory: {e}"),
            unwritable,
        )
    })?;
    let lock_path = dir.join(LOCK);
    let mut lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| {
            refused(
                dir,
                format!("cannot write in the save directory ({LOCK}: {e})"),
                unwritable,
            )
        })?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let holder = fs::read_to_string(&lock_path).unwrap_or_default();
            let holder = holder.trim();
            return Err(refused(
                dir,
                format!(
                    "another run is writing checkpoints here ({})",
                    if holder.is_empty() {
                        "it has not named itself yet".to_string()
                    } else {
                        holder.to_string()
                    }
                ),
                "wait for that run to end, or pass another --save-dir (two runs in one folder would interleave their steps and remove each other's saves)",
            ));
        }
        Err(fs::TryLockError::Error(e)) => {
            return Err(refused(
                dir,
                format!("cannot lock {LOCK}: {e}"),
                "pass a --save-dir on a file system that supports file locks",
            ))
        }
    }
    lock.set_len(0)
        .and_then(|()| lock.write_all(format!("{owner}\n").as_bytes()))
        .and_then(|()| lock.sync_all())
        .map_err(|e| refused(dir, format!("cannot write {LOCK}: {e}"), unwritable))?;
    let continues = resumed.is_some_and(|ck| lies_in(ck, dir));
    let survey = Survey::of(dir);
    if survey.holds_checkpoints() && !continues && !overwrite {
        let shown = resumed.map(|ck| ck.dir().display().to_string());
        let (problem, fix) = refuse_foreign(dir, &survey, shown.as_deref());
        return Err(refused(dir, problem, &fix));
    }
    let lineage = resumed
        .and_then(|ck| ck.index().lineage.clone())
        .unwrap_or_else(new_lineage);
    Ok(Claim {
        _lock: lock,
        lineage,
        dir: dir.to_path_buf(),
    })
}
