//! Issue 16's classes of bad input, each run against the binary: exit 2 (or the signal's
//! code), the file and key named, no panic, and every input byte-identical afterwards.
//! docs/reliability.md lists the classes and what each test tries.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const TINY: &str = "specs/models/tiny.toml";
const CPU8: &str = "specs/clusters/cpu-8.toml";

// ---- panics: a hand-edited plan, and runtime conditions checked before the run ----

/// `explain`, `validate` and `run` all refuse the edited plan, naming `field`.
fn plan_refused_everywhere(plan: &Path, field: &str) {
    let before = Inputs::of(&[plan]);
    for cmd in ["explain", "validate", "run"] {
        let r = run(&[cmd, &s(plan), "--steps", "1"][..if cmd == "run" { 4 } else { 2 }]);
        refused(&r, &[&s(plan), field]);
    }
    before.unchanged();
}

#[test]
fn plan_with_no_stages_in_its_memory_report() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    edit_json(&plan, |v| {
        v["predicted"]["memory"]["per_stage"] = serde_json::json!([])
    });
    plan_refused_everywhere(&plan, "predicted.memory.per_stage");
}

#[test]
fn plan_whose_peak_stage_is_past_the_last() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    edit_json(&plan, |v| v["predicted"]["memory"]["peak_stage"] = 7.into());
    plan_refused_everywhere(&plan, "predicted.memory.peak_stage");
}

#[test]
fn position_table_shorter_than_the_sequence_is_refused_by_plan_and_validate() {
    let dir = Scratch::new();
    let model = dir.copy_edit(TINY, &[("max_positions = 64", "max_positions = 32")]);
    let before = Inputs::of(&[&model]);
    let r = run(&["plan", &s(&model), CPU8]);
    refused(
        &r,
        &[&s(&model), "architecture.max_positions", "seq_len 64"],
    );
    // The line of the key.
    assert!(r.stderr.contains("tiny.toml:19:"), "{}", r.stderr);
    refused(
        &run(&["validate", &s(&model)]),
        &["architecture.max_positions"],
    );
    // A longer sequence from the command line is caught the same way.
    refused(
        &run(&["plan", TINY, CPU8, "--seq-len", "128"]),
        &["max_positions"],
    );
    before.unchanged();
}

// ---- hangs: huge counts get an answer in bounded time ----

fn answers(args: &[&str]) -> Ran {
    let r = run_within(args, Duration::from_secs(30));
    assert!(
        r.code == Some(0) || r.code == Some(2),
        "tessera {args:?}: exit {:?}\n{}",
        r.code,
        r.stderr
    );
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    r
}

#[test]
fn huge_counts_get_an_answer() {
    let dir = Scratch::new();
    let max = i64::MAX.to_string();
    let cases: Vec<(&str, &str, String)> = vec![
        (CPU8, "nodes = 1", "nodes = 1000000000000".into()),
        (CPU8, "nodes = 1", format!("nodes = {max}")),
        (CPU8, "gpus_per_node = 8", format!("gpus_per_node = {max}")),
        (TINY, "global_batch = 16", format!("global_batch = {max}")),
        (TINY, "layers = 4", format!("layers = {max}")),
        (TINY, "vocab = 256", format!("vocab = {max}")),
        (TINY, "hidden = 64", format!("hidden = {max}")),
        (TINY, "seq_len = 64", format!("seq_len = {max}")),
    ];
    for (file, from, to) in &cases {
        let edited = dir.copy_edit(file, &[(from, to)]);
        let (model, cluster) = if *file == TINY {
            (s(&edited), CPU8.to_string())
        } else {
            (TINY.to_string(), s(&edited))
        };
        let before = Inputs::of(&[&edited]);
        answers(&["plan", &model, &cluster]);
        before.unchanged();
    }
    answers(&["plan", TINY, CPU8, "--nodes", "1000000000000"]);
    answers(&["plan", TINY, CPU8, "--nodes", &max]);
    answers(&["plan", TINY, CPU8, "--global-batch", &max]);
    answers(&["plan", TINY, CPU8, "--seq-len", &max]);
    // A float where a count belongs is a type error, not a number to search.
    let float = dir.copy_edit(TINY, &[("global_batch = 16", "global_batch = 1e12")]);
    refused(
        &answers(&["plan", &s(&float), CPU8]),
        &["training.global_batch"],
    );
}

