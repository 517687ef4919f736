//! Bad input: every case exits with code 2, never panics, and says where and how to fix it.
//!
//! Each test copies a preset into its own scratch folder, edits one line, and runs the binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A scratch folder of one test, removed when the test ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("tessera-bad-input-{}-{test}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Copies `preset` (relative to the repository) with the line `from` replaced by `to`
    /// (`None` deletes it). Returns the new file and the 1-based number of the edited line.
    fn edit(&self, preset: &str, from: &str, to: Option<&str>) -> (PathBuf, usize) {
        let text = std::fs::read_to_string(root().join(preset)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| *l == from)
            .unwrap_or_else(|| panic!("{preset} has no line `{from}`"));
        assert_eq!(
            lines.iter().filter(|l| **l == from).count(),
            1,
            "`{from}` is not unique in {preset}"
        );
        let mut out: Vec<&str> = lines.clone();
        match to {
            Some(t) => out[at] = t,
            None => {
                out.remove(at);
            }
        }
        let name = Path::new(preset).file_name().unwrap();
        let path = self.0.join(name);
        std::fs::write(&path, out.join("\n") + "\n").unwrap();
        (path, at + 1)
    }

    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn tessera(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| a.to_string()).collect()
}

/// Runs the binary, checks that it fails as a usage error (exit 2, no panic), returns stderr.
fn fails(args: &[String]) -> String {
    let out = tessera(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(2),
        "tessera {args:?} should exit 2; stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "tessera {args:?} panicked:\n{stderr}"
    );
    stderr
}

/// Every part must appear in the message.
fn says(stderr: &str, parts: &[&str]) {
    for p in parts {
        assert!(
            stderr.contains(p),
            "the message lacks `{p}`; it is:\n{stderr}"
        );
    }
}

const LLAMA: &str = "specs/models/llama3-8b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";
const A100: &str = "specs/clusters/dgx-a100-80g.toml";
const GPT3: &str = "specs/models/gpt3-175b.toml";

fn plan_model(model: &Path) -> String {
    fails(&["plan".into(), s(model), H100.into()])
}

fn plan_cluster(cluster: &Path) -> String {
    fails(&["plan".into(), LLAMA.into(), s(cluster)])
}

#[test]
fn malformed_toml_in_a_model_spec() {
    let dir = Scratch::new("syntax-model");
    let (model, line) = dir.edit(LLAMA, "hidden = 4096", Some("hidden = 4096 x"));
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:", s(&model)),
            "`architecture.hidden`",
            "invalid TOML",
            "fix: fix the syntax",
        ],
    );
}

#[test]
fn malformed_toml_in_a_cluster_spec() {
    let dir = Scratch::new("syntax-cluster");
    let (cluster, line) = dir.edit(H100, "memory_gib = 80", Some("memory_gib = = 80"));
    let err = plan_cluster(&cluster);
    says(
        &err,
        &[
            &format!("{}:{line}:", s(&cluster)),
            "`device.memory_gib`",
            "invalid TOML",
            "fix: fix the syntax",
        ],
    );
}

#[test]
fn unknown_key_in_a_model_spec_suggests_the_near_key() {
    let dir = Scratch::new("unknown-model");
    let (model, line) = dir.edit(LLAMA, "hidden = 4096", Some("hiden = 4096"));
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:1", s(&model)),
            "`architecture.hiden`",
            "unknown key `hiden`",
            "fix: did you mean `hidden`?",
        ],
    );
}

#[test]
fn unknown_key_in_a_cluster_spec_suggests_the_near_key() {
    let dir = Scratch::new("unknown-cluster");
    let (cluster, line) = dir.edit(H100, "memory_gib = 80", Some("memroy_gib = 80"));
    let err = plan_cluster(&cluster);
    says(
        &err,
        &[
            &format!("{}:{line}:1", s(&cluster)),
            "`device.memroy_gib`",
            "unknown key `memroy_gib`",
            "fix: did you mean `memory_gib`?",
        ],
    );
}

#[test]
fn missing_required_key_points_at_the_table_header() {
    let dir = Scratch::new("missing-heads");
    let (model, _) = dir.edit(LLAMA, "heads = 32", None);
    let text = std::fs::read_to_string(&model).unwrap();
    let header = text.lines().position(|l| l == "[architecture]").unwrap() + 1;
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{header}:1", s(&model)),
            "`architecture.heads`",
            "required key `heads` is missing",
            "fix: add `heads = ",
            "under [architecture]",
        ],
    );
}

