//! Launch variables from injected maps (the process environment is never touched).

use std::collections::HashMap;
use std::time::Duration;

use super::*;

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn read(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, EnvError> {
    let m = vars(pairs);
    LaunchEnv::from_vars(&|k| m.get(k).cloned())
}

fn config(pairs: &[(&str, &str)]) -> Result<Config, EnvError> {
    let m = vars(pairs);
    let var = |k: &str| m.get(k).cloned();
    LaunchEnv::from_vars(&var)?
        .expect("a launch")
        .rendezvous_config(&var)
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29500"),
    ("TESSERA_JOB_TOKEN", "abc"),
];

#[test]
fn no_launcher_means_one_process() {
    assert_eq!(read(&[("HOME", "/h")]).unwrap(), None);
}

#[test]
fn torchrun_variables() {
    let e = read(TORCHRUN).unwrap().unwrap();
    assert_eq!(
        e,
        LaunchEnv {
            source: Source::Torchrun,
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29500),
            job_token: Some("abc".into()),
        }
    );
    // Without LOCAL_*: one node holds every rank.
    let e = read(&[("RANK", "2"), ("WORLD_SIZE", "3")])
        .unwrap()
        .unwrap();
    assert_eq!(
        (e.local_rank, e.local_world_size, e.job_token),
        (2, 3, None)
    );
}