// ---- accepted nonsense ----

#[test]
fn plan_with_nonsense_in_its_job_or_prediction() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit); 5] = [
        ("job.cluster.gpus_per_node", |v| {
            v["job"]["cluster"]["gpus_per_node"] = 0.into()
        }),
        ("job.cluster.device.memory_gib", |v| {
            v["job"]["cluster"]["device"]["memory_gib"] = (-80.0).into()
        }),
        ("predicted.step_time_s", |v| {
            v["predicted"]["step_time_s"] = (-1.0).into()
        }),
        ("job.cluster.calibration.memory_efficiency", |v| {
            v["job"]["cluster"]["calibration"]["memory_efficiency"] = 7.into()
        }),
        ("job.model.architecture.max_positions", |v| {
            v["job"]["model"]["architecture"]["max_positions"] = 8.into()
        }),
    ];
    for (field, edit) in cases {
        let dir = Scratch::new();
        let plan = tiny_plan(&dir);
        edit_json(&plan, edit);
        plan_refused_everywhere(&plan, field);
    }
}

#[test]
fn run_flags_out_of_range() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    for flag in [
        "--lr=nan",
        "--lr=inf",
        "--lr=-1",
        "--lr=0",
        "--lr=1e39",
        "--steps=0",
        "--steps=-3",
    ] {
        let r = run(&["run", &s(&plan), flag]);
        refused(&r, &[flag.split('=').next().unwrap()]);
    }
}

#[test]
fn a_run_whose_loss_diverges_stops_at_that_step() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let metrics = dir.path("m.jsonl");
    // A learning rate of 1e30 makes the weights, then the loss, non-finite within a few steps.
    let r = run(&[
        "run",
        &s(&plan),
        "--lr",
        "1e30",
        "--steps",
        "200",
        "--metrics",
        &s(&metrics),
    ]);
    assert_ne!(r.code, Some(0), "a diverged run must fail:\n{}", r.stdout);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    assert!(r.stderr.contains("step "), "{}", r.stderr);
    assert!(r.stderr.contains("not a finite number"), "{}", r.stderr);
    let lines = std::fs::read_to_string(&metrics).unwrap();
    assert!(lines.lines().count() < 200, "it stopped early");
}

// ---- silent overwrite ----

#[test]
fn an_output_may_not_name_an_input() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let model = dir.copy_edit(TINY, &[]);
    let cluster = dir.copy_edit(CPU8, &[]);
    let data = dir.path("data.txt");
    std::fs::copy(root().join("examples/data/parallelism.txt"), &data).unwrap();
    let link = dir.path("link.toml");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    let hard = dir.path("hard.json");
    std::fs::hard_link(&plan, &hard).unwrap();
    let before = Inputs::of(&[&plan, &model, &cluster, &data]);
    let (p, m, c, d) = (s(&plan), s(&model), s(&cluster), s(&data));
    let dotted = s(&dir.0.path().join(".").join("tiny.toml"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["plan", &m, &c, "-o", &m], "MODEL"),
        (vec!["plan", &m, &c, "-o", &c], "CLUSTER"),
        (vec!["plan", &m, &c, "-o", &dotted], "MODEL"),
        (vec!["plan", &m, &c, "--trace", &m], "MODEL"),
        (vec!["plan", &m, &c, "-o", link.to_str().unwrap()], "MODEL"),
        (vec!["run", &p, "--metrics", &p], "PLAN"),
        (vec!["run", &p, "--metrics", hard.to_str().unwrap()], "PLAN"),
        (vec!["run", &p, "--data", &d, "--trace", &d], "--data"),
        (vec!["run", &p, "--data", &d, "--metrics", &d], "--data"),
    ];
    for (args, input_flag) in cases {
        let r = run(&args);
        let out_flag = args[args.len() - 2];
        refused(&r, &[out_flag, input_flag]);
    }
    // Two outputs onto one file.
    let out = s(&dir.path("out.json"));
    refused(
        &run(&["plan", &m, &c, "-o", &out, "--trace", &out]),
        &["-o", "--trace"],
    );
    before.unchanged();
}

// ---- outputs that are not plain files ----

