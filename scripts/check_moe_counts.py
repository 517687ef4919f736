#!/usr/bin/env python3
"""Counts the parameters of the MoE fixtures with transformers itself, independently of Tessera.

Each tests/fixtures/hf/<name>/config.json is built by transformers' own class
(AutoModelForCausalLM.from_config) on the meta device, so no weight is allocated, and its
tensors are counted: every parameter plus every persistent buffer (what a safetensors checkpoint
holds: DeepSeek-V3's router `e_score_correction_bias` is a buffer), tied tensors once. The
active count is the same sum with each MoE layer's routed experts cut to the top-k: a routed
expert's share of an experts tensor is its numel / num_experts.

The totals printed are the ones written into tests/presets.rs and tests/moe_specs.rs (the
Rust code computes them from its own formula; this script never reads it). Usage, with torch
and transformers (checked with torch 2.15.0 and transformers 5.24.0):

    python3 scripts/check_moe_counts.py
"""

import json
import pathlib
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ["mixtral-8x7b", "mixtral-8x22b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "deepseek-v3"]


def count(name):
    raw = json.loads((ROOT / "tests/fixtures/hf" / name / "config.json").read_text())
    model_type = raw.pop("model_type")
    raw.pop("auto_map", None)  # transformers' own class, not the repository's remote code
    config = AutoConfig.for_model(model_type, **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen, total = set(), 0
    for key, t in model.state_dict(keep_vars=True).items():
        ident = id(t)
        if ident in seen:
            continue
        seen.add(ident)
        total += t.numel()
    # The routed experts not chosen for a token: (E - k) experts' share of each experts tensor.
    k = config.num_experts_per_tok
    idle = 0
    for mod_name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if type(module).__name__.endswith("Experts") and experts:
            per_expert = sum(p.numel() for p in module.parameters(recurse=False)) // experts
            idle += (experts - k) * per_expert
    return total, total - idle


def main():
    for name in NAMES:
        total, active = count(name)
        print(f"{name:20} total {total:>18,}  active {active:>17,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
