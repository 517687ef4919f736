//! No string from a spec can make an export run anything: hostile names (newlines, quotes,
//! command substitutions, Unicode line separators, YAML and TOML syntax) are fed straight into
//! every writer, bypassing the loaders' name rule, and each result is read back with its own
//! grammar: `bash -n` and a stubbed run that proves no injected command executes (shell
//! files), the YAML and TOML parsers (manifests and configs), JSON. And the loaders refuse such
//! names with exit 2, naming the key.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use proptest::prelude::*;
use tessera_planner::export::{export, Target};
use tessera_planner::plan::Plan;

/// Plans tiny on cpu-8 (a CPU plan), and Llama-3 8B on two DGX H100 nodes on one stage with
/// ZeRO-1 (which Megatron-LM and DeepSpeed take) and on two stages with ZeRO-3 (which
/// torchtitan takes), on two nodes with FSDP only (accelerate, Lightning), and a LoRA fine-tune
/// on one RTX 4090 (which PEFT and torchtune take), so that every writer's text is produced for
/// some plan.
fn base_plans(dir: &Scratch) -> Vec<Plan> {
    let mut paths = vec![tiny_plan(dir)];
    for (zero, pp, dp) in [("1", "1", "8"), ("3", "2", "4")] {
        let name = format!("gpu-zero{zero}.json");
        let pins = format!("--nodes 2 --tp 2 --pp {pp} --dp {dp} --micro-batch 1 --sp --schedule 1f1b --zero {zero} --recompute full");
        let mut args = vec![
            "specs/models/llama3-8b.toml",
            "specs/clusters/dgx-h100-80g.toml",
        ];
        args.extend(pins.split_whitespace());
        paths.push(plan_file(dir, &name, &args));
    }
    // Data parallelism only, for the trainers (accelerate, Lightning): FSDP over two nodes.
    let fsdp = "specs/models/llama3-8b.toml specs/clusters/dgx-h100-80g.toml --nodes 2 --dp 16 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 1 --recompute full";
    let args: Vec<&str> = fsdp.split_whitespace().collect();
    paths.push(plan_file(dir, "fsdp.json", &args));
    paths.push(plan_file(
        dir,
        "lora.json",
        &[
            "specs/finetune/llama3-8b-lora-torchtune.toml",
            "specs/clusters/rtx4090-24g.toml",
            "--devices",
            "1",
            "--micro-batch",
            "2",
            "--recompute",
            "full",
        ],
    ));
    paths
        .iter()
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

/// Every target is written for at least one base plan (none is refused for all of them).
#[test]
fn every_writer_is_exercised() {
    let dir = Scratch::new();
    let plans = base_plans(&dir);
    for target in Target::ALL {
        assert!(
            plans.iter().any(|p| export(p, target).is_ok()),
            "{} refuses every base plan: the injection tests would not reach its writer",
            target.name()
        );
    }
}

/// The payloads: each would create `marker` if any shell ran it.
fn payloads(marker: &Path) -> Vec<String> {
    let m = marker.display();
    vec![
        format!("x\ntouch {m}\n"),
        format!("x\r\ntouch {m}"),
        format!("$(touch {m})"),
        format!("`touch {m}`"),
        format!("x; touch {m}"),
        format!("x' ; touch {m} ; '"),
        format!("x\" ; touch {m} ; \""),
        format!("x\u{2028}touch {m}\u{2029}"),
        format!("x\n#SBATCH --nodes=999\ntouch {m}"),
        "x\nkey: [unclosed\n- \"y".to_string(),
        "x\n[parallelism]\ntensor_parallel_degree = 99".to_string(),
        "x\\\n\u{0}\u{1b}]0;title\u{7}".to_string(),
    ]
}

fn with_names(plan: &Plan, name: &str) -> Plan {
    let mut p = plan.clone();
    p.job.model.name = name.to_string();
    p.job.cluster.name = name.to_string();
    p.job.cluster.device.name = name.to_string();
    p
}

/// Runs `script` with bash, PATH first holding stubs of `srun` and `scontrol` that only log.
fn run_stubbed(dir: &Path, script: &Path) -> std::process::Output {
    let bin = dir.join("stubs");
    std::fs::create_dir_all(&bin).unwrap();
    for stub in ["srun", "scontrol", "tessera", "torchrun"] {
        let p = bin.join(stub);
        std::fs::write(
            &p,
            format!("#!/bin/sh\necho {stub} \"$@\" >> \"$STUB_LOG\"\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    Command::new("bash")
        .arg(script)
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .env("STUB_LOG", dir.join("stub.log"))
        .env("SLURM_JOB_NODELIST", "node1")
        .output()
        .unwrap()
}

/// Checks one export of `plan` (names set to `name`) in its own grammar; `marker` must never
/// be created.
fn check_export(dir: &Path, plan: &Plan, target: Target, marker: &Path) {
    let text = match export(plan, target) {
        Ok(t) => t,
        Err(_) => return, // refused for the layout (e.g. a CPU plan to Megatron): nothing written
    };
    let file = dir.join(format!("out.{}", target.name()));
    std::fs::write(&file, &text).unwrap();
    match target {
        Target::Megatron => {
            let n = Command::new("bash").arg("-n").arg(&file).output().unwrap();
            assert!(n.status.success(), "bash -n refused:\n{text}");
            // Sourcing it defines the array and runs nothing else.
            let out = Command::new("bash")
                .args([
                    "-c",
                    "set -eu; source \"$1\"; printf '%s\\n' \"${MEGATRON_ARGS[@]}\"",
                    "_",
                ])
                .arg(&file)
                .output()
                .unwrap();
            assert!(out.status.success(), "{text}");
            let args = String::from_utf8(out.stdout).unwrap();
            assert!(args.starts_with("--num-layers\n"), "{args}");
        }
        Target::Sbatch => {
            let n = Command::new("bash").arg("-n").arg(&file).output().unwrap();
            assert!(n.status.success(), "bash -n refused:\n{text}");
            // Slurm reads #SBATCH lines up to the first line that is not a comment: every
            // directive must come before it, and be one the writer emits.
            let lines: Vec<&str> = text.lines().collect();
            let first_command = lines.iter().position(|l| !l.starts_with('#')).unwrap();
            let directives: Vec<&&str> =
                lines.iter().filter(|l| l.starts_with("#SBATCH")).collect();
            assert!(directives.len() >= 3, "{text}");
            assert!(
                lines[first_command..]
                    .iter()
                    .all(|l| !l.starts_with("#SBATCH")),
                "{text}"
            );
            assert!(
                directives
                    .iter()
                    .all(|d| !d.starts_with("#SBATCH --nodes=999")),
                "{text}"
            );
            let out = run_stubbed(dir, &file);
            assert!(out.status.success(), "{text}\n{out:?}");
            let log = std::fs::read_to_string(dir.join("stub.log")).unwrap_or_default();
            assert!(log.contains("srun tessera run plan.json"), "{log}");
        }
        Target::Kubernetes => {
            let docs: Vec<serde_yaml_ng::Value> = text
                .split("\n---\n")
                .map(|d| serde_yaml_ng::from_str(d).unwrap_or_else(|e| panic!("{e}\n{text}")))
                .collect();
            let job = docs.last().unwrap();
            assert_eq!(job["kind"].as_str(), Some("Job"), "{text}");
            let name = job["metadata"]["name"].as_str().unwrap();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{name}"
            );
            let cmd = &job["spec"]["template"]["spec"]["containers"][0]["command"];
            assert_eq!(cmd[0].as_str(), Some("tessera"), "{text}");
        }
        Target::Torchtitan => {
            let v: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            // `[checkpoint]` is there exactly when the plan has a cadence, and holds numbers.
            assert_eq!(
                v.contains_key("checkpoint"),
                plan.predicted.checkpoint.is_some(),
                "{text}"
            );
            if let Some(c) = &plan.predicted.checkpoint {
                assert_eq!(
                    v["checkpoint"]["interval"].as_integer(),
                    Some(c.save_every as i64)
                );
            }
            let keys: Vec<&String> = v.keys().filter(|k| *k != "checkpoint").collect();
            assert_eq!(
                keys,
                [
                    "activation_checkpoint",
                    "lr_scheduler",
                    "optimizer",
                    "parallelism",
                    "training"
                ],
                "{text}"
            );
            assert_eq!(
                v["parallelism"]["tensor_parallel_degree"].as_integer(),
                Some(plan.parallel.tp as i64)
            );
        }
        Target::DeepSpeed => {
            let _: serde_json::Value = serde_json::from_str(&text).unwrap();
        }
        Target::Peft => {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["peft_type"], "LORA", "{text}");
        }
        Target::Accelerate => {
            // Every line before the YAML is a comment; the YAML is one mapping.
            let v = yaml_after_comments(&text);
            assert_eq!(
                v["compute_environment"].as_str(),
                Some("LOCAL_MACHINE"),
                "{text}"
            );
        }
        Target::Lightning => {
            // Python's own parser: the comments come first and the module is only the
            // imports, the two assignments and the __main__ block; no string holds the name.
            let check = r##"
import ast, sys
text = open(sys.argv[1]).read()
lines = text.splitlines()
code = [i for i, l in enumerate(lines) if not l.startswith("#")]
assert all(not l.startswith("#") for l in lines[code[0]:]), "a comment after the code"
tree = ast.parse(text)
kinds = [type(n).__name__ for n in tree.body]
assert kinds[-3:] == ["Assign", "Assign", "If"], kinds
assert set(kinds[:-3]) <= {"Import", "ImportFrom"}, kinds
for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        assert node.value.isascii() and "\n" not in node.value and "touch" not in node.value, node.value
"##;
            let out = Command::new("python3")
                .args(["-c", check])
                .arg(&file)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}
{text}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Target::Torchtune => {
            // Every line before the YAML is a comment; the YAML is one mapping.
            assert!(text.lines().take_while(|l| l.starts_with('#')).count() >= 3);
            let v = yaml_after_comments(&text);
            assert!(v["model"]["_component_"]
                .as_str()
                .unwrap()
                .starts_with("torchtune.models."));
        }
    }
    assert!(
        !marker.exists(),
        "an injected command ran ({}):\n{text}",
        target.name()
    );
}

/// The YAML of a text whose header is comments: read whole and without the header, the two
/// must be the same mapping (no comment line ended early).
fn yaml_after_comments(text: &str) -> serde_yaml_ng::Value {
    let body: String = text
        .lines()
        .skip_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(text.lines().take_while(|l| l.starts_with('#')).count() >= 2);
    let v: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let b: serde_yaml_ng::Value = serde_yaml_ng::from_str(&body).unwrap();
    assert_eq!(v, b, "a comment line ended early:\n{text}");
    v
}

#[test]
fn hostile_names_never_escape_any_writer() {
    let dir = Scratch::new();
    let marker = dir.path("INJECTED");
    for plan in base_plans(&dir) {
        for name in payloads(&marker) {
            let p = with_names(&plan, &name);
            for target in Target::ALL {
                check_export(dir.0.path(), &p, target, &marker);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Arbitrary strings of the characters that mean something to a shell, YAML or TOML.
    #[test]
    fn arbitrary_names_never_escape_any_writer(
        name in "[a-z \\n\\r\\t'\"`$(){};|&<>#:\\[\\]=\\\\*!~\\-\u{2028}\u{85}]{1,40}",
    ) {
        let dir = Scratch::new();
        let marker = dir.path("INJECTED");
        let plans = base_plans(&dir);
        let name = format!("{name}\ntouch {}", marker.display());
        for plan in &plans {
            let p = with_names(plan, &name);
            for target in Target::ALL {
                check_export(dir.0.path(), &p, target, &marker);
            }
        }
    }
}

#[test]
fn loaders_refuse_unsafe_names_naming_the_key() {
    let dir = Scratch::new();
    // A TOML model spec.
    let model = dir.copy_edit(
        "specs/models/tiny.toml",
        &[("name = \"tiny\"", "name = \"tiny\\nid\"")],
    );
    let r = run(&["plan", &s(&model), "specs/clusters/cpu-8.toml"]);
    refused(&r, &["name", "tiny.toml", "letters, digits"]);
    // A cluster's device name.
    let cluster = dir.copy_edit(
        "specs/clusters/cpu-8.toml",
        &[("name = \"host-cpu-f32\"", "name = \"cpu$(id)\"")],
    );
    let r = run(&["plan", "specs/models/tiny.toml", &s(&cluster)]);
    refused(&r, &["device.name", "cpu-8.toml"]);
    // A Hugging Face config's _name_or_path.
    let hf = dir.path("config.json");
    std::fs::write(
        &hf,
        r#"{"model_type": "llama", "_name_or_path": "org/x\nrm -rf ~", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128}"#,
    )
    .unwrap();
    let r = run(&[
        "plan",
        &s(&hf),
        "specs/clusters/cpu-8.toml",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
    ]);
    refused(&r, &["_name_or_path", "config.json"]);
    // A hand-edited plan.
    let plan = tiny_plan(&dir);
    edit_json(&plan, |v| {
        v["job"]["model"]["name"] = "tiny\ntouch /tmp/x".into();
    });
    let r = run(&["export", &s(&plan), "--to", "sbatch"]);
    refused(&r, &["name", "plan.json"]);
}
