//! `tessera calibrate`: measures this host for the CPU backend and writes a cluster spec that
//! `tessera plan` takes like a preset; GPU clusters and overwriting the input are refused, and
//! so, at once, is any rank count this host cannot measure; each device of the written spec
//! gets the host's memory over the spec's devices; the written spec keeps what `--help` says.
//! (Whether the calibrated predictions match measured runs is a benchmark's question:
//! docs/calibration-cpu.md.)

mod common;

use common::*;

#[test]
fn calibrated_spec_is_a_cluster_spec_with_measured_rates() {
    let dir = Scratch::new();
    let out = dir.path("cpu-calibrated.toml");
    let r = run(&[
        "calibrate",
        "specs/clusters/cpu-8.toml",
        "--ranks",
        "2",
        "-o",
        &s(&out),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stderr.contains("f32 GEMM 1024×1024×1024"), "{}", r.stderr);
    let text = std::fs::read_to_string(&out).unwrap();
    let spec: toml::Table = toml::from_str(&text).expect("valid TOML");
    assert_eq!(spec["name"].as_str(), Some("cpu-8-calibrated"));
    let peak = spec["device"]["peak_tflops"].as_float().unwrap();
    assert!(peak > 0.0 && peak < 100.0, "{peak}");
    let curve = spec["calibration"]["matmul_efficiency"].as_array().unwrap();
    assert_eq!(curve.len(), 7);
    let exp = spec["device"]["transcendental_gops"].as_float().unwrap();
    assert!(exp > 0.0 && exp < 100.0, "{exp}");
    let cores = spec["device"]["shared_cores"].as_integer().unwrap();
    assert!(cores >= 1, "{cores}");
    // The best size is 1.0 of the peak.
    assert!(curve
        .iter()
        .any(|p| p.as_array().unwrap()[1].as_float() == Some(1.0)));
    // The planner takes it as it takes the presets.
    let r = run(&["validate", &s(&out)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let r = run(&[
        "plan",
        "specs/models/tiny.toml",
        &s(&out),
        "--format",
        "json",
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let plan: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(plan["job"]["cluster"]["calibrated"], true);
}

#[test]
fn gpu_clusters_and_overwriting_the_input_are_refused() {
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    let r = run(&[
        "calibrate",
        "specs/clusters/dgx-a100-80g.toml",
        "-o",
        &s(&out),
    ]);
    refused(&r, &["dgx-a100-80g.toml", "GPU cluster", "fix:"]);
    assert!(!out.exists());
    let spec = dir.copy_edit("specs/clusters/cpu-8.toml", &[]);
    let before = Inputs::of(&[&spec]);
    let r = run(&["calibrate", &s(&spec), "-o", &s(&spec)]);
    refused(&r, &["-o/--output"]);
    before.unchanged();
}

/// This host's available memory (`MemAvailable`), bytes.
fn available_bytes() -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<f64>()
        .unwrap()
        * 1024.0
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Rank counts this host cannot measure are refused at once, before anything is allocated,
/// with the flag, the value, the limit, how it was derived and the fix; so are counts no
/// integer type holds. None of them is measured (a file is never written).
#[test]
fn ranks_beyond_this_host_are_refused_at_once() {
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    // Past 1024 on any host; 1024 itself on a host with fewer than 128 cores.
    let mut counts = vec![
        "1025",
        "100000",
        "9223372036854775807",
        "18446744073709551615",
    ];
    if cores() < 128 {
        counts.push("1024");
    }
    for ranks in counts {
        let r = run_within(
            &[
                "calibrate",
                "specs/clusters/cpu-8.toml",
                "--ranks",
                ranks,
                "-o",
                &s(&out),
            ],
            std::time::Duration::from_secs(10),
        );
        refused(
            &r,
            &[
                "--ranks",
                ranks,
                "at most",
                &format!("{} core", cores()),
                "available memory",
                "fix:",
            ],
        );
        assert!(!out.exists(), "--ranks {ranks} wrote {}", out.display());
    }
    for bad in ["0", "18446744073709551616", "-1", "eight"] {
        let r = run_within(
            &["calibrate", "specs/clusters/cpu-8.toml", "--ranks", bad],
            std::time::Duration::from_secs(10),
        );
        refused(&r, &["--ranks"]);
    }
}

/// Without `--ranks`, the spec's devices are the ranks measured: a spec with more devices
/// than this host can measure is refused naming the spec's fields, the count and the limit.
#[test]
fn a_spec_with_more_devices_than_this_host_can_measure_is_refused() {
    let dir = Scratch::new();
    for (nodes, devices) in [
        ("12500", "100000"),
        ("1152921504606846975", "9223372036854775800"),
    ] {
        let spec = dir.copy_edit(
            "specs/clusters/cpu-8.toml",
            &[("nodes = 1", &format!("nodes = {nodes}"))],
        );
        let out = dir.path("out.toml");
        let r = run_within(
            &["calibrate", &s(&spec), "-o", &s(&out)],
            std::time::Duration::from_secs(10),
        );
        refused(
            &r,
            &[
                &s(&spec),
                "nodes",
                "gpus_per_node",
                devices,
                "at most",
                "--ranks",
                "fix:",
            ],
        );
        assert!(!out.exists());
    }
}

/// The README's job measures 8 ranks on this 2-core machine: that stays allowed.
#[test]
fn eight_ranks_on_two_cores_are_allowed() {
    let r = run(&["calibrate", "specs/clusters/cpu-8.toml"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let spec: toml::Table = toml::from_str(&r.stdout).expect("valid TOML");
    assert_eq!(spec["gpus_per_node"].as_integer(), Some(8));
    // The phases were reported as they ran (one line each: standard error is not a terminal).
    for phase in [
        "[1/11] f32 GEMM 16×16×16",
        "[8/11] memory copy",
        "[11/11] all-reduce",
    ] {
        assert!(r.stderr.contains(phase), "no `{phase}` in:\n{}", r.stderr);
    }
}

/// Each device of the written spec gets this host's available memory over the spec's devices,
/// whatever the ranks measured: one rank measured for 8 devices does not give each device the
/// whole host.
#[test]
fn memory_per_device_is_the_hosts_over_the_specs_devices() {
    let dir = Scratch::new();
    let spec = dir.copy_edit(
        "specs/clusters/cpu-8.toml",
        &[
            ("gpus_per_node = 8", "gpus_per_node = 4"),
            ("nodes = 1", "nodes = 3"),
        ],
    );
    let r = run(&["calibrate", &s(&spec), "--ranks", "1"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let written: toml::Table = toml::from_str(&r.stdout).expect("valid TOML");
    let gib = written["device"]["memory_gib"].as_float().unwrap();
    let share = gib * (1u64 << 30) as f64 * 12.0 / available_bytes();
    assert!(
        (0.5..1.5).contains(&share),
        "12 devices × {gib} GiB is {share:.3} of this host's available memory"
    );
}

/// The keys `--help` says are kept, between "Kept from it:" and the next ";" (in backticks).
fn kept_keys(help: &str) -> Vec<String> {
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    let start = flat
        .find("Kept from it:")
        .unwrap_or_else(|| panic!("--help does not say what is kept:\n{help}"));
    let list = &flat[start..];
    let list = &list[..list.find(';').expect("the list ends with `;`")];
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

/// The value at a dotted key of a TOML table, or the table itself for `[table]`.
fn at<'a>(t: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let key = key.trim_start_matches('[').trim_end_matches(']');
    let (head, rest) = key.split_once('.').unwrap_or((key, ""));
    let v = t.get(head)?;
    if rest.is_empty() {
        Some(v)
    } else {
        at(v.as_table()?, rest)
    }
}

/// Every leaf key of a TOML table, dotted.
fn leaves(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (k, v) in t {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v.as_table() {
            Some(t) => leaves(t, &key, out),
            None => out.push(key),
        }
    }
}

/// The written spec keeps exactly what `--help` promises: each key the help names as kept has
/// the input's value, the name gets `-calibrated`, and every other key the input sets (each
/// given a value no measurement lands on) is replaced. With one rank, which cannot measure the
/// links, the help's one-rank list is kept too.
#[test]
fn the_written_spec_keeps_what_the_help_promises() {
    let help = run(&["calibrate", "--help"]).stdout;
    let kept = kept_keys(&help);
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("`name` gets `-calibrated` appended"),
        "{help}"
    );
    let dir = Scratch::new();
    let input = "name = \"host-x\"\nnodes = 2\ngpus_per_node = 2\n\n\
        [device]\nname = \"my-cpu\"\nkind = \"cpu\"\nmemory_gib = 7.25\npeak_tflops = 0.1234\n\
        memory_bandwidth_gbps = 12.34\nsms = 7\nkernel_launch_us = 3.5\ntranscendental_gops = 0.0123\nshared_cores = 999\n\n\
        [intra_node]\nbandwidth_gbps = 4.321\nlatency_us = 12.5\n\n\
        [inter_node]\nbandwidth_gbps = 1.234\nlatency_us = 45.5\n\n\
        [overhead]\ncontext_gib = 0.125\nfragmentation = 0.05\ncuda_context_mib = 1.5\ncublas_workspace_mib = 2.5\nnccl_mib_per_communicator = 3.5\n\n\
        [calibration]\nmatmul_efficiency = [[64, 0.11], [1024, 0.22]]\nmemory_efficiency = 0.7\ngemm_efficiency = 0.55\n\
        flash_attention_efficiency = 0.45\nintra_node_efficiency = 0.65\ninter_node_efficiency = 0.6\n";
    let spec = dir.path("host-x.toml");
    std::fs::write(&spec, input).unwrap();
    let input: toml::Table = toml::from_str(input).unwrap();
    let mut keys = Vec::new();
    leaves(&input, "", &mut keys);
    for (ranks, one_rank) in [("2", false), ("1", true)] {
        let r = run(&["calibrate", &s(&spec), "--ranks", ranks]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let written: toml::Table = toml::from_str(&r.stdout).expect("valid TOML");
        let mut kept = kept.clone();
        if one_rank {
            let i = flat
                .find("with one rank")
                .expect("the help's one-rank rule");
            let tail = &flat[i..];
            let tail = &tail[..tail.find(';').or(tail.find('.')).unwrap()];
            kept.extend(tail.split('`').skip(1).step_by(2).map(String::from));
        }
        for k in &kept {
            assert_eq!(
                at(&written, k),
                at(&input, k),
                "--ranks {ranks}: `{k}` is kept, says --help"
            );
        }
        assert_eq!(written["name"].as_str(), Some("host-x-calibrated"));
        for k in &keys {
            let is_kept = k == "name"
                || kept.iter().any(|c| {
                    k == c.trim_matches(['[', ']'])
                        || k.starts_with(&format!("{}.", c.trim_matches(['[', ']'])))
                });
            if !is_kept {
                assert_ne!(
                    at(&written, k),
                    at(&input, k),
                    "--ranks {ranks}: `{k}` was kept, and --help does not say so"
                );
            }
        }
        // The one key that is not measured but derived: the host's memory over the 4 devices.
        let gib = written["device"]["memory_gib"].as_float().unwrap();
        let share = gib * (1u64 << 30) as f64 * 4.0 / available_bytes();
        assert!((0.5..1.5).contains(&share), "{share}");
    }
}

/// Busy loops in other processes, one per core, stopped (by their ids) when dropped.
struct Spinners(Vec<std::process::Child>);

impl Spinners {
    fn start(n: usize) -> Spinners {
        Spinners(
            (0..n)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("sh runs")
                })
                .collect(),
        )
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            c.kill().ok();
            c.wait().ok();
        }
    }
}

/// Every figure is repeated until its runs agree and its spread is said, on standard error
/// and in the written spec; a calibration while other processes keep every core busy says it
/// was under load, in both. (How stable a quiet host's calibrations are is a benchmark's
/// question: docs/calibration-cpu.md, "CPU calibrate stability".)
#[test]
fn a_calibration_says_its_spread_and_that_it_ran_under_load() {
    let dir = Scratch::new();
    let out = dir.path("loaded.toml");
    let spinners = Spinners::start(cores());
    let r = run(&[
        "calibrate",
        "specs/clusters/cpu-8.toml",
        "--ranks",
        "1",
        "-o",
        &s(&out),
    ]);
    drop(spinners);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let text = std::fs::read_to_string(&out).unwrap();
    for (what, haystack) in [("stderr", &r.stderr), ("the spec", &text)] {
        for part in [
            "spread",
            "over",
            "runs",
            "under load: other processes took",
            "calibrate again when the host is quiet",
        ] {
            assert!(
                haystack.contains(part),
                "{what} lacks `{part}`:\n{haystack}"
            );
        }
        assert!(
            haystack.contains("stable: every figure")
                || haystack.contains("not stable: the 3 fastest runs"),
            "{what} says nothing of stability:\n{haystack}"
        );
    }
    assert!(r.stderr.contains("warning: under load"), "{}", r.stderr);
    assert!(text.contains("#   memory copy: spread"), "{text}");
    // Still a spec `tessera plan` reads.
    let r = run(&["validate", &s(&out)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

/// `--host` replaces only the GPU spec's `[host]`: the memory is /proc/meminfo's MemTotal, the
/// AdamW rate measured (positive, below any CPU's memory bound of ~100 Gparams/s), the link and
/// NVMe the input's; `tessera plan` reads the result; a CPU cluster is refused.
#[test]
fn host_calibration_replaces_only_the_host_tier() {
    let dir = Scratch::new();
    let out = dir.path("h100-host.toml");
    let r = run(&[
        "calibrate",
        "--host",
        "specs/clusters/dgx-h100-80g.toml",
        "-o",
        &s(&out),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let text = std::fs::read_to_string(&out).unwrap();
    let spec: toml::Table = toml::from_str(&text).expect("valid TOML");
    let input: toml::Table =
        toml::from_str(&std::fs::read_to_string("specs/clusters/dgx-h100-80g.toml").unwrap())
            .unwrap();
    for table in [
        "device",
        "intra_node",
        "inter_node",
        "overhead",
        "calibration",
    ] {
        assert_eq!(spec[table], input[table], "{table} must be kept");
    }
    let host = spec["host"].as_table().unwrap();
    let kb: f64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap();
    let gib = host["memory_gib"].as_float().unwrap();
    assert!((gib - kb / 1048576.0).abs() < 0.11, "{gib} vs {kb} kB");
    let adamw = host["adamw_gparams_per_s"].as_float().unwrap();
    assert!(adamw > 0.0 && adamw < 100.0, "{adamw}");
    assert_eq!(host["link_gbps"], input["host"]["link_gbps"]);
    assert_eq!(host["nvme_gib"], input["host"]["nvme_gib"]);
    let plan = run(&[
        "plan",
        "specs/models/gpt2-124m.toml",
        &s(&out),
        "--devices",
        "1",
        "--top",
        "1",
    ]);
    assert_eq!(plan.code, Some(0), "{}", plan.stderr);
    let cpu = run(&["calibrate", "--host", "specs/clusters/cpu-8.toml"]);
    assert_ne!(cpu.code, Some(0));
    assert!(cpu.stderr.contains("is a CPU cluster"), "{}", cpu.stderr);
}
