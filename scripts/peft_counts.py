#!/usr/bin/env python3
"""Reference LoRA trainable/frozen parameter counts, computed by PEFT's own code, independently of Tessera.

For each case, tests/fixtures/hf/<fixture>/config.json is built by transformers' own class
(AutoModelForCausalLM.from_config) on the meta device, so no weight is allocated; its plain
parameter count is taken (sum(p.numel() for p in model.parameters()): a tied tensor, such as
GPT-2's lm_head/wte, counted once); it is then wrapped with
peft.get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout=0.0,
task_type="CAUSAL_LM")) and PEFT's own PeftModel.get_nb_trainable_parameters() gives
(trainable, all); frozen = all - trainable. The script never reads Tessera's code.

Targets are given in Tessera's vocabulary and translated per model family:
  llama, mistral, qwen2, qwen3:  q,k,v,o,gate,up,down -> q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
  gpt2 (Conv1D layers):          qkv -> c_attn, o -> attn.c_proj, up -> mlp.c_fc, down -> mlp.c_proj
Two targets are passed to PEFT untranslated: `all-linear` (PEFT's shorthand) and `default`
(target_modules=None: PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the model type).

Usage (one case, printed as a TOML table):

    python scripts/peft_counts.py --fixture llama3-8b --r 16 --targets q,k,v,o,gate,up,down

The reference file tests/fixtures/peft-counts.toml (every case of CASES below) is written by:

    python scripts/peft_counts.py --all --out tests/fixtures/peft-counts.toml

Needs torch, transformers and peft (checked with torch 2.15.0, transformers 5.23.0, peft 0.21.2).
"""

import argparse
import importlib.metadata
import pathlib
import platform
import re
import sys
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from peft import LoraConfig, get_peft_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
HF = ROOT / "tests/fixtures/hf"

LLAMA_NAMES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
GPT2_NAMES = {
    "qkv": "c_attn",
    "o": "attn.c_proj",  # suffix-matched as ".attn.c_proj": the attention projection only
    "up": "mlp.c_fc",
    "down": "mlp.c_proj",
}
FAMILIES = {"llama": LLAMA_NAMES, "mistral": LLAMA_NAMES, "qwen2": LLAMA_NAMES, "qwen3": LLAMA_NAMES, "gpt2": GPT2_NAMES}
PASS_THROUGH = ("all-linear", "default")

ALL7 = "q,k,v,o,gate,up,down"
# (fixture, r, targets): the cases of tests/fixtures/peft-counts.toml
CASES = [
    ("llama3-8b", 16, ALL7),
    ("qwen2-7b", 16, ALL7),
    ("mistral-7b", 16, ALL7),
    ("llama3.1-8b", 16, ALL7),
    ("llama3-8b", 8, "q,v"),
    ("gpt2", 16, "qkv,o,up,down"),
    ("gpt2", 8, "qkv"),
    # Cross-checks of the translation against PEFT's own target resolution:
    ("llama3-8b", 16, "all-linear"),  # must equal llama3-8b r=16 on the seven linears
    ("llama3-8b", 8, "default"),  # PEFT's default for llama: q_proj,v_proj
    ("gpt2", 16, "all-linear"),  # must equal gpt2 r=16 on qkv,o,up,down
    ("gpt2", 8, "default"),  # PEFT's default for gpt2: c_attn
]


def load_config(fixture):
    return AutoConfig.from_pretrained(HF / fixture, local_files_only=True)


def peft_targets(model_type, targets):
    """Tessera target names -> (tessera list, PEFT target_modules)."""
    if targets in PASS_THROUGH:
        return [targets], (None if targets == "default" else targets)
    names = FAMILIES.get(model_type)
    if names is None:
        raise SystemExit(f"no Tessera->PEFT target names for model_type {model_type!r}")
    tessera = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in tessera if t not in names]
    if unknown:
        raise SystemExit(f"{model_type}: unknown target(s) {unknown}; known: {sorted(names)}")
    return tessera, [names[t] for t in tessera]


