//! Tests of `LocalComm` with real threads: each op for several group sizes, n = 1 included.

use super::*;

/// Rank r's test data: `len` values that differ per rank and do not sum exactly in f32.
fn data(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((r * 31 + i * 7) % 13) as f32 * 0.1 + 1.0 / (1.0 + r as f32 + i as f32))
        .collect()
}

/// The reference: element-wise sum in rank order 0..n.
fn rank_order_sum(n: usize, len: usize) -> Vec<f32> {
    let mut acc = data(0, len);
    for r in 1..n {
        acc.iter_mut().zip(data(r, len)).for_each(|(a, b)| *a += b);
    }
    acc
}

#[test]
fn all_reduce_is_rank_order_sum_bitwise_on_every_rank() {
    for n in 1..=5 {
        for len in [0, 1, 3, 17, 1000] {
            let out = LocalComm::run(n, |c| {
                let mut buf = data(c.rank(), len);
                c.all_reduce_sum(&mut buf).unwrap();
                buf
            });
            let want = rank_order_sum(n, len);
            for got in &out {
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "n={n} len={len}");
            }
        }
    }
}

#[test]
fn all_gather_concatenates_in_rank_order() {
    for n in 1..=4 {
        let out = LocalComm::run(n, |c| {
            let mut o = vec![0.0; 5 * n];
            c.all_gather(&data(c.rank(), 5), &mut o).unwrap();
            o
        });
        let want: Vec<f32> = (0..n).flat_map(|r| data(r, 5)).collect();
        assert!(out.iter().all(|o| *o == want));
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_chunk_of_the_sum() {
    for n in 1..=4 {
        let out = LocalComm::run(n, |c| {
            let mut o = vec![0.0; 3];
            c.reduce_scatter_sum(&data(c.rank(), 3 * n), &mut o)
                .unwrap();
            o
        });
        let want = rank_order_sum(n, 3 * n);
        for (r, o) in out.iter().enumerate() {
            assert_eq!(o[..], want[3 * r..3 * r + 3]);
        }
    }
}

#[test]
fn broadcast_copies_root_to_all() {
    for n in 1..=4 {
        for root in 0..n {
            let out = LocalComm::run(n, |c| {
                let mut b = data(c.rank(), 4);
                c.broadcast(&mut b, root).unwrap();
                b
            });
            assert!(out.iter().all(|b| *b == data(root, 4)));
        }
    }
}

#[test]
fn send_is_buffered_and_recv_keeps_order() {
    // A ring where every rank sends twice before receiving: buffered sends cannot deadlock.
    for n in 2..=4 {
        let out = LocalComm::run(n, |c| {
            let (next, prev) = ((c.rank() + 1) % n, (c.rank() + n - 1) % n);
            c.send(&data(c.rank(), 3), next).unwrap();
            c.send(&data(c.rank() + 100, 3), next).unwrap();
            let (mut a, mut b) = (vec![0.0; 3], vec![0.0; 3]);
            c.recv(&mut a, prev).unwrap();
            c.recv(&mut b, prev).unwrap();
            (prev, a, b)
        });
        for (prev, a, b) in out {
            assert_eq!(a, data(prev, 3));
            assert_eq!(b, data(prev + 100, 3));
        }
    }
}

#[test]
fn barrier_and_single_rank_group() {
    let out = LocalComm::run(1, |c| {
        c.barrier().unwrap();
        let mut b = vec![1.0, 2.0];
        c.all_reduce_sum(&mut b).unwrap();
        assert!(c.send(&b, 0).is_err(), "sending to oneself is an error");
        b
    });
    assert_eq!(out[0], vec![1.0, 2.0]);
    let n = LocalComm::run(4, |c| c.barrier().is_ok());
    assert!(n.into_iter().all(|ok| ok));
}

#[test]
fn size_mismatch_is_an_error() {
    let out = LocalComm::run(2, |c| {
        let mut o = vec![0.0; 3];
        c.all_gather(&[1.0, 2.0], &mut o)
    });
    assert!(matches!(
        out[0],
        Err(CommError::SizeMismatch {
            expected: 4,
            got: 3,
            ..
        })
    ));
}

#[test]
fn a_panicking_rank_does_not_hang_its_peers() {
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = LocalComm::group(3)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    if c.rank() == 1 {
                        panic!("rank 1 dies (expected in this test)");
                    }
                    let mut b = vec![1.0; 8];
                    c.all_reduce_sum(&mut b)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect::<Vec<_>>()
    });
    assert!(out[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        let res = out[r].as_ref().expect("no panic on healthy ranks");
        assert!(matches!(res, Err(CommError::PeerGone { .. })), "{res:?}");
    }
}

#[test]
fn out_of_step_ranks_get_a_clear_error_or_timeout() {
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = LocalComm::group(2)
            .into_iter()
            .map(|c| c.with_timeout(Some(std::time::Duration::from_millis(200))))
            .map(|c| {
                s.spawn(move || {
                    if c.rank() == 0 {
                        c.barrier()
                    } else {
                        let mut b = vec![0.0; 2];
                        c.broadcast(&mut b, 0)
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        matches!(out[1], Err(CommError::OutOfStep { .. })),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(
            out[0],
            Err(CommError::Timeout { .. } | CommError::PeerGone { .. })
        ),
        "{:?}",
        out[0]
    );
}

#[test]
fn from_groups_partitions_the_world() {
    // World 4 as two TP groups {0,1}, {2,3}: group ranks follow the listed order.
    let comms = LocalComm::from_groups(4, &[vec![0, 1], vec![3, 2]]).unwrap();
    let ranks: Vec<(usize, usize)> = comms.iter().map(|c| (c.rank(), c.size())).collect();
    assert_eq!(ranks, vec![(0, 2), (1, 2), (1, 2), (0, 2)]);
    assert!(LocalComm::from_groups(3, &[vec![0, 1]]).is_err());
    assert!(LocalComm::from_groups(2, &[vec![0, 1], vec![1]]).is_err());
}

#[test]
fn f64_sum_and_max_helpers() {
    let out = LocalComm::run(3, |c| {
        let s = crate::comm::all_reduce_f64(&c, 1e-20 + c.rank() as f64).unwrap();
        let mut m = vec![c.rank() as f32, -(c.rank() as f32)];
        crate::comm::all_reduce_max(&c, &mut m).unwrap();
        (s, m)
    });
    for (s, m) in out {
        assert_eq!(s, 1e-20 + 1e-20 + 1.0 + 1e-20 + 2.0);
        assert_eq!(m, vec![2.0, 0.0]);
    }
}

#[test]
fn pooled_buffers_are_reused_and_never_leak_old_data() {
    // Repeated all-reduces of the same size, with data that changes every round, then a
    // different size: results stay exact, and the pool stops growing once warm.
    let out = LocalComm::run(3, |c| {
        let mut sizes = Vec::new();
        for round in 0..6 {
            let len = if round < 4 { 1000 } else { 17 };
            let mut buf: Vec<f32> = data(c.rank(), len)
                .iter()
                .map(|x| x + round as f32)
                .collect();
            c.all_reduce_sum(&mut buf).unwrap();
            let mut want = vec![0.0f32; len];
            for r in 0..3 {
                let d: Vec<f32> = data(r, len).iter().map(|x| x + round as f32).collect();
                if r == 0 {
                    want = d;
                } else {
                    want.iter_mut().zip(d).for_each(|(a, b)| *a += b);
                }
            }
            assert_eq!(buf, want, "round {round}");
            c.barrier().unwrap();
            sizes.push(c.pool.borrow().len());
        }
        sizes
    });
    for sizes in out {
        // Round 0 fills the pool; rounds 1..3 reuse it; a new size adds buffers.
        assert!(sizes[1..4].iter().all(|&s| s == sizes[0]), "{sizes:?}");
        assert!(sizes[0] > 0 && sizes[4] > sizes[3], "{sizes:?}");
        assert!(sizes.iter().all(|&s| s <= POOL_CAP), "{sizes:?}");
    }
}
