//! A rank's TP, DP, PP and CP group handles, built from the planner's [`Mesh`] (the one place
//! that decides which world ranks form a group; `rank = tp + TP·(cp + CP·(dp + DP·pp))`).
//!
//! This module must not compute rank arithmetic itself: it only asks the mesh.

use tessera_planner::Mesh;

use super::{CommError, LocalComm};

/// The groups one rank belongs to.
pub struct RankGroups<C> {
    /// Ranks with the same (cp, dp, pp): tensor parallelism.
    pub tp: C,
    /// The ranks holding the same weights, with the same (tp, pp): data parallelism, times
    /// context parallelism when CP > 1 (`Mesh::dp_cp_group`, Megatron-Core's
    /// `data_parallel_group_with_cp`): gradient all-reduce / ZeRO shards span DP × CP.
    pub dp: C,
    /// Ranks with the same (tp, cp, dp), one per stage: pipeline send/recv.
    pub pp: C,
    /// Ranks with the same (tp, dp, pp), in CP order: the ring of ring attention. `None`
    /// without context parallelism (CP 1).
    pub cp: Option<C>,
}

/// Every distinct group `group_of` gives over the world's ranks, in order of first appearance.
pub(crate) fn partition(world: usize, group_of: &dyn Fn(u64) -> Vec<u64>) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for r in 0..world as u64 {
        let g: Vec<usize> = group_of(r).into_iter().map(|x| x as usize).collect();
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    groups
}

/// Thread-backed group handles for every world rank of `mesh`, indexed by world rank; move
/// entry `r` into rank r's thread.
pub fn local_groups(mesh: &Mesh) -> Result<Vec<RankGroups<LocalComm>>, CommError> {
    let world = mesh.world() as usize;
    let tp = LocalComm::from_groups(world, &partition(world, &|r| mesh.tp_group(r)))?;
    let dp = LocalComm::from_groups(world, &partition(world, &|r| mesh.dp_cp_group(r)))?;
    let pp = LocalComm::from_groups(world, &partition(world, &|r| mesh.pp_group(r)))?;
    let cp = cp_groups(mesh)?;
    Ok(tp
        .into_iter()
        .zip(dp)
        .zip(pp)
        .zip(cp)
        .map(|(((tp, dp), pp), cp)| RankGroups { tp, dp, pp, cp })
        .collect())
}

/// Each world rank's CP group handle, `None` for every rank at CP 1.
fn cp_groups(mesh: &Mesh) -> Result<Vec<Option<LocalComm>>, CommError> {
    let world = mesh.world() as usize;
    Ok(match mesh.cp > 1 {
        true => LocalComm::from_groups(world, &partition(world, &|r| mesh.cp_group(r)))?
            .into_iter()
            .map(Some)
            .collect(),
        false => (0..world).map(|_| None).collect(),
    })
}

/// The groups of a mixture-of-experts model's rank besides [`RankGroups`]: built only for MoE
/// plans (an extra channel per pair of ranks in each).
pub struct MoeGroups<C> {
    /// `Mesh::ep_group`: the ranks exchanging tokens by all-to-all, in EP order (EP rank `e`
    /// holds experts `e·E/EP ..`). One rank without expert parallelism.
    pub ep: C,
    /// `Mesh::expert_dp_group`: the ranks holding the same experts, which sum their gradients
    /// (the DP × CP group itself with EP 1).
    pub expert_dp: C,
    /// `Mesh::cp_group`: the ranks holding the other tokens of the same micro-batch, over which
    /// the load-balancing loss counts its tokens. `None` with CP 1.
    pub cp: Option<C>,
}

/// Thread-backed [`MoeGroups`] for every world rank of `mesh`, indexed by world rank.
pub fn local_moe_groups(mesh: &Mesh) -> Result<Vec<MoeGroups<LocalComm>>, CommError> {
    let world = mesh.world() as usize;
    let ep = LocalComm::from_groups(world, &partition(world, &|r| mesh.ep_group(r)))?;
    let edp = LocalComm::from_groups(world, &partition(world, &|r| mesh.expert_dp_group(r)))?;
    let cp = cp_groups(mesh)?;
    Ok(ep
        .into_iter()
        .zip(edp)
        .zip(cp)
        .map(|((ep, expert_dp), cp)| MoeGroups { ep, expert_dp, cp })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Comm;

    #[test]
    fn groups_follow_the_mesh_coordinates() {
        let mesh = Mesh::new(2, 3, 2, 8);
        let groups = local_groups(&mesh).unwrap();
        assert_eq!(groups.len(), 12);
        for (r, g) in groups.iter().enumerate() {
            let c = mesh.coord(r as u64);
            assert_eq!((g.tp.rank(), g.tp.size()), (c.tp as usize, 2));
            assert_eq!((g.dp.rank(), g.dp.size()), (c.dp as usize, 2));
            assert_eq!((g.pp.rank(), g.pp.size()), (c.pp as usize, 3));
            assert!(g.cp.is_none());
        }
    }

    #[test]
    fn context_parallel_groups_follow_the_mesh() {
        // DP 2, CP 2, PP 2, TP 2: the gradient group spans DP × CP.
        let mesh = Mesh::with_cp(2, 2, 2, 2, 8);
        let groups = local_groups(&mesh).unwrap();
        assert_eq!(groups.len(), 16);
        for (r, g) in groups.iter().enumerate() {
            let c = mesh.coord(r as u64);
            let cp = g.cp.as_ref().unwrap();
            assert_eq!((cp.rank(), cp.size()), (c.cp as usize, 2));
            let dp_cp = mesh.dp_cp_group(r as u64);
            let at = dp_cp.iter().position(|&x| x == r as u64).unwrap();
            assert_eq!((g.dp.rank(), g.dp.size()), (at, 4));
            assert_eq!((g.tp.rank(), g.tp.size()), (c.tp as usize, 2));
            assert_eq!((g.pp.rank(), g.pp.size()), (c.pp as usize, 2));
        }
    }

    #[test]
    fn expert_groups_follow_the_mesh() {
        // DP 4, CP 1, TP 2, EP 2: EP groups of consecutive DP indices, expert-DP the others.
        let mesh = Mesh::new(4, 1, 2, 8).with_ep(2);
        let groups = local_moe_groups(&mesh).unwrap();
        for (r, g) in groups.iter().enumerate() {
            let ep = mesh.ep_group(r as u64);
            assert_eq!(g.ep.size(), 2);
            assert_eq!(ep[g.ep.rank()], r as u64);
            assert_eq!(g.ep.rank() as u64, mesh.ep_rank(r as u64));
            assert_eq!(g.expert_dp.size(), 2);
            assert!(g.cp.is_none());
        }
    }
}
