//! `tessera checkpoint export --to peft` and `--to hf --merge` of a LoRA checkpoint, end to end
//! on the release binary: a base trained 4 steps and exported to HF, a LoRA plan `--init-from`
//! it trained 4 steps, then both exports. For GPT-2 (specs/models/tiny.toml, adapters on qkv,
//! o, up and down: every Conv1D, c_attn fused) and a Llama with GQA and a padded vocabulary
//! (tests/fixtures/tiny-llama.toml, adapters on all seven of PEFT's Llama modules, five of them
//! parts of the runtime's fused q/k/v and gate/up projections).
//!
//! The files are checked here against PEFT's layout as peft 0.21.2's save_pretrained writes it
//! (keys, shapes, values, the LoraConfig's fields), and the merge against `W + (alpha/r)·B·A`
//! computed here from the PEFT file, in HF's orientation. Rank 4 with alpha 32 scales by 8, so
//! an export that drops or misapplies the scaling is far off. The merged folder read back by
//! `--init-from` must give the LoRA checkpoint's logits (Tessera's forward through the
//! adapters). The reference implementation's verdict: scripts/check_peft_export.py applies the
//! PEFT folder to the base with `PeftModel.from_pretrained` and loads the merged folder with
//! transformers, with the Python of TESSERA_TORCH_PYTHON (skipped, saying why, where it is unset
//! or lacks torch, transformers or peft).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const RANK: usize = 4;
const ALPHA: usize = 32;
const SCALING: f64 = 8.0;

/// One model family's case.
struct Case {
    name: &'static str,
    spec: &'static str,
    targets: &'static str,
    /// PEFT's `target_modules`, in the order the plan's targets are.
    peft_targets: &'static [&'static str],
    layers: usize,
    /// Where HF keeps block `l`: `{blocks}.{l}`.
    blocks: &'static str,
    /// Each adapted linear: the runtime's name in a block, HF's module name, (in, out).
    linears: &'static [(&'static str, &'static str, (usize, usize))],
    /// GPT-2's Conv1D weights are stored (in, out); Llama's Linear (out, in).
    conv1d: bool,
}

const GPT2: Case = Case {
    name: "gpt",
    spec: "specs/models/tiny.toml",
    targets: "qkv,o,up,down",
    peft_targets: &["c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
    layers: 4,
    blocks: "transformer.h",
    linears: &[
        ("attn.qkv", "attn.c_attn", (64, 192)),
        ("attn.o", "attn.c_proj", (64, 64)),
        ("mlp.fc", "mlp.c_fc", (64, 256)),
        ("mlp.proj", "mlp.c_proj", (256, 64)),
    ],
    conv1d: true,
};

const LLAMA: Case = Case {
    name: "llama",
    spec: "tests/fixtures/tiny-llama.toml",
    targets: "q,k,v,o,gate,up,down",
    peft_targets: &[
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ],
    layers: 2,
    blocks: "model.layers",
    // q, k, v and gate, up are parts of the runtime's fused projections; k and v are GQA's
    // 2 heads of 16.
    linears: &[
        ("attn.q", "self_attn.q_proj", (64, 64)),
        ("attn.k", "self_attn.k_proj", (64, 32)),
        ("attn.v", "self_attn.v_proj", (64, 32)),
        ("attn.o", "self_attn.o_proj", (64, 64)),
        ("mlp.gate", "mlp.gate_proj", (64, 128)),
        ("mlp.up", "mlp.up_proj", (64, 128)),
        ("mlp.proj", "mlp.down_proj", (128, 64)),
    ],
    conv1d: false,
};

/// The folders of one case.
struct Tuned {
    base_ck: PathBuf,
    base_hf: PathBuf,
    lora_ck: PathBuf,
    peft: PathBuf,
    merged: PathBuf,
}

fn ok(args: &[&str]) -> String {
    let r = run(args);
    assert_eq!(r.code, Some(0), "{args:?}: {}", r.stderr);
    r.stdout
}

/// Trains the base 4 steps on one rank and exports it to HF; trains LoRA adapters on it 4
/// steps (`--init-from`); exports them to PEFT and merged.
fn tuned(dir: &Scratch, c: &Case) -> Tuned {
    let one = [c.spec, "specs/clusters/cpu-8.toml", "--devices", "1"];
    let base_plan = plan_file(dir, &format!("{}.json", c.name), &one);
    let t = |what: &str| dir.path(&format!("{}-{what}", c.name));
    let (base_ck, base_hf, lora_ck) = (t("ck"), t("hf"), t("lora-ck"));
    let (peft, merged) = (t("peft"), t("merged"));
    ok(&[
        "run",
        &s(&base_plan),
        "--steps",
        "4",
        "--save-dir",
        &s(&base_ck),
    ]);
    ok(&[
        "checkpoint",
        "export",
        &s(&base_ck),
        "--to",
        "hf",
        "-o",
        &s(&base_hf),
    ]);
    let (rank, alpha) = (RANK.to_string(), ALPHA.to_string());
    let lora = [
        "--method",
        "lora",
        "--lora-rank",
        &rank,
        "--lora-alpha",
        &alpha,
        "--lora-targets",
        c.targets,
    ];
    let lora_plan = plan_file(
        dir,
        &format!("{}-lora.json", c.name),
        &[&one[..], &lora].concat(),
    );
    let args = ["run", &s(&lora_plan), "--steps", "4", "--lr", "1e-2"];
    ok(&[
        &args[..],
        &["--init-from", &s(&base_hf), "--save-dir", &s(&lora_ck)],
    ]
    .concat());
    let out = ok(&[
        "checkpoint",
        "export",
        &s(&lora_ck),
        "--to",
        "peft",
        "-o",
        &s(&peft),
    ]);
    assert!(out.contains("adapter_model.safetensors"), "{out}");
    let args = [
        "checkpoint",
        "export",
        &s(&lora_ck),
        "--to",
        "hf",
        "--merge",
    ];
    let out = ok(&[&args[..], &["-o", &s(&merged)]].concat());
    assert!(out.contains("LoRA adapters merged"), "{out}");
    Tuned {
        base_ck,
        base_hf,
        lora_ck,
        peft,
        merged,
    }
}

/// A safetensors file's F32 tensors by name: shape and values.
fn tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, (v.shape().to_vec(), values))
        })
        .collect()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `tessera checkpoint logits` of two sequences of 4 tokens.
