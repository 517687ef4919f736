"""`tessera export --to lightning` snippets executed with Lightning's own code.

Usage: python check_exports_lightning.py [--results FILE] NAME PLAN.json SNIPPET.py [...] with a
Python that has torch, lightning, transformers and deepspeed (scripts/check-exports.sh runs it
with the engines venv). For each snippet: it is executed (runpy, not as __main__), which imports
Lightning and builds its strategy object; then `lightning.Trainer(**trainer_kwargs)` is built
from it (no fit: no model, no data, no process group), and what the Trainer and the strategy hold
is compared with the plan (derived from plan.json): the strategy's class, FSDP's sharding
strategy, CPU offload, wrapped and checkpointed layer classes and hybrid mesh, or the DeepSpeed
config dict's ZeRO stage, offload devices and NVMe path (and DeepSpeed's own
DeepSpeedZeroConfig of it); devices per node, nodes, world size, precision, gradient
accumulation (the plan's micro-batches per step) and clipping. The snippet with a sharding
strategy (a ZeRO stage, a precision) Lightning or DeepSpeed does not know must be refused.

There is no GPU here: Lightning's Trainer refuses a "gpu" accelerator without CUDA, so the check
answers CUDA's availability and device count (the plan's GPUs per node). Nothing runs on them.
"""

import os
import runpy
import sys
import tempfile
from unittest import mock

import lightning
import lightning.fabric.accelerators.cuda as fabric_cuda
import lightning.pytorch.accelerators.cuda as pl_cuda
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from check_exports_common import compare, launch, offload_devices, run, want_offload

print(f"lightning {lightning.__version__}")

PRECISION = {"default": "bf16-mixed", "megatron": "bf16-mixed", "mixed16": "bf16-mixed",
             "bf16": "bf16-true", "fp32": "32-true"}
NVME_PATH = "/local_nvme"  # the export's placeholder (docs/exports.md)


def layer_class(a):
    if a["position"] == "learned" and a["norm"] == "layernorm" and a["activation"] == "gelu":
        return "GPT2Block"
    if a.get("qkv_bias") and not a.get("bias"):
        return "Qwen2DecoderLayer"
    return "LlamaDecoderLayer"


def engine(p):
    off, to = p.get("offload", "none"), p.get("offload_to", "cpu")
    if p["zero_stage"] == 1 or off == "optimizer" or (off != "none" and to == "nvme"):
        return "DeepSpeedStrategy"
    return "FSDPStrategy" if p["zero_stage"] >= 2 else "DDPStrategy"


def build(path, gpus):
    """The snippet's strategy and the Trainer built from its trainer_kwargs."""
    g = runpy.run_path(path, run_name="tessera_check")
    with mock.patch.object(pl_cuda.CUDAAccelerator, "is_available", staticmethod(lambda: True)), \
            mock.patch.object(pl_cuda, "num_cuda_devices", lambda: gpus), \
            mock.patch.object(fabric_cuda, "num_cuda_devices", lambda: gpus):
        trainer = lightning.Trainer(**g["trainer_kwargs"], logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False)
    return g["strategy"], trainer


