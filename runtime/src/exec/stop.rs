//! Stopping a run early, at one step boundary on every rank.
//!
//! A signal handler (or any other thread) calls [`Stop::request`]; each rank asks
//! [`Stop::may_start`] before every step. Both hold one lock, so the answer is the same on every
//! rank: the steps that some rank had already begun when the request came are finished by all
//! ranks (their collectives need every member), and no rank begins a later one. Without this
//! agreement one rank could stop while its peers wait for it inside a collective.

use std::sync::Mutex;

/// A shared request to stop after the step in progress.
#[derive(Debug, Default)]
pub struct Stop {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Steps begun by the rank that is furthest ahead (its last step index + 1).
    begun: usize,
    /// Once requested: no rank begins a step at or after this index.
    stop_at: Option<usize>,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: it is two integers.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks every rank to stop once the steps already begun are finished. Returns the number
    /// of steps the run will have done. Later calls change nothing.
    pub fn request(&self) -> usize {
        let mut s = self.state();
        let begun = s.begun;
        *s.stop_at.get_or_insert(begun)
    }

    /// Whether a stop was requested.
    pub fn requested(&self) -> bool {
        self.state().stop_at.is_some()
    }

    /// Called by each rank before step `step` (0-based): whether it may run it.
    pub fn may_start(&self, step: usize) -> bool {
        let mut s = self.state();
        if s.stop_at.is_some_and(|at| step >= at) {
            return false;
        }
        s.begun = s.begun.max(step + 1);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_behind_finish_the_step_the_leader_began() {
        let stop = Stop::new();
        // Rank A has begun steps 0..=3, rank B only 0..=2.
        for step in 0..=3 {
            assert!(stop.may_start(step));
        }
        assert_eq!(stop.request(), 4);
        // B may still run step 3 (A is inside it and needs B), but nobody runs step 4.
        assert!(stop.may_start(3));
        assert!(!stop.may_start(4));
        assert!(stop.requested());
        // A second request keeps the first boundary.
        assert_eq!(stop.request(), 4);
    }

    #[test]
    fn a_request_before_any_step_runs_none() {
        let stop = Stop::new();
        assert_eq!(stop.request(), 0);
        assert!(!stop.may_start(0));
    }
}