fn logits(ck: &Path) -> Vec<f64> {
    let out = ok(&[
        "checkpoint",
        "logits",
        &s(ck),
        "--tokens",
        "3,17,42,249,0,5,99,128",
        "--seq-len",
        "4",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
        .collect()
}

/// max |a - b| / max |b|.
fn rel_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// The PEFT folder: PEFT's config fields, and exactly PEFT's keys, with its shapes and the
/// checkpoint's adapter values (a fused B flattened).
fn check_peft(c: &Case, t: &Tuned) {
    let cfg = json(&t.peft.join("adapter_config.json"));
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(cfg["r"], RANK);
    assert_eq!(cfg["lora_alpha"], ALPHA);
    assert_eq!(cfg["lora_dropout"], 0.0);
    assert_eq!(cfg["bias"], "none");
    assert_eq!(cfg["fan_in_fan_out"], c.conv1d);
    assert_eq!(cfg["target_modules"], serde_json::json!(c.peft_targets));

    let file = tensors(&t.peft.join("adapter_model.safetensors"));
    let step = tessera_runtime::checkpoint::Checkpoint::open(&t.lora_ck.join("step-4")).unwrap();
    let ours: BTreeMap<&str, &[f32]> = step.params().map(|(n, _, v)| (n, v)).collect();
    let mut want = Vec::new();
    for l in 0..c.layers {
        for &(linear, module, (i, o)) in c.linears {
            for (half, shape) in [("A", [RANK, i]), ("B", [o, RANK])] {
                let key = format!(
                    "base_model.model.{}.{l}.{module}.lora_{half}.weight",
                    c.blocks
                );
                let (got_shape, got) = &file[&key];
                assert_eq!(got_shape, &shape, "{key}");
                let name = format!("h.{l}.{linear}.lora_{half}.weight");
                assert!(ours[name.as_str()] == got.as_slice(), "{key} is not {name}");
                want.push(key);
            }
        }
    }
    let keys: Vec<&String> = file.keys().collect();
    want.sort();
    assert_eq!(
        keys,
        want.iter().collect::<Vec<_>>(),
        "PEFT's keys and no others"
    );
}

/// The merged folder: every adapted weight is the base's plus `(alpha/r)·B·A` in HF's
/// orientation (the A and B of the PEFT file); every other tensor is the base's, bit for bit.
fn check_merged(c: &Case, t: &Tuned) {
    let (base, merged) = (
        tensors(&t.base_hf.join("model.safetensors")),
        tensors(&t.merged.join("model.safetensors")),
    );
    let peft = tensors(&t.peft.join("adapter_model.safetensors"));
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        merged.keys().collect::<Vec<_>>()
    );
    let mut adapted = 0;
    for (key, (shape, got)) in &merged {
        let (base_shape, w) = &base[key];
        assert_eq!(shape, base_shape, "{key}");
        let module = key.strip_suffix(".weight").unwrap_or(key);
        let lora = |h: &str| peft.get(&format!("base_model.model.{module}.lora_{h}.weight"));
        let (Some((_, a)), Some((_, b))) = (lora("A"), lora("B")) else {
            assert!(got == w, "{key} changed, but has no adapter");
            continue;
        };
        adapted += 1;
        let (i, o) = if c.conv1d {
            (shape[0], shape[1])
        } else {
            (shape[1], shape[0])
        };
        let mut worst = 0.0f64;
        for oo in 0..o {
            for ii in 0..i {
                let ba: f64 = (0..RANK)
                    .map(|k| f64::from(b[oo * RANK + k]) * f64::from(a[k * i + ii]))
                    .sum();
                let at = if c.conv1d { ii * o + oo } else { oo * i + ii };
                let want = f64::from(w[at]) + SCALING * ba;
                worst = worst.max((f64::from(got[at]) - want).abs());
            }
        }
        assert!(worst < 1e-6, "{key}: merged weight off by {worst}");
    }
    assert_eq!(adapted, c.layers * c.linears.len());
}

/// The merged model, read back by `--init-from` into a full plan and run one step at a rate
/// too small to move a weight, computes the LoRA checkpoint's forward; the base alone does not.
fn check_logits(dir: &Scratch, c: &Case, t: &Tuned) {
    let plan = dir.path(&format!("{}.json", c.name));
    let again = dir.path(&format!("{}-merged-ck", c.name));
    let args = ["run", &s(&plan), "--steps", "1", "--lr", "1e-30"];
    ok(&[
        &args[..],
        &["--init-from", &s(&t.merged), "--save-dir", &s(&again)],
    ]
    .concat());
    let (tuned, merged, base) = (logits(&t.lora_ck), logits(&again), logits(&t.base_ck));
    let diff = rel_diff(&merged, &tuned);
    assert!(
        diff < 1e-4,
        "{}: merged logits differ from the adapters' by {diff}",
        c.name
    );
    let effect = rel_diff(&base, &tuned);
    assert!(
        effect > 1e-2,
        "{}: the adapters move the logits by {effect} only",
        c.name
    );
}

/// What is refused, with the fix, writing nothing.
fn check_refusals(dir: &Scratch, t: &Tuned) {
    let out = dir.path("refused");
    let export = |ck: &Path, to: &[&str]| {
        let args = ["checkpoint", "export", &s(ck), "--to"];
        run(&[&args[..], to, &["-o", &s(&out)]].concat())
    };
    let r = export(&t.lora_ck, &["hf"]);
    refused(&r, &["LoRA adapters", "--merge", "--to peft", "fix:"]);
    let r = export(&t.base_ck, &["peft"]);
    refused(&r, &["holds no LoRA adapters", "fix:", "--to hf"]);
    let r = export(&t.base_ck, &["hf", "--merge"]);
    refused(&r, &["holds no LoRA adapters", "fix:"]);
    let r = export(&t.lora_ck, &["peft", "--merge"]);
    refused(&r, &["--merge with --to peft", "fix:"]);
    assert!(!out.exists(), "a refused export wrote {}", out.display());
}

/// scripts/check_peft_export.py's verdict, or why it was skipped.
fn reference(c: &Case, t: &Tuned) {
    let Some(python) = reference_python("torch, transformers, peft") else {
        return;
    };
    let out = Command::new(&python)
        .current_dir(root())
        .args([
            "scripts/check_peft_export.py",
            "--tessera",
            env!("CARGO_BIN_EXE_tessera"),
        ])
        .args(["--checkpoint", &s(&t.lora_ck), "--base", &s(&t.base_hf)])
        .args(["--peft", &s(&t.peft), "--merged", &s(&t.merged)])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{}: {stdout}", c.name);
    assert!(
        out.status.success(),
        "{}: check_peft_export.py failed:\n{stdout}\n{}",
        c.name,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn gpt2_adapters_export_to_peft_and_merge() {
    let dir = Scratch::new();
    let t = tuned(&dir, &GPT2);
    check_peft(&GPT2, &t);
    check_merged(&GPT2, &t);
    check_logits(&dir, &GPT2, &t);
    check_refusals(&dir, &t);
    reference(&GPT2, &t);
}

#[test]
fn llama_adapters_export_to_peft_and_merge() {
    let dir = Scratch::new();
    let t = tuned(&dir, &LLAMA);
    check_peft(&LLAMA, &t);
    check_merged(&LLAMA, &t);
    check_logits(&dir, &LLAMA, &t);
    reference(&LLAMA, &t);
}
