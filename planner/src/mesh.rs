//! The rank mesh: the one place that answers every question about ranks.
//!
//! World = DP × PP × TP, in Megatron's default order: TP varies fastest, then DP, then PP:
//!
//! ```text
//! rank = tp + TP·(dp + DP·pp)
//! node = rank / gpus_per_node,  local = rank % gpus_per_node
//! ```
//!
//! TP groups are consecutive ranks, so they stay inside a node when TP ≤ gpus_per_node. The
//! planner and the runtime both use this type; no global rank state exists anywhere else.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Coord {
    pub dp: u64,
    pub pp: u64,
    pub tp: u64,
}

/// The DP × PP × TP grid laid over the cluster's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Mesh {
    pub dp: u64,
    pub pp: u64,
    pub tp: u64,
    pub gpus_per_node: u64,
}

/// The order ranks are laid out in, fastest first; written into plan.json.
pub const MESH_ORDER: &str = "tp-dp-pp";

impl Mesh {
    pub fn new(dp: u64, pp: u64, tp: u64, gpus_per_node: u64) -> Mesh {
        Mesh {
            dp,
            pp,
            tp,
            gpus_per_node: gpus_per_node.max(1),
        }
    }

    pub fn world(&self) -> u64 {
        self.dp * self.pp * self.tp
    }

    pub fn rank(&self, c: Coord) -> u64 {
        c.tp + self.tp * (c.dp + self.dp * c.pp)
    }

    pub fn coord(&self, rank: u64) -> Coord {
        Coord {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    pub fn node(&self, rank: u64) -> u64 {
        rank / self.gpus_per_node
    }

    pub fn local(&self, rank: u64) -> u64 {
        rank % self.gpus_per_node
    }

    /// The TP group of `rank`, in TP order.
    pub fn tp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        (0..self.tp)
            .map(|tp| self.rank(Coord { tp, ..c }))
            .collect()
    }

    /// The DP group of `rank`, in DP order.
    pub fn dp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        (0..self.dp)
            .map(|dp| self.rank(Coord { dp, ..c }))
            .collect()
    }

    /// The PP group of `rank` (one rank per stage), in stage order.
    pub fn pp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        (0..self.pp)
            .map(|pp| self.rank(Coord { pp, ..c }))
            .collect()
    }

    /// How many nodes a group of ranks spans.
    pub fn nodes_spanned(&self, group: &[u64]) -> u64 {
        let mut nodes: Vec<u64> = group.iter().map(|r| self.node(*r)).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len() as u64
    }

    /// Whether every TP group stays inside one node.
    pub fn tp_within_node(&self) -> bool {
        (0..self.world())
            .step_by(self.tp as usize)
            .all(|r| self.nodes_spanned(&self.tp_group(r)) == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_formula_and_inverse() {
        let m = Mesh::new(3, 4, 2, 8);
        for r in 0..m.world() {
            let c = m.coord(r);
            assert_eq!(m.rank(c), r);
            assert_eq!(r, c.tp + 2 * (c.dp + 3 * c.pp));
        }
    }

    #[test]
    fn groups_partition_the_world() {
        let m = Mesh::new(2, 2, 4, 8);
        assert_eq!(m.tp_group(5), vec![4, 5, 6, 7]);
        assert_eq!(m.dp_group(1), vec![1, 5]);
        assert_eq!(m.pp_group(1), vec![1, 9]);
        for r in 0..m.world() {
            assert!(m.tp_group(r).contains(&r));
            assert!(m.dp_group(r).contains(&r));
            assert!(m.pp_group(r).contains(&r));
        }
    }

    #[test]
    fn tp_crossing_the_node_boundary_is_seen() {
        assert!(Mesh::new(2, 1, 8, 8).tp_within_node());
        assert!(!Mesh::new(1, 1, 16, 8).tp_within_node());
        assert_eq!(Mesh::new(1, 1, 16, 8).nodes_spanned(&[0, 15]), 2);
    }
}
