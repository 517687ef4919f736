"""The flags `tessera export --to deepspeed` prints, read by Megatron-DeepSpeed's own parser.

Usage: python check_exports_megatron_deepspeed.py PLAN.json CONFIG.json ARG... with a
Megatron-DeepSpeed tree on PYTHONPATH (scripts/check-exports.sh megatron-deepspeed passes the
flags the export printed on stderr, the model-shape and batch flags of the Megatron export of
the same plan that Megatron-DeepSpeed also has, and `--deepspeed --deepspeed_config CONFIG`).
Fails unless megatron.arguments.parse_args (unknown flags are errors) and validate_args accept
them, the values are the plan's and the config's, and a misspelt flag is refused.
"""

import contextlib
import io
import json
import os
import sys

from check_exports_argparse import refuses_misspelt

plan_path, config_path, *ours = sys.argv[1:]
plan = json.load(open(plan_path))
config = json.load(open(config_path))
p = plan["parallel"]
tr = plan["job"]["model"]["training"]
# What the launcher gives every rank: the plan's GPU count.
os.environ.update(WORLD_SIZE=str(p["world"]), RANK="0", LOCAL_RANK="0")

import megatron.arguments as ma  # noqa: E402

sys.argv = ["pretrain_gpt.py", *ours]
args = ma.parse_args(ignore_unknown_args=False)
with contextlib.redirect_stdout(io.StringIO()):  # all of args, one a line
    ma.validate_args(args)

want = {
    "tensor_model_parallel_size": p["tp"],
    "pipeline_model_parallel_size": p["pp"],
    "data_parallel_size": p["dp"],
    "sequence_parallel": p["sequence_parallel"],
    "checkpoint_activations": p["recompute"] == "full",
    "deepspeed_activation_checkpointing": p["recompute"] == "full",
    "micro_batch_size": p["micro_batch"],
    "global_batch_size": tr["global_batch"],
    "bf16": True,
    "deepspeed": True,
    "ds_pipeline_enabled": True,
}
got = {k: getattr(args, k) for k in want}
for k in want:
    print(f"  {k}: Megatron-DeepSpeed read {got[k]!r}, plan {want[k]!r}")
assert got == want, "Megatron-DeepSpeed's reading differs from the plan"
# The batch Megatron-DeepSpeed hands DeepSpeed is the config's.
ds = (config["train_micro_batch_size_per_gpu"], config["train_batch_size"], config["bf16"]["enabled"])
assert (args.micro_batch_size, args.global_batch_size, args.bf16) == ds, (ds, args)
print(f"  config {args.deepspeed_config}: micro-batch {ds[0]}, global batch {ds[1]}, bf16 {ds[2]}"
      f" (Megatron-DeepSpeed's --zero-stage is {args.zero_stage}, the config's stage"
      f" {config['zero_optimization']['stage']})")

# Not in the printed flags: the plan's interleaving (DeepSpeed's pipeline engine, which
# Megatron-DeepSpeed uses with --deepspeed, has no interleaved schedule). Shown, not asserted.
print(f"  virtual stages: Megatron-DeepSpeed {args.virtual_pipeline_model_parallel_size},"
      f" plan {p['virtual_stages']} ({p['schedule']}); recompute_granularity {args.recompute_granularity}")

# The check can fail: a misspelt flag is refused.
refuses_misspelt(ma.parse_args, ours)
print(f"ok: Megatron-DeepSpeed accepts the flags for {plan['job']['model']['name']}")
