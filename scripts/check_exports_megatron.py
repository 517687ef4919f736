"""`tessera export --to megatron` arguments read by Megatron-LM's own parser.

Usage: python check_exports_megatron.py PLAN.json ARG... with Megatron-LM's tree on PYTHONPATH
(scripts/check-exports.sh megatron passes the exported MEGATRON_ARGS). Fails unless
megatron.training.arguments.parse_args (unknown flags are errors) and validate_args accept the
arguments, Megatron's values are the plan's, core_transformer_config_from_args builds a
TransformerConfig, and a misspelt flag is refused. No data or tokenizer arguments are added:
neither function asks for them.
"""

import contextlib
import io
import json
import os
import sys

from check_exports_argparse import refuses_misspelt

plan = json.load(open(sys.argv[1]))
ours = sys.argv[2:]
p = plan["parallel"]
a = plan["job"]["model"]["architecture"]
tr = plan["job"]["model"]["training"]
# What torchrun and the launch environment give every rank: the plan's GPU count, and (TP > 1
# on GPUs before Blackwell) CUDA_DEVICE_MAX_CONNECTIONS=1, which validate_args requires.
os.environ.update(WORLD_SIZE=str(p["world"]), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")

import megatron.training.arguments as ma  # noqa: E402

sys.argv = ["pretrain_gpt.py", *ours]
args = ma.parse_args(ignore_unknown_args=False)

# validate_args asks the GPU for its architecture; there is none here: the plan's device's.
device = plan["job"]["cluster"]["device"]["name"]
arch = next(v for k, v in {"A100": 8, "H100": 9, "H200": 9, "B200": 10}.items() if device.startswith(k))
ma.get_device_arch_version = lambda: arch
with contextlib.redirect_stdout(io.StringIO()) as log:  # all of args follows its own lines
    ma.validate_args(args)
print(log.getvalue().split("-" * 24)[0], end="")

stage_layers = [c["layers"][1] - c["layers"][0] for s in plan["stages"] for c in s["chunks"]]
even = len(set(stage_layers)) == 1
want = {
    "num_layers": a["layers"],
    "hidden_size": a["hidden"],
    "num_attention_heads": a["heads"],
    "num_query_groups": a["kv_heads"],
    "kv_channels": a["head_dim"],
    "ffn_hidden_size": a["ffn_hidden"],
    "swiglu": a["activation"] == "swiglu",
    "normalization": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[a["norm"]],
    "position_embedding_type": {"learned": "learned_absolute", "rope": "rope"}[a["position"]],
    "untie_embeddings_and_output_weights": not a["tied_embeddings"],
    "add_bias_linear": a["bias"],
    "seq_length": tr["seq_len"],
    "attention_dropout": tr["dropout"],
    "hidden_dropout": tr["dropout"],
    "make_vocab_size_divisible_by": a["vocab_divisible_by"],
    "data_parallel_size": p["dp"],
    "tensor_model_parallel_size": p["tp"],
    "pipeline_model_parallel_size": p["pp"],
    "virtual_pipeline_model_parallel_size": p["virtual_stages"] if p["virtual_stages"] > 1 else None,
    "decoder_first_pipeline_num_layers": None if even else stage_layers[0],
    "decoder_last_pipeline_num_layers": None if even else stage_layers[-1],
    "sequence_parallel": p["sequence_parallel"],
    "micro_batch_size": p["micro_batch"],
    "global_batch_size": tr["global_batch"],
    "recompute_granularity": None if p["recompute"] == "none" else p["recompute"],
    "use_distributed_optimizer": p["zero_stage"] >= 1,
    "bf16": True,
}
got = {k: getattr(args, k) for k in want}
if not args.group_query_attention:  # Megatron ignores num_query_groups: one group per head
    got["num_query_groups"] = args.num_attention_heads
for k in want:
    print(f"  {k}: Megatron read {got[k]!r}, plan {want[k]!r}")
assert got == want, "Megatron-LM's reading differs from the plan"
print(f"  recompute: {args.recompute_method} {args.recompute_num_layers}")

# The model config Megatron builds from the arguments (TransformerConfig.__post_init__ has its
# own checks). Rope fusion is Transformer Engine's kernel, not installed here: off.
args.apply_rope_fusion = False
cfg = ma.core_transformer_config_from_args(args)
print(f"  TransformerConfig: {cfg.num_layers} layers, recompute {cfg.recompute_granularity}"
      f" {cfg.recompute_method} {cfg.recompute_num_layers}")

# The check can fail: a misspelt flag is refused.
refuses_misspelt(ma.parse_args, ours)
print(f"ok: Megatron-LM accepts the MEGATRON_ARGS for {plan['job']['model']['name']}")
