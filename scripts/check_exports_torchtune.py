"""`tessera export --to torchtune` recipe configs read by torchtune's own code (0.6.1).

Usage: python check_exports_torchtune.py [--results FILE] NAME PLAN.json CONFIG.yaml [...] with the
Python of scripts/check-exports-env.sh torchtune (torchtune, torch, torchao, bitsandbytes). For
each config:
- torchtune's recipe argument parser reads it as `tune run` does (TuneRecipeArgumentParser,
  _merge_yaml_and_cli_args); the recipe named in its header is in torchtune's recipe registry,
  distributed exactly when the plan has DP > 1; every key the recipe reads unconditionally
  (`cfg.KEY` in its source) is there; the keys left to the user are exactly OmegaConf's missing
  ones (output_dir, tokenizer.path, checkpointer.checkpoint_dir/checkpoint_files, dataset);
- torchtune's `config.instantiate` builds the model on the meta device (no weights), and its
  layers, heads, KV heads, dims, vocabulary, MLP width and RoPE base are the plan's; with
  adapters, each LoRA linear's rank, alpha and dropout and which linears carry one are the
  plan's, the base of a QLoRA plan is torchao's NF4, and after torchtune's
  set_trainable_params(model, get_adapter_params(model)) the trainable count equals
  r · Σ (in + out) × layers computed here from plan.json; a full model's count is the plan's;
- batch size, accumulation (global batch / (DP × micro-batch)), dtype, activation
  checkpointing, FSDP resharding and the optimizer (instantiated by torchtune: AdamW, or
  bitsandbytes' AdamW8bit for 8-bit states) with the plan's lr, betas, eps, weight decay, and the
  warm-up steps;
- the same model with an argument its builder does not take is refused by torchtune.
"""

import pathlib
import re

import torch
import torchao
import torchtune
from omegaconf import OmegaConf
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import config
from torchtune._recipe_registry import get_all_recipes
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _get_component_from_path, _merge_yaml_and_cli_args
from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params

from check_exports_common import compare, load, run

print(f"torchtune {torchtune.__version__}, torch {torch.__version__}, torchao {torchao.__version__}")
RECIPES = pathlib.Path(torchtune.__file__).resolve().parent.parent / "recipes"
# The user's keys, and the two that interpolate ${output_dir} (OmegaConf counts them missing too).
MISSING = {"output_dir", "tokenizer.path", "checkpointer.checkpoint_dir",
           "checkpointer.checkpoint_files", "dataset", "checkpointer.output_dir", "metric_logger.log_dir"}
TT = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "output_proj",
      "gate": "w1", "down": "w2", "up": "w3"}  # torchtune's FeedForward: w1 gate, w2 down, w3 up


def shape(a, t):
    h, q, kv, f = a["hidden"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"], a["ffn_hidden"]
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h),
            "gate": (h, f), "up": (h, f), "down": (f, h)}[t]


def parse(path):
    """The config as `tune run RECIPE --config PATH` hands it to the recipe."""
    yaml_args, cli = TuneRecipeArgumentParser().parse_known_args(["--config", path])
    return _merge_yaml_and_cli_args(yaml_args, cli)