#[test]
fn torchrun_errors_name_the_variable() {
    let e = read(&[("RANK", "1")]).unwrap_err();
    assert!(
        matches!(
            e,
            EnvError::Missing {
                var: "WORLD_SIZE",
                ..
            }
        ),
        "{e}"
    );
    let e = read(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err();
    assert!(
        matches!(
            e,
            EnvError::Missing {
                var: "LOCAL_WORLD_SIZE",
                ..
            }
        ),
        "{e}"
    );
    let e = read(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert_eq!(e.to_string(), "RANK=\"x\" is not a non-negative integer");
    let e = read(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert!(
        e.to_string()
            .contains("rank 2 is not below the world size 2"),
        "{e}"
    );
    let e = read(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
    ])
    .unwrap_err();
    assert!(matches!(e, EnvError::Inconsistent { .. }), "{e}");
    let e = read(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")]).unwrap_err();
    assert!(
        matches!(
            e,
            EnvError::Invalid {
                var: "MASTER_PORT",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn slurm_variables() {
    let e = read(&[
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NTASKS_PER_NODE", "4"),
        ("SLURM_JOB_ID", "777"),
        ("MASTER_ADDR", "node1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.source, Source::Slurm);
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (6, 8, 2, 4)
    );
    assert_eq!(e.job_token.as_deref(), Some("slurm-777"));
    // Uneven nodes: this node (id 2) runs 2 tasks.
    let e = read(&[
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "10"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_TASKS_PER_NODE", "4(x2),2"),
        ("SLURM_NODEID", "2"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.local_world_size, 2);
    let e = read(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ])
    .unwrap_err();
    assert!(
        matches!(
            e,
            EnvError::Missing {
                var: "SLURM_LOCALID",
                ..
            }
        ),
        "{e}"
    );
    let e = read(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_TASKS_PER_NODE", "2(x"),
    ])
    .unwrap_err();
    assert!(matches!(e, EnvError::Invalid { .. }), "{e}");
}

#[test]
fn torchrun_inside_slurm_uses_torchrun_ranks() {
    let mut pairs = TORCHRUN.to_vec();
    pairs.extend([
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
    ]);
    let e = read(&pairs).unwrap().unwrap();
    assert_eq!((e.source, e.rank, e.world_size), (Source::Torchrun, 5, 8));
    assert_eq!(
        e.job_token.as_deref(),
        Some("abc"),
        "TESSERA_JOB_TOKEN first"
    );
}

#[test]
fn torchelastic_default_run_id_is_not_a_token() {
    let e = read(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("TORCHELASTIC_RUN_ID", "none"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.job_token, None);
    let e = read(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("TORCHELASTIC_RUN_ID", "job42"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.job_token.as_deref(), Some("job42"));
}

#[test]
fn slurm_task_lists_expand() {
    assert_eq!(expand_tasks_per_node("4"), Some(vec![4]));
    assert_eq!(expand_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
    assert_eq!(expand_tasks_per_node("2(x3"), None);
    assert_eq!(expand_tasks_per_node("a"), None);
}

#[test]
fn rendezvous_configuration() {
    let c = config(TORCHRUN).unwrap();
    assert_eq!(c.token, "abc");
    assert_eq!((c.rank, c.world), (5, 8));
    assert_eq!(c.timeout, Duration::from_secs(300));
    assert_eq!(
        c.transport,
        Transport::Tcp {
            host: "10.0.0.1".into(),
            port: 29500,
            bind: None
        }
    );
    let mut p = TORCHRUN.to_vec();
    p.extend([
        ("TESSERA_RENDEZVOUS", "file:/shared/rdzv"),
        ("TESSERA_RENDEZVOUS_TIMEOUT", "2.5"),
    ]);
    let c = config(&p).unwrap();
    assert_eq!(
        c.transport,
        Transport::File {
            path: "/shared/rdzv".into()
        }
    );
    assert_eq!(c.timeout, Duration::from_millis(2500));
    let mut p = TORCHRUN.to_vec();
    p.push(("TESSERA_RENDEZVOUS_BIND", "0.0.0.0"));
    assert!(
        matches!(config(&p).unwrap().transport, Transport::Tcp { bind: Some(b), .. } if b == "0.0.0.0")
    );
}

#[test]
fn rendezvous_configuration_errors() {
    let no_token: Vec<_> = TORCHRUN
        .iter()
        .copied()
        .filter(|p| p.0 != "TESSERA_JOB_TOKEN")
        .collect();
    let e = config(&no_token).unwrap_err();
    assert!(
        matches!(
            e,
            EnvError::Missing {
                var: "TESSERA_JOB_TOKEN",
                ..
            }
        ),
        "{e}"
    );
    let no_addr: Vec<_> = TORCHRUN
        .iter()
        .copied()
        .filter(|p| p.0 != "MASTER_ADDR")
        .collect();
    let e = config(&no_addr).unwrap_err();
    assert!(e.to_string().contains("scontrol show hostnames"), "{e}");
    let mut p: Vec<_> = TORCHRUN
        .iter()
        .copied()
        .filter(|p| p.0 != "MASTER_PORT")
        .collect();
    p.push(("MASTER_PORT", "0"));
    assert!(matches!(
        config(&p).unwrap_err(),
        EnvError::Invalid {
            var: "MASTER_PORT",
            ..
        }
    ));
    let mut p = TORCHRUN.to_vec();
    p.push(("TESSERA_RENDEZVOUS", "etcd"));
    assert!(matches!(
        config(&p).unwrap_err(),
        EnvError::Invalid {
            var: "TESSERA_RENDEZVOUS",
            ..
        }
    ));
    let mut p = TORCHRUN.to_vec();
    p.push(("TESSERA_RENDEZVOUS_TIMEOUT", "-1"));
    assert!(matches!(config(&p).unwrap_err(), EnvError::Invalid { .. }));
}

#[test]
fn a_timeout_too_large_for_a_duration_is_refused_not_a_panic() {
    for bad in ["inf", "NaN", "1e300", "0", "soon"] {
        let mut p = TORCHRUN.to_vec();
        p.push(("TESSERA_RENDEZVOUS_TIMEOUT", bad));
        assert!(
            matches!(
                config(&p).unwrap_err(),
                EnvError::Invalid {
                    var: "TESSERA_RENDEZVOUS_TIMEOUT",
                    ..
                }
            ),
            "{bad}"
        );
    }
}

#[test]
fn the_rendezvous_kind_is_tcp_or_a_file_with_a_path() {
    use std::path::PathBuf;
    assert_eq!(RendezvousKind::parse("tcp"), Some(RendezvousKind::Tcp));
    assert_eq!(RendezvousKind::parse(" tcp\n"), Some(RendezvousKind::Tcp));
    assert_eq!(
        RendezvousKind::parse("file:/shared/rdzv"),
        Some(RendezvousKind::File(PathBuf::from("/shared/rdzv")))
    );
    for bad in [
        "",
        "TCP",
        "bogus",
        "file:",
        "file",
        "etcd://host:2379",
        "tcp:29500",
    ] {
        assert_eq!(RendezvousKind::parse(bad), None, "{bad:?}");
    }
}
