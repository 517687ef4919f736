//! `tessera calibrate`: measures this host for the CPU backend and writes a cluster spec that
//! `tessera plan` takes like a preset; GPU clusters and overwriting the input are refused.
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
