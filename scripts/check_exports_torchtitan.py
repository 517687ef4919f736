"""`tessera export --to torchtitan` job configs read by torchtitan's own code.

Usage: python check_exports_torchtitan.py [--results FILE] NAME PLAN.json CONFIG.toml [...] with a
Python that has torch and torchtitan 0.2.x (0.3 reads no TOML job config). For each config:
torchtitan's parser (`--job.config_file`, as its run_train.sh passes it) must accept it, and what
torchtitan makes of it must be the plan's, derived from plan.json:
- the degrees, schedule and micro-batch size as parsed;
- the device mesh torchtitan's ParallelDims builds for the plan's world size (over a fake
  process group, one per rank): every rank's TP, PP, FSDP-shard and replicate groups are the
  plan's (mesh order tp-dp-pp; hybrid sharding shards over the DP ranks of a node);
- the batch arithmetic of torchtitan 0.2.2's trainer (quoted below): the global batch, the
  gradient-accumulation steps and the pipeline's micro-batches;
- the split (with PP): one model part per (virtual) stage, torchtitan's module names in order,
  the plan's layers in each;
- the layers torchtitan's apply_ac checkpoints on each rank, run on torchtitan's Llama-3
  Transformer (built on the meta device with the plan's layer count, cut into the rank's model
  parts as pipeline_module_split cuts it);
and the same config with one key misspelt must be refused.
"""

import contextlib
import dataclasses
import io
import logging
import re
import tempfile
from importlib.metadata import version

import torch
import torch.distributed as dist
import torchtitan.distributed.activation_checkpoint as tac
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config import ConfigManager
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3 import Transformer, llama3_args
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

from check_exports_common import chunks, compare, recomputed_layers, run

logging.getLogger().setLevel(logging.ERROR)  # torchtitan's warnings about the user's sections
print(f"torchtitan {version('torchtitan')}, torch {torch.__version__}")


