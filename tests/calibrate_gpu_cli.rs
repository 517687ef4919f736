//! `tessera calibrate --gpu` / `--from-json`: kernel measurements taken through PyTorch
//! (scripts/calibrate_gpu.py) become a GPU spec's `[calibration]` table. No GPU is lent to
//! this project's tests, so the measurement is a recorded one (tests/fixtures/gpu-calibration/
//! h100.json, a subset of ../shared/gpu/h100-kernels.jsonl built by make_h100.py there), and
//! the script is stood in for by fakes where the path through it is tested.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::*;

const FIXTURE: &str = "tests/fixtures/gpu-calibration/h100.json";

fn tessera(args: &[&str], python: Option<&Path>) -> Output {
    let mut c = bin();
    c.args(args);
    if let Some(p) = python {
        c.env("TESSERA_PYTHON", p);
    }
    c.output().expect("tessera runs")
}

/// An executable shell script standing in for Python (it ignores the script path it is given).
fn fake_python(dir: &Scratch, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.path("fake-python");
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn f(t: &toml::Table, key: &str) -> f64 {
    let v = &t["calibration"][key];
    v.as_float()
        .or_else(|| v.as_integer().map(|i| i as f64))
        .unwrap_or_else(|| panic!("calibration.{key}: {v:?}"))
}

/// The H100 measurements against the H100 preset's peaks (989.4 TFLOP/s, 3350 GB/s), by hand
/// from the rows of ../shared/gpu/h100-kernels.jsonl the fixture holds:
/// - GEMM, smallest dimension 4096: the square 4096³ at 783.7 TFLOP/s (0.792, README: "4096³
///   0.79") and the four TP-1 layer GEMMs of h 4096 at 16384 tokens, 0.652, 0.652, 0.675,
///   0.693: median of five = the third, fc1's 668.3 / 989.4 = 0.6755 → 0.675 (not the square's
///   0.79: the median over shapes is the point).
/// - Smallest dimension 768: the h 768 TP-1 layer GEMMs at 16384 tokens, 0.490, 0.553, 0.557,
///   0.677: median of four = (547.0 + 551.2) / 2 / 989.4 = 0.55498 → 0.555.
/// - Smallest dimension 1024: the launch-bound square 1024³ (75.7 TFLOP/s, 0.077) and two
///   4096-token layer GEMMs, 625.2 and 638.9 TFLOP/s: median 625.2 / 989.4 = 0.6319 → 0.632.
/// - Smallest dimension 200 (h 1600 TP 8 proj at 4096 tokens): 101.7 / 989.4 = 0.103.
/// - One shape each at 2048, 8192, 16384: the squares, 636.3, 796.7, 708.7 → 0.643, 0.805, 0.716.
/// - Memory: copy 3000, layernorm 1984, GELU 2913 GB/s; median 2913 / 3350 = 0.8696 → 0.870.
/// - Flash attention: SDPA fwd+bwd 0.116, 0.208, 0.255, 0.280, 0.317 of peak at T 1024 … 16384;
///   median 0.255.
/// - host_op_us: 0.1 s over 10 000 ops = 10 µs (the fixture's round number, not a measurement).
#[test]
fn recorded_h100_measurement_gives_the_hand_computed_calibration() {
    let dir = Scratch::new();
    let out = dir.path("h100-calibrated.toml");
    let r = tessera(
        &[
            "calibrate",
            "specs/clusters/dgx-h100-80g.toml",
            "--from-json",
            FIXTURE,
            "-o",
            &s(&out),
        ],
        None,
    );
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    let written = std::fs::read_to_string(&out).unwrap();
    let t: toml::Table = toml::from_str(&written).expect("valid TOML");
    assert_eq!(t["name"].as_str(), Some("dgx-h100-80g-calibrated"));
    let curve: Vec<(f64, f64)> = t["calibration"]["matmul_efficiency"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let p = p.as_array().unwrap();
            (p[0].as_integer().unwrap() as f64, p[1].as_float().unwrap())
        })
        .collect();
    assert_eq!(
        curve,
        vec![
            (200.0, 0.103),
            (768.0, 0.555),
            (1024.0, 0.632),
            (2048.0, 0.643),
            (4096.0, 0.675),
            (8192.0, 0.805),
            (16384.0, 0.716)
        ]
    );
    assert_eq!(f(&t, "memory_efficiency"), 0.870);
    assert_eq!(f(&t, "flash_attention_efficiency"), 0.255);
    assert_eq!(f(&t, "host_op_us"), 10.0);
    // The measured curve replaces the tile and wave model; the collectives are the input's.
    assert!(t["calibration"].get("gemm_efficiency").is_none());
    assert_eq!(f(&t, "intra_node_efficiency"), 0.822);
    assert_eq!(f(&t, "inter_node_efficiency"), 0.94);
    assert_eq!(t["device"]["peak_tflops"].as_float(), Some(989.4));
    // Each value says what measured it.
    mentions(
        &written,
        &[
            "median of 5 shape(s)",
            "gelu 2913 GB/s",
            "T 16384 d 128",
            "forward and backward",
            "F.cross_entropy on fp32 8192 × 50257 logits: 8.300 ms",
            "NVIDIA H100 80GB HBM3",
        ],
    );
    // The written spec is one `tessera plan` reads, `host_op_us` included: a pytorch-eager
    // GPT-2 plan on one of its GPUs is charged the measured per-op host cost.
    plans_on(
        "specs/models/gpt2-124m.toml",
        &out,
        &["--devices", "1", "--framework", "pytorch-eager"],
    );
}

