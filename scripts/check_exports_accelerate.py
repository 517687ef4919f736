"""`tessera export --to accelerate` configs read by Hugging Face Accelerate's own code.

Usage: python check_exports_accelerate.py [--results FILE] NAME PLAN.json EXPORT [...] with a
Python that has torch, accelerate, deepspeed and peft (scripts/check-exports.sh runs it with the
engines venv). EXPORT is the YAML file, or for an adapter plan the folder holding
accelerate_config.yaml and PEFT's adapter_config.json. For each export:
- `ClusterConfig.from_yaml_file` loads it (an unknown key is an error there);
- `accelerate launch --config_file EXPORT train.py` is parsed by accelerate's own parser and
  `_validate_launch_command` (which fills the arguments from the config), and the environment
  its launcher gives the processes is built by `prepare_multi_gpu_env` (DDP, FSDP) or
  `prepare_deepspeed_cmd_env` (DeepSpeed), as `launch_command` does;
- in that environment the plugin the processes build is constructed:
  `FullyShardedDataParallelPlugin()` or `DeepSpeedPlugin()`, and its reading is compared with the
  plan (derived from plan.json): processes, machines, mixed precision, the engine, FSDP's sharding
  strategy, CPU offload, wrapped layer class and activation checkpointing, or DeepSpeed's ZeRO
  stage and offload devices (and DeepSpeed's own DeepSpeedZeroConfig of the plugin's section),
  accumulation and clipping;
- for an adapter plan the LoraConfig is checked as the peft column checks it;
- the same config with a sharding strategy or ZeRO stage accelerate does not know is refused.
"""

import copy
import os
import sys
import tempfile
from unittest import mock

import accelerate
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from check_exports_common import compare, launch, offload_devices, run, want_offload

print(f"accelerate {accelerate.__version__}")

MIXED = {"default": "bf16", "megatron": "bf16", "mixed16": "bf16", "fp32": "no"}


def layer_class(a):
    """transformers' decoder layer of the architecture (as check_exports_peft.py builds it)."""
    if a["position"] == "learned" and a["norm"] == "layernorm" and a["activation"] == "gelu":
        return "GPT2Block"
    if a.get("qkv_bias") and not a.get("bias"):
        return "Qwen2DecoderLayer"
    return "LlamaDecoderLayer"


def engine(p):
    """The engine the plan needs: DeepSpeed for ZeRO-1, optimizer-only or NVMe offload (FSDP has
    none of them); FSDP for ZeRO-2/3; DDP for ZeRO-0."""
    off, to = p.get("offload", "none"), p.get("offload_to", "cpu")
    if p["zero_stage"] == 1 or off == "optimizer" or (off != "none" and to == "nvme"):
        return "DEEPSPEED"
    return "FSDP" if p["zero_stage"] >= 2 else ("NO" if p["world"] == 1 else "MULTI_GPU")


def launcher_env(config_path):
    """The environment `accelerate launch --config_file CONFIG train.py` gives each process."""
    args = launch_command_parser().parse_args(["--config_file", config_path, "train.py"])
    # The launcher reads the GPU count when the config does not give it; it does.
    with mock.patch("torch.cuda.device_count", return_value=8):
        args, defaults, mp_from_config_flag = _validate_launch_command(args)
    if args.use_deepspeed:
        # As launch_command does before deepspeed_launcher.
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config_flag:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args, env


def plugin_in(env, cls):
    """The plugin a process builds in `env`. FSDP's asks for the current GPU (to place the
    modules it syncs from rank 0): there is none here, so the check answers GPU 0."""
    with mock.patch.dict(os.environ, env, clear=False), \
            mock.patch("accelerate.utils.dataclasses.is_cuda_available", return_value=True), \
            mock.patch("torch.cuda.current_device", return_value=0):
        return cls()


