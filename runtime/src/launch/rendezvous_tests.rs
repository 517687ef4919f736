//! Rendezvous on loopback with threads as ranks (the separate-process runs are in
//! `supervise_tests.rs` and `tests/launch.rs`).

use std::net::TcpStream;
use std::path::Path;
use std::thread;

use super::*;

fn tcp(token: &str, rank: usize, world: usize, port: u16, secs: f64) -> Config {
    Config {
        token: token.into(),
        rank,
        world,
        timeout: Duration::from_secs_f64(secs),
        transport: Transport::Tcp {
            host: "127.0.0.1".into(),
            port,
            bind: None,
        },
    }
}

fn port() -> u16 {
    crate::launch::free_port("127.0.0.1").unwrap()
}

fn blob() -> Result<Vec<u8>, String> {
    Ok((0..=255u8).chain(0..=255u8).collect())
}

fn never() -> Result<Vec<u8>, String> {
    unreachable!("only rank 0 makes the blob")
}

#[test]
fn tcp_delivers_the_blob_and_the_outcome_to_every_rank() {
    for outcome in [Ok(()), Err("rank 0 ran out of memory".to_string())] {
        let p = port();
        let peers: Vec<_> = (1..4)
            .map(|r| {
                thread::spawn(move || {
                    let j = rendezvous(&tcp("job", r, 4, p, 10.0), never).unwrap();
                    assert!(!j.session.is_root());
                    (j.blob, j.session.wait())
                })
            })
            .collect();
        let root = rendezvous(&tcp("job", 0, 4, p, 10.0), blob).unwrap();
        assert_eq!(root.blob, blob().unwrap());
        root.session.finish(outcome.clone()).unwrap();
        for h in peers {
            let (b, done) = h.join().unwrap();
            assert_eq!(b, blob().unwrap());
            match (&outcome, done) {
                (Ok(()), Ok(())) => {}
                (Err(m), Err(RendezvousError::RootFailed { message })) => assert_eq!(&message, m),
                (o, d) => panic!("outcome {o:?} but the peer saw {d:?}"),
            }
        }
    }
}

#[test]
fn a_peer_of_another_job_or_world_is_rejected_and_rank_0_carries_on() {
    let p = port();
    let root = thread::spawn(move || rendezvous(&tcp("job-a", 0, 2, p, 10.0), blob));
    let intruder = rendezvous(&tcp("job-b", 1, 2, p, 10.0), never).unwrap_err();
    assert!(
        matches!(&intruder, RendezvousError::Rejected { reason, .. } if reason.contains("wrong job token")),
        "{intruder}"
    );
    let wrong_world = rendezvous(&tcp("job-a", 1, 3, p, 10.0), never).unwrap_err();
    assert!(
        wrong_world
            .to_string()
            .contains("says the world has 3 ranks, rank 0 says 2"),
        "{wrong_world}"
    );
    let wrong_rank = rendezvous(&tcp("job-a", 0, 2, p, 10.0).with_rank(2), never);
    assert!(wrong_rank.is_err());
    let good = rendezvous(&tcp("job-a", 1, 2, p, 10.0), never).unwrap();
    assert_eq!(good.blob, blob().unwrap());
    root.join().unwrap().unwrap();
}

impl Config {
    fn with_rank(mut self, rank: usize) -> Self {
        self.rank = rank;
        self
    }
}

#[test]
fn garbage_on_the_port_is_rejected_without_a_huge_allocation() {
    let p = port();
    let root = thread::spawn(move || rendezvous(&tcp("job", 0, 2, p, 10.0), blob));
    let mut s = loop {
        match TcpStream::connect(("127.0.0.1", p)) {
            Ok(s) => break s,
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    };
    s.write_all(&[HELLO, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).ok();
    assert_eq!(
        answer.first(),
        Some(&REJECT),
        "rank 0 answers with a rejection"
    );
    rendezvous(&tcp("job", 1, 2, p, 10.0), never).unwrap();
    root.join().unwrap().unwrap();
}

#[test]
fn rank_0_binds_only_the_address_it_is_told() {
    let p = port();
    let root = thread::spawn(move || rendezvous(&tcp("job", 0, 2, p, 10.0), blob));
    thread::sleep(Duration::from_millis(200));
    // 127.0.0.2 is this machine too (loopback), but not the address rank 0 was told.
    assert!(TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 2], p)),
        Duration::from_secs(1)
    )
    .is_err());
    rendezvous(&tcp("job", 1, 2, p, 10.0), never).unwrap();
    root.join().unwrap().unwrap();
    // An address that is not this machine's cannot be bound: a clear error with the fix.
    let c = Config {
        transport: Transport::Tcp {
            host: "192.0.2.1".into(),
            port: p,
            bind: None,
        },
        ..tcp("job", 0, 2, p, 1.0)
    };
    let e = rendezvous(&c, blob).unwrap_err();
    assert!(
        matches!(e, RendezvousError::Bind { .. }) && e.to_string().contains("fix:"),
        "{e}"
    );
}