/// The written spec says each of `what`.
fn mentions(written: &str, what: &[&str]) {
    for w in what {
        assert!(written.contains(w), "no `{w}` in\n{written}");
    }
}

/// `tessera plan MODEL SPEC ARGS` must succeed: the written spec is one the planner reads.
fn plans_on(model: &str, spec: &Path, args: &[&str]) {
    let spec = s(spec);
    let mut all = vec!["plan", model, spec.as_str()];
    all.extend_from_slice(args);
    let r = tessera(&all, None);
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
}

/// `--gpu` runs the script with TESSERA_PYTHON: a stand-in that prints the recorded
/// measurement gives the same table as `--from-json`.
#[test]
fn gpu_runs_the_script_and_converts_what_it_prints() {
    let dir = Scratch::new();
    let py = fake_python(
        &dir,
        &format!("echo 'gemm 1024^3' >&2\ncat '{}'", s(&root().join(FIXTURE))),
    );
    let r = tessera(
        &["calibrate", "specs/clusters/dgx-h100-80g.toml", "--gpu"],
        Some(&py),
    );
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    assert!(
        text(&r.stderr).contains("gemm 1024^3"),
        "progress passed on"
    );
    let t: toml::Table = toml::from_str(&text(&r.stdout)).expect("valid TOML");
    assert_eq!(f(&t, "flash_attention_efficiency"), 0.255);
    assert!(text(&r.stdout).contains("measured on this machine"));
}

