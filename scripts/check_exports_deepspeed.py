"""A `tessera export --to deepspeed` config read by DeepSpeed's own DeepSpeedConfig.

Usage: python check_exports_deepspeed.py CONFIG.json PLAN.json (scripts/check-exports.sh
deepspeed runs it with a Python that has torch and deepspeed). Fails (exit 1) unless DeepSpeed
accepts the config, reads back the plan's batch, ZeRO stage and precision, and rejects the
same config with train_batch_size off by one.
"""

import copy
import json
import sys
import tempfile

import deepspeed
from deepspeed.runtime import constants
from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT, ACT_CHKPT_DEFAULT
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

config_path, plan_path = sys.argv[1:3]
config = json.load(open(config_path))
plan = json.load(open(plan_path))
p = plan["parallel"]

# DeepSpeedConfig first asks deepspeed.comm for the rank; with no backend it silently takes
# world size 1 and never asks the mpu. So: a real one-process gloo group, and the plan's DP
# from an mpu, as Megatron-DeepSpeed passes its own.
store = tempfile.mkdtemp()
deepspeed.init_distributed("gloo", auto_mpi_discovery=False, init_method=f"file://{store}/store",
                           rank=0, world_size=1)


class Mpu:
    """What DeepSpeed asks a model-parallel unit, answered with the plan's degrees."""

    def get_data_parallel_world_size(self):
        return p["dp"]

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return p["tp"] * p["pp"]

    def get_model_parallel_rank(self):
        return 0


# DeepSpeed ignores top-level and activation-checkpointing keys it does not know (its
# zero_optimization and bf16 sections are pydantic models that reject them): ours must be
# names DeepSpeed reads.
known = {v for v in vars(constants).values() if isinstance(v, str)} | {ZERO_OPTIMIZATION, ACT_CHKPT}
unknown = [k for k in config if k not in known]
unknown += [f"{ACT_CHKPT}.{k}" for k in config.get(ACT_CHKPT, {}) if k not in ACT_CHKPT_DEFAULT]
assert not unknown, f"keys DeepSpeed does not read: {unknown}"

c = DeepSpeedConfig(config_path, mpu=Mpu())
got = {
    "data-parallel world size": c.world_size,
    "train_batch_size": c.train_batch_size,
    "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
    "gradient_accumulation_steps": c.gradient_accumulation_steps,
    "zero stage": int(c.zero_optimization_stage),
    "zero_hpz_partition_size": c.zero_config.zero_hpz_partition_size,
    "bf16": c.bfloat16_config.enabled,
    "fp16": c.float16_config.enabled,
}
want = {
    "data-parallel world size": p["dp"],
    "train_batch_size": plan["job"]["model"]["training"]["global_batch"],
    "train_micro_batch_size_per_gpu": p["micro_batch"],
    "gradient_accumulation_steps": p["microbatches"],
    "zero stage": p["zero_stage"],
    "zero_hpz_partition_size": plan["job"]["cluster"]["gpus_per_node"] if p["hybrid_shard"] else 1,
    "bf16": True,
    "fp16": False,
}
for key in want:
    print(f"  {key}: DeepSpeed read {got[key]}, plan {want[key]}")
assert got == want, "DeepSpeed's reading differs from the plan"
if p["recompute"] == "full":
    print(f"  activation_checkpointing: {vars(c.activation_checkpointing_config)}")

# The check can fail: the same config with the batch off by one is refused.
broken = copy.deepcopy(config)
broken["train_batch_size"] += 1
try:
    DeepSpeedConfig(broken, mpu=Mpu())
except AssertionError as e:
    print(f"  train_batch_size + 1 refused: {e}")
else:
    sys.exit("DeepSpeedConfig accepted train_batch_size + 1")
print(f"ok: DeepSpeed {deepspeed.__version__} accepts {config_path}")
