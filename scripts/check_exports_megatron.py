"""`tessera export --to megatron` arguments read by Megatron-LM's own code.

Usage: python check_exports_megatron.py [--results FILE] NAME PLAN.json EXPORT [...] with
Megatron-LM's `megatron` package importable: megatron-core's wheel, which ships
megatron/training since 0.14 (CI: 0.19.0), or a Megatron-LM tree on PYTHONPATH (MEGATRON_LM).
For each export: the MEGATRON_ARGS array as bash reads it (the file is sourced), then
megatron.training.arguments.parse_args (unknown flags are errors) and validate_args, and
core_transformer_config_from_args (a TransformerConfig, whose __post_init__ has its own
checks). Fails unless Megatron's values are the plan's (derived from plan.json, not from the
arguments): the model shape, the degrees, the micro-batches per step (Megatron's
num-microbatches calculator), the padded vocabulary, the layers Megatron builds on every
(virtual) pipeline stage (its own get_num_layers_to_build and get_transformer_layer_offset), the
layers it recomputes in each model chunk, and the nodes and processes per node of the torchrun
line in the file's comment; and unless a misspelt flag is refused. No data or tokenizer
arguments are added: neither function asks for them.
"""

import contextlib
import io
import os
import re
import subprocess
import sys

from check_exports_argparse import refuses_misspelt
from check_exports_common import chunks, compare, launch, recomputed_layers, run

# What torchrun and the launch environment give every rank (WORLD_SIZE is set per plan): TP > 1
# on GPUs before Blackwell needs CUDA_DEVICE_MAX_CONNECTIONS=1, which validate_args asserts.
os.environ.update(RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")

import megatron.training.arguments as ma  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.num_microbatches_calculator import (  # noqa: E402
    get_num_microbatches, init_num_microbatches_calculator, unset_num_microbatches_calculator)
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

try:
    from megatron.core.package_info import __version__ as MEGATRON_VERSION
except ImportError:
    MEGATRON_VERSION = "unknown"
print(f"Megatron-LM: megatron-core {MEGATRON_VERSION}, {os.path.dirname(ma.__file__)}")


def padded_vocab(vocab, args):
    """Megatron's padded vocabulary for the plan's model vocabulary (training/vocab_utils.py in
    megatron-core 0.19; the tokenizer module's _vocab_size_with_padding in older trees)."""
    try:
        from megatron.training.vocab_utils import calculate_padded_vocab_size
        return calculate_padded_vocab_size(vocab, args.make_vocab_size_divisible_by,
                                           args.tensor_model_parallel_size, logging_enabled=False)
    except ImportError:
        from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding
        with contextlib.redirect_stdout(io.StringIO()):
            return _vocab_size_with_padding(vocab, args, logging_enabled=False)


def read_array(path):
    """MEGATRON_ARGS as bash reads it: the export is sourced, and the array's words printed."""
    out = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\0" "${MEGATRON_ARGS[@]}"', "_", path],
                         check=True, capture_output=True, text=True).stdout
    return out.split("\0")[:-1]


def torchrun_line(text):
    """The launch in the file's comment: nodes, processes on each node, and whether
    CUDA_DEVICE_MAX_CONNECTIONS=1 is set."""
    m = re.search(r"^#.*?((?:CUDA_DEVICE_MAX_CONNECTIONS=1 )?)torchrun --nnodes (\d+) --nproc-per-node (\d+)"
                  r"(?: \(on the last node: (\d+)\))?", text, re.M)
    assert m, "no torchrun line in the comment"
    nodes, nproc = int(m.group(2)), int(m.group(3))
    last = int(m.group(4)) if m.group(4) else nproc
    return [nproc] * (nodes - 1) + [last], bool(m.group(1))


