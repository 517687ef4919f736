//! `tessera diff` shows every plan.json key that changes what runs. For each leaf of real plans
//! (every key the plan's JSON Schema has, optional ones included), a copy of the plan with that
//! one value changed must make `plan::diff::diff` report a change naming the key, unless the
//! key is in [`NOT_SHOWN`] with the reason. A key added to plan.json fails this test until diff
//! shows it or it is listed here.
//!
//! The copies are compared as `Plan` values, not loaded from files: `Plan::load` recomputes
//! `predicted` and checks the rest, so most one-value edits would not load. That is why the
//! derived keys are listed: two loadable plans that differ there also differ in a key diff
//! shows.

mod common;

use std::collections::BTreeSet;

use common::*;
use serde_json::Value;
use tessera_planner::plan::diff::diff;
use tessera_planner::plan::Plan;

/// The prediction is recomputed on load from `job`, `parallel` and `stages` (docs/plan.md, "What
/// a reader checks"), each key of which diff shows; diff shows its memory and time numbers as
/// their consequences.
const DERIVED: &str = "derived: `Plan::load` recomputes `predicted` from the job, the layout and the stages, which diff shows";
/// Stage and chunk numbers and the embedding and head flags are checked on load to be the
/// layout's (`stages_for_split`): they follow from `parallel` and the layer ranges.
const POSITION: &str = "checked on load to be the layout's (`stages_for_split`): it follows from `parallel` and the layer ranges, which diff shows";
/// The search summary records how the layout was chosen; nothing that runs or exports a plan
/// reads it.
const SEARCH: &str =
    "the record of how the layout was chosen: no command that runs or exports a plan reads it";

/// Keys diff does not show, with why (array indices written `[]`).
const NOT_SHOWN: &[(&str, &str)] = &[
    (
        "format",
        "always `tessera.plan/v1`: a reader refuses any other",
    ),
    (
        "generator",
        "the version of the tool that wrote the plan: nothing runs differently for it",
    ),
    (
        "parallel.vocab.reason",
        "prose made of vocab.model, vocab.padded, vocab.multiple and tp, which diff shows",
    ),
    ("stages[].stage", POSITION),
    ("stages[].chunks[].chunk", POSITION),
    ("stages[].chunks[].virtual_stage", POSITION),
    ("stages[].chunks[].embedding", POSITION),
    ("stages[].chunks[].head", POSITION),
    (
        "job.model.optimizer.name",
        "one value only (`adamw`): no two plans differ in it",
    ),
    // The whole run and the cadence follow from job.model.training.tokens, job.cluster's
    // [reliability], [storage] and [cost], and the step time, which diff shows.
    ("predicted.checkpoint.save_bytes", DERIVED),
    ("predicted.checkpoint.node_bytes", DERIVED),
    ("predicted.checkpoint.save_s", DERIVED),
    ("predicted.checkpoint.job_mtbf_hours", DERIVED),
    ("predicted.checkpoint.interval_s", DERIVED),
    ("predicted.checkpoint.save_every", DERIVED),
    ("predicted.checkpoint.goodput", DERIVED),
    ("predicted.whole_run.tokens", DERIVED),
    ("predicted.whole_run.tokens_per_step", DERIVED),
    ("predicted.whole_run.steps", DERIVED),
    ("predicted.whole_run.compute_hours", DERIVED),
    ("predicted.whole_run.wall_hours", DERIVED),
    ("predicted.whole_run.gpu_hours", DERIVED),
    ("predicted.whole_run.cost_usd", DERIVED),
    ("predicted.whole_run.interruptions", DERIVED),
    // What FP8 would change follows from job.model.training.fp8 and the device's FP8 keys,
    // which diff shows, and the layout.
    // What TP overlap would change follows from job.model.training.tp_comm_overlap, the
    // layout and the framework profile, as the step time does.
    ("predicted.tp_overlap.stated", DERIVED),
    ("predicted.tp_overlap.step_time_s_overlapped", DERIVED),
    ("predicted.tp_overlap.step_time_s_sequential", DERIVED),
    ("predicted.fp8.recipe", DERIVED),
    ("predicted.fp8.stated", DERIVED),
    ("predicted.fp8.step_time_s_bf16", DERIVED),
    ("predicted.fp8.step_time_s_fp8", DERIVED),
    ("predicted.fp8.peak_bytes_bf16", DERIVED),
    ("predicted.fp8.peak_bytes_fp8", DERIVED),
    ("predicted.fp8.memory", DERIVED),
    ("predicted.fp8.linears[].name", DERIVED),
    ("predicted.fp8.linears[].m", DERIVED),
    ("predicted.fp8.linears[].k", DERIVED),
    ("predicted.fp8.linears[].n", DERIVED),
    ("predicted.fp8.linears[].count", DERIVED),
    ("predicted.fp8.linears[].bf16_s", DERIVED),
    ("predicted.fp8.linears[].fp8_gemm_s", DERIVED),
    ("predicted.fp8.linears[].cast_s", DERIVED),
    ("predicted.fp8.linears[].wins", DERIVED),
    ("predicted.memory.peak_stage", DERIVED),
    ("predicted.memory.capacity_bytes", DERIVED),
    ("predicted.memory.per_stage[].stage", DERIVED),
    ("predicted.memory.per_stage[].layers", DERIVED),
    ("predicted.memory.per_stage[].params_per_rank", DERIVED),
    ("predicted.memory.per_stage[].in_flight", DERIVED),
    ("predicted.memory.per_stage[].terms[].name", DERIVED),
    ("predicted.memory.per_stage[].terms[].kind", DERIVED),
    ("predicted.memory.per_stage[].terms[].reason", DERIVED),
    ("predicted.memory.host.per_stage[].stage", DERIVED),
    ("predicted.memory.host.per_stage[].terms[].name", DERIVED),
    ("predicted.memory.host.per_stage[].terms[].kind", DERIVED),
    ("predicted.memory.host.per_stage[].terms[].reason", DERIVED),
    ("predicted.memory.host.host_capacity_bytes", DERIVED),
    ("predicted.memory.host.nvme_capacity_bytes", DERIVED),
    ("predicted.memory.host.host_bytes_per_node", DERIVED),
    ("predicted.memory.host.nvme_bytes_per_node", DERIVED),
    ("predicted.memory.host.per_stage[].host_bytes", DERIVED),
    ("predicted.memory.host.per_stage[].nvme_bytes", DERIVED),
    ("predicted.memory.host.per_stage[].terms[].bytes", DERIVED),
    ("predicted.breakdown[].name", DERIVED),
    ("predicted.breakdown[].reason", DERIVED),
    ("predicted.tokens_per_s_per_device", DERIVED),
    ("predicted.model_flops_per_step", DERIVED),
    ("predicted.flop_convention", DERIVED),
    ("predicted.bottleneck_stage", DERIVED),
    ("predicted.caveats[].id", DERIVED),
    ("predicted.caveats[].text", DERIVED),
    ("search.ordering", SEARCH),
    ("search.evaluated", SEARCH),
    ("search.fitting", SEARCH),
    ("search.alternatives[].rank", SEARCH),
    ("search.alternatives[].layout", SEARCH),
    ("search.alternatives[].peak_bytes", SEARCH),
    ("search.alternatives[].step_time_s", SEARCH),
    ("search.alternatives[].tokens_per_s", SEARCH),
    ("search.alternatives[].mfu", SEARCH),
    ("search.alternatives[].breakdown[].name", SEARCH),
    ("search.alternatives[].breakdown[].seconds", SEARCH),
    ("search.alternatives[].breakdown[].reason", SEARCH),
    ("search.alternatives[].why", SEARCH),
];