def plan_groups(plan, rank):
    """The plan's groups of `rank` (mesh order tp-cp-dp-pp: rank = tp + TP·(cp + CP·(dp + DP·pp)),
    docs/plan.md; CP 1 is tp-dp-pp. ZeRO shards over DP × CP, the ranks that hold the same
    weights; hybrid sharding shards within a node and replicates across nodes)."""
    p = plan["parallel"]
    tp, dp, pp, cp = p["tp"], p["dp"], p["pp"], p.get("cp", 1)
    t, c, d, s = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    at = lambda t, c, d, s: t + tp * (c + cp * (d + dp * s))  # noqa: E731
    dp_group = [at(t, c, q, s) for q in range(dp)]
    dp_cp_group = [at(t, x, q, s) for q in range(dp) for x in range(cp)]
    if p["zero_stage"] == 3 and p["hybrid_shard"]:
        gpn = plan["job"]["cluster"]["gpus_per_node"]
        shard = [q for q in dp_cp_group if q // gpn == rank // gpn]
        i = shard.index(rank)
        replicate = [q for q in dp_cp_group if [x for x in dp_cp_group if x // gpn == q // gpn].index(q) == i]
    elif p["zero_stage"] == 3:
        shard, replicate = dp_cp_group, [rank]
    else:  # ZeRO-0: DDP replicates over the DP group
        shard, replicate = [rank], dp_group
    return {"tp": [at(x, c, d, s) for x in range(tp)], "pp": [at(t, c, d, x) for x in range(pp)],
            "cp": [at(t, x, d, s) for x in range(cp)], "fsdp": shard, "dp_replicate": replicate}


def torchtitan_groups(dims, rank):
    """torchtitan's groups of `rank`: its own mesh, built by ParallelDims.build_mesh over a fake
    process group in which this process is `rank`."""
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        d = dataclasses.replace(dims)  # a fresh ParallelDims: build_mesh caches its meshes
        d.build_mesh()
        out = {}
        for name in ("tp", "pp", "cp", "fsdp", "dp_replicate"):
            mesh = d.get_optional_mesh(name)
            out[name] = [rank] if mesh is None else mesh.mesh.flatten().tolist()
        return out
    finally:
        dist.destroy_process_group()


def checkpointed(config, plan, parts_of_rank):
    """The layers torchtitan's apply_ac checkpoints whole, and those it gives per-op
    checkpointing, on every rank: torchtitan's Llama-3 Transformer (the plan's layer count, on the
    meta device) cut into each rank's model parts, apply_ac run on the parts in the order
    pipeline_llm parallelizes them, with the layer counter of activation_checkpoint.py at 0 as in
    a fresh process."""
    ac = config.activation_checkpoint
    whole, per_op = set(), set()
    if ac.mode == "none":
        return whole, per_op
    args = dataclasses.replace(llama3_args["debugmodel"], n_layers=plan["job"]["model"]["architecture"]["layers"])
    for parts in parts_of_rank:
        tac._layer_sac_count = 0  # module-global: one count per process, across its model parts
        for part in parts:
            with torch.device("meta"):
                model = Transformer(args)
            for key in list(model.layers.keys()):
                if part is not None and f"layers.{key}" not in part:
                    del model.layers[key]  # as pipeline_module_split keeps a part's layers
            with contextlib.redirect_stdout(io.StringIO()):
                tac.apply_ac(model, ac, op_sac_save_list=_op_sac_save_list)
            for key, block in model.layers.items():
                if isinstance(block, CheckpointWrapper):
                    (per_op if ac.mode == "selective" and ac.selective_ac_option == "op" else whole).add(int(key))
    return whole, per_op


def check(name, plan, plan_path, config_path):
    p = plan["parallel"]
    tr = plan["job"]["model"]["training"]
    layers = plan["job"]["model"]["architecture"]["layers"]
    c = ConfigManager().parse_args(["--job.config_file", config_path])
    par = c.parallelism

    want = {
        "tensor_parallel_degree": p["tp"],
        "pipeline_parallel_degree": p["pp"],
        "context_parallel_degree": p.get("cp", 1),
        "seq_len": tr["seq_len"],
    }
    if p.get("cp", 1) > 1:
        # torchtitan's names: a ring of K/V passes is "alltoall", gathering them "allgather".
        want["context_parallel_rotate_method"] = {"p2p": "alltoall", "all_gather": "allgather"}[p.get("cp_comm", "p2p")]
    got = {k: getattr(par, k) for k in want if hasattr(par, k)}
    got["seq_len"] = c.training.seq_len
    # The profile's torch.compile, as torchtitan 0.2.2's [compile] reads it: each block and the
    # loss (torchtitan-compile), the blocks alone (torchtitan-compile-blocks), or nothing.
    components = {"torchtitan-compile": ["model", "loss"],
                  "torchtitan-compile-blocks": ["model"]}.get(tr.get("framework"), [])
    want["compile.enable"] = bool(components)
    got["compile.enable"] = c.compile.enable
    if components:
        want["compile.components"] = components
        got["compile.components"] = list(c.compile.components)
    # FSDP2's CPUOffloadPolicy (apply_fsdp(cpu_offload=...)): the plan's params offload.
    want["training.enable_cpu_offload"] = p.get("offload", "none") == "params"
    got["training.enable_cpu_offload"] = c.training.enable_cpu_offload
    if p["pp"] > 1:
        want["pipeline_parallel_schedule"] = {"1f1b": "1F1B", "gpipe": "GPipe",
                                              "interleaved": "Interleaved1F1B",
                                              "zb-v": "ZBVZeroBubble"}[p["schedule"]]
        got["pipeline_parallel_schedule"] = par.pipeline_parallel_schedule
    if p["pp"] > 1 and p["schedule"] == "zb-v":
        # torchtitan puts model part i (module_fqns_per_model_part, in piece order) on the rank
        # torch's V mapping names (pipeline_module_split, style "v"): the plan's holder of piece i.
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
        v_map = generate_stage_to_rank_mapping(p["pp"], 2 * p["pp"], style="v")
        held = {c["virtual_stage"]: s["stage"] for s in plan["stages"] for c in s["chunks"]}
        got["rank of each ZB-V model part"] = [v_map[i] for i in range(2 * p["pp"])]
        want["rank of each ZB-V model part"] = [held[i] for i in range(2 * p["pp"])]
        got["schedule class"] = get_schedule_class(par.pipeline_parallel_schedule).__name__
        want["schedule class"] = "ScheduleZBVZeroBubble"

    # The mesh torchtitan builds for the plan's GPU count (ParallelDims asserts that the
    # degrees' product is the world size), and every rank's groups in it.
    dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                        pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree,
                        etp=par.expert_tensor_parallel_degree, world_size=p["world"])
    ranks = range(p["world"]) if p["world"] <= 64 else sorted({*range(0, p["world"], 7), p["world"] - 1})
    mismatched = [r for r in ranks if torchtitan_groups(dims, r) != plan_groups(plan, r)]
    got["ranks whose TP, PP, CP, shard and replicate groups differ"] = mismatched[:4]
    want["ranks whose TP, PP, CP, shard and replicate groups differ"] = []
    if mismatched:
        print(f"  rank {mismatched[0]}: torchtitan {torchtitan_groups(dims, mismatched[0])},"
              f" plan {plan_groups(plan, mismatched[0])}")
    print(f"  ParallelDims: world {dims.world_size}, dp_replicate {dims.dp_replicate}, dp_shard {dims.dp_shard},"
          f" tp {dims.tp}, pp {dims.pp}; groups of rank 0: {torchtitan_groups(dims, 0)}")

    # The batch, as torchtitan 0.2.2's trainer derives it (torchtitan/train.py, Trainer.__init__):
    #     batch_degree = batch_mesh.size()            # dp_replicate × dp_shard (if DP is on)
    #     global_batch_size = job_config.training.global_batch_size
    #     if global_batch_size < 0:
    #         global_batch_size = job_config.training.local_batch_size * batch_degree
    #     self.gradient_accumulation_steps = global_batch_size // (
    #         job_config.training.local_batch_size * batch_degree)
    # and its pipeline (torchtitan/distributed/pipeline_parallel.py, build_pipeline_schedule):
    #     n_microbatches = job_config.training.local_batch_size // pipeline_parallel_microbatch_size
    # The plan's step: global batch = DP × micro-batch × micro-batches. Without PP each
    # micro-batch is a forward of its own (accumulation = micro-batches); with PP the micro-batches
    # are the pipeline's, in one schedule run (accumulation 1).
    local = c.training.local_batch_size
    batch_degree = dims.dp_replicate * dims.dp_shard
    global_batch = c.training.global_batch_size
    if global_batch < 0:
        global_batch = local * batch_degree
    assert global_batch % (local * batch_degree) == 0, "torchtitan asserts: global % (local × DP) != 0"
    got["global batch"] = global_batch
    got["gradient accumulation steps"] = global_batch // (local * batch_degree)
    want["global batch"] = tr["global_batch"]
    want["gradient accumulation steps"] = 1 if p["pp"] > 1 else p["microbatches"]
    if p["pp"] > 1:
        mb = par.pipeline_parallel_microbatch_size
        assert local % mb == 0, "torchtitan refuses: local batch not divisible by the microbatch size"
        got["sequences per pipeline micro-batch"], want["sequences per pipeline micro-batch"] = mb, p["micro_batch"]
        got["pipeline micro-batches"], want["pipeline micro-batches"] = local // mb, p["microbatches"]
    else:
        got["sequences per forward"], want["sequences per forward"] = local, p["micro_batch"]

    # The split: as many model parts as the schedule's stages (one a rank for a single-stage
    # schedule), torchtitan's module names in order, and the plan's layers in each.
    plan_chunks = chunks(plan)
    if p["pp"] > 1:
        parts = par.module_fqns_per_model_part
        assert parts is not None, "a pipeline without the plan's split"
        single = issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle)
        got["model parts"] = len(parts)
        want["model parts"] = p["pp"] * (1 if single else p["virtual_stages"])
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(llama3_args["debugmodel"], n_layers=layers))
        top = [n for n, _ in model.named_children() if n != "layers"]
        top[1:1] = [f"layers.{n}" for n, _ in model.layers.named_children()]
        got["modules of the parts, in order"] = "torchtitan's" if [m for part in parts for m in part] == top else \
            [m for part in parts for m in part]
        want["modules of the parts, in order"] = "torchtitan's"
        got["layers of each part"] = [f"{part[0]}..{part[-1]}" for part in
                                      ([m for m in part if m.startswith("layers.")] for part in parts)]
        want["layers of each part"] = [f"layers.{a}..layers.{b - 1}" for _, _, a, b, _, _ in plan_chunks]
        # pipeline_module_split, "loop" style: PP rank s builds stages s, s + PP, s + 2·PP, …;
        # "v" style (ZBVZeroBubble): stages s and 2·PP − 1 − s.
        n = len(parts)
        if p["schedule"] == "zb-v":
            parts_of_rank = [[set(parts[s]), set(parts[n - 1 - s])] for s in range(p["pp"])]
        else:
            parts_of_rank = [[set(parts[i]) for i in range(s, n, p["pp"])] for s in range(p["pp"])]
    else:
        parts_of_rank = [[None]]

    # Recompute: the layers torchtitan checkpoints whole, or per op, against the plan's.
    whole, per_op = checkpointed(c, plan, parts_of_rank)
    got["layers recomputed whole"] = sorted(whole)
    got["layers with per-op checkpointing"] = sorted(per_op)
    want["layers recomputed whole"] = sorted(recomputed_layers(plan))
    flash = tr["attention"] == "flash"
    want["layers with per-op checkpointing"] = list(range(layers)) if p["recompute"] == "selective" and flash else []
    # FP8 (training.fp8): torchao's float8 linears through the converter torchtitan registers,
    # the recipe (tensorwise: the default, no recipe_name), float8 all-gather exactly where FSDP
    # shards and the recipe is tensorwise, and the LM head ("output") left in 16-bit.
    fp8 = tr.get("fp8", "none")
    f8 = c.quantize.linear.float8
    got["converters"], want["converters"] = list(c.model.converters), [] if fp8 == "none" else ["quantize.linear.float8"]
    if fp8 != "none":
        got["float8 recipe_name"] = f8.recipe_name
        want["float8 recipe_name"] = None if fp8 == "tensorwise" else fp8
        got["enable_fsdp_float8_all_gather"] = f8.enable_fsdp_float8_all_gather
        want["enable_fsdp_float8_all_gather"] = fp8 == "tensorwise" and dims.dp_shard > 1
        got["float8 filter_fqns"], want["float8 filter_fqns"] = list(f8.filter_fqns), ["output"]
    compare("torchtitan", got, want)
    ac = c.activation_checkpoint
    print(f"  activation_checkpoint: mode {ac.mode!r}, selective_ac_option {ac.selective_ac_option!r}")

    # What torchtitan took by default for the sections the export leaves to the user.
    print(f"  defaults: model {c.model.name} {c.model.flavor}, training.dtype {c.training.dtype},"
          f" mixed_precision_param {c.training.mixed_precision_param}, steps {c.training.steps},"
          f" dataset {c.training.dataset}")

    # The check can fail: the same config with one key misspelt is refused.
    text = open(config_path).read()
    broken = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    broken.write(re.sub(r"^tensor_parallel_degree =", "tensor_parallel_degre =", text, flags=re.M))
    broken.close()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            ConfigManager().parse_args(["--job.config_file", broken.name])
    except ValueError as e:
        print(f"  tensor_parallel_degre refused: {str(e).splitlines()[0]}")
    else:
        raise AssertionError("torchtitan accepted tensor_parallel_degre")
    print(f"ok: torchtitan {version('torchtitan')} accepts the config of {name}")


run("torchtitan", check)
