//! FSDP2's peak over the step's phases (`fsdp::Phase`): a stage's terms as alive at the start
//! and at the end of the backward, and the larger of the two, where the layout's phases are
//! modelled (`fsdp::phased`); every other stage keeps the sum of its terms.

use super::{activations, fsdp, Ctx, MemoryTerm, Sink, Total};
use crate::spec::DeviceKind;

/// A sink that passes on each term's share alive at one FSDP2 phase (`fsdp::Phase`).
struct PhaseSink<'s> {
    inner: &'s mut dyn Sink,
    share: &'s dyn Fn(&str) -> f64,
    phase: fsdp::Phase,
}

impl Sink for PhaseSink<'_> {
    fn term(
        &mut self,
        name: &'static str,
        kind: &'static str,
        bytes: f64,
        reason: &dyn Fn() -> String,
    ) {
        let share = (self.share)(name);
        if share == 1.0 {
            self.inner.term(name, kind, bytes, reason);
        } else if share > 0.0 {
            let phase = self.phase;
            self.inner.term(name, kind, bytes * share, &|| {
                format!("{}; {}: {share:.3} of it", reason(), phase.name())
            });
        }
    }
}

impl Ctx<'_> {
    /// The phases `stage`'s peak is taken over (`fsdp::phased`); `None`: the sum of every term.
    fn phases(&self) -> Option<[fsdp::Phase; 2]> {
        let gpu = self.cluster.device.kind == DeviceKind::Gpu;
        fsdp::phased(&self.fsdp, self.model, self.layout, gpu).then_some(fsdp::Phase::BOTH)
    }

    /// [`Ctx::stage`]'s terms as alive at `phase`.
    fn stage_at(&self, stage: u64, phase: fsdp::Phase, sink: &mut dyn Sink) {
        let (model, layout) = (self.model, self.layout);
        let head: Vec<&str> = if stage == layout.pp - 1 {
            let local = layout.rank_tokens(model);
            let (b, tp, sp) = (layout.micro_batch, layout.tp, layout.sequence_parallel);
            activations::head_terms(&local, b, tp, sp, self.fsdp.loss, self.fsdp.pad_vocab)
                .iter()
                .map(|t| t.0)
                .collect()
        } else {
            Vec::new()
        };
        let (m, layers) = (self.microbatches, self.layers(stage));
        let share = |name: &str| fsdp::phase_share(phase, name, m, layers, &head);
        self.stage(
            stage,
            &mut PhaseSink {
                inner: sink,
                share: &share,
                phase,
            },
        );
    }

    /// `stage`'s terms at its peak: the larger phase's where the stage has phases (the start
    /// of the backward on a tie), else every term.
    pub(super) fn peak_terms(&self, stage: u64) -> Vec<MemoryTerm> {
        let total = |t: &[MemoryTerm]| t.iter().fold(0u64, |a, x| a.saturating_add(x.bytes));
        let Some(phases) = self.phases() else {
            let mut t = Vec::new();
            self.stage(stage, &mut t);
            return t;
        };
        let mut best: Option<Vec<MemoryTerm>> = None;
        for p in phases {
            let mut t = Vec::new();
            self.stage_at(stage, p, &mut t);
            if best.as_ref().is_none_or(|b| total(&t) > total(b)) {
                best = Some(t);
            }
        }
        best.unwrap_or_default()
    }

    /// The bytes of [`Ctx::peak_terms`].
    pub(super) fn peak_total(&self, stage: u64) -> u64 {
        let Some(phases) = self.phases() else {
            let mut t = Total(0);
            self.stage(stage, &mut t);
            return t.0;
        };
        phases
            .iter()
            .map(|&p| {
                let mut t = Total(0);
                self.stage_at(stage, p, &mut t);
                t.0
            })
            .max()
            .unwrap_or(0)
    }
}