#[test]
fn timeouts_name_who_is_missing() {
    let p = port();
    let root = thread::spawn(move || rendezvous(&tcp("job", 0, 3, p, 1.0), blob));
    let peer = thread::spawn(move || rendezvous(&tcp("job", 1, 3, p, 3.0), never));
    let e = root.join().unwrap().unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Timeout { missing, have: 2, need: 3, .. } if missing == &vec![2]),
        "{e}"
    );
    // Rank 0 gave up and closed: the waiting peer learns it.
    assert!(peer.join().unwrap().is_err());
    // Nobody listening: the peer retries, then says where it looked.
    let e = rendezvous(&tcp("job", 1, 2, port(), 0.5), never).unwrap_err();
    assert!(
        matches!(e, RendezvousError::Connect { attempts, .. } if attempts > 1),
        "{e}"
    );
}

#[test]
fn a_root_that_dies_is_noticed_by_waiting_peers() {
    let p = port();
    let peer = thread::spawn(move || {
        rendezvous(&tcp("job", 1, 2, p, 10.0), never)
            .unwrap()
            .session
            .wait()
    });
    let root = rendezvous(&tcp("job", 0, 2, p, 10.0), blob).unwrap();
    drop(root);
    assert!(matches!(
        peer.join().unwrap(),
        Err(RendezvousError::RootGone { rank: 1 })
    ));
}

fn file_cfg(dir: &Path, token: &str, rank: usize, world: usize, secs: f64) -> Config {
    Config {
        token: token.into(),
        rank,
        world,
        timeout: Duration::from_secs_f64(secs),
        transport: Transport::File {
            path: dir.join("rdzv"),
        },
    }
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-rdzv-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn shared_file_delivers_the_blob_and_the_outcome() {
    let dir = temp("file");
    for outcome in [Ok(()), Err("boom".to_string())] {
        let peers: Vec<_> = (1..3)
            .map(|r| {
                let dir = dir.clone();
                thread::spawn(move || {
                    let j = rendezvous(&file_cfg(&dir, "job", r, 3, 10.0), never).unwrap();
                    (j.blob, j.session.wait())
                })
            })
            .collect();
        let root = rendezvous(&file_cfg(&dir, "job", 0, 3, 10.0), blob).unwrap();
        root.session.finish(outcome.clone()).unwrap();
        for h in peers {
            let (b, done) = h.join().unwrap();
            assert_eq!(b, blob().unwrap());
            assert_eq!(done.is_ok(), outcome.is_ok());
            if let Err(RendezvousError::RootFailed { message }) = done {
                assert_eq!(message, "boom");
            }
        }
        // No temporary files are left behind.
        assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn shared_file_of_another_job_or_world_is_refused() {
    let dir = temp("file-refuse");
    let root = {
        let dir = dir.clone();
        thread::spawn(move || rendezvous(&file_cfg(&dir, "job-a", 0, 2, 1.0), blob))
    };
    thread::sleep(Duration::from_millis(100));
    let e = rendezvous(&file_cfg(&dir, "job-b", 1, 2, 0.5), never).unwrap_err();
    assert!(e.to_string().contains("another job"), "{e}");
    let e = rendezvous(&file_cfg(&dir, "job-a", 1, 3, 0.5), never).unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Rejected { reason, .. } if reason.contains("world has 2 ranks")),
        "{e}"
    );
    let e = root.join().unwrap().unwrap_err();
    assert!(matches!(e, RendezvousError::Timeout { .. }), "{e}");
    // A file left behind (a crashed run, or a job using the same path) stops rank 0.
    std::fs::write(dir.join("rdzv"), "tessera-rendezvous 1\n").unwrap();
    let e = rendezvous(&file_cfg(&dir, "job-a", 0, 2, 0.5), blob).unwrap_err();
    assert!(
        e.to_string().contains("already exists") && e.to_string().contains("fix:"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn one_rank_needs_no_peers() {
    let j = rendezvous(&tcp("job", 0, 1, 1, 0.1), blob).unwrap();
    assert!(j.session.is_root());
    j.session.finish(Ok(())).unwrap();
    assert!(matches!(
        rendezvous(&tcp("", 0, 1, 1, 0.1), blob),
        Err(RendezvousError::Config(_))
    ));
}
