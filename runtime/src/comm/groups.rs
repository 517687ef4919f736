//! A rank's TP, DP and PP group handles, built from the planner's [`Mesh`] (the one place that
//! decides which world ranks form a group; `rank = tp + TP·(dp + DP·pp)`).
//!
//! This module must not compute rank arithmetic itself: it only asks the mesh.

use tessera_planner::Mesh;

use super::{CommError, LocalComm};

/// The three groups one rank belongs to.
pub struct RankGroups<C> {
    /// Ranks with the same (dp, pp): tensor parallelism.
    pub tp: C,
    /// Ranks with the same (tp, pp): data parallelism (gradient all-reduce / ZeRO).
    pub dp: C,
    /// Ranks with the same (tp, dp), one per stage: pipeline send/recv.
    pub pp: C,
}

/// Thread-backed group handles for every world rank of `mesh`, indexed by world rank; move
/// entry `r` into rank r's thread.
pub fn local_groups(mesh: &Mesh) -> Result<Vec<RankGroups<LocalComm>>, CommError> {
    let world = mesh.world() as usize;
    let partition = |group_of: &dyn Fn(u64) -> Vec<u64>| -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for r in 0..world as u64 {
            let g: Vec<usize> = group_of(r).into_iter().map(|x| x as usize).collect();
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
        groups
    };
    let tp = LocalComm::from_groups(world, &partition(&|r| mesh.tp_group(r)))?;
    let dp = LocalComm::from_groups(world, &partition(&|r| mesh.dp_group(r)))?;
    let pp = LocalComm::from_groups(world, &partition(&|r| mesh.pp_group(r)))?;
    Ok(tp
        .into_iter()
        .zip(dp)
        .zip(pp)
        .map(|((tp, dp), pp)| RankGroups { tp, dp, pp })
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
        }
    }
}