/// `a.b[3].c` as `a.b[].c`.
fn pattern(path: &str) -> String {
    let mut out = String::new();
    let mut in_index = false;
    for ch in path.chars() {
        match ch {
            '[' => {
                in_index = true;
                out.push_str("[]");
            }
            ']' => in_index = false,
            _ if in_index => {}
            _ => out.push(ch),
        }
    }
    out
}

/// Every leaf of `v`: its dotted path (`stages[1].chunks[0].layers[0]`) and JSON pointer.
fn leaves(v: &Value, path: &str, pointer: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                leaves(x, &p, &format!("{pointer}/{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                leaves(x, &format!("{path}[{i}]"), &format!("{pointer}/{i}"), out);
            }
        }
        _ => out.push((path.to_string(), pointer.to_string())),
    }
}

/// The leaf patterns of the plan's JSON Schema (`[]` for arrays), and every string constant it
/// lists (the enums' values).
fn schema_leaves(
    s: &Value,
    defs: &Value,
    path: &str,
    out: &mut BTreeSet<String>,
    strings: &mut BTreeSet<String>,
) {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap();
        return schema_leaves(&defs[name], defs, path, out, strings);
    }
    for c in ["const"] {
        if let Some(v) = s.get(c).and_then(Value::as_str) {
            strings.insert(v.to_string());
        }
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        strings.extend(e.iter().filter_map(Value::as_str).map(String::from));
    }
    if let Some(alts) = s.get("anyOf").or(s.get("oneOf")).and_then(Value::as_array) {
        let objects: Vec<&Value> = alts
            .iter()
            .filter(|a| a.get("$ref").is_some() || a.get("properties").is_some())
            .collect();
        if !objects.is_empty() {
            for a in objects {
                schema_leaves(a, defs, path, out, strings);
            }
            return;
        }
        for a in alts {
            schema_leaves(a, defs, "", &mut BTreeSet::new(), strings);
        }
    }
    if let Some(props) = s.get("properties").and_then(Value::as_object) {
        for (k, x) in props {
            let p = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            schema_leaves(x, defs, &p, out, strings);
        }
        return;
    }
    let is_array = match &s["type"] {
        Value::String(t) => t == "array",
        Value::Array(ts) => ts.iter().any(|t| t == "array"),
        _ => false,
    };
    if is_array {
        let items = s.get("items").or(s.get("prefixItems")).unwrap();
        let items = items.as_array().map_or(items, |a| &a[0]);
        return schema_leaves(items, defs, &format!("{path}[]"), out, strings);
    }
    if !path.is_empty() {
        out.insert(path.to_string());
    }
}