def check(name, plan, plan_path, export_path):
    m, p = plan["job"]["model"], plan["parallel"]
    adapters = m["training"].get("method", "full") in ("lora", "qlora")
    config_path = os.path.join(export_path, "accelerate_config.yaml") if adapters else export_path
    c = ClusterConfig.from_yaml_file(config_path)
    args, env = launcher_env(config_path)
    L = launch(plan)
    off, to = p.get("offload", "none"), p.get("offload_to", "cpu")
    want_engine = engine(p)
    got = {
        "distributed_type": c.distributed_type.value,
        "num_processes": c.num_processes,
        "num_machines": c.num_machines,
        "processes per machine": c.num_processes // c.num_machines,
        "mixed_precision (launcher)": env.get("ACCELERATE_MIXED_PRECISION"),
    }
    want = {
        "distributed_type": want_engine,
        "num_processes": L["world"],
        "num_machines": L["nodes"],
        "processes per machine": L["per_node"][0],
        "mixed_precision (launcher)": MIXED[m["training"]["precision"]],
    }
    if want_engine == "FSDP":
        f = plugin_in(env, FullyShardedDataParallelPlugin)
        hybrid = p["hybrid_shard"]
        got.update({
            "sharding_strategy": f.sharding_strategy.name,
            "cpu_offload.offload_params": f.cpu_offload.offload_params,
            "auto_wrap_policy": f.auto_wrap_policy.__name__ if callable(f.auto_wrap_policy) else str(f.auto_wrap_policy),
            "transformer_cls_names_to_wrap": list(f.transformer_cls_names_to_wrap or []),
            "activation_checkpointing": f.activation_checkpointing,
        })
        want.update({
            "sharding_strategy": {(3, False): "FULL_SHARD", (3, True): "HYBRID_SHARD",
                                  (2, False): "SHARD_GRAD_OP", (2, True): "_HYBRID_SHARD_ZERO2"}[(p["zero_stage"], hybrid)],
            "cpu_offload.offload_params": off == "params",
            "auto_wrap_policy": "transformer_auto_wrap_policy",
            "transformer_cls_names_to_wrap": [layer_class(m["architecture"])],
            "activation_checkpointing": p["recompute"] == "full",
        })
    elif want_engine == "DEEPSPEED":
        d = plugin_in(env, DeepSpeedPlugin)
        z = d.deepspeed_config["zero_optimization"]
        device = lambda on: to if on else "none"  # noqa: E731
        got.update({
            "zero stage": z["stage"],
            "offload_optimizer.device": z.get("offload_optimizer", {}).get("device", "none"),
            "offload_param.device": z.get("offload_param", {}).get("device", "none"),
            "gradient_accumulation_steps": d.deepspeed_config["gradient_accumulation_steps"],
            "gradient_clipping": float(d.deepspeed_config["gradient_clipping"]),
        })
        want.update({
            "zero stage": p["zero_stage"],
            "offload_optimizer.device": device(off != "none"),
            "offload_param.device": device(off == "params"),
            "gradient_accumulation_steps": p["microbatches"],
            "gradient_clipping": float(m["optimizer"]["clip_grad"]),
        })
        # DeepSpeed's own model of the section (what deepspeed.initialize validates).
        zc = DeepSpeedZeroConfig(**z)
        got.update({
            "DeepSpeedZeroConfig stage": int(zc.stage),
            "DeepSpeedZeroConfig offload devices": offload_devices(zc),
        })
        want.update({
            "DeepSpeedZeroConfig stage": p["zero_stage"],
            "DeepSpeedZeroConfig offload devices": want_offload(plan),
        })
    compare("accelerate", got, want)

    if adapters:
        from check_exports_peft import check as check_lora
        check_lora(name, plan, plan_path, os.path.join(export_path, "adapter_config.json"))

    # The check can fail: a sharding strategy or ZeRO stage accelerate does not know is refused.
    raw = yaml.safe_load(open(config_path))
    broken = copy.deepcopy(raw)
    if want_engine == "FSDP":
        broken["fsdp_config"]["fsdp_sharding_strategy"] = "FULL_SHARDED"
        plugin = FullyShardedDataParallelPlugin
    elif want_engine == "DEEPSPEED":
        broken["deepspeed_config"]["offload_optimizer_device"] = "gpu"
        plugin = DeepSpeedPlugin
    else:
        broken["distributed_type"] = "MULTI_GPUS"
        plugin = None
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(broken, f)
    try:
        _, env = launcher_env(f.name)
        if plugin is not None:
            built = plugin_in(env, plugin)
            if plugin is DeepSpeedPlugin:
                DeepSpeedZeroConfig(**built.deepspeed_config["zero_optimization"])
    except (ValueError, KeyError, AssertionError) as e:
        print(f"  the broken variant is refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    else:
        raise AssertionError("accelerate accepted the broken variant")
    finally:
        os.unlink(f.name)
    print(f"ok: accelerate {accelerate.__version__} reads the config of {name} as the plan")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run("accelerate", check)
