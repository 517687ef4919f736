//! A plan's step on every pipeline stage ([`crate::cost::stages`]), from the plan alone: the
//! job, layout and split it holds, costed and simulated as `Predicted::derive` does.

use super::{check::split_of, Plan};
use crate::cost::comm::Links;
use crate::cost::pipeline::Simulator;
use crate::cost::stages::StageTime;
use crate::cost::{self, Options};

impl Plan {
    /// Every pipeline stage's share of the predicted step (compute, exposed communication,
    /// bubble, optimizer), in stage order; the bottleneck stage's row regroups
    /// `predicted.breakdown`. `None` when the stages do not describe a split of the model's
    /// layers, which `Plan::load` refuses.
    pub fn stage_times(&self) -> Option<Vec<StageTime>> {
        let (model, cluster) = (&self.job.model, &self.job.cluster);
        let layout = self.parallel.layout();
        let split = split_of(&self.stages, &layout, model.architecture.layers)?;
        let options = Options::for_model(model, cluster);
        let links = Links::new(cluster, &layout.mesh(cluster));
        let times = cost::layer_times(model, cluster, &layout, &links, options);
        let e = cost::evaluate(model, cluster, &layout, &split, &links, &times, options);
        Some(e.stage_times(&Simulator::new().run(&e.pipeline)))
    }
}
