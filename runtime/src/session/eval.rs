//! `--eval-every N [--eval-tokens M]`, resolved: the fixed validation sequences a run
//! evaluates. The validation pass itself is `crate::exec::EvalSet`.

use tessera_planner::plan::Plan;

use crate::data::Tokens;
use crate::exec::EvalSet;

use super::{refused, SessionError};

/// How often a run evaluates, and on how many tokens (`tessera run`'s evaluation flags, with
/// the `cli` feature).
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EvalOptions {
    /// Compute the validation loss every N steps and after the last step, on fixed sequences
    /// of the validation data (--val-data, or the val shards of a prepared --data folder)
    #[cfg_attr(feature = "cli", arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000)))]
    pub eval_every: Option<u64>,
    /// With --eval-every: validation tokens per evaluation, rounded down to whole global
    /// batches [default: 4 global batches, or as many whole ones as the validation data holds]
    #[cfg_attr(feature = "cli", arg(long, requires = "eval_every", value_parser = clap::value_parser!(u64).range(1..)))]
    pub eval_tokens: Option<u64>,
}

impl EvalOptions {
    /// The fixed eval sequences of the validation corpus `val` (its first whole windows, the
    /// same for every layout), or `None` without `every`. Refuses a run that asks for
    /// evaluation without validation data, or for more than the data holds.
    pub fn eval_set(
        &self,
        plan: &Plan,
        val: Option<&Tokens>,
    ) -> Result<Option<EvalSet>, SessionError> {
        let Some(every) = self.eval_every else {
            return Ok(None);
        };
        let Some(val) = val else {
            return Err(refused(
                "--eval-every: there is no validation data",
                "pass --val-data FILE, or --data a folder prepared by `tessera data prepare --val-fraction F` (it holds val shards)",
            ));
        };
        let t = &plan.job.model.training;
        let (seq, batch) = (t.seq_len, t.global_batch);
        let source = val.describe();
        // Whole windows of seq + 1 tokens the validation data holds, in whole global batches.
        let windows = val.eval_windows(seq as usize) as u64;
        let batches_held = windows / batch;
        if batches_held == 0 {
            return Err(refused(
                format!(
                    "{source}: the validation data holds {windows} whole windows of seq_len {seq} + 1 tokens; one eval batch is the plan's global batch of {batch} sequences ({} tokens)",
                    batch * (seq + 1)
                ),
                "pass a longer --val-data, or prepare a larger val split (--val-fraction)",
            ));
        }
        let batches = match self.eval_tokens {
            None => batches_held.min(4),
            Some(m) => {
                let want = m / (batch * seq);
                if want == 0 {
                    return Err(refused(
                        format!(
                            "--eval-tokens {m}: less than one global batch ({} tokens: {batch} sequences of {seq})",
                            batch * seq
                        ),
                        format!("pass --eval-tokens {} or more", batch * seq),
                    ));
                }
                if want > batches_held {
                    return Err(refused(
                        format!(
                            "--eval-tokens {m}: {source} holds {batches_held} global batches of validation sequences ({} tokens), not {want}",
                            batches_held * batch * seq
                        ),
                        format!(
                            "pass --eval-tokens {} or less, or more validation data",
                            batches_held * batch * seq
                        ),
                    ));
                }
                want
            }
        };
        let (inputs, targets) = val.eval_sequences(seq as usize, (batches * batch) as usize);
        Ok(Some(EvalSet {
            every: every as usize,
            inputs,
            targets,
            source,
        }))
    }
}