def count(fixture, r, targets, alpha=None):
    config = load_config(fixture)
    tessera, target_modules = peft_targets(config.model_type, targets)
    alpha = 2 * r if alpha is None else alpha
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
            plain = sum(p.numel() for p in model.parameters())
            lora = LoraConfig(
                r=r,
                lora_alpha=alpha,
                target_modules=target_modules,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
            )
            peft_model = get_peft_model(model, lora)
    trainable, total = peft_model.get_nb_trainable_parameters()

    # What PEFT resolved and wrapped, and an independent check of its count:
    # each wrapped layer adds A (r x in) and B (out x r).
    resolved = peft_model.peft_config["default"].target_modules
    resolved = sorted(resolved) if not isinstance(resolved, str) else [resolved]
    wrapped, by_hand = [], 0
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            wrapped.append(name)
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            by_hand += a.numel() + b.numel()
            assert a.shape[0] == r and b.shape[1] == r, (name, a.shape, b.shape)
    assert by_hand == trainable, (fixture, by_hand, trainable)
    assert total == plain + trainable, (fixture, total, plain, trainable)
    # Per-layer suffixes of the wrapped modules, e.g. "self_attn.q_proj" (layer index dropped).
    suffixes = sorted({re.sub(r"^.*?\.\d+\.", "", n) for n in wrapped})
    messages = sorted({str(w.message) for w in caught if "peft" in (w.filename or "")})
    return {
        "fixture": fixture,
        "model_type": config.model_type,
        "rank": r,
        "lora_alpha": alpha,
        "targets": tessera,
        "peft_target_modules": resolved,
        "wrapped_modules": len(wrapped),
        "wrapped_suffixes": suffixes,
        "trainable": trainable,
        "all": total,
        "frozen": total - trainable,
        "plain": plain,
        "tied_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "peft_warnings": messages,
    }


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(v)


def toml_case(c):
    lines = ["[[case]]"]
    for k, v in c.items():
        lines.append(f"{k} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


def versions():
    v = lambda p: importlib.metadata.version(p)
    return (
        f"python {platform.python_version()}, torch {v('torch')}, transformers {v('transformers')}, "
        f"peft {v('peft')}, bitsandbytes {v('bitsandbytes')}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", help="directory name under tests/fixtures/hf/")
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--alpha", type=int, default=None, help="lora_alpha (default 2*r; counts do not depend on it)")
    ap.add_argument("--targets", default=ALL7, help=f"Tessera targets, comma-separated, or all-linear/default (default {ALL7})")
    ap.add_argument("--all", action="store_true", help="every case of the reference file")
    ap.add_argument("--out", help="write the TOML here instead of stdout")
    args = ap.parse_args()
    if args.all == bool(args.fixture):
        ap.error("give exactly one of --fixture or --all")

    cases = CASES if args.all else [(args.fixture, args.r, args.targets)]
    out = [
        "# Reference LoRA parameter counts, computed by PEFT's own get_nb_trainable_parameters() on",
        "# transformers' own model classes (meta device), independently of Tessera. Produced by:",
        "#   " + " ".join([sys.executable, "scripts/peft_counts.py"] + sys.argv[1:]),
        "# with " + versions() + ".",
        "# frozen = all - trainable; plain = sum(p.numel() for p in model.parameters()) before PEFT",
        "# (tied tensors once); all == plain + trainable is asserted, and trainable is asserted equal to",
        "# the sum of the wrapped layers' lora_A and lora_B numel. lora_dropout = 0.0, task_type CAUSAL_LM.",
        "",
    ]
    for fixture, r, targets in cases:
        c = count(fixture, r, targets, args.alpha)
        out.append(toml_case(c))
        print(
            f"{fixture:12} r={r:<3} {','.join(c['targets']):22} trainable {c['trainable']:>12,}  "
            f"all {c['all']:>14,}  frozen {c['frozen']:>14,}  plain {c['plain']:>14,}",
            file=sys.stderr,
        )
    text = "\n".join(out)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