/// No GPU: one message naming what was looked for (and the script's reason), exit status 3
/// (the script's own no-GPU status), nothing written. A Python that cannot be started is the
/// same.
#[test]
fn no_gpu_says_what_it_looked_for_exits_3_and_writes_nothing() {
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    let py = fake_python(
        &dir,
        "echo 'no GPU to measure: torch.cuda.is_available() is False (PyTorch 2.5.1)' >&2\nexit 3",
    );
    let missing = dir.path("no-such-python");
    for (python, reason) in [
        (&py, "torch.cuda.is_available() is False (PyTorch 2.5.1)"),
        (&missing, "could not be started"),
    ] {
        let r = tessera(
            &[
                "calibrate",
                "specs/clusters/dgx-h100-80g.toml",
                "--gpu",
                "-o",
                &s(&out),
            ],
            Some(python),
        );
        let err = text(&r.stderr);
        assert_eq!(r.status.code(), Some(3), "{err}");
        for part in [
            "no GPU to measure",
            "looked for a CUDA device through PyTorch",
            &s(python),
            reason,
            "fix:",
        ] {
            assert!(err.contains(part), "no `{part}` in {err}");
        }
        assert_eq!(err.matches("no GPU to measure").count(), 1, "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists());
    }
    // A script that fails otherwise is an error (2), not "no GPU".
    let broken = fake_python(&dir, "echo 'Traceback: CUDA error' >&2\nexit 1");
    let r = tessera(
        &["calibrate", "specs/clusters/dgx-h100-80g.toml", "--gpu"],
        Some(&broken),
    );
    assert_eq!(r.status.code(), Some(2));
    assert!(text(&r.stderr).contains("failed with exit status 1"));
}

/// A malformed measurement: an error naming the file and the field, exit status 2, nothing
/// written.
#[test]
fn malformed_measurements_name_the_file_and_the_field() {
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    let good = std::fs::read_to_string(root().join(FIXTURE)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["gemm"][2]["seconds"] = serde_json::json!(-1.0);
    let negative = v.to_string();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v.as_object_mut().unwrap().remove("host_op");
    let no_host = v.to_string();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["attention"][1]["causal"] = serde_json::json!(false);
    let not_causal = v.to_string();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    v["schema"] = serde_json::json!("tessera-gpu-calibration/0");
    let old = v.to_string();
    for (i, (body, field)) in [
        (
            negative.as_str(),
            "`gemm[2].seconds`: must be a number above 0, found -1.0",
        ),
        (no_host.as_str(), "field `host_op` is missing"),
        (not_causal.as_str(), "`attention[1].causal`"),
        (old.as_str(), "field `schema`"),
        ("{\"schema\": ", "not a JSON document"),
    ]
    .into_iter()
    .enumerate()
    {
        let json = dir.path(&format!("m{i}.json"));
        std::fs::write(&json, body).unwrap();
        let r = tessera(
            &[
                "calibrate",
                "specs/clusters/dgx-h100-80g.toml",
                "--from-json",
                &s(&json),
                "-o",
                &s(&out),
            ],
            None,
        );
        let err = text(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{err}");
        assert!(err.contains(&s(&json)), "no file in {err}");
        assert!(err.contains(field), "no `{field}` in {err}");
        assert!(!out.exists());
    }
}

/// A GEMM faster than the spec's peak is the spec's error, said so (peak 500: the first
/// point over it is smallest dimension 768, (547.0 + 551.2) / 2 / 500 = 1.098); a CPU cluster is not
/// calibrated as a GPU, and --ranks (CPU ranks) does not go with --gpu.
#[test]
fn measurements_above_the_peak_and_mismatched_flags_are_refused() {
    let dir = Scratch::new();
    let spec = dir.copy_edit(
        "specs/clusters/dgx-h100-80g.toml",
        &[("peak_tflops = 989.4", "peak_tflops = 500")],
    );
    let r = tessera(&["calibrate", &s(&spec), "--from-json", FIXTURE], None);
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("smallest dimension 768 reach 1.098") && err.contains("peak_tflops"),
        "{err}"
    );
    let r = tessera(
        &[
            "calibrate",
            "specs/clusters/cpu-8.toml",
            "--from-json",
            FIXTURE,
        ],
        None,
    );
    assert_eq!(r.status.code(), Some(2));
    assert!(text(&r.stderr).contains("is a CPU cluster"));
    let r = tessera(
        &[
            "calibrate",
            "specs/clusters/dgx-h100-80g.toml",
            "--gpu",
            "--ranks",
            "2",
        ],
        None,
    );
    assert_eq!(r.status.code(), Some(2));
    assert!(text(&r.stderr).contains("cannot be used with"));
}

/// A measuring script that never returns is stopped at `--timeout`, with everything it
/// started (its process group): one message naming the script, the time waited and a fix,
/// exit status 2, nothing written. The stand-in starts a `sleep` of its own, which would keep
/// the output pipe open (and tessera waiting) if only the stand-in were killed.
#[test]
fn a_script_that_never_returns_is_stopped_at_the_timeout() {
    use std::time::{Duration, Instant};
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    let sleeper = dir.path("sleeper.pid");
    let py = fake_python(
        &dir,
        &format!(
            "echo 'gemm 1024^3' >&2\nsleep 300 &\necho $! > '{}'\nwait",
            s(&sleeper)
        ),
    );
    let start = Instant::now();
    let mut c = bin();
    c.args([
        "calibrate",
        "specs/clusters/dgx-h100-80g.toml",
        "--gpu",
        "--timeout",
        "1",
        "-o",
        &s(&out),
    ])
    .env("TESSERA_PYTHON", &py)
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().expect("tessera runs");
    let (status, _, err) = wait_draining(
        &mut child,
        Duration::from_secs(60),
        |c| {
            c.kill().ok();
        },
        || "tessera calibrate --gpu --timeout 1 did not stop the script".into(),
    );
    assert!(start.elapsed() < Duration::from_secs(30), "{err}");
    assert_eq!(status.code(), Some(2), "{err}");
    for part in [
        "scripts/calibrate_gpu.py",
        &s(&py),
        "did not finish within 1 s",
        "--timeout",
        "fix:",
    ] {
        assert!(err.contains(part), "no `{part}` in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists());
    // The script's own child went with it.
    let pid = std::fs::read_to_string(&sleeper).unwrap();
    let proc_dir = Path::new("/proc").join(pid.trim());
    let gone = (0..100).any(|_| {
        let state = std::fs::read_to_string(proc_dir.join("stat")).unwrap_or_default();
        let done = state.is_empty() || state.contains(") Z ");
        if !done {
            std::thread::sleep(Duration::from_millis(50));
        }
        done
    });
    assert!(gone, "the script's sleep {} still runs", pid.trim());
    // The flag goes with --gpu only, and takes seconds above 0.
    for (args, part) in [
        (vec!["--from-json", FIXTURE, "--timeout", "5"], "--gpu"),
        (vec!["--gpu", "--timeout", "0"], "above 0"),
        (vec!["--gpu", "--timeout", "soon"], "number of seconds"),
    ] {
        let mut all = vec!["calibrate", "specs/clusters/dgx-h100-80g.toml"];
        all.extend(args);
        let r = run(&all);
        refused(&r, &["--timeout", part]);
    }
}

/// A measurement that does not fit the spec it would calibrate is refused, exit status 2,
/// naming the file, the field, the value and a fix, and nothing is written: another GPU (its
/// model, its form factor, its memory), another dtype's kernels, a kernel of one kind recorded
/// in another kind's list (or a "GEMM" with a dimension below a tensor-core tile), and a
/// value `tessera plan` would refuse in the written spec (host_op_us above 1e6, an efficiency
/// above 1).
#[test]
fn measurements_that_do_not_fit_the_spec_are_refused() {
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "another GPU",
            |v| v["device"]["name"] = "NVIDIA A100-SXM4-80GB".into(),
            vec![
                "`device.name`",
                "NVIDIA A100-SXM4-80GB",
                "A100",
                "H100-SXM5-80GB",
            ],
        ),
        (
            "another form factor",
            |v| v["device"]["name"] = "NVIDIA H100 PCIe".into(),
            vec!["`device.name`", "NVIDIA H100 PCIe", "PCIE", "SXM"],
        ),
        (
            "another memory size",
            |v| v["device"]["memory_gib"] = 93.6.into(),
            vec!["`device.memory_gib`", "93.6", "80"],
        ),
        (
            "fp32 GEMMs",
            |v| v["gemm"][3]["dtype"] = "fp32".into(),
            vec!["`gemm[3].dtype`", "\"fp32\"", "bf16"],
        ),
        (
            "fp8 GEMMs",
            |v| v["gemm"][0]["dtype"] = "float8_e4m3fn".into(),
            vec!["`gemm[0].dtype`", "fp8", "bf16"],
        ),
        (
            "an element-wise op under a GEMM's name",
            |v| v["gemm"][2]["op"] = "gelu".into(),
            vec!["`gemm[2].op`", "\"gelu\"", "element-wise", "`elementwise`"],
        ),
        (
            "an element-wise entry in the GEMM list",
            |v| {
                let e = v["elementwise"][2].clone();
                v["gemm"].as_array_mut().unwrap().push(e);
            },
            vec!["`gemm[16].bytes`", "element-wise"],
        ),
        (
            "a GEMM's kind that is not a GEMM",
            |v| v["gemm"][1]["kind"] = "layernorm".into(),
            vec!["`gemm[1].kind`", "\"layernorm\""],
        ),
        (
            "a GEMM that is an outer product",
            |v| v["gemm"][4]["k"] = 1.into(),
            vec!["`gemm[4].k`", "1 is not a GEMM"],
        ),
        (
            "a GEMM recorded as an element-wise kernel",
            |v| v["elementwise"][0]["op"] = "matmul".into(),
            vec!["`elementwise[0].op`", "\"matmul\"", "a GEMM"],
        ),
        (
            "a host cost plan refuses",
            |v| {
                v["host_op"]["ops"] = 10.into();
                v["host_op"]["seconds"] = 100.0.into();
            },
            vec![
                "host_op_us = 10000000.00",
                "`calibration.host_op_us`",
                "`host_op.seconds`",
                "tessera plan",
            ],
        ),
        (
            "element-wise kernels faster than the spec's bandwidth",
            |v| {
                for e in v["elementwise"].as_array_mut().unwrap() {
                    e["seconds"] = 1e-6.into();
                }
            },
            vec!["`elementwise[0]`", "memory_bandwidth_gbps", "above 1"],
        ),
    ];
    let dir = Scratch::new();
    let out = dir.path("out.toml");
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(FIXTURE)).unwrap()).unwrap();
    for (i, (what, edit, parts)) in cases.into_iter().enumerate() {
        let mut v = good.clone();
        edit(&mut v);
        let json = dir.path(&format!("case{i}.json"));
        std::fs::write(&json, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let r = run(&[
            "calibrate",
            "specs/clusters/dgx-h100-80g.toml",
            "--from-json",
            &s(&json),
            "-o",
            &s(&out),
        ]);
        let mut all = vec![s(&json), "fix:".to_string()];
        all.extend(parts.iter().map(|p| p.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        assert_eq!(r.code, Some(2), "{what}: {}", r.stderr);
        refused(&r, &all);
        assert!(!out.exists(), "{what}: written");
    }
    // A spec whose device computes in fp32 is not calibrated with bf16 kernels.
    let fp32 = dir.copy_edit(
        "specs/clusters/dgx-h100-80g.toml",
        &[(
            "memory_gib = 80\n",
            "memory_gib = 80\nprecision = \"fp32\"\n",
        )],
    );
    let r = run(&[
        "calibrate",
        &s(&fp32),
        "--from-json",
        FIXTURE,
        "-o",
        &s(&out),
    ]);
    refused(
        &r,
        &[FIXTURE, "`gemm[0].dtype`", "\"bf16\"", "fp32", "fix:"],
    );
    assert!(!out.exists());
    // The script's own output is held to the same rules under --gpu.
    let mut v = good.clone();
    v["device"]["name"] = "NVIDIA A100-SXM4-40GB".into();
    let json = dir.path("a100.json");
    std::fs::write(&json, v.to_string()).unwrap();
    let py = fake_python(&dir, &format!("cat '{}'", s(&json)));
    let r = tessera(
        &[
            "calibrate",
            "specs/clusters/dgx-h100-80g.toml",
            "--gpu",
            "-o",
            &s(&out),
        ],
        Some(&py),
    );
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    for part in ["measuring script", "`device.name`", "A100", "fix:"] {
        assert!(err.contains(part), "no `{part}` in {err}");
    }
    assert!(!out.exists());
}

/// The forward op split into dispatch and launch (`host_op.forward_seconds`, `launch_seconds`),
/// on the recorded fixture with round numbers added (not a measurement): 0.05 s of forwards
/// over 10 000 ops is 5 µs per op, of which one launch is 2 µs, so a dispatch is 3 µs. Without
/// the launch the pair is refused, naming the field.
#[test]
fn the_host_ops_forward_splits_into_dispatch_and_launch() {
    let dir = Scratch::new();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(FIXTURE)).unwrap()).unwrap();
    v["host_op"]["forward_seconds"] = 0.05.into();
    v["host_op"]["launch_seconds"] = 2e-6.into();
    let json = dir.path("split.json");
    std::fs::write(&json, v.to_string()).unwrap();
    let args = |j: &Path| {
        tessera(
            &[
                "calibrate",
                "specs/clusters/dgx-h100-80g.toml",
                "--from-json",
                &s(j),
            ],
            None,
        )
    };
    let r = args(&json);
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    let t: toml::Table = toml::from_str(&text(&r.stdout)).expect("valid TOML");
    assert_eq!(f(&t, "host_dispatch_us"), 3.0);
    assert_eq!(f(&t, "host_launch_us"), 2.0);
    v["host_op"]
        .as_object_mut()
        .unwrap()
        .remove("launch_seconds");
    std::fs::write(&json, v.to_string()).unwrap();
    let r = args(&json);
    assert_ne!(r.status.code(), Some(0));
    assert!(
        text(&r.stderr).contains("`host_op`") && text(&r.stderr).contains("launch_seconds"),
        "{}",
        text(&r.stderr)
    );
}

/// FP8 GEMMs (`gemm_fp8`) against the H100 preset's dense FP8 peak (1979 TFLOP/s), on the
/// recorded fixture with round-number FP8 times added (not a measurement): 4096³ in 0.2 ms is
/// 2·4096³ / 2e-4 = 687.2 TFLOP/s = 0.3472 of 1979; 8192³ in 1.0 ms, 1099.5 TFLOP/s = 0.5556;
/// 16384³ in 6.0 ms, 1466.1 TFLOP/s = 0.7408; 2048³ in 0.1 ms is listed but below 4096, not
/// counted. gemm_efficiency_fp8 = the median of the three = 0.556. The calibrated spec keeps
/// the FP8 peak (it used to be dropped), so an FP8 plan runs on it. Refused: an FP8 GEMM on a
/// spec without `peak_tflops_fp8`, and a bf16 entry in `gemm_fp8`, each naming the field.
#[test]
fn fp8_gemms_give_the_fp8_gemm_efficiency() {
    let dir = Scratch::new();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(FIXTURE)).unwrap()).unwrap();
    let entry = |d: u64, seconds: f64| serde_json::json!({"m": d, "k": d, "n": d, "dtype": "fp8", "seconds": seconds});
    v["gemm_fp8"] = serde_json::json!([
        entry(2048, 1e-4),
        entry(4096, 2e-4),
        entry(8192, 1e-3),
        entry(16384, 6e-3)
    ]);
    let json = dir.path("fp8.json");
    std::fs::write(&json, v.to_string()).unwrap();
    let out = dir.path("h100-fp8.toml");
    let calibrate = |spec: &str, j: &Path, o: &Path| {
        tessera(
            &["calibrate", spec, "--from-json", &s(j), "-o", &s(o)],
            None,
        )
    };
    let r = calibrate("specs/clusters/dgx-h100-80g.toml", &json, &out);
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    let written = std::fs::read_to_string(&out).unwrap();
    let t: toml::Table = toml::from_str(&written).expect("valid TOML");
    assert_eq!(f(&t, "gemm_efficiency_fp8"), 0.556);
    assert_eq!(t["device"]["peak_tflops_fp8"].as_integer(), Some(1979));
    mentions(
        &written,
        &[
            "8192 × 8192 × 8192: 1099.5 TFLOP/s, 0.556",
            "2048 × 2048 × 2048",
        ],
    );
    plans_on(
        "specs/models/llama3-8b.toml",
        &out,
        &["--devices", "8", "--fp8", "tensorwise"],
    );
    // A spec without the FP8 peak.
    let spec = dir.path("no-fp8-peak.toml");
    let preset = std::fs::read_to_string(root().join("specs/clusters/dgx-h100-80g.toml")).unwrap();
    let without: String = preset
        .lines()
        .filter(|l| !l.starts_with("peak_tflops_fp8"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&spec, without).unwrap();
    let r = calibrate(&s(&spec), &json, &dir.path("refused.toml"));
    assert_eq!(r.status.code(), Some(2), "{}", text(&r.stderr));
    let err = text(&r.stderr);
    assert!(
        err.contains("`gemm_fp8`") && err.contains("peak_tflops_fp8"),
        "{err}"
    );
    assert!(!dir.path("refused.toml").exists());
    // A bf16 entry in the FP8 list.
    v["gemm_fp8"][1]["dtype"] = "bf16".into();
    std::fs::write(&json, v.to_string()).unwrap();
    let r = calibrate(
        "specs/clusters/dgx-h100-80g.toml",
        &json,
        &dir.path("bf16.toml"),
    );
    assert_ne!(r.status.code(), Some(0));
    assert!(
        text(&r.stderr).contains("`gemm_fp8[1].dtype`"),
        "{}",
        text(&r.stderr)
    );
}

