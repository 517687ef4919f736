"""A `tessera export --to torchtitan` job config read by torchtitan's own ConfigManager.

Usage: python check_exports_torchtitan.py CONFIG.toml PLAN.json (scripts/check-exports.sh
torchtitan runs it with a Python that has torch and torchtitan 0.2.x: 0.3 reads no TOML job
config). Fails (exit 1) unless torchtitan's parser (`--job.config_file`, as its run_train.sh
passes it) accepts the config, its values are the plan's, its ParallelDims accepts the degrees
for the plan's GPU count, the pipeline schedule and the split fit each other and name modules of
torchtitan's own Llama-3 8B, and the same config with one key misspelt is refused.
"""

import contextlib
import io
import json
import logging
import re
import sys
import tempfile

import torch
from importlib.metadata import version
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import Transformer, llama3_args

config_path, plan_path = sys.argv[1:3]
plan = json.load(open(plan_path))
p = plan["parallel"]
tr = plan["job"]["model"]["training"]
logging.getLogger().setLevel(logging.ERROR)  # torchtitan's warnings about the user's sections

c = ConfigManager().parse_args(["--job.config_file", config_path])
par, ac = c.parallelism, c.activation_checkpoint

# The plan's recompute in torchtitan's terms (docs/exports.md).
if p["recompute"] == "full":
    every = p.get("recompute_every", 1) or 1
    want_ac = ("full", None) if every == 1 else ("selective", str(every))
elif p["recompute"] == "selective":
    want_ac = ("selective", "op") if tr["attention"] == "flash" else ("none", None)
else:
    want_ac = ("none", None)
shard = p["zero_stage"] == 3
want = {
    "data_parallel_shard_degree": p["dp"] if shard else 1,  # plans here have no hybrid sharding
    "data_parallel_replicate_degree": 1 if shard else p["dp"],
    "tensor_parallel_degree": p["tp"],
    "pipeline_parallel_degree": p["pp"],
    "context_parallel_degree": 1,
    "pipeline_parallel_schedule": {"1f1b": "1F1B", "gpipe": "GPipe",
                                   "interleaved": "Interleaved1F1B"}[p["schedule"]],
    "pipeline_parallel_microbatch_size": p["micro_batch"],
    "local_batch_size": tr["global_batch"] // p["dp"],
    "seq_len": tr["seq_len"],
    "activation_checkpoint": want_ac,
}
got = {k: getattr(par, k) for k in want if hasattr(par, k)}
got.update(local_batch_size=c.training.local_batch_size, seq_len=c.training.seq_len,
           activation_checkpoint=(ac.mode, ac.selective_ac_option if ac.mode == "selective" else None))
for k in want:
    print(f"  {k}: torchtitan read {got[k]!r}, plan {want[k]!r}")
assert got == want, "torchtitan's reading differs from the plan"

# What torchtitan's trainer derives from these: the parallel dims for the plan's GPU count (an
# assertion unless their product is WORLD_SIZE), the global batch (training.global_batch_size
# is not written: torchtitan takes local × DP, one gradient-accumulation step) and the
# pipeline's micro-batches (local batch / microbatch size).
dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                    cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                    pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                    etp=par.expert_tensor_parallel_degree, world_size=p["world"])
batch_degree = dims.dp_replicate * dims.dp_shard
assert c.training.global_batch_size < 0, "the export sets no global_batch_size"
global_batch = c.training.local_batch_size * batch_degree
microbatches = c.training.local_batch_size // par.pipeline_parallel_microbatch_size
print(f"  ParallelDims: world {dims.world_size}, global batch {global_batch} (plan {tr['global_batch']}),"
      f" {microbatches} pipeline micro-batches (plan {p['microbatches']})")
assert (global_batch, microbatches) == (tr["global_batch"], p["microbatches"])

# The split: as many model parts as the schedule's stages (one a rank for a single-stage
# schedule), each module a module of torchtitan's own Llama-3 8B, all of them, in order.
if p["pp"] > 1:
    parts = par.module_fqns_per_model_part
    assert parts is not None, "a pipeline without the plan's split"
    single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
    assert len(parts) == p["pp"] * (1 if single else p["virtual_stages"]), (len(parts), single)
    with torch.device("meta"):
        model = Transformer(llama3_args["8B"])
    top = [n for n, _ in model.named_children() if n != "layers"]
    top[1:1] = [f"layers.{n}" for n, _ in model.layers.named_children()]
    assert [m for part in parts for m in part] == top, "the split does not name torchtitan's modules"
    sizes = [sum(m.startswith("layers.") for m in part) for part in parts]
    plan_sizes = [ch["layers"][1] - ch["layers"][0] for s in plan["stages"] for ch in s["chunks"]]
    print(f"  module_fqns_per_model_part: {len(parts)} parts of {sizes} layers (plan {plan_sizes}),"
          f" {len(top)} modules of torchtitan's llama3 8B")
    assert sizes == plan_sizes

# What torchtitan took by default for the sections the export leaves to the user.
print(f"  defaults: model {c.model.name} {c.model.flavor}, training.dtype {c.training.dtype},"
      f" mixed_precision_param {c.training.mixed_precision_param}, steps {c.training.steps},"
      f" dataset {c.training.dataset}")

# The check can fail: the same config with one key misspelt is refused.
text = open(config_path).read()
broken = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
broken.write(re.sub(r"^pipeline_parallel_degree =", "pipeline_parallel_degre =", text, flags=re.M))
broken.close()
try:
    with contextlib.redirect_stderr(io.StringIO()):
        ConfigManager().parse_args(["--job.config_file", broken.name])
except ValueError as e:
    print(f"  pipeline_parallel_degre refused: {str(e).splitlines()[0]}")
else:
    sys.exit("torchtitan accepted pipeline_parallel_degre")
print(f"ok: torchtitan {version('torchtitan')} accepts {config_path}")
