"""`tessera export --to deepspeed` configs read by DeepSpeed's own DeepSpeedConfig.

Usage: python check_exports_deepspeed.py [--results FILE] NAME PLAN.json CONFIG.json [...] with a
Python that has torch and deepspeed (scripts/check-exports.sh runs it). For each config: every
key must be one DeepSpeed reads, DeepSpeedConfig must accept it for the plan's DP degree, and its
reading must be the plan's (batch, micro-batch, accumulation steps, ZeRO stage and hpZ, bf16,
activation checkpointing, offload devices, NVMe folder and cpu_checkpointing), derived from plan.json; the same config with train_batch_size + 1 must
be refused. Where the export's stderr was saved beside the config (CONFIG.stderr), the
Megatron-DeepSpeed flags printed there must be the plan's degrees, ZeRO stage, SP and recompute.
"""

import copy
import os
import re
import tempfile

import deepspeed
from deepspeed.runtime import constants
from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT, ACT_CHKPT_DEFAULT
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

from check_exports_common import compare, load, offload_devices, run, want_offload

NVME_PATH = "/local_nvme"  # the export's placeholder (docs/exports.md)

# DeepSpeedConfig first asks deepspeed.comm for the rank; with no backend it silently takes
# world size 1 and never asks the mpu. So: a real one-process gloo group, and each plan's DP
# from an mpu, as Megatron-DeepSpeed passes its own.
deepspeed.init_distributed("gloo", auto_mpi_discovery=False,
                           init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
print(f"DeepSpeed {deepspeed.__version__}")


class Mpu:
    """What DeepSpeed asks a model-parallel unit, answered with the plan's degrees."""

    def __init__(self, p):
        self.p = p

    def get_data_parallel_world_size(self):
        return self.p["dp"]

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return self.p["tp"] * self.p["pp"]

    def get_model_parallel_rank(self):
        return 0


def check(name, plan, plan_path, config_path):
    p = plan["parallel"]
    config = load(config_path)
    # DeepSpeed ignores top-level and activation-checkpointing keys it does not know (its
    # zero_optimization and bf16 sections are pydantic models that reject them): ours must be
    # names DeepSpeed reads.
    known = {v for v in vars(constants).values() if isinstance(v, str)} | {ZERO_OPTIMIZATION, ACT_CHKPT}
    unknown = [k for k in config if k not in known]
    unknown += [f"{ACT_CHKPT}.{k}" for k in config.get(ACT_CHKPT, {}) if k not in ACT_CHKPT_DEFAULT]
    assert not unknown, f"keys DeepSpeed does not read: {unknown}"

    c = DeepSpeedConfig(config_path, mpu=Mpu(p))
    got = {
        "data-parallel world size": c.world_size,
        "train_batch_size": c.train_batch_size,
        "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": c.gradient_accumulation_steps,
        "zero stage": int(c.zero_optimization_stage),
        "zero_hpz_partition_size": c.zero_config.zero_hpz_partition_size,
        "bf16": c.bfloat16_config.enabled,
        "fp16": c.float16_config.enabled,
        # The config's section configures DeepSpeed's checkpointing; Megatron-DeepSpeed turns
        # it on with --checkpoint-activations (below): present exactly with full recompute.
        "activation_checkpointing section": ACT_CHKPT in config,
        # ZeRO-Offload / ZeRO-Infinity, as DeepSpeed's own offload config models read them.
        "offload devices (optimizer, param)": offload_devices(c.zero_config),
        "offload nvme_path": sorted({str(s.nvme_path) for s in (c.zero_config.offload_optimizer,
                                                                c.zero_config.offload_param) if s and s.nvme_path}),
        "offload pin_memory": sorted({s.pin_memory for s in (c.zero_config.offload_optimizer,
                                                             c.zero_config.offload_param) if s}),
        "cpu_checkpointing": bool(c.activation_checkpointing_config.cpu_checkpointing),
    }
    want = {
        "data-parallel world size": p["dp"],
        "train_batch_size": plan["job"]["model"]["training"]["global_batch"],
        "train_micro_batch_size_per_gpu": p["micro_batch"],
        "gradient_accumulation_steps": p["microbatches"],
        "zero stage": p["zero_stage"],
        "zero_hpz_partition_size": 1,  # hpZ is not the plan's hybrid sharding
        "bf16": True,
        "fp16": False,
        "activation_checkpointing section": p["recompute"] == "full",
        "offload devices (optimizer, param)": want_offload(plan),
        "offload nvme_path": [NVME_PATH] if "nvme" in want_offload(plan) else [],
        "offload pin_memory": [True] if p.get("offload", "none") != "none" else [],
        "cpu_checkpointing": p.get("offload_activations", False),
    }
    stderr = config_path + ".stderr"
    if os.path.exists(stderr):
        m = re.search(r"^Megatron-DeepSpeed flags the config cannot hold: (.*)$", open(stderr).read(), re.M)
        assert m, f"no Megatron-DeepSpeed flags in {stderr}"
        words = m.group(1).split()
        value = lambda flag: int(words[words.index(flag) + 1]) if flag in words else None  # noqa: E731
        got.update({
            "--tensor-model-parallel-size": value("--tensor-model-parallel-size"),
            "--pipeline-model-parallel-size": value("--pipeline-model-parallel-size"),
            "--zero-stage": value("--zero-stage"),
            "--sequence-parallel": "--sequence-parallel" in words,
            "--checkpoint-activations": "--checkpoint-activations" in words,
            "--deepspeed-activation-checkpointing": "--deepspeed-activation-checkpointing" in words,
        })
        want.update({
            "--tensor-model-parallel-size": p["tp"],
            "--pipeline-model-parallel-size": p["pp"],
            "--zero-stage": p["zero_stage"],
            "--sequence-parallel": p["sequence_parallel"],
            "--checkpoint-activations": p["recompute"] == "full",
            "--deepspeed-activation-checkpointing": p["recompute"] == "full",
        })
    compare("DeepSpeed", got, want)

    # The check can fail: the same config with the batch off by one is refused.
    broken = copy.deepcopy(config)
    broken["train_batch_size"] += 1
    try:
        DeepSpeedConfig(broken, mpu=Mpu(p))
    except AssertionError as e:
        print(f"  train_batch_size + 1 refused: {e}")
    else:
        raise AssertionError("DeepSpeedConfig accepted train_batch_size + 1")
    print(f"ok: DeepSpeed {deepspeed.__version__} accepts the config of {name}")


run("deepspeed", check)
