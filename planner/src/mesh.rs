//! The rank mesh: the one place that answers every question about ranks.
//!
//! World = DP × CP × PP × TP, in Megatron's default order: TP varies fastest, then CP (context
//! parallelism), then DP, then PP (`tp-cp-ep-dp-pp` in Megatron-Core's `RankGenerator`, with
//! no EP yet):
//!
//! ```text
//! rank = tp + TP·(cp + CP·(dp + DP·pp))
//! node = rank / gpus_per_node,  local = rank % gpus_per_node
//! ```
//!
//! With CP = 1 this is `tp + TP·(dp + DP·pp)`, the order of plans without context parallelism.
//! TP groups are consecutive ranks, so they stay inside a node when TP ≤ gpus_per_node; CP
//! groups come next. The planner and the runtime both use this type; no global rank state
//! exists anywhere else.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Coord {
    pub dp: u64,
    pub pp: u64,
    pub tp: u64,
    /// The context-parallel rank: which two chunks of each sequence this rank holds.
    #[serde(default)]
    pub cp: u64,
}

/// The DP × PP × TP grid laid over the cluster's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Mesh {
    pub dp: u64,
    pub pp: u64,
    pub tp: u64,
    pub gpus_per_node: u64,
    /// Context-parallel degree (1: none).
    #[serde(default = "one")]
    pub cp: u64,
    /// Expert-parallel degree (1: none). It does not change the rank order: EP groups are
    /// cut from the DP × CP ranks that share a TP and PP coordinate (see [`Mesh::ep_group`]).
    #[serde(default = "one")]
    pub ep: u64,
}

fn one() -> u64 {
    1
}

/// The order ranks are laid out in, fastest first; written into plan.json.
pub const MESH_ORDER: &str = "tp-dp-pp";

/// The order with context parallelism (CP > 1), fastest first.
pub const MESH_ORDER_CP: &str = "tp-cp-dp-pp";

impl Mesh {
    /// A mesh without context parallelism.
    pub fn new(dp: u64, pp: u64, tp: u64, gpus_per_node: u64) -> Mesh {
        Mesh::with_cp(dp, 1, pp, tp, gpus_per_node)
    }

    /// A mesh of DP × CP × PP × TP.
    pub fn with_cp(dp: u64, cp: u64, pp: u64, tp: u64, gpus_per_node: u64) -> Mesh {
        Mesh {
            dp,
            pp,
            tp,
            gpus_per_node: gpus_per_node.max(1),
            cp: cp.max(1),
            ep: 1,
        }
    }

    /// This mesh with expert parallelism `ep`, which must divide DP × CP.
    pub fn with_ep(self, ep: u64) -> Mesh {
        Mesh {
            ep: ep.max(1),
            ..self
        }
    }

    /// The index of `rank` among the DP × CP ranks of its TP and PP coordinate: `cp + CP·dp`
    /// (the order of [`Mesh::dp_cp_group`]).
    fn dp_cp_index(&self, c: Coord) -> u64 {
        c.cp + self.cp * c.dp
    }

    /// The rank of DP × CP index `j` at the TP and PP coordinate of `c`.
    fn at_dp_cp_index(&self, c: Coord, j: u64) -> u64 {
        self.rank(Coord {
            cp: j % self.cp,
            dp: j / self.cp,
            ..c
        })
    }

    /// The expert-parallel coordinate of `rank`: which 1/EP of each MoE layer's routed
    /// experts it holds (experts `ep·E/EP .. (ep+1)·E/EP`).
    pub fn ep_rank(&self, rank: u64) -> u64 {
        self.dp_cp_index(self.coord(rank)) % self.ep
    }

