//! ChannelComm over host memory: the same bits as LocalComm on a 2×2×2 mesh, and the same
//! failure behaviour.

use std::time::Duration;

use tessera_planner::Mesh;

use super::*;
use crate::comm::local_groups;
use crate::comm_parity::run_all;

/// 2×2×2 (the layout the GPU parity test uses) and DP 3 (three-term sums, where the order of
/// summation shows in the bits).
#[test]
fn host_carrier_gives_localcomm_bits() {
    for mesh in [Mesh::new(2, 2, 2, 8), Mesh::new(3, 2, 2, 8)] {
        same_bits(&mesh);
    }
}

fn same_bits(mesh: &Mesh) {
    let mesh = *mesh;
    let want = run_all(local_groups(&mesh).unwrap(), &mesh);
    let got = run_all(channel_groups(&mesh, &|_| HostCarrier).unwrap(), &mesh);
    for (r, (w, g)) in want.into_iter().zip(got).enumerate() {
        let (w, g) = (w.unwrap(), g.unwrap());
        assert!(w.len() > 1000, "rank {r}: workload too small ({})", w.len());
        assert_eq!(w.len(), g.len(), "rank {r}");
        let diff = w
            .iter()
            .zip(&g)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(diff, None, "rank {r}: first differing value");
    }
}

#[test]
fn a_dropped_peer_is_reported_not_waited_for() {
    let mut handles = ChannelComm::group(vec![HostCarrier, HostCarrier]);
    let b = handles.pop().unwrap();
    let a = handles.pop().unwrap();
    drop(b);
    let mut buf = [0.0f32; 3];
    assert_eq!(
        a.recv(&mut buf, 1),
        Err(CommError::PeerGone {
            op: "send/recv",
            peer: 1
        })
    );
    assert!(matches!(a.send(&buf, 1), Err(CommError::PeerGone { .. })));
}

#[test]
fn ranks_out_of_step_and_timeouts_are_errors() {
    let mut handles = ChannelComm::group(vec![HostCarrier, HostCarrier]);
    let b = handles
        .pop()
        .unwrap()
        .with_timeout(Duration::from_millis(50));
    let a = handles.pop().unwrap();
    a.send(&[1.0, 2.0], 1).unwrap();
    let mut one = [0.0f32; 1];
    assert!(matches!(
        b.recv(&mut one, 0),
        Err(CommError::OutOfStep { .. })
    ));
    assert!(matches!(
        b.recv(&mut one, 0),
        Err(CommError::Timeout { .. })
    ));
    assert!(matches!(a.send(&one, 0), Err(CommError::BadRank { .. })));
    let mut out = [0.0f32; 3];
    assert!(matches!(
        a.all_gather(&one, &mut out),
        Err(CommError::SizeMismatch { .. })
    ));
}