/// What the calibration measures nothing of stays the input's: a spec's `[cost]`,
/// `[reliability]` and `[storage]` tables (the whole run's price, interruptions and checkpoint
/// writes; the H100 preset states the last two, a `[cost]` is added here) are carried into the
/// calibrated spec with their values, where they used to be dropped (the calibrated spec's
/// plans then printed no cost, no interruptions and no checkpoint cadence).
#[test]
fn the_whole_run_tables_are_carried_over() {
    let dir = Scratch::new();
    let spec = dir.path("h100-priced.toml");
    let preset = std::fs::read_to_string(root().join("specs/clusters/dgx-h100-80g.toml")).unwrap();
    std::fs::write(&spec, format!("{preset}\n[cost]\nusd_per_gpu_hour = 2.5\n")).unwrap();
    let out = dir.path("calibrated.toml");
    let r = tessera(
        &[
            "calibrate",
            &s(&spec),
            "--from-json",
            FIXTURE,
            "-o",
            &s(&out),
        ],
        None,
    );
    assert_eq!(r.status.code(), Some(0), "{}", text(&r.stderr));
    let t: toml::Table = toml::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let num = |table: &str, key: &str| {
        let v = &t[table][key];
        v.as_float()
            .or_else(|| v.as_integer().map(|i| i as f64))
            .unwrap_or_else(|| panic!("{table}.{key}: {v:?}"))
    };
    assert_eq!(num("cost", "usd_per_gpu_hour"), 2.5);
    // The preset's own [reliability] and [storage], as it states them.
    let p: toml::Table = toml::from_str(&preset).unwrap();
    for (table, key) in [
        ("reliability", "gpu_mtbf_hours"),
        ("reliability", "restart_minutes"),
        ("storage", "write_gbps"),
    ] {
        let want = &p[table][key];
        let want = want
            .as_float()
            .or_else(|| want.as_integer().map(|i| i as f64))
            .unwrap();
        assert_eq!(num(table, key), want, "{table}.{key}");
    }
}
