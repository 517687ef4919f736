//! Which NCCL unique id each rank uses. NCCL needs one id per communicator, shared by its
//! members; rank 0 creates one for every group — every TP group, then every DP group, then
//! every PP group, each kind in the order its groups first appear over world ranks 0, 1, … —
//! and sends them all in one rendezvous blob. Each rank picks the three ids of its groups. The
//! DP groups are DP × CP (`Mesh::dp_cp_group`, the same as DP without context parallelism).
//!
//! Pure layout arithmetic (no NCCL), so it is tested without a GPU. Group membership comes from
//! the mesh, as in `groups.rs`.

use tessera_planner::Mesh;

use super::CommError;

/// Bytes of one `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

/// Indices of a rank's three ids in the blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSlots {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
}

fn partition(world: u64, group_of: &dyn Fn(u64) -> Vec<u64>) -> Vec<Vec<u64>> {
    let mut groups: Vec<Vec<u64>> = Vec::new();
    for r in 0..world {
        let g = group_of(r);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    groups
}

/// The three partitions of the world, in blob order.
fn partitions(mesh: &Mesh) -> [Vec<Vec<u64>>; 3] {
    let w = mesh.world();
    [
        partition(w, &|r| mesh.tp_group(r)),
        partition(w, &|r| mesh.dp_cp_group(r)),
        partition(w, &|r| mesh.pp_group(r)),
    ]
}

/// Number of ids rank 0 must create (and bytes / [`ID_BYTES`] of the blob).
pub fn id_count(mesh: &Mesh) -> usize {
    partitions(mesh).iter().map(Vec::len).sum()
}

/// Where `rank`'s TP, DP and PP ids sit in the blob.
pub fn slots(mesh: &Mesh, rank: u64) -> GroupSlots {
    let [tp, dp, pp] = partitions(mesh);
    let find = |groups: &[Vec<u64>]| {
        groups
            .iter()
            .position(|g| g.contains(&rank))
            .expect("every rank is in one group of each kind")
    };
    GroupSlots {
        tp: find(&tp),
        dp: tp.len() + find(&dp),
        pp: tp.len() + dp.len() + find(&pp),
    }
}

/// Id number `slot` of the blob.
pub fn id_at(blob: &[u8], slot: usize) -> Result<[u8; ID_BYTES], CommError> {
    let range = slot * ID_BYTES..(slot + 1) * ID_BYTES;
    blob.get(range)
        .and_then(|b| b.try_into().ok())
        .ok_or(CommError::SizeMismatch {
            op: "NCCL id blob",
            expected: (slot + 1) * ID_BYTES,
            got: blob.len(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_of_a_group_share_its_id_and_groups_do_not() {
        for mesh in [
            Mesh::new(2, 2, 2, 8),
            Mesh::new(4, 3, 2, 8),
            Mesh::new(1, 1, 1, 8),
        ] {
            let world = mesh.world();
            let n = id_count(&mesh);
            let all: Vec<GroupSlots> = (0..world).map(|r| slots(&mesh, r)).collect();
            for a in 0..world {
                let sa = all[a as usize];
                assert!(sa.tp < sa.dp && sa.dp < sa.pp && sa.pp < n);
                for b in 0..world {
                    let sb = all[b as usize];
                    assert_eq!(sa.tp == sb.tp, mesh.tp_group(a).contains(&b), "{a} {b}");
                    assert_eq!(sa.dp == sb.dp, mesh.dp_group(a).contains(&b), "{a} {b}");
                    assert_eq!(sa.pp == sb.pp, mesh.pp_group(a).contains(&b), "{a} {b}");
                }
            }
            // One id per group: world/tp TP groups, world/dp DP groups, world/pp PP groups.
            assert_eq!(
                n as u64,
                world / mesh.tp + world / mesh.dp + world / mesh.pp
            );
        }
    }

    #[test]
    fn ids_are_cut_from_the_blob() {
        let blob: Vec<u8> = (0..3 * ID_BYTES).map(|i| (i / ID_BYTES) as u8).collect();
        assert_eq!(id_at(&blob, 2).unwrap(), [2u8; ID_BYTES]);
        assert!(matches!(
            id_at(&blob, 3),
            Err(CommError::SizeMismatch { .. })
        ));
    }
}
