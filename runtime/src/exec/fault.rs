//! A test hook: one rank fails at one step, with an error or a panic (`tessera run --fault`,
//! hidden). It shows how a run ends when a rank fails mid-run (tests/rank_faults.rs); a run
//! without it ([`TrainOptions::fault`](super::TrainOptions) `None`) never reaches this code.

use std::fmt;
use std::str::FromStr;

use super::RunError;

/// How the rank fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank's step returns an error.
    Error,
    /// The rank's thread panics.
    Panic,
}

/// Rank `rank` fails as `kind` says when it begins step `step` (0-based): the other ranks are
/// then inside that step, waiting for it in a collective or a receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: usize,
    pub kind: FaultKind,
}

impl FromStr for Fault {
    type Err = String;

    /// `RANK:STEP:error` or `RANK:STEP:panic`.
    fn from_str(s: &str) -> Result<Fault, String> {
        let usage = || format!("`{s}`: expected RANK:STEP:error or RANK:STEP:panic");
        let mut parts = s.trim().split(':');
        let (Some(rank), Some(step), Some(kind), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(usage());
        };
        let number = |t: &str| t.trim().parse::<usize>().map_err(|_| usage());
        let kind = match kind.trim() {
            "error" => FaultKind::Error,
            "panic" => FaultKind::Panic,
            _ => return Err(usage()),
        };
        Ok(Fault {
            rank: number(rank)?,
            step: number(step)?,
            kind,
        })
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FaultKind::Error => "error",
            FaultKind::Panic => "panic",
        };
        write!(f, "{}:{}:{kind}", self.rank, self.step)
    }
}

impl Fault {
    /// Called by rank `rank` before step `step`: fails there if this fault says so.
    pub(super) fn strike(&self, rank: usize, step: usize) -> Result<(), RunError> {
        if (rank, step) != (self.rank, self.step) {
            return Ok(());
        }
        match self.kind {
            FaultKind::Error => Err(RunError::Injected { step }),
            FaultKind::Panic => panic!("step {step}: injected panic (test hook --fault {self})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_back() {
        let f: Fault = "3:2:panic".parse().unwrap();
        assert_eq!(
            f,
            Fault {
                rank: 3,
                step: 2,
                kind: FaultKind::Panic
            }
        );
        assert_eq!(f.to_string(), "3:2:panic");
        assert_eq!("0:0:error".parse::<Fault>().unwrap().kind, FaultKind::Error);
        for bad in [
            "",
            "1:2",
            "1:2:boom",
            "x:2:error",
            "1:2:error:4",
            "-1:2:panic",
        ] {
            assert!(bad.parse::<Fault>().is_err(), "{bad}");
        }
    }

    #[test]
    fn strikes_only_its_rank_and_step() {
        let f: Fault = "1:2:error".parse().unwrap();
        assert!(f.strike(0, 2).is_ok());
        assert!(f.strike(1, 1).is_ok());
        let e = f.strike(1, 2).unwrap_err();
        assert!(e.to_string().contains("step 2: injected error"), "{e}");
    }
}