#[test]
fn zero_layers() {
    let dir = Scratch::new("zero-layers");
    let (model, line) = dir.edit(LLAMA, "layers = 32", Some("layers = 0"));
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:10", s(&model)),
            "`architecture.layers`",
            "found 0",
            "fix: set `layers` to a value of at least 1",
        ],
    );
}

#[test]
fn negative_device_memory() {
    let dir = Scratch::new("negative-memory");
    let (cluster, line) = dir.edit(H100, "memory_gib = 80", Some("memory_gib = -8"));
    let err = plan_cluster(&cluster);
    says(
        &err,
        &[
            &format!("{}:{line}:14", s(&cluster)),
            "`device.memory_gib`",
            "found -8",
            "fix: set `memory_gib` to a positive number",
        ],
    );
}

#[test]
fn heads_not_divisible_by_kv_heads() {
    let dir = Scratch::new("kv-heads");
    let (model, line) = dir.edit(LLAMA, "kv_heads = 8", Some("kv_heads = 5"));
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:12", s(&model)),
            "`architecture.kv_heads`",
            "heads (32) is not divisible by kv_heads (5)",
            "fix: set kv_heads to a divisor of 32: 1, 2, 4, 8, 16, 32",
        ],
    );
}

#[test]
fn unknown_activation() {
    let dir = Scratch::new("activation");
    let (model, line) = dir.edit(
        LLAMA,
        "activation = \"swiglu\"",
        Some("activation = \"relu\""),
    );
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:14", s(&model)),
            "`architecture.activation`",
            "unknown value \"relu\"",
            "fix:",
            "gelu | swiglu",
        ],
    );
}

#[test]
fn unknown_precision_policy() {
    let dir = Scratch::new("precision");
    let (model, line) = dir.edit(
        LLAMA,
        "precision = \"default\"",
        Some("precision = \"fp8-magic\""),
    );
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{line}:13", s(&model)),
            "`training.precision`",
            "unknown precision policy \"fp8-magic\"",
            "fix: use one of: default | megatron | mixed16",
        ],
    );
}

#[test]
fn indivisible_tensor_parallel_pin() {
    let err = fails(&args(&["plan", GPT3, A100, "--nodes", "1", "--tp", "3"]));
    says(
        &err,
        &[
            "<command line>",
            "`--tp`",
            "--tp 3 does not divide the 8 devices",
            "fix: pass --tp as a divisor of 8: 1, 2, 4, 8",
        ],
    );
}

