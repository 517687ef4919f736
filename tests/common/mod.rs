//! What the reliability tests share: scratch folders, running the binary under a deadline,
//! and the checks every bad input must pass (exit 2, no panic, inputs byte-identical).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.current_dir(root());
    c
}

/// A scratch folder, removed at the end of the test.
pub struct Scratch(pub tempfile::TempDir);

impl Scratch {
    pub fn new() -> Scratch {
        Scratch(tempfile::tempdir().expect("a temp folder"))
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    /// Copies a repository file into the folder, with every `from` replaced by `to`.
    pub fn copy_edit(&self, preset: &str, edits: &[(&str, &str)]) -> PathBuf {
        let mut text = std::fs::read_to_string(root().join(preset)).unwrap();
        for (from, to) in edits {
            assert!(text.contains(from), "{preset} has no `{from}`");
            text = text.replacen(from, to, 1);
        }
        let path = self.path(Path::new(preset).file_name().unwrap().to_str().unwrap());
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Names of the files in the folder, sorted.
    pub fn files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.0.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

pub fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A command's outcome, and how long it took.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Runs tessera with `args`; a run past `deadline` is killed and fails the test (a hang).
pub fn run_within(args: &[&str], deadline: Duration) -> Ran {
    let start = Instant::now();
    let mut child = bin()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tessera binary runs");
    let (status, stdout, stderr) = wait_draining(
        &mut child,
        deadline,
        |c| {
            c.kill().ok();
        },
        || format!("tessera {args:?} did not answer within {deadline:?}"),
    );
    Ran {
        code: status.code(),
        stdout,
        stderr,
        took: start.elapsed(),
    }
}

/// Waits at most `deadline` for `child` while draining its piped stdout and stderr (or a
/// chatty child blocks on a full pipe); returns its status and both outputs. Past the
/// deadline, `kill`s it, reaps it and fails the test with `hang`'s message.
pub fn wait_draining(
    child: &mut Child,
    deadline: Duration,
    kill: impl FnOnce(&mut Child),
    hang: impl FnOnce() -> String,
) -> (ExitStatus, String, String) {
    let start = Instant::now();
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                r.read_to_end(&mut buf).ok();
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > deadline {
            kill(child);
            child.wait().ok();
            panic!("{}", hang());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status, out.join().unwrap(), err.join().unwrap())
}

pub fn run(args: &[&str]) -> Ran {
    run_within(args, Duration::from_secs(120))
}

/// Byte snapshots of input files, compared after the command.
pub struct Inputs(Vec<(PathBuf, Vec<u8>)>);

impl Inputs {
    pub fn of(paths: &[&Path]) -> Inputs {
        Inputs(
            paths
                .iter()
                .map(|p| (p.to_path_buf(), std::fs::read(p).unwrap()))
                .collect(),
        )
    }

    pub fn unchanged(&self) {
        for (p, bytes) in &self.0 {
            let now = std::fs::read(p).unwrap_or_default();
            assert!(now == *bytes, "{} changed", p.display());
        }
    }
}

/// The command failed as bad input: exit 2, no panic, and the message has every part.
pub fn refused(r: &Ran, parts: &[&str]) {
    assert_eq!(r.code, Some(2), "expected exit 2; stderr:\n{}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "panicked:\n{}", r.stderr);
    for p in parts {
        assert!(
            r.stderr.contains(p),
            "the message lacks `{p}`:\n{}",
            r.stderr
        );
    }
}

/// GPT-3 175B on 128 DGX A100 in Megatron-LM's SC'21 layout: TP 8, PP 8 interleaved ×2, SP,
/// full recompute, the distributed optimizer (ZeRO-1).
pub const GPT3_MEGATRON_LAYOUT: &[&str] = &[
    "specs/models/gpt3-175b.toml",
    "specs/clusters/dgx-a100-80g.toml",
    "--nodes",
    "128",
    "--tp",
    "8",
    "--pp",
    "8",
    "--dp",
    "16",
    "--micro-batch",
    "1",
    "--recompute",
    "full",
    "--zero",
    "1",
    "--sp",
    "--schedule",
    "interleaved",
    "--virtual-stages",
    "2",
];

/// The README's job: tiny on cpu-8 as DP 2 × PP 2 × TP 2 (without `plan` and `-o`).
pub const README_TINY_LAYOUT: &[&str] = &[
    "specs/models/tiny.toml",
    "specs/clusters/cpu-8.toml",
    "--dp",
    "2",
    "--pp",
    "2",
    "--tp",
    "2",
    "--no-sp",
    "--micro-batch",
    "2",
    "--schedule",
    "1f1b",
    "--zero",
    "1",
];

/// Plans tiny on cpu-8 as the README does, into `dir`.
pub fn tiny_plan(dir: &Scratch) -> PathBuf {
    let out = dir.path("plan.json");
    let o = s(&out);
    let mut args = vec!["plan"];
    args.extend_from_slice(README_TINY_LAYOUT);
    args.extend(["-o", o.as_str()]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    out
}

/// Runs `tessera plan ARGS -o dir/name`, which must succeed; the plan's path.
pub fn plan_file(dir: &Scratch, name: &str, args: &[&str]) -> PathBuf {
    let out = dir.path(name);
    let mut all = vec!["plan"];
    all.extend(args);
    let o = s(&out);
    all.extend(["-o", &o]);
    let r = run(&all);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    out
}

/// `tessera export PLAN --to TO` on stdout, which must succeed.
pub fn export_text(plan: &Path, to: &str) -> String {
    let r = run(&["export", &s(plan), "--to", to]);
    assert_eq!(r.code, Some(0), "{to}: {}", r.stderr);
    r.stdout
}

/// (step, loss) of every line of a `--metrics` file.
pub fn metrics_losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

/// Trains `plan` for 8 steps saving every 4 into `dir/ck`, with metrics in `dir/a.jsonl`: the
/// checkpoint folder and the straight run's (step, loss).
pub fn train_8_saving_at_4(dir: &Scratch, plan: &Path) -> (PathBuf, Vec<(u64, f64)>) {
    let (ck, a) = (dir.path("ck"), dir.path("a.jsonl"));
    let r = run(&[
        "run",
        &s(plan),
        "--steps",
        "8",
        "--save-dir",
        &s(&ck),
        "--save-every",
        "4",
        "--metrics",
        &s(&a),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    (ck, metrics_losses(&a))
}

/// Edits a JSON file in place: `f` changes the parsed value.
pub fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// The Python of TESSERA_TORCH_PYTHON where it imports `modules` (comma-separated, e.g.
/// `torch, transformers`), for a check by the reference implementation; else `None`, having
/// printed why the check is skipped (CI sets it: `bash scripts/check-exports-env.sh engines`).
pub fn reference_python(modules: &str) -> Option<std::ffi::OsString> {
    let Some(python) = std::env::var_os("TESSERA_TORCH_PYTHON") else {
        println!("skipped: TESSERA_TORCH_PYTHON is not set (bash scripts/check-exports-env.sh engines prints one)");
        return None;
    };
    let probe = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = probe.map_or_else(
            |e| e.to_string(),
            |o| String::from_utf8_lossy(&o.stderr).into_owned(),
        );
        println!(
            "skipped: {} cannot import {modules}: {why}",
            python.to_string_lossy()
        );
        return None;
    }
    Some(python)
}
