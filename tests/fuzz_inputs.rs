//! Property: bad input → exit 2 with the file or flag named, never a panic or a hang, and the
//! inputs byte-identical afterwards. The cases are generated mutations of the tiny model spec,
//! the cpu-8 cluster spec, a plan of them, and the flags of `plan` and `run`: wrong types; 0,
//! -1, 2^63, i64::MAX, NaN and inf; missing and duplicated keys. A mutation that happens to be
//! valid may succeed (exit 0); any other outcome fails the property.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::Config;

const TINY: &str = "specs/models/tiny.toml";
const CPU8: &str = "specs/clusters/cpu-8.toml";

/// Values that a hand-edit or a script might put anywhere.
const TOML_VALUES: &[&str] = &[
    "0",
    "-1",
    "9223372036854775807",
    "9223372036854775808",
    "nan",
    "inf",
    "-inf",
    "1e308",
    "0.5",
    "\"text\"",
    "\"\"",
    "true",
    "[]",
    "{}",
];

#[derive(Debug, Clone)]
enum Edit {
    /// Replace the value of the n-th `key = value` line.
    Set(usize, usize),
    /// Delete it.
    Delete(usize),
    /// Write it twice.
    Duplicate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), 0..TOML_VALUES.len()).prop_map(|(k, v)| Edit::Set(k, v)),
        1 => any::<usize>().prop_map(Edit::Delete),
        1 => any::<usize>().prop_map(Edit::Duplicate),
    ]
}

/// Applies an edit to the `key = value` lines of a TOML text.
fn mutate_toml(text: &str, e: &Edit) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let keyed: Vec<usize> = (0..lines.len())
        .filter(|&i| {
            let l = lines[i].trim_start();
            !l.starts_with('#') && !l.starts_with('[') && l.contains('=')
        })
        .collect();
    let pick = |k: usize| keyed[k % keyed.len()];
    match *e {
        Edit::Set(k, v) => {
            let i = pick(k);
            let key = lines[i].split('=').next().unwrap().to_string();
            lines[i] = format!("{key}= {}", TOML_VALUES[v]);
        }
        Edit::Delete(k) => {
            lines.remove(pick(k));
        }
        Edit::Duplicate(k) => {
            let i = pick(k);
            let copy = lines[i].clone();
            lines.insert(i, copy);
        }
    }
    lines.join("\n") + "\n"
}

/// The outcome every case must have.
fn holds(r: &Ran, named: &[&str]) -> Result<(), TestCaseError> {
    prop_assert!(!r.stderr.contains("panicked"), "panicked:\n{}", r.stderr);
    prop_assert!(
        r.code == Some(0) || r.code == Some(2),
        "exit {:?}:\n{}",
        r.code,
        r.stderr
    );
    if r.code == Some(2) {
        prop_assert!(
            named.iter().any(|n| r.stderr.contains(n)),
            "the message names none of {named:?}:\n{}",
            r.stderr
        );
    }
    Ok(())
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

const DEADLINE: Duration = Duration::from_secs(30);

proptest! {
    #![proptest_config(config(100))]

    #[test]
    fn mutated_specs(model_edit in edit(), cluster_edit in edit(), which in 0..3u8) {
        let dir = Scratch::new();
        let read = |p: &str| std::fs::read_to_string(root().join(p)).unwrap();
        let model = dir.path("model.toml");
        let cluster = dir.path("cluster.toml");
        let model_text = if which != 1 { mutate_toml(&read(TINY), &model_edit) } else { read(TINY) };
        let cluster_text = if which != 0 { mutate_toml(&read(CPU8), &cluster_edit) } else { read(CPU8) };
        std::fs::write(&model, &model_text).unwrap();
        std::fs::write(&cluster, &cluster_text).unwrap();
        let before = Inputs::of(&[&model, &cluster]);
        let out = dir.path("plan.json");
        let r = run_within(&["plan", &s(&model), &s(&cluster), "-o", &s(&out)], DEADLINE);
        holds(&r, &[&s(&model), &s(&cluster), "<command line>"])?;
        let r = run_within(&["validate", &s(&model), &s(&cluster)], DEADLINE);
        holds(&r, &[&s(&model), &s(&cluster)])?;
        before.unchanged();
        if r.code == Some(2) {
            prop_assert!(!out.exists() || run_within(&["validate", &s(&out)], DEADLINE).code == Some(0));
        }
    }
}

/// JSON values for a plan's fields.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(9223372036854775808u64)),
        Just(json!(i64::MAX)),
        Just(json!(1e308)),
        Just(json!(-0.5)),
        Just(json!("NaN")),
        Just(json!("inf")),
        Just(json!(null)),
        Just(json!([])),
        Just(json!({})),
        Just(json!(true)),
    ]
}