/// Plans that between them hold every optional key: the README's tiny job on cpu-8 (no
/// calibration: a caveat), the tiny model with full recompute of every second layer on a
/// calibrated CPU cluster that sets every optional device and calibration key, and a tiny
/// Llama with every optional architecture key (tests/fixtures/tiny-llama-rope.toml).
fn plans(dir: &Scratch) -> Vec<Value> {
    let readme = tiny_plan(dir);
    let cluster = dir.path("cpu-every-key.toml");
    std::fs::write(
        &cluster,
        "name = \"cpu-every-key\"\nnodes = 2\ngpus_per_node = 4\n\n\
         [device]\nname = \"host\"\nkind = \"cpu\"\nmemory_gib = 2\npeak_tflops = 0.1\n\
         memory_bandwidth_gbps = 10\nsms = 4\nkernel_launch_us = 1.5\ntranscendental_gops = 0.1\nshared_cores = 2\n\n\
         [intra_node]\nbandwidth_gbps = 5\nlatency_us = 10\n\n[inter_node]\nbandwidth_gbps = 2\nlatency_us = 20\n\n\
         [overhead]\ncontext_gib = 0.01\nfragmentation = 0.05\ncuda_context_mib = 1\ncublas_workspace_mib = 1\nnccl_mib_per_communicator = 1\n\n\
         [calibration]\nmatmul_efficiency = [[64, 0.5], [1024, 0.9]]\nmemory_efficiency = 0.8\ngemm_efficiency = 0.7\n\
         flash_attention_efficiency = 0.5\nintra_node_efficiency = 0.9\ninter_node_efficiency = 0.8\n\
         host_op_us = 20\nhost_dispatch_us = 5\nhost_launch_us = 2\nnccl_ctas = 8\n\n\
         [cost]\nusd_per_gpu_hour = 2\n\n[reliability]\ngpu_mtbf_hours = 1000\nrestart_minutes = 5\npreemptions_per_hour = 0.01\n\n\
         [storage]\nwrite_gbps = 1\n",
    )
    .unwrap();
    let every = dir.path("every.json");
    let (c, o) = (s(&cluster), s(&every));
    let mut args = vec!["plan", "specs/models/tiny.toml", c.as_str()];
    args.extend_from_slice(&README_TINY_LAYOUT[2..]);
    args.extend([
        "--recompute",
        "full",
        "--recompute-every",
        "2",
        "--framework",
        "tessera",
        "--tokens",
        "1M",
        "-o",
        o.as_str(),
    ]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // A RoPE model whose rope_theta, norm_eps, rope_scaling and sliding_window are set.
    let mut args = vec!["tests/fixtures/tiny-llama-rope.toml"];
    args.extend_from_slice(&README_TINY_LAYOUT[1..]);
    let rope = plan_file(dir, "rope.json", &args);
    // Context parallelism (K and V all-gathered): CP 2 × PP 2 × TP 2, on a GPU cluster, with
    // Transformer Engine's FP8 (training.fp8).
    let cp = plan_file(
        dir,
        "cp.json",
        &[
            "specs/models/tiny.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--devices",
            "8",
            "--dp",
            "1",
            "--cp",
            "2",
            "--cp-comm",
            "all-gather",
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
            "--fp8",
            "delayed",
        ],
    );
    // Mixture of experts with every MoE and MLA key set, EP 2 × TP 2 with SP, its TP
    // collectives overlapped (training.tp_comm_overlap).
    let moe = plan_file(
        dir,
        "moe.json",
        &[
            "tests/fixtures/tiny-moe-every-key.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--devices",
            "8",
            "--dp",
            "4",
            "--ep",
            "2",
            "--tp",
            "2",
            "--sp",
            "--tp-comm-overlap",
        ],
    );
    // A LoRA fine-tune with every [lora] key and 8-bit optimizer states.
    let lora = plan_file(
        dir,
        "lora.json",
        &[
            "specs/models/tiny.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--devices",
            "1",
            "--method",
            "lora",
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--lora-dropout",
            "0.1",
            "--lora-targets",
            "qkv,o",
            "--optimizer-states",
            "8bit",
        ],
    );
    // Parameters offloaded to NVMe under ZeRO-3, with activation offload (DeepSpeed runs all
    // three), on a GPU cluster with a [host] tier.
    let offload = plan_file(
        dir,
        "offload.json",
        &[
            "specs/models/tiny.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--devices",
            "2",
            "--framework",
            "deepspeed",
            "--dp",
            "2",
            "--zero",
            "3",
            "--recompute",
            "full",
            "--offload",
            "params",
            "--offload-to",
            "nvme",
            "--offload-activations",
        ],
    );
    [readme, every, rope, cp, moe, lora, offload]
        .iter()
        .map(|p| {
            Plan::load(p).unwrap_or_else(|e| panic!("{e}"));
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        })
        .collect()
}

/// Values to put in place of `v`, of its type: the first that still reads as a plan is used.
fn changed(v: &Value, strings: &BTreeSet<String>) -> Vec<Value> {
    match v {
        Value::Bool(b) => vec![Value::Bool(!b)],
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(u), _) => vec![(u + 1).into(), u.saturating_sub(1).into()],
            (None, Some(x)) => vec![(x * 1.5 + 0.25).into()],
            _ => vec![],
        },
        Value::String(s) => strings
            .iter()
            .filter(|c| *c != s)
            .cloned()
            .chain([format!("{s}-changed")])
            .map(Value::String)
            .collect(),
        // An optional value left out (`null`): set it to a number.
        Value::Null => vec![1000.into(), 0.5.into()],
        _ => vec![],
    }
}