#[test]
fn an_output_symlink_is_written_through() {
    let dir = Scratch::new();
    let target = dir.path("real.json");
    std::fs::write(&target, "old").unwrap();
    let link = dir.path("plan.json");
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    let r = run(&["plan", TINY, CPU8, "-o", &s(&link)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let text = std::fs::read_to_string(&target).unwrap();
    assert!(text.contains("tessera.plan/v1"));
    assert_eq!(dir.files(), vec!["plan.json", "real.json"]);
}

#[test]
fn a_fifo_is_written_in_place() {
    use std::os::unix::fs::FileTypeExt;
    let dir = Scratch::new();
    let fifo = dir.path("plan.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped: mkfifo is not available here");
        return;
    }
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let r = run(&["plan", TINY, CPU8, "-o", &s(&fifo)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let text = reader.join().unwrap();
    assert!(text.contains("tessera.plan/v1"));
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
}

#[test]
fn a_full_device_is_an_error_and_stays_a_device() {
    use std::os::unix::fs::FileTypeExt;
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this platform");
        return;
    }
    let r = run(&["plan", TINY, CPU8, "-o", "/dev/full"]);
    refused(&r, &["/dev/full", "cannot write"]);
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
    let r = run(&["plan", TINY, CPU8, "-o", "/dev/null"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
}

// ---- torn files: signals and a full disk ----

fn signal_run(sig: i32, code: i32) {
    signal_command(&["run"], &[], sig, code);
}

/// Starts `tessera PREFIX plan [BETWEEN] --steps 10^6 --metrics … --trace …`, signals it after 3
/// metrics lines, and checks the exit code, the whole lines and the closed trace.
fn signal_command(prefix: &[&str], between: &[&str], sig: i32, code: i32) {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let metrics = dir.path("m.jsonl");
    let trace = dir.path("trace.json");
    let mut args: Vec<String> = prefix.iter().map(|a| a.to_string()).collect();
    args.push(s(&plan));
    args.extend(between.iter().map(|a| a.to_string()));
    for a in [
        "--steps",
        "1000000",
        "--metrics",
        &s(&metrics),
        "--trace",
        &s(&trace),
    ] {
        args.push(a.to_string());
    }
    let child = bin()
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until some steps are recorded, then signal.
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < 3
    {
        assert!(start.elapsed() < Duration::from_secs(60), "no steps ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
    let sent = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(sent.elapsed() < Duration::from_secs(10), "slow to stop");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.ends_with('\n'), "the last line is torn: {text:?}");
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("each line is whole JSON");
    }
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).expect("trace closes");
    assert!(trace.is_object() || trace.is_array());
    assert!(!dir.files().iter().any(|f| f.ends_with(".tmp")));
}

#[test]
fn sigterm_to_launch_is_passed_on_to_its_ranks() {
    signal_command(&["launch"], &["--nproc", "8", "--"], libc::SIGTERM, 143);
}

#[test]
fn sigterm_finishes_the_step_and_exits_143() {
    signal_run(libc::SIGTERM, 143);
}

#[test]
fn sigint_finishes_the_step_and_exits_130() {
    signal_run(libc::SIGINT, 130);
}

#[test]
fn a_full_disk_under_metrics_stops_the_run_at_once() {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this platform");
        return;
    }
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let r = run_within(
        &[
            "run",
            &s(&plan),
            "--steps",
            "1000000",
            "--metrics",
            "/dev/full",
        ],
        Duration::from_secs(60),
    );
    refused(&r, &["/dev/full", "step 0"]);
}

// ---- temp files ----

#[test]
fn writers_share_no_temporary_file_and_leave_none() {
    let dir = Scratch::new();
    let out = dir.path("plan.json");
    let children: Vec<_> = (0..4)
        .map(|_| {
            bin()
                .args(["plan", TINY, CPU8, "-o", &s(&out)])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(dir.files(), vec!["plan.json"]);
    let r = run(&["validate", &s(&out)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // A write that cannot happen leaves nothing.
    let r = run(&[
        "plan",
        TINY,
        CPU8,
        "-o",
        &s(&out.join("inside-a-file.json")),
    ]);
    refused(&r, &["inside-a-file.json"]);
    assert_eq!(dir.files(), vec!["plan.json"]);
}

// ---- vague errors ----

#[test]
fn too_little_memory_is_said_in_units_that_are_not_zero() {
    let dir = Scratch::new();
    let cluster = dir.copy_edit(CPU8, &[("memory_gib = 2 ", "memory_gib = 0.0001 ")]);
    let r = run(&["plan", TINY, &s(&cluster)]);
    refused(&r, &["needs", "KiB"]);
    assert!(!r.stderr.contains(" 0.0 GiB"), "{}", r.stderr);
}

#[test]
fn a_config_without_model_type_names_the_key() {
    let dir = Scratch::new();
    let config = dir.path("config.json");
    std::fs::write(&config, r#"{"hidden_size": 64}"#).unwrap();
    let r = run(&[
        "plan",
        &s(&config),
        CPU8,
        "--seq-len",
        "64",
        "--global-batch",
        "8",
    ]);
    refused(&r, &[&s(&config), "model_type", "missing"]);
}

#[test]
fn a_cluster_file_value_is_blamed_on_the_file() {
    let dir = Scratch::new();
    let max = i64::MAX.to_string();
    let cluster = dir.copy_edit(CPU8, &[("nodes = 1", &format!("nodes = {max}"))]);
    let r = run(&["plan", TINY, &s(&cluster)]);
    refused(&r, &[&s(&cluster), "nodes"]);
    assert!(!r.stderr.contains("<command line>"), "{}", r.stderr);
}

// ---- cases beyond the issue's examples, one rule each ----

#[test]
fn dev_stdout_onto_a_pipe_is_written_in_place() {
    if !Path::new("/dev/stdout").exists() {
        eprintln!("skipped: no /dev/stdout on this platform");
        return;
    }
    // run_within pipes stdout: /dev/stdout names that pipe through /proc/self/fd.
    let r = run(&["plan", TINY, CPU8, "-o", "/dev/stdout", "--format", "table"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("\"format\": \"tessera.plan/v1\""));
}

#[test]
fn launch_counts_out_of_range() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    for args in [
        vec!["--nproc", "0"],
        vec!["--nnodes", "0"],
        vec!["--master-port", "0"],
        vec!["--node-rank", "5"],
        // 2 × (2^63 + 4) wraps to 8 in 64 bits: it must not be taken for the 8 ranks.
        vec!["--nproc", "9223372036854775812", "--nnodes", "2"],
    ] {
        let mut all = vec!["launch", plan.to_str().unwrap()];
        all.extend(&args);
        refused(&run(&all), &[args[0]]);
    }
}

#[test]
fn rates_too_small_for_a_finite_prediction_are_refused_before_writing() {
    let dir = Scratch::new();
    let cluster = dir.copy_edit(
        CPU8,
        &[(
            "memory_bandwidth_gbps = 10 ",
            "memory_bandwidth_gbps = 1e-310 ",
        )],
    );
    let out = dir.path("plan.json");
    let r = run(&["plan", TINY, &s(&cluster), "-o", &s(&out)]);
    refused(&r, &[&s(&cluster), "memory_bandwidth_gbps"]);
    assert!(!out.exists());
}

#[test]
fn runtime_conditions_are_checked_by_plan_and_validate() {
    let dir = Scratch::new();
    // RoPE needs an even head size: hidden 60 over 12 heads is 5.
    let rope = dir.copy_edit(
        TINY,
        &[
            ("hidden = 64", "hidden = 60"),
            ("heads = 4", "heads = 12"),
            ("kv_heads = 4", "kv_heads = 12"),
            ("position = \"learned\"", "position = \"rope\""),
        ],
    );
    refused(
        &run(&["validate", &s(&rope)]),
        &["architecture.head_dim", "even"],
    );
    // Dropout: the CPU runtime runs it (runtime/tests/dropout_parity.rs), except under context
    // parallelism, whose ranks hold two chunks of each sequence: that plan is refused.
    let dropout = dir.copy_edit(TINY, &[("dropout = 0.0", "dropout = 0.1")]);
    let r = run(&["plan", &s(&dropout), CPU8, "-o", &s(&dir.path("p.json"))]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(dir.path("p.json").exists());
    refused(
        &run(&[
            "plan",
            &s(&dropout),
            CPU8,
            "--cp",
            "2",
            "-o",
            &s(&dir.path("cp.json")),
        ]),
        &[&s(&dropout), "dropout", "parallel.cp 2", "--cp 1"],
    );
    assert!(!dir.path("cp.json").exists());
    // More CPU ranks than the backend runs.
    let wide = dir.copy_edit(CPU8, &[("gpus_per_node = 8", "gpus_per_node = 2048")]);
    let batch = dir.copy_edit(TINY, &[("global_batch = 16", "global_batch = 4096")]);
    refused(&run(&["plan", &s(&batch), &s(&wide)]), &["2048 ranks"]);
}

#[test]
fn bad_data_files_are_refused_naming_them() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let empty = dir.path("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let huge_ids = dir.path("ids.u32");
    std::fs::write(&huge_ids, [0xffu8; 4 * 200]).unwrap();
    let odd = dir.path("odd.bin");
    std::fs::write(&odd, b"abc").unwrap();
    for data in [&empty, &huge_ids, &odd, &dir.0.path().to_path_buf()] {
        let r = run(&["run", &s(&plan), "--steps", "1", "--data", &s(data)]);
        refused(&r, &[&s(data)]);
    }
}

#[test]
fn an_output_that_cannot_be_written_is_refused_before_the_work() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let missing = dir.path("no-such-folder").join("trace.json");
    // A million steps: the refusal must come first, not after the run.
    let r = run_within(
        &[
            "run",
            &s(&plan),
            "--steps",
            "1000000",
            "--trace",
            &s(&missing),
        ],
        Duration::from_secs(30),
    );
    refused(&r, &["--trace", "no-such-folder"]);
    let r = run(&["run", &s(&plan), "--metrics", &s(dir.0.path())]);
    refused(&r, &["--metrics", "is a folder"]);
}

#[test]
fn an_endless_input_is_refused_at_a_bound() {
    if !Path::new("/dev/zero").exists() {
        eprintln!("skipped: no /dev/zero on this platform");
        return;
    }
    let r = run_within(&["plan", "/dev/zero", CPU8], Duration::from_secs(30));
    refused(&r, &["/dev/zero", "larger than"]);
    let r = run_within(&["validate", "/dev/zero"], Duration::from_secs(30));
    refused(&r, &["/dev/zero"]);
}

// ---- signals through a launcher, second signals, FIFOs that nobody reads ----

/// A child that is killed if the test gives up on it (a hang must fail the test, not hang it).
struct Bounded(Option<std::process::Child>);

impl Bounded {
    /// Starts `tessera ARGS` in a process group of its own, as a shell starts a foreground job:
    /// the test then plays the terminal, signalling the whole group.
    fn group(args: &[String]) -> Bounded {
        use std::os::unix::process::CommandExt;
        let child = bin()
            .args(args)
            .env_remove("TESSERA_JOB_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        Bounded(Some(child))
    }

    fn pid(&self) -> i32 {
        self.0.as_ref().unwrap().id() as i32
    }

    /// Sends `sig` to the child's whole process group (what Ctrl-C does).
    fn signal_group(&self, sig: i32) {
        // SAFETY: signalling the process group our own child leads.
        unsafe {
            libc::kill(-self.pid(), sig);
        }
    }

    fn signal(&self, pid: i32, sig: i32) {
        assert!(pid > 0);
        // SAFETY: signalling a process this test started (or its child).
        unsafe {
            libc::kill(pid, sig);
        }
    }

    /// Waits at most `deadline` for the exit; past it, kills the group and fails.
    fn finish(mut self, deadline: Duration) -> (Option<i32>, String, String) {
        let mut child = self.0.take().unwrap();
        let (status, out, err) = wait_draining(
            &mut child,
            deadline,
            |c| {
                // SAFETY: killing the group our own child leads.
                unsafe {
                    libc::kill(-(c.id() as i32), libc::SIGKILL);
                }
            },
            || format!("did not stop within {deadline:?} of the signal"),
        );
        // The launcher's ranks hold the pipes too; they must have ended with it.
        (status.code(), out, err)
    }
}

impl Drop for Bounded {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            // SAFETY: killing the group our own child leads.
            unsafe {
                libc::kill(-(c.id() as i32), libc::SIGKILL);
            }
            c.wait().ok();
        }
    }
}

/// Waits until `path` has `lines` lines (at most 120 s).
fn wait_for_lines(path: &Path, lines: usize) {
    let start = std::time::Instant::now();
    while std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < lines
    {
        assert!(start.elapsed() < Duration::from_secs(120), "no steps ran");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The metrics are whole lines, the trace is closed JSON, no temporary file is left; returns
/// the trace.
fn outputs_closed(dir: &Scratch, metrics: &Path, trace: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(metrics).unwrap();
    assert!(text.ends_with('\n'), "the last line is torn: {text:?}");
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("each line is whole JSON");
    }
    let trace = std::fs::read_to_string(trace).expect("the trace was written");
    let trace: serde_json::Value = serde_json::from_str(&trace).expect("the trace is closed");
    assert!(trace["traceEvents"].is_array(), "{trace}");
    assert!(!dir.files().iter().any(|f| f.ends_with(".tmp")));
    trace
}

fn op_events(trace: &serde_json::Value) -> usize {
    trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count()
}

/// `launch PLAN BETWEEN -- --steps 10^6 --metrics … --trace …` as strings.
fn long_run(cmd: &str, plan: &Path, between: &[&str], metrics: &Path, trace: &Path) -> Vec<String> {
    let mut args = vec![cmd.to_string(), s(plan)];
    args.extend(between.iter().map(|a| a.to_string()));
    if cmd == "launch" {
        args.push("--".into());
    }
    for a in [
        "--steps",
        "1000000",
        "--metrics",
        &s(metrics),
        "--trace",
        &s(trace),
    ] {
        args.push(a.to_string());
    }
    args
}

/// The rank processes of a launcher: (pid, RANK) of its children, from /proc.
fn ranks_of(launcher: i32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …: the comm may hold spaces, so split after its ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let ppid: i32 = rest
            .split_whitespace()
            .nth(1)
            .unwrap_or("0")
            .parse()
            .unwrap_or(0);
        if ppid != launcher {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = env
            .split(|b| *b == 0)
            .filter_map(|kv| kv.strip_prefix(b"RANK="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .next()
            .unwrap_or_default();
        out.push((pid, rank));
    }
    out
}

/// Whether a process still runs (a zombie, waiting for a parent to reap it, does not).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

#[test]
fn ctrl_c_on_a_launch_stops_every_rank_once_and_closes_the_trace() {
    // The terminal sends SIGINT to the whole foreground group; the launcher passes it on too.
    // Rank 0 must take the two as one request: finish the step, write the whole trace, 130.
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (metrics, trace) = (dir.path("m.jsonl"), dir.path("trace.json"));
    let args = long_run("launch", &plan, &["--nproc", "8"], &metrics, &trace);
    let child = Bounded::group(&args);
    wait_for_lines(&metrics, 3);
    child.signal_group(libc::SIGINT);
    let (code, out, err) = child.finish(Duration::from_secs(30));
    assert_eq!(code, Some(130), "{out}\n{err}");
    // Neither rank 0 nor the launcher took it for a second request.
    assert!(
        !err.contains("[rank 0] SIGINT: stopping now") && !err.contains("passing it on again"),
        "one Ctrl-C escalated:\n{err}"
    );
    let trace = outputs_closed(&dir, &metrics, &trace);
    assert!(op_events(&trace) > 0, "the whole trace: {trace}");
}

#[test]
fn a_signal_sent_to_the_launcher_and_its_rank_alike_is_one_request() {
    // A job controller (Slurm's scancel, a cgroup kill) signals every process of the job: the
    // launcher's copy that reaches rank 0 a moment later is not a second request.
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (metrics, trace) = (dir.path("m.jsonl"), dir.path("trace.json"));
    let args = long_run("launch", &plan, &["--nproc", "8"], &metrics, &trace);
    let child = Bounded::group(&args);
    wait_for_lines(&metrics, 3);
    let ranks = ranks_of(child.pid());
    assert_eq!(ranks.len(), 8, "{ranks:?}");
    for (pid, _) in &ranks {
        child.signal(*pid, libc::SIGTERM);
    }
    child.signal(child.pid(), libc::SIGTERM);
    let (code, out, err) = child.finish(Duration::from_secs(30));
    assert_eq!(code, Some(143), "{out}\n{err}");
    assert!(
        !err.contains("[rank 0] SIGTERM: stopping now") && !err.contains("passing it on again"),
        "a copy escalated:\n{err}"
    );
    let trace = outputs_closed(&dir, &metrics, &trace);
    assert!(op_events(&trace) > 0, "the whole trace: {trace}");
}

/// A model whose steps take about a second on a CPU, planned on one rank.
fn slow_plan(dir: &Scratch) -> std::path::PathBuf {
    let model = dir.copy_edit(
        TINY,
        &[
            ("hidden = 64", "hidden = 512"),
            ("ffn_hidden = 256", "ffn_hidden = 2048"),
        ],
    );
    let out = dir.path("slow.json");
    let r = run(&[
        "plan",
        &s(&model),
        CPU8,
        "--devices",
        "1",
        "--dp",
        "1",
        "--pp",
        "1",
        "--tp",
        "1",
        "--micro-batch",
        "2",
        "-o",
        &s(&out),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    out
}

#[test]
fn a_real_second_signal_exits_at_once_and_still_closes_the_trace() {
    for (cmd, between, sig, code) in [
        ("run", &[][..], libc::SIGTERM, 143),
        ("launch", &["--nproc", "1"][..], libc::SIGINT, 130),
    ] {
        let dir = Scratch::new();
        let plan = slow_plan(&dir);
        let (metrics, trace) = (dir.path("m.jsonl"), dir.path("trace.json"));
        let child = Bounded::group(&long_run(cmd, &plan, between, &metrics, &trace));
        wait_for_lines(&metrics, 1);
        child.signal_group(sig);
        // A second request well inside the step (about a second on 2 cores).
        std::thread::sleep(Duration::from_millis(50));
        child.signal_group(sig);
        // At once: well before the step in progress (about a second or more) could finish.
        let (got, out, err) = child.finish(Duration::from_secs(20));
        assert_eq!(got, Some(code), "{cmd}: {out}\n{err}");
        assert!(err.contains("stopping now"), "{cmd}: {err}");
        outputs_closed(&dir, &metrics, &trace);
    }
}

#[test]
fn a_killed_launcher_takes_its_ranks_with_it() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (metrics, trace) = (dir.path("m.jsonl"), dir.path("trace.json"));
    let child = Bounded::group(&long_run(
        "launch",
        &plan,
        &["--nproc", "8"],
        &metrics,
        &trace,
    ));
    wait_for_lines(&metrics, 3);
    let ranks = ranks_of(child.pid());
    assert_eq!(ranks.len(), 8, "{ranks:?}");
    child.signal(child.pid(), libc::SIGKILL);
    let start = std::time::Instant::now();
    while ranks.iter().any(|(pid, _)| alive(*pid)) {
        if start.elapsed() > Duration::from_secs(10) {
            for (pid, _) in &ranks {
                child.signal(*pid, libc::SIGKILL);
            }
            panic!("rank processes outlived their launcher: {ranks:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, _, _) = child.finish(Duration::from_secs(10));
    assert_eq!(code, None, "killed");
}

fn mkfifo(path: &Path) -> bool {
    std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn an_output_fifo_without_a_reader_does_not_block_a_stop() {
    for flag in ["--metrics", "--trace"] {
        for (sig, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
            let dir = Scratch::new();
            let plan = tiny_plan(&dir);
            let fifo = dir.path("out.fifo");
            if !mkfifo(&fifo) {
                eprintln!("skipped: mkfifo is not available here");
                return;
            }
            let args: Vec<String> = ["run", &s(&plan), "--steps", "2", flag, &s(&fifo)]
                .iter()
                .map(|a| a.to_string())
                .collect();
            let child = Bounded::group(&args);
            // Long enough for a 2-step run to reach its outputs, and to be waiting there.
            std::thread::sleep(Duration::from_millis(1500));
            child.signal(child.pid(), sig);
            let (got, out, err) = child.finish(Duration::from_secs(10));
            assert_eq!(got, Some(code), "{flag}: {out}\n{err}");
            assert!(
                err.contains(flag) && err.contains("reader"),
                "{flag}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
            assert_eq!(dir.files(), vec!["out.fifo", "plan.json"], "{flag}");
        }
    }
}

#[test]
fn a_trace_fifo_with_a_reader_gets_the_whole_trace() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let fifo = dir.path("trace.fifo");
    if !mkfifo(&fifo) {
        eprintln!("skipped: mkfifo is not available here");
        return;
    }
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let r = run_within(
        &["run", &s(&plan), "--steps", "2", "--trace", &s(&fifo)],
        Duration::from_secs(60),
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let trace: serde_json::Value = serde_json::from_str(&reader.join().unwrap()).unwrap();
    assert!(op_events(&trace) > 0);
}
