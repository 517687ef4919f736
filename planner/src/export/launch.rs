//! How many processes a plan runs, and where: derived from the plan's world size and the mesh's
//! placement of ranks on nodes (rank r on node r / gpus_per_node, `mesh::Mesh`), never from the
//! cluster's shape alone.

use crate::plan::Plan;
use crate::spec::DeviceKind;

/// The processes an export launches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Ranks in the job: the plan's world size.
    pub world: u64,
    /// Nodes the ranks occupy.
    pub nodes: u64,
    /// Processes on each node, in node order. A CPU plan runs one process (its ranks are
    /// threads of `tessera run`).
    pub per_node: Vec<u64>,
    /// One GPU per process; false for a CPU plan.
    pub gpus: bool,
}

impl Launch {
    pub fn of(plan: &Plan) -> Launch {
        let world = plan.parallel.world;
        let c = &plan.job.cluster;
        if c.device.kind == DeviceKind::Cpu {
            // The CPU backend trains every rank as a thread of one process (docs/cuda.md,
            // "Launching"): one process on one node.
            return Launch {
                world,
                nodes: 1,
                per_node: vec![1],
                gpus: false,
            };
        }
        let gpn = c.gpus_per_node.max(1);
        let nodes = world.div_ceil(gpn).max(1);
        let per_node = (0..nodes)
            .map(|n| (world - n * gpn).min(gpn))
            .collect::<Vec<_>>();
        Launch {
            world,
            nodes,
            per_node,
            gpus: true,
        }
    }

    /// The processes per node when every node runs the same number (launchers that take one
    /// `--nproc-per-node` need it), else `None`.
    pub fn uniform(&self) -> Option<u64> {
        let first = self.per_node[0];
        self.per_node.iter().all(|&n| n == first).then_some(first)
    }

    /// "2 nodes × 8 GPUs", or "1 node × 8 GPUs and 1 node × 4 GPUs", or "1 process (CPU)".
    pub fn describe(&self) -> String {
        if !self.gpus {
            return format!("1 process with {} CPU ranks as threads", self.world);
        }
        let node = |n: u64| if n == 1 { "node" } else { "nodes" };
        match self.uniform() {
            Some(p) => format!("{} {} × {p} GPUs", self.nodes, node(self.nodes)),
            None => {
                let full = self.nodes - 1;
                format!(
                    "{full} {} × {} GPUs and 1 node × {} GPUs",
                    node(full),
                    self.per_node[0],
                    self.per_node[self.per_node.len() - 1]
                )
            }
        }
    }
}
