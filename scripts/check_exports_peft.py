"""`tessera export --to peft` configs read by Hugging Face PEFT's own code.

Usage: python check_exports_peft.py [--results FILE] NAME PLAN.json ADAPTER_CONFIG.json [...] with a
Python that has torch, transformers and peft (scripts/check-exports.sh runs it with the engines
venv). For each export: PEFT's `LoraConfig.from_pretrained` loads it (as adapter_config.json in a
directory, as a trained adapter is saved) and must read the plan's rank, alpha, dropout and the
target modules of the model's family; the transformers model the plan's architecture describes is
built on the meta device (no weights), `get_peft_model` applies the config, and PEFT's trainable
count must equal r · Σ (in + out) over the targets × layers, computed here from plan.json alone;
the same config with a target the model does not have must be refused by PEFT.
"""

import copy
import os
import shutil
import tempfile

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model

from check_exports_common import compare, load, run

print(f"PEFT {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")

LLAMA = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
         "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
GPT2 = {"qkv": "c_attn", "o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}


def family(a):
    if a["position"] == "rope" and a["norm"] == "rmsnorm" and a["activation"] == "swiglu":
        return "llama"
    if a["position"] == "learned" and a["norm"] == "layernorm" and a["activation"] == "gelu":
        return "gpt"
    raise AssertionError(f"no transformers model for this architecture: {a}")


def hf_config(a):
    """The transformers config of the plan's architecture (Llama's, or Qwen2's for Q/K/V biases;
    GPT-2's)."""
    if family(a) == "gpt":
        return transformers.GPT2Config(
            vocab_size=a["vocab"], n_positions=a["max_positions"], n_embd=a["hidden"],
            n_layer=a["layers"], n_head=a["heads"], n_inner=a["ffn_hidden"],
            layer_norm_epsilon=a.get("norm_eps", 1e-5), tie_word_embeddings=a["tied_embeddings"])
    common = dict(
        vocab_size=a["vocab"], hidden_size=a["hidden"], intermediate_size=a["ffn_hidden"],
        num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
        num_key_value_heads=a["kv_heads"], head_dim=a["head_dim"],
        rms_norm_eps=a.get("norm_eps", 1e-5), tie_word_embeddings=a["tied_embeddings"])
    if a.get("qkv_bias") and not a.get("bias"):
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, attention_bias=bool(a.get("bias")), mlp_bias=bool(a.get("bias")))


def shape(a, t):
    """(in, out) features of target t, from the architecture's numbers."""
    h, q, kv, f = a["hidden"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"], a["ffn_hidden"]
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "qkv": (h, q + 2 * kv), "o": (q, h),
            "gate": (h, f), "up": (h, f), "down": (f, h)}[t]


def check(name, plan, plan_path, export_path):
    m = plan["job"]["model"]
    a, lora = m["architecture"], m["lora"]
    names = GPT2 if family(a) == "gpt" else LLAMA
    d = tempfile.mkdtemp()
    try:
        shutil.copy(export_path, os.path.join(d, "adapter_config.json"))
        c = LoraConfig.from_pretrained(d)
    finally:
        shutil.rmtree(d)
    config = hf_config(a)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    pm = get_peft_model(model, c)
    trainable, total = pm.get_nb_trainable_parameters()
    expected = lora["rank"] * sum(sum(shape(a, t)) for t in lora["targets"]) * a["layers"]
    base = total - trainable
    adapted = sorted({n.rsplit(".", 1)[0].rsplit(".lora_A", 1)[0] for n, _ in pm.named_parameters()
                      if "lora_A" in n})
    got = {
        "peft_type": str(c.peft_type.value if hasattr(c.peft_type, "value") else c.peft_type),
        "task_type": str(c.task_type.value if hasattr(c.task_type, "value") else c.task_type),
        "r": c.r,
        "lora_alpha": c.lora_alpha,
        "lora_dropout": c.lora_dropout,
        "target_modules": sorted(c.target_modules),
        "bias": c.bias,
        "adapted linears": len(adapted),
        "trainable (PEFT's count)": trainable,
    }
    want = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(names[t] for t in lora["targets"]),
        "bias": "none",
        "adapted linears": len(lora["targets"]) * a["layers"],
        "trainable (PEFT's count)": expected,
    }
    print(f"  model: {type(model).__name__} on meta, {base} frozen parameters")
    compare("PEFT", got, want)

    # The check can fail: a target module the model does not have is refused by PEFT.
    broken = copy.deepcopy(load(export_path))
    broken["target_modules"] = ["no_such_proj"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        get_peft_model(model, LoraConfig(**{k: v for k, v in broken.items()
                                            if k not in ("peft_type", "base_model_name_or_path")}))
    except ValueError as e:
        print(f"  target_modules = ['no_such_proj'] refused: {str(e).splitlines()[0][:100]}")
    else:
        raise AssertionError("PEFT accepted a target module the model does not have")


if __name__ == "__main__":
    run("peft", check)
