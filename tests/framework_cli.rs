//! Framework profiles at the command line: `--framework` and `training.framework` name a
//! profile of specs/frameworks/, the search offers only what it can run, plan.json keeps it, and
//! an export to an engine that runs another framework is refused (a stated profile) or warned
//! about (the default profile).

use std::path::Path;
use std::process::{Command, Output};

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const LLAMA_ONE_NODE: [&str; 5] = [
    "plan",
    "specs/models/llama3-8b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "1",
];

fn plan_json(framework: Option<&str>, out: &Path) {
    let mut args = LLAMA_ONE_NODE.to_vec();
    let o = out.to_str().unwrap();
    // ZeRO-3: a layout both megatron-core and torchtitan run (torchtitan's FSDP2).
    args.extend(["--top", "1", "--zero", "3", "-o", o]);
    if let Some(f) = framework {
        args.extend(["--framework", f]);
    }
    let r = tessera(&args);
    assert!(r.status.success(), "{}", text(&r.stderr));
}

#[test]
fn a_stated_framework_limits_the_search_and_is_kept_in_plan_json() {
    let mut args = LLAMA_ONE_NODE.to_vec();
    args.extend(["--framework", "pytorch-eager", "--top", "3"]);
    let o = tessera(&args);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        out.contains("framework profile \"pytorch-eager\" (stated)"),
        "{out}"
    );
    // pytorch-eager runs data parallelism only: the layouts it cannot run are refused by name,
    // and every ranked layout is TP 1 × PP 1.
    assert!(
        out.contains("the framework cannot run this layout"),
        "{out}"
    );
    assert!(out.contains("pytorch-eager cannot run"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#  dp"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    for r in rows {
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((cols[2], cols[3]), ("1", "1"), "tp, pp of {r}");
    }

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("plan.json");
    plan_json(Some("torchtitan"), &p);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    assert_eq!(v["job"]["model"]["training"]["framework"], "torchtitan");
}

#[test]
fn the_default_profile_is_named_and_not_written() {
    let o = tessera(&LLAMA_ONE_NODE);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        out.contains("framework profile \"megatron-core\" (the default;"),
        "{out}"
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("plan.json");
    plan_json(None, &p);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    assert!(v["job"]["model"]["training"].get("framework").is_none());
}

#[test]
fn an_unknown_framework_is_refused_with_the_known_names() {
    let mut args = LLAMA_ONE_NODE.to_vec();
    args.extend(["--framework", "jax"]);
    let o = tessera(&args);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--framework") && err.contains("\"jax\""),
        "{err}"
    );
    assert!(
        err.contains("torchtitan") && err.contains("megatron-core"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("m.toml");
    let base = std::fs::read_to_string("specs/models/tiny.toml").unwrap();
    let with = base.replacen("[training]", "[training]\nframework = \"torchtitn\"", 1);
    std::fs::write(&spec, with).unwrap();
    let o = tessera(&["plan", spec.to_str().unwrap(), "specs/clusters/cpu-8.toml"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("training.framework"), "{err}");
    assert!(
        err.contains("torchtitn") && err.contains("torchtitan"),
        "{err}"
    );
    assert!(err.contains("m.toml"), "{err}");
}

#[test]
fn an_export_to_another_framework_is_refused_or_warned() {
    let dir = tempfile::tempdir().unwrap();
    let titan = dir.path().join("titan.json");
    plan_json(Some("torchtitan"), &titan);
    let t = titan.to_str().unwrap();

    let o = tessera(&["export", t, "--to", "megatron"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("\"torchtitan\""), "{err}");
    assert!(err.contains("--framework megatron-core"), "{err}");
    assert!(o.stdout.is_empty());

    let o = tessera(&["export", t, "--to", "torchtitan"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(!text(&o.stderr).contains("warning"), "{}", text(&o.stderr));

    let default = dir.path().join("default.json");
    plan_json(None, &default);
    let o = tessera(&["export", default.to_str().unwrap(), "--to", "torchtitan"]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("warning") && err.contains("\"megatron-core\" (the default)"),
        "{err}"
    );
    assert!(err.contains("--framework torchtitan"), "{err}");
}