def check(name, plan, plan_path, export_path):
    m, p = plan["job"]["model"], plan["parallel"]
    L = launch(plan)
    gpus = plan["job"]["cluster"]["gpus_per_node"]
    strategy, trainer = build(export_path, gpus)
    off, to = p.get("offload", "none"), p.get("offload_to", "cpu")
    clip = m["optimizer"]["clip_grad"]
    got = {
        "strategy": type(strategy).__name__,
        "the Trainer's strategy is the snippet's": trainer.strategy is strategy,
        "devices per node": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "world size": trainer.world_size,
        "precision": trainer.precision,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
    }
    want = {
        "strategy": engine(p),
        "the Trainer's strategy is the snippet's": True,
        "devices per node": L["per_node"][0],
        "num_nodes": L["nodes"],
        "world size": L["world"],
        "precision": PRECISION[m["training"]["precision"]],
        "accumulate_grad_batches": p["microbatches"],
        "gradient_clip_val": clip if clip > 0 else None,
    }
    if engine(p) == "FSDPStrategy":
        cls = layer_class(m["architecture"])
        kw = strategy.kwargs
        wrapped = getattr(kw.get("auto_wrap_policy"), "_module_classes", None)
        ckpt = getattr(strategy, "_activation_checkpointing_kwargs", {}).get("auto_wrap_policy")
        ckpt = getattr(ckpt, "_module_classes", None)
        hybrid = p["hybrid_shard"]
        got.update({
            "sharding_strategy": strategy.sharding_strategy.name,
            "cpu_offload.offload_params": strategy.cpu_offload.offload_params,
            "auto_wrap_policy classes": sorted(c.__name__ for c in wrapped or []),
            "activation checkpointing classes": sorted(c.__name__ for c in ckpt or []),
            "device_mesh": kw.get("device_mesh"),
        })
        shard = min(max(gpus, 1), p["dp"])
        want.update({
            "sharding_strategy": {(3, False): "FULL_SHARD", (3, True): "HYBRID_SHARD",
                                  (2, False): "SHARD_GRAD_OP", (2, True): "_HYBRID_SHARD_ZERO2"}[(p["zero_stage"], hybrid)],
            "cpu_offload.offload_params": off == "params",
            "auto_wrap_policy classes": [cls],
            "activation checkpointing classes": [cls] if p["recompute"] == "full" else [],
            "device_mesh": (p["dp"] // shard, shard) if hybrid else None,
        })
    elif engine(p) == "DeepSpeedStrategy":
        z = strategy.config["zero_optimization"]
        zc = DeepSpeedZeroConfig(**z)
        device = lambda on: to if on else "none"  # noqa: E731
        got.update({
            "zero_optimization.stage": z["stage"],
            "offload_optimizer.device": z.get("offload_optimizer", {}).get("device", "none"),
            "offload_param.device": z.get("offload_param", {}).get("device", "none"),
            "DeepSpeedZeroConfig stage": int(zc.stage),
            "DeepSpeedZeroConfig offload devices": offload_devices(zc),
        })
        want.update({
            "zero_optimization.stage": p["zero_stage"],
            "offload_optimizer.device": device(off != "none"),
            "offload_param.device": device(off == "params"),
            "DeepSpeedZeroConfig stage": p["zero_stage"],
            "DeepSpeedZeroConfig offload devices": want_offload(plan),
        })
        if off != "none" and to == "nvme":
            got["offload_optimizer.nvme_path"] = str(zc.offload_optimizer.nvme_path)
            want["offload_optimizer.nvme_path"] = NVME_PATH
    compare("Lightning", got, want)

    # The check can fail: a sharding strategy, ZeRO stage or precision Lightning does not know.
    text = open(export_path).read()
    if engine(p) == "FSDPStrategy":
        broken = text.replace('sharding_strategy="', 'sharding_strategy="NOT_', 1)
    elif engine(p) == "DeepSpeedStrategy":
        broken = text.replace(f"    stage={p['zero_stage']},\n", "    stage=4,\n", 1)
    else:
        # DDPStrategy passes unknown keywords on to DistributedDataParallel at fit time: the
        # Trainer's precision is what its constructor checks.
        broken = text.replace('    precision="', '    precision="x', 1)
    assert broken != text, "the broken variant did not change the snippet"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(broken)
    try:
        s, _ = build(f.name, gpus)
        if engine(p) == "DeepSpeedStrategy":
            DeepSpeedZeroConfig(**s.config["zero_optimization"])
    except (KeyError, ValueError, TypeError) as e:
        print(f"  the broken variant is refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    else:
        raise AssertionError("Lightning accepted the broken variant")
    finally:
        os.unlink(f.name)
    print(f"ok: Lightning {lightning.__version__} builds the Trainer of {name} as the plan")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run("lightning", check)