def check(name, plan, plan_path, export_path):
    m, p = plan["job"]["model"], plan["parallel"]
    a, t, o = m["architecture"], m["training"], m["optimizer"]
    adapters = t.get("method", "full") != "full"
    cfg = parse(export_path)
    text = open(export_path).read()
    recipe = re.search(r"^# recipe: (\S+)$", text, re.M).group(1)
    registry = {r.name: r for r in get_all_recipes()}
    assert recipe in registry, f"{recipe} is not a torchtune recipe"
    source = (RECIPES / registry[recipe].file_path).read_text()
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())  # not comments
    needed = sorted(set(re.findall(r"\bcfg\.([a-z_]+)\b(?!\s*\()", code)))
    absent = [k for k in needed if k not in cfg.keys()]  # `in cfg` is False for ??? values
    assert not absent, f"{recipe} reads cfg.{absent}, which the config lacks"
    print(f"  {recipe} reads {needed}: all there")

    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    if adapters:
        set_trainable_params(model, get_adapter_params(model))
    trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    layer = model.layers[0]
    loras = {n: mod for n, mod in model.named_modules() if isinstance(mod, LoRALinear)}
    adapted0 = sorted(n.split(".")[-1] for n in loras if n.startswith("layers.0."))
    rope = layer.attn.pos_embeddings
    got = {
        "recipe": recipe,
        "missing (the user's)": sorted(OmegaConf.missing_keys(cfg)),
        "layers": len(model.layers),
        "heads": layer.attn.num_heads,
        "kv heads": layer.attn.num_kv_heads,
        "head_dim": layer.attn.head_dim,
        "embed_dim": layer.attn.embed_dim,
        "vocab": model.tok_embeddings.num_embeddings,
        "MLP width": layer.mlp.w1.out_dim if isinstance(layer.mlp.w1, LoRALinear) else layer.mlp.w1.out_features,
        "RoPE base": rope.base,
        "norm eps": layer.sa_norm.eps,
        "tokenizer.max_seq_len": cfg.tokenizer.max_seq_len,
        "trainable": trainable,
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "dtype": cfg.dtype,
        "enable_activation_checkpointing": cfg.enable_activation_checkpointing,
        "fsdp_reshard_after_forward": cfg.get("fsdp_reshard_after_forward", None),
        # The recipes read it as cfg.get("fsdp_cpu_offload", False).
        "fsdp_cpu_offload": cfg.get("fsdp_cpu_offload", False),
        "enable_activation_offloading": cfg.enable_activation_offloading,
    }
    dp = p["dp"]
    want = {
        "recipe": ("lora" if adapters else "full") + "_finetune_" + ("distributed" if dp > 1 else "single_device"),
        "missing (the user's)": sorted(MISSING),
        "layers": a["layers"],
        "heads": a["heads"],
        "kv heads": a["kv_heads"],
        "head_dim": a["head_dim"],
        "embed_dim": a["hidden"],
        "vocab": a["vocab"],
        "MLP width": a["ffn_hidden"],
        "RoPE base": a["rope_theta"],
        "norm eps": a["norm_eps"],
        "tokenizer.max_seq_len": t["seq_len"],
        "trainable": plan["job"]["parameters"],
        "batch_size": p["micro_batch"],
        "gradient_accumulation_steps": t["global_batch"] // (dp * p["micro_batch"]),
        "dtype": {"bf16": "bf16", "fp32": "fp32"}[t["precision"]],
        "enable_activation_checkpointing": p["recompute"] == "full",
        "fsdp_reshard_after_forward": (p["zero_stage"] == 3) if dp > 1 else None,
        # FSDP2's CPU offload (weights, gradients, optimizer states): the plan's params offload.
        "fsdp_cpu_offload": p.get("offload", "none") == "params",
        "enable_activation_offloading": p.get("offload_activations", False),
    }
    assert registry[recipe].supports_distributed == (dp > 1), recipe
    if a.get("rope_scaling"):
        got["RoPE scale_factor"] = rope.scale_factor
        want["RoPE scale_factor"] = a["rope_scaling"]["factor"]
    if adapters:
        lora = m["lora"]
        got.update({
            "adapted linears": len(loras),
            "adapted in layer 0": adapted0,
            "LoRA rank": sorted({x.rank for x in loras.values()}),
            "LoRA alpha": sorted({x.alpha for x in loras.values()}),
            "LoRA dropout": sorted({x.dropout.p if isinstance(x.dropout, torch.nn.Dropout) else 0.0
                                    for x in loras.values()}),
            "NF4 base": sorted({isinstance(x.weight, NF4Tensor) for x in loras.values()}),
        })
        want.update({
            "trainable": lora["rank"] * sum(sum(shape(a, x)) for x in lora["targets"]) * a["layers"],
            "adapted linears": len(lora["targets"]) * a["layers"],
            "adapted in layer 0": sorted(TT[x] for x in lora["targets"]),
            "LoRA rank": [lora["rank"]],
            "LoRA alpha": [lora["alpha"]],
            "LoRA dropout": [lora["dropout"]],
            "NF4 base": [t["method"] == "qlora"],
        })
    # The optimizer, built by torchtune over a stand-in parameter.
    opt = config.instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(4, 4))])
    g = opt.param_groups[0]
    wd = 0.0 if o["decay_on"] == "none" else o["weight_decay"]
    got.update({"optimizer": type(opt).__name__, "lr": g["lr"], "betas": list(g["betas"]),
                "eps": g["eps"], "weight_decay": g["weight_decay"],
                "clip_grad_norm": cfg.clip_grad_norm})
    want.update({"optimizer": "AdamW8bit" if t.get("optimizer_states") == "8bit" else "AdamW",
                 "lr": o["lr"], "betas": [o["beta1"], o["beta2"]], "eps": o["eps"],
                 "weight_decay": wd, "clip_grad_norm": o["clip_grad"] or None})
    if "lr_scheduler" in cfg:
        assert _get_component_from_path(cfg.lr_scheduler._component_).__name__ == "get_cosine_schedule_with_warmup"
        got["num_warmup_steps"] = cfg.lr_scheduler.num_warmup_steps
        want["num_warmup_steps"] = m["schedule"]["warmup_steps"]
    compare("torchtune", got, want)

    # The check can fail: an argument the model builder does not take is refused.
    broken = OmegaConf.merge(cfg.model, {"not_an_argument": 1})
    try:
        with torch.device("meta"):
            config.instantiate(broken)
    except Exception as e:  # torchtune wraps the builder's TypeError
        print(f"  model.not_an_argument refused: {str(e).splitlines()[0][:100]}")
    else:
        raise AssertionError("torchtune built a model with an argument its builder does not take")


if __name__ == "__main__":
    run("torchtune", check)