def check(name, plan, plan_path, path):
    p = plan["parallel"]
    a = plan["job"]["model"]["architecture"]
    tr = plan["job"]["model"]["training"]
    text = open(path).read()
    ours = read_array(path)

    # The launch: nodes and processes per node from the plan's world size (rank r on node
    # r // gpus_per_node), and CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1.
    per_node, max_conn = torchrun_line(text)
    compare("the torchrun line", {"processes per node": per_node, "CUDA_DEVICE_MAX_CONNECTIONS=1": max_conn},
            {"processes per node": launch(plan)["per_node"], "CUDA_DEVICE_MAX_CONNECTIONS=1": p["tp"] > 1})

    os.environ["WORLD_SIZE"] = str(p["world"])
    sys.argv = ["pretrain_gpt.py", *ours]
    args = ma.parse_args(ignore_unknown_args=False)
    # validate_args asks the GPU for its architecture; there is none here: the plan's device's.
    device = plan["job"]["cluster"]["device"]["name"]
    arch = next(v for k, v in {"A100": 8, "H100": 9, "H800": 9, "H200": 9, "B200": 10}.items() if device.startswith(k))
    ma.get_device_arch_version = lambda: arch
    with contextlib.redirect_stdout(io.StringIO()) as log:  # all of args follows its own lines
        ma.validate_args(args)
    print(log.getvalue().split("-" * 24)[0], end="")

    unset_num_microbatches_calculator()
    init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=args.global_batch_size,
                                     micro_batch_size=args.micro_batch_size,
                                     data_parallel_size=args.data_parallel_size,
                                     decrease_batch_size_if_needed=False)
    # The model config Megatron builds from the arguments (TransformerConfig.__post_init__ has
    # its own checks, and parses --pipeline-model-parallel-layout). Rope fusion is Transformer
    # Engine's kernel, not installed here: off.
    args.apply_rope_fusion = False
    cfg = ma.core_transformer_config_from_args(args)

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
        "qkv bias": a["bias"] or a["qkv_bias"],
        "seq_length": tr["seq_len"],
        "attention_dropout": tr["dropout"],
        "hidden_dropout": tr["dropout"],
        "padded vocabulary": plan["parallel"]["vocab"]["padded"],
        "data_parallel_size": p["dp"],
        "tensor_model_parallel_size": p["tp"],
        "pipeline_model_parallel_size": p["pp"],
        "virtual_pipeline_model_parallel_size": p["virtual_stages"] if p["virtual_stages"] > 1 else None,
        "sequence_parallel": p["sequence_parallel"],
        "micro_batch_size": p["micro_batch"],
        "global_batch_size": tr["global_batch"],
        "micro-batches per step": p["microbatches"],
        "recompute_granularity": None if p["recompute"] == "none" else p["recompute"],
        "use_distributed_optimizer": p["zero_stage"] >= 1,
        "bf16": True,
    }
    if a["position"] == "learned":
        want["max_position_embeddings"] = a["max_positions"]
    want["context_parallel_size"] = p.get("cp", 1)
    if p.get("cp", 1) > 1:
        want["cp_comm_type"] = [p.get("cp_comm", "p2p")]  # one type for every layer
    # Mixture of experts and MLA: the values Megatron reads, and the MoE layers its
    # TransformerConfig builds (moe_layer_freq: an int N, every N-th layer, or a 0/1 per layer).
    moe = a.get("moe")
    if moe:
        def is_moe(layer):
            if moe.get("moe_layers") is not None:
                return layer in moe["moe_layers"]
            first = moe["first_dense_layers"]
            return layer >= first and (layer - first) % max(moe["moe_layer_frequency"], 1) == 0
        want.update({
            "num_experts": moe["experts"],
            "moe_router_topk": moe["experts_per_token"],
            "moe_ffn_hidden_size": moe["moe_ffn_hidden"],
            "expert_model_parallel_size": p.get("ep", 1),
            "moe_aux_loss_coeff": moe["router_aux_loss_coef"],
            "moe_expert_capacity_factor": moe.get("capacity_factor"),
            "moe_shared_expert_intermediate_size": moe["shared_experts"] * moe["shared_expert_ffn_hidden"] or None,
            "moe_router_score_function": moe["router_scoring"],
            "moe_router_enable_expert_bias": moe["router_score_bias"],
            "moe_router_topk_scaling_factor": None if moe["routed_scaling_factor"] == 1 else moe["routed_scaling_factor"],
            "moe_router_num_groups": moe["expert_groups"] if moe["expert_groups"] > 1 else None,
            "moe_router_group_topk": moe["expert_groups_per_token"] if moe["expert_groups"] > 1 else None,
            "MoE layers": [layer for layer in range(a["layers"]) if is_moe(layer)],
        })
    mla = a.get("mla")
    if mla:
        want.update({
            "multi_latent_attention": True,
            "q_lora_rank": mla.get("q_lora_rank"),
            "kv_lora_rank": mla["kv_lora_rank"],
            "qk_head_dim": mla["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": mla["qk_rope_head_dim"],
            "v_head_dim": mla["v_head_dim"],
        })
    # The distributed optimizer's CPU offload (the plan's optimizer offload): all of it.
    offload = p.get("offload", "none") == "optimizer"
    want.update({
        "optimizer_cpu_offload": offload,
        "optimizer_offload_fraction": 1.0,
        "use_precision_aware_optimizer": offload,
    })
    # FP8 (training.fp8): Transformer Engine's format and recipe, as Megatron parsed them and as
    # its TransformerConfig keeps them; E4M3 everywhere for DeepSeek-V3's blockwise recipe.
    fp8 = tr.get("fp8", "none")
    want["fp8"] = None if fp8 == "none" else ("e4m3" if fp8 == "blockwise" else "hybrid")
    if fp8 != "none":
        want["fp8_recipe"] = fp8
    got = {k: getattr(args, k, None) for k in want}
    if fp8 != "none":
        got["fp8_recipe"] = str(getattr(cfg.fp8_recipe, "value", cfg.fp8_recipe))
    if moe:
        freq = cfg.moe_layer_freq
        got["MoE layers"] = ([layer for layer in range(a["layers"]) if layer % freq == 0]
                             if isinstance(freq, int) else [i for i, x in enumerate(freq) if x])
    if not args.group_query_attention:  # Megatron ignores num_query_groups: one group per head
        got["num_query_groups"] = args.num_attention_heads
    got["qkv bias"] = args.add_bias_linear or args.add_qkv_bias
    got["padded vocabulary"] = padded_vocab(plan["parallel"]["vocab"]["model"], args)
    got["micro-batches per step"] = get_num_microbatches()

    # The layers of every (virtual) pipeline stage as Megatron builds them, and the layers it
    # recomputes in each: with --recompute-method uniform every layer of the chunk (in groups of
    # recompute_num_layers), with block the first recompute_num_layers layers of each chunk
    # (megatron/core/recompute.py; the same in transformer_block.py of older trees). The plan's
    # every-N-th layers are N, 2N, …; Megatron's block recomputes as many per chunk, not the
    # same ones, so the count per chunk is compared.
    vpp = cfg.virtual_pipeline_model_parallel_size
    ps.set_virtual_pipeline_model_parallel_world_size(vpp)
    ps.set_pipeline_model_parallel_world_size(cfg.pipeline_model_parallel_size)
    rc = recomputed_layers(plan)
    split, recomputed, plan_split, plan_recomputed = [], [], [], []
    for stage, chunk, start, end, _, _ in chunks(plan):
        ps.set_pipeline_model_parallel_rank(stage)
        vp = chunk if vpp else None
        n = get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=stage)
        off = get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=stage)
        split.append(f"{off}-{off + n}")
        plan_split.append(f"{start}-{end}")
        if cfg.recompute_granularity != "full":
            recomputed.append(0)
        elif cfg.recompute_method == "uniform":
            recomputed.append(n)
        else:
            recomputed.append(min(cfg.recompute_num_layers, n))
        plan_recomputed.append(len([j for j in rc if start <= j < end]))
    ps.set_pipeline_model_parallel_rank(None)
    ps.set_virtual_pipeline_model_parallel_world_size(None)
    ps.set_pipeline_model_parallel_world_size(None)
    got["layers of each virtual stage"], want["layers of each virtual stage"] = split, plan_split
    got["layers recomputed in full per chunk"] = recomputed
    want["layers recomputed in full per chunk"] = plan_recomputed
    compare("Megatron", got, want)
    print(f"  recompute: {args.recompute_method} {args.recompute_num_layers};"
          f" TransformerConfig: {cfg.num_layers} layers, layout {cfg.pipeline_model_parallel_layout}")

    # The check can fail: a misspelt flag is refused.
    refuses_misspelt(ma.parse_args, ours)
    print(f"ok: Megatron-LM accepts the MEGATRON_ARGS of {name}")


run("megatron", check)