/// Every path to a leaf of a JSON value (object keys and array indices).
fn leaves(v: &serde_json::Value, path: Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let mut p = path.clone();
                p.push(k.clone());
                leaves(x, p, out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let mut p = path.clone();
                p.push(i.to_string());
                leaves(x, p, out);
            }
        }
        _ => out.push(path),
    }
}

fn at<'a>(v: &'a mut serde_json::Value, path: &[String]) -> &'a mut serde_json::Value {
    path.iter().fold(v, |v, k| match v {
        serde_json::Value::Array(a) => &mut a[k.parse::<usize>().unwrap()],
        other => &mut other[k.as_str()],
    })
}

fn plan_once() -> &'static str {
    use std::sync::OnceLock;
    static PLAN: OnceLock<String> = OnceLock::new();
    PLAN.get_or_init(|| {
        let dir = Scratch::new();
        std::fs::read_to_string(tiny_plan(&dir)).unwrap()
    })
}

proptest! {
    #![proptest_config(config(100))]

    #[test]
    fn mutated_plans(pick in any::<usize>(), value in json_value(), kind in 0..4u8) {
        let dir = Scratch::new();
        let plan = dir.path("plan.json");
        let mut v: serde_json::Value = serde_json::from_str(plan_once()).unwrap();
        let mut paths = Vec::new();
        leaves(&v, vec![], &mut paths);
        let path = &paths[pick % paths.len()];
        let text = match kind {
            // Delete the key (or the array element).
            0 => {
                let (last, parent) = path.split_last().unwrap();
                match at(&mut v, parent) {
                    serde_json::Value::Object(m) => { m.remove(last); }
                    serde_json::Value::Array(a) => { a.remove(last.parse::<usize>().unwrap()); }
                    _ => {}
                }
                serde_json::to_string_pretty(&v).unwrap()
            }
            // Duplicate the key's line.
            1 => {
                let text = serde_json::to_string_pretty(&v).unwrap();
                let key = format!("\"{}\":", path.last().unwrap());
                let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
                if let Some(i) = lines.iter().position(|l| l.trim_start().starts_with(&key)) {
                    let mut copy = lines[i].clone();
                    if !copy.ends_with(',') { copy.push(','); }
                    lines.insert(i, copy);
                }
                lines.join("\n")
            }
            // Truncate the file.
            2 => {
                let text = serde_json::to_string_pretty(&v).unwrap();
                // At a character boundary: the plan's text holds non-ASCII (×, ·).
                let mut end = pick % text.len();
                while !text.is_char_boundary(end) { end -= 1; }
                text[..end].to_string()
            }
            _ => {
                *at(&mut v, path) = value;
                serde_json::to_string_pretty(&v).unwrap()
            }
        };
        std::fs::write(&plan, &text).unwrap();
        let before = Inputs::of(&[&plan]);
        for args in [vec!["validate", &*s(&plan)].clone(), vec!["explain", &*s(&plan)]] {
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let r = run_within(&args, DEADLINE);
            holds(&r, &[&s(&plan)])?;
        }
        let r = run_within(&["run", &s(&plan), "--steps", "1"], DEADLINE);
        holds(&r, &[&s(&plan)])?;
        before.unchanged();
    }
}

const FLAG_VALUES: &[&str] = &[
    "0",
    "-1",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "nan",
    "inf",
    "-inf",
    "1e39",
    "abc",
    "",
    "2",
];

const PLAN_FLAGS: &[&str] = &[
    "--tp",
    "--pp",
    "--dp",
    "--micro-batch",
    "--nodes",
    "--devices",
    "--global-batch",
    "--seq-len",
    "--virtual-stages",
    "--zero",
    "--top",
];

const RUN_FLAGS: &[&str] = &["--steps", "--lr", "--seed"];

proptest! {
    #![proptest_config(config(60))]

    #[test]
    fn mutated_flags(flag in any::<usize>(), value in 0..FLAG_VALUES.len(), run_it in any::<bool>()) {
        let dir = Scratch::new();
        let value = FLAG_VALUES[value];
        let r = if run_it {
            let plan = tiny_plan(&dir);
            let before = Inputs::of(&[&plan]);
            let f = RUN_FLAGS[flag % RUN_FLAGS.len()];
            // A valid value trains for at most 2 steps.
            let steps = if f == "--steps" { value } else { "2" };
            let (f, v) = if f == "--steps" { ("--seed", "1") } else { (f, value) };
            let arg = format!("{f}={v}");
            let steps = format!("--steps={steps}");
            let r = run_within(&["run", &s(&plan), &arg, &steps], DEADLINE);
            before.unchanged();
            r
        } else {
            let f = PLAN_FLAGS[flag % PLAN_FLAGS.len()];
            let arg = format!("{f}={value}");
            run_within(&["plan", TINY, CPU8, &arg], DEADLINE)
        };
        holds(&r, &["<command line>", "--", "cpu-8.toml", "tiny.toml"])?;
        prop_assert!(!Path::new(&dir.path("plan.json.tmp")).exists());
    }
}