/// Writes the plan of tiny on cpu-8 into `dir` and returns its path.
fn tiny_plan(dir: &Scratch) -> PathBuf {
    let out = dir.path("plan.json");
    let run = tessera(&[
        "plan".into(),
        "specs/models/tiny.toml".into(),
        "specs/clusters/cpu-8.toml".into(),
        "-o".into(),
        s(&out),
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// `explain` and `validate` both reject the plan with the same message; returns it.
fn plan_rejected(plan: &Path) -> String {
    let explain = fails(&["explain".into(), s(plan)]);
    let validate = fails(&["validate".into(), s(plan)]);
    assert!(
        validate.contains(explain.trim()),
        "validate and explain disagree:\n{explain}\n{validate}"
    );
    explain
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().starts_with(needle))
        .unwrap_or_else(|| panic!("no line starts with {needle}"))
        + 1
}

#[test]
fn plan_of_another_format_version() {
    let dir = Scratch::new("plan-v0");
    let plan = tiny_plan(&dir);
    let text = std::fs::read_to_string(&plan).unwrap();
    let old = text.replacen("\"tessera.plan/v1\"", "\"tessera.plan/v0\"", 1);
    assert_ne!(old, text);
    std::fs::write(&plan, &old).unwrap();
    let err = plan_rejected(&plan);
    let line = line_of(&old, "\"format\"");
    says(
        &err,
        &[
            &format!("{}:{line}:", s(&plan)),
            "`format`",
            "\"tessera.plan/v0\"",
            "\"tessera.plan/v1\"",
            "fix: re-create the plan",
        ],
    );
}

#[test]
fn truncated_plan() {
    let dir = Scratch::new("plan-truncated");
    let plan = tiny_plan(&dir);
    let text = std::fs::read_to_string(&plan).unwrap();
    let cut = &text[..text.len() / 2];
    std::fs::write(&plan, cut).unwrap();
    let err = plan_rejected(&plan);
    says(
        &err,
        &[
            // serde_json reports the end of the text: the line after the last newline.
            &format!("{}:{}:", s(&plan), cut.matches('\n').count() + 1),
            "not valid JSON",
            "truncated",
            "fix: re-create it with `tessera plan",
        ],
    );
}

#[test]
fn plan_whose_degrees_no_longer_multiply() {
    let dir = Scratch::new("plan-dp");
    let plan = tiny_plan(&dir);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let dp = v["parallel"]["dp"].as_u64().unwrap();
    v["parallel"]["dp"] = (dp * 2).into();
    let edited = serde_json::to_string_pretty(&v).unwrap();
    std::fs::write(&plan, &edited).unwrap();
    let err = plan_rejected(&plan);
    let line = line_of(&edited, "\"parallel\"");
    says(
        &err,
        &[
            &format!("{}:{line}:", s(&plan)),
            "`parallel`",
            &format!("DP {}", dp * 2),
            "does not equal the 8 devices",
            "fix: the plan was edited or damaged; re-create it",
        ],
    );
}

#[test]
fn model_that_fits_on_no_layout_says_what_it_needs() {
    let dir = Scratch::new("nothing-fits");
    let out = dir.path("out.json");
    let err = fails(&args(&[
        "plan",
        "specs/models/llama3.1-405b.toml",
        H100,
        "--devices",
        "1",
        "-o",
        &s(&out),
    ]));
    says(
        &err,
        &[
            "no layout of 1 devices fits llama3.1-405b",
            "per device",
            "the device has 80.00 GiB",
            "fix: use more devices",
        ],
    );
    // "needs N UNIT per device": a size well above the 80 GiB the device has, in the unit
    // that reads it best (TiB here).
    let need: f64 = err
        .split("needs ")
        .nth(1)
        .and_then(|rest| rest.split(" per device").next())
        .and_then(|n| {
            let (num, unit) = n.split_once(' ')?;
            let scale = match unit {
                "GiB" => 1.0,
                "TiB" => 1024.0,
                _ => return None,
            };
            Some(num.parse::<f64>().ok()? * scale)
        })
        .unwrap_or_else(|| panic!("no \"needs N GiB|TiB per device\" in:\n{err}"));
    assert!(need > 80.0, "{need}");
    assert!(!out.exists(), "a failed plan must not write its output");
}

const PINNED: &[&str] = &[
    "--nodes",
    "1",
    "--tp",
    "8",
    "--pp",
    "1",
    "--dp",
    "1",
    "--micro-batch",
    "1",
    "--zero",
    "0",
    "--recompute",
    "none",
    "--no-sp",
];

fn pinned_gpt3(extra: &[&str]) -> Vec<String> {
    let mut a = args(&["plan", GPT3, A100]);
    a.extend(args(PINNED));
    a.extend(args(extra));
    a
}

#[test]
fn pinned_layout_that_does_not_fit() {
    let dir = Scratch::new("pinned");
    let out = dir.path("out.json");
    let err = fails(&pinned_gpt3(&["-o", &s(&out)]));
    says(
        &err,
        &[
            "does not fit",
            "GiB over the 80.00 GiB",
            // The memory breakdown: per-stage totals and the peak stage's terms.
            "states GiB",
            "activations GiB",
            "weights_bf16",
            "adam_m_fp32",
            "layer_activations",
            "cuda_context",
            "`pins`",
            "GiB over device memory",
            "fix: unpin a knob",
            "--force",
        ],
    );
    assert!(!out.exists(), "a failed plan must not write its output");
}

#[test]
fn pinned_layout_that_does_not_fit_is_written_with_force() {
    let dir = Scratch::new("pinned-force");
    let out = dir.path("out.json");
    let run = tessera(&pinned_gpt3(&["--force", "-o", &s(&out)]));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("marked infeasible"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["feasible"], false);
    assert_eq!(v["parallel"]["tp"], 8);
    assert_eq!(v["parallel"]["dp"], 1);
}

#[test]
fn zero_nodes() {
    let err = fails(&args(&["plan", LLAMA, H100, "--nodes", "0"]));
    says(
        &err,
        &[
            "<command line>",
            "`--nodes`",
            "found 0",
            "fix: pass --nodes 1 or more",
        ],
    );
}

#[test]
fn zero_global_batch_and_seq_len() {
    for flag in ["--global-batch", "--seq-len"] {
        for model in [LLAMA, "tests/fixtures/hf/llama3-8b/config.json"] {
            let mut a = args(&[
                "plan",
                model,
                H100,
                "--seq-len",
                "8192",
                "--global-batch",
                "512",
            ]);
            let at = a.iter().position(|x| x == flag).unwrap();
            a[at + 1] = "0".into();
            let err = fails(&a);
            says(
                &err,
                &[
                    "<command line>",
                    &format!("`{flag}`"),
                    "found 0",
                    &format!("fix: pass {flag} 1 or more"),
                ],
            );
        }
    }
}

#[test]
fn missing_file() {
    let dir = Scratch::new("missing-file");
    let model = dir.path("no-such-model.toml");
    let err = plan_model(&model);
    says(
        &err,
        &[&s(&model), "cannot read the file", "fix: check the path"],
    );
}

#[test]
fn failed_plan_leaves_no_output_file() {
    let dir = Scratch::new("no-output");
    let (model, _) = dir.edit(LLAMA, "layers = 32", Some("layers = 0"));
    let out = dir.path("out.json");
    let before = dir.files();
    let runs = [
        // A bad spec.
        args(&["plan", &s(&model), H100, "-o", &s(&out)]),
        // A spec that fits nowhere.
        args(&[
            "plan",
            "specs/models/llama3.1-405b.toml",
            H100,
            "--devices",
            "1",
            "-o",
            &s(&out),
        ]),
        // A pinned layout that does not fit, without --force.
        pinned_gpt3(&["-o", &s(&out)]),
    ];
    for a in &runs {
        fails(a);
        assert!(!out.exists(), "tessera {a:?} failed but wrote {}", s(&out));
        assert_eq!(dir.files(), before, "tessera {a:?} left files behind");
    }
}

#[test]
fn flash_kernel_without_flash_attention() {
    let dir = Scratch::new("flash-kernel");
    let (model, line) = dir.edit(
        GPT3,
        "attention = \"eager\"",
        Some("attention = \"eager\"\nflash_kernel = \"triton\""),
    );
    let err = plan_model(&model);
    says(
        &err,
        &[
            &format!("{}:{}:16", s(&model), line + 1),
            "`training.flash_kernel`",
            "attention is \"eager\"",
            "fix: remove flash_kernel, or set attention = \"flash\"",
        ],
    );
}

/// The cluster's `[host]` tier (issue 38): a tier without its link, half an NVMe tier and a
/// negative size are each one message naming the file, the line and the key, and the fix.
#[test]
fn a_host_tier_missing_a_key_or_negative_is_refused_at_its_line() {
    let dir = Scratch::new("host-tier");
    let text = std::fs::read_to_string(root().join(H100)).unwrap();
    let line_of = |t: &str, key: &str| {
        t.lines()
            .position(|l| l.starts_with(key))
            .map(|i| i + 1)
            .unwrap()
    };
    let header = line_of(&text, "[host]");
    // No link_gbps: the [host] table's line.
    let no_link: String = text
        .lines()
        .filter(|l| !l.starts_with("link_gbps"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.path("no-link.toml");
    std::fs::write(&path, &no_link).unwrap();
    says(
        &plan_cluster(&path),
        &[
            &format!("{}:{header}:", s(&path)),
            "`host.link_gbps`",
            "fix: add link_gbps under [host]",
        ],
    );
    // NVMe capacity without its rate: the nvme_gib line.
    let no_rate: String = text
        .lines()
        .filter(|l| !l.starts_with("nvme_gbps"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.path("no-nvme-rate.toml");
    std::fs::write(&path, &no_rate).unwrap();
    says(
        &plan_cluster(&path),
        &[
            &format!("{}:{}:", s(&path), line_of(&no_rate, "nvme_gib")),
            "`host.nvme_gib`",
            "no nvme_gbps",
            "fix: add nvme_gbps under [host]",
        ],
    );
    // A negative host memory.
    let negative = text.replacen("memory_gib = 2048", "memory_gib = -1", 1);
    let path = dir.path("negative.toml");
    std::fs::write(&path, &negative).unwrap();
    says(
        &plan_cluster(&path),
        &[
            &format!("{}:{}:", s(&path), line_of(&negative, "memory_gib = -1")),
            "`host.memory_gib`",
        ],
    );
}

/// The host floor's per-op costs (`[calibration] host_dispatch_us`, `host_launch_us`): a value
/// past 1e6 µs or below zero is refused with one message naming the key and the fix.
#[test]
fn host_floor_costs_out_of_range_name_the_key() {
    let dir = Scratch::new("host-costs");
    let (cluster, _) = dir.edit(
        H100,
        "host_dispatch_us = 6.8",
        Some("host_dispatch_us = 1e7"),
    );
    says(
        &plan_cluster(&cluster),
        &[
            "calibration.host_dispatch_us",
            "at most 1e6 microseconds",
            "fix:",
        ],
    );
    let (cluster, line) = dir.edit(H100, "host_launch_us = 2.43", Some("host_launch_us = -1"));
    says(
        &plan_cluster(&cluster),
        &[&format!("{}:{line}", s(&cluster)), "host_launch_us", "fix:"],
    );
}