    /// The EP group of `rank`, in EP order: consecutive DP × CP indices, the ranks its tokens
    /// are exchanged with by all-to-all. Megatron-Core's expert rank order `tp-ep-dp-pp` with
    /// expert TP equal to TP: EP varies right after TP (and CP).
    pub fn ep_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        let base = self.dp_cp_index(c) / self.ep * self.ep;
        (0..self.ep)
            .map(|e| self.at_dp_cp_index(c, base + e))
            .collect()
    }

    /// The expert-data-parallel group of `rank`: the DP × CP / EP ranks that hold the same
    /// experts and sum their gradients, in order.
    pub fn expert_dp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        let e = self.dp_cp_index(c) % self.ep;
        (0..self.dp * self.cp / self.ep)
            .map(|k| self.at_dp_cp_index(c, e + k * self.ep))
            .collect()
    }

    /// The rank order as plan.json states it.
    pub fn order(&self) -> &'static str {
        if self.cp > 1 {
            MESH_ORDER_CP
        } else {
            MESH_ORDER
        }
    }

    pub fn world(&self) -> u64 {
        self.dp * self.cp * self.pp * self.tp
    }

    pub fn rank(&self, c: Coord) -> u64 {
        c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp))
    }

    pub fn coord(&self, rank: u64) -> Coord {
        let inner = rank / self.tp;
        Coord {
            tp: rank % self.tp,
            cp: inner % self.cp,
            dp: (inner / self.cp) % self.dp,
            pp: inner / (self.cp * self.dp),
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

    /// The CP group of `rank`, in CP order: the ranks that hold the chunks of the same
    /// sequences (the ring of ring attention).
    pub fn cp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        (0..self.cp)
            .map(|cp| self.rank(Coord { cp, ..c }))
            .collect()
    }

    /// The ranks that hold the same weights and sum their gradients: DP × CP, in (dp, cp)
    /// order (Megatron's `data_parallel_group_with_cp`). Without CP, the DP group.
    pub fn dp_cp_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coord(rank);
        (0..self.dp)
            .flat_map(|dp| (0..self.cp).map(move |cp| (dp, cp)))
            .map(|(dp, cp)| self.rank(Coord { dp, cp, ..c }))
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
    fn context_parallel_ranks_sit_between_tp_and_dp() {
        // Megatron-Core's order tp-cp-dp-pp: TP 2, CP 2, DP 2, PP 2 on 16 ranks.
        let m = Mesh::with_cp(2, 2, 2, 2, 8);
        assert_eq!(m.world(), 16);
        for r in 0..m.world() {
            let c = m.coord(r);
            assert_eq!(m.rank(c), r);
            assert_eq!(r, c.tp + 2 * (c.cp + 2 * (c.dp + 2 * c.pp)));
        }
        assert_eq!(m.tp_group(5), vec![4, 5]);
        assert_eq!(m.cp_group(5), vec![5, 7]);
        assert_eq!(m.dp_group(5), vec![1, 5]);
        assert_eq!(m.dp_cp_group(5), vec![1, 3, 5, 7]);
        assert_eq!(m.pp_group(5), vec![5, 13]);
        assert_eq!(m.order(), "tp-cp-dp-pp");
        // CP 1 is the mesh without it.
        let plain = Mesh::new(2, 2, 2, 8);
        assert_eq!(Mesh::with_cp(2, 1, 2, 2, 8), plain);
        assert_eq!(plain.dp_cp_group(3), plain.dp_group(3));
        assert_eq!(plain.order(), MESH_ORDER);
    }

    #[test]
    fn expert_groups_cut_the_dp_cp_ranks() {
        // TP 2, CP 2, DP 4, PP 1 on 16 ranks, EP 4: the DP × CP ranks of TP coordinate 0 are
        // 0, 2, 4, …, 14 (index j = cp + 2·dp); EP groups are j in 0..4 and 4..8.
        let m = Mesh::with_cp(4, 2, 1, 2, 8).with_ep(4);
        assert_eq!(m.ep_group(0), vec![0, 2, 4, 6]);
        assert_eq!(m.ep_group(6), vec![0, 2, 4, 6]);
        assert_eq!(m.ep_group(9), vec![9, 11, 13, 15]);
        assert_eq!(m.expert_dp_group(0), vec![0, 8]);
        assert_eq!(m.expert_dp_group(11), vec![3, 11]);
        assert_eq!(m.ep_rank(11), 1);
        for r in 0..m.world() {
            let (ep, edp) = (m.ep_group(r), m.expert_dp_group(r));
            assert_eq!(ep.len() * edp.len(), (m.dp * m.cp) as usize);
            assert!(ep.contains(&r) && edp.contains(&r));
            // An EP group holds each expert shard once; the expert-DP group one shard only.
            let mut shards: Vec<u64> = ep.iter().map(|x| m.ep_rank(*x)).collect();
            shards.sort_unstable();
            assert_eq!(shards, (0..4).collect::<Vec<_>>());
            assert!(edp.iter().all(|x| m.ep_rank(*x) == m.ep_rank(r)));
        }
        // EP 1: one-rank EP groups, and the expert-DP group is DP × CP.
        let plain = Mesh::with_cp(4, 2, 1, 2, 8);
        assert_eq!(plain.ep_group(3), vec![3]);
        assert_eq!(plain.expert_dp_group(3), plain.dp_cp_group(3));
    }

    #[test]
    fn tp_crossing_the_node_boundary_is_seen() {
        assert!(Mesh::new(2, 1, 8, 8).tp_within_node());
        assert!(!Mesh::new(1, 1, 16, 8).tp_within_node());
        assert_eq!(Mesh::new(1, 1, 16, 8).nodes_spanned(&[0, 15]), 2);
    }
}