/// The keys a diff names.
fn named(a: &Plan, b: &Plan) -> Vec<String> {
    let d = diff(a, b);
    let texts = d.job.iter().chain(&d.layout).chain(&d.stages);
    let numbers = d.memory.iter().chain(&d.time);
    texts
        .map(|c| c.key.clone())
        .chain(numbers.map(|c| c.key.clone()))
        .collect()
}

/// A key names a leaf when it is the leaf or holds it (`…matmul_efficiency` holds
/// `…matmul_efficiency[0][1]`).
fn names(key: &str, leaf: &str) -> bool {
    leaf == key
        || leaf
            .strip_prefix(key)
            .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
}

#[test]
fn diff_names_every_plan_key_that_changes_what_runs() {
    let schema = serde_json::to_value(schemars::schema_for!(Plan)).unwrap();
    let (mut schema_keys, mut strings) = (BTreeSet::new(), BTreeSet::new());
    schema_leaves(
        &schema,
        &schema["$defs"],
        "",
        &mut schema_keys,
        &mut strings,
    );
    let not_shown: BTreeSet<&str> = NOT_SHOWN.iter().map(|(k, _)| *k).collect();
    for k in &not_shown {
        assert!(
            schema_keys.contains(*k),
            "NOT_SHOWN lists `{k}`, which plan.json no longer has"
        );
    }

    let dir = Scratch::new();
    let mut walked = BTreeSet::new();
    let mut unnamed = Vec::new();
    for original in plans(&dir) {
        let a: Plan = serde_json::from_value(original.clone()).unwrap();
        assert!(diff(&a, &a).is_empty(), "a plan differs from itself");
        let mut all = Vec::new();
        leaves(&original, "", "", &mut all);
        for (path, pointer) in all {
            let key = pattern(&path);
            walked.insert(key.clone());
            let old = original.pointer(&pointer).unwrap();
            let b = changed(old, &strings).into_iter().find_map(|new| {
                let mut copy = original.clone();
                *copy.pointer_mut(&pointer).unwrap() = new;
                serde_json::from_value::<Plan>(copy).ok()
            });
            if not_shown.contains(key.as_str()) {
                continue;
            }
            let Some(b) = b else {
                panic!("`{path}` = {old}: no other value of its type reads as a plan");
            };
            let keys = named(&a, &b);
            if !keys.iter().any(|k| names(k, &path)) {
                unnamed.push(format!("{path} (diff named {keys:?})"));
            }
        }
    }
    assert!(
        unnamed.is_empty(),
        "diff does not name these changed keys (show them, or list them in NOT_SHOWN with why):\n  {}",
        unnamed.join("\n  ")
    );
    let unwalked: Vec<&String> = schema_keys
        .iter()
        .filter(|k| !walked.contains(*k) && !not_shown.contains(k.as_str()))
        .collect();
    assert!(
        unwalked.is_empty(),
        "plan.json keys no test plan holds (give `plans` one that sets them): {unwalked:?}"
    );
}
