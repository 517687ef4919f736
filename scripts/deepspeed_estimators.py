#!/usr/bin/env python3
"""DeepSpeed's own ZeRO model-state memory estimates, for comparing with Tessera's offload model.

Reads a JSON list of cases on stdin and prints one JSON list on stdout, one entry per case:

    {"case": {...the case, defaults filled in...}, "gpu_bytes": N, "cpu_bytes": N}

(stage 3 entries also carry "largest_layer_bytes", the third value DeepSpeed returns). Each case:

    {"stage": 2 | 3,
     "total_params": N,
     "largest_layer_params": N,          # stage 3 only, required there
     "gpus_per_node": g,                 # default 1
     "nodes": n,                         # default 1
     "offload": "none" | "optimizer" | "params",
     "additional_buffer_factor": 1.5}    # default 1.5, DeepSpeed's own default

The numbers come from CALLING DeepSpeed's non-printing estimators, not from a copy of their
formulas, so that a DeepSpeed upgrade that changes them shows up here:

    deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs(
        total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
        -> (cpu_mem, gpu_mem)
    deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs(
        total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
        cpu_offload_params, zero_init, additional_buffer_factor)
        -> (cpu_mem, gpu_mem, largest_layer_memory)

offload maps to: none -> cpu_offload=False; optimizer -> cpu_offload=True; params ->
cpu_offload=True, cpu_offload_params=True (stage 3 only: stage 2 cannot offload parameters).
zero_init is always True (deepspeed.zero.Init, how a model too big for one device is built).
gpu_bytes is per GPU; cpu_bytes is what DeepSpeed calls "per CPU", i.e. per node.
docs/offload-validation/deepspeed-estimators.md gives the formulas term by term.

Usage:

    echo '[{"stage": 3, "total_params": 1e10, "largest_layer_params": 1e8,
            "gpus_per_node": 8, "nodes": 1, "offload": "params"}]' \\
        | python scripts/deepspeed_estimators.py

`--check` recomputes the t5-3b table DeepSpeed publishes in docs/code-docs/source/memory.rst
through the same mapping and exits 1 if any value differs.

Needs deepspeed (checked with 0.19.8 on torch 2.15.0) but no GPU: DS_ACCELERATOR defaults to cpu.
"""

import contextlib
import json
import os
import sys

OFFLOADS = ("none", "optimizer", "params")


class CaseError(Exception):
    """A case that cannot be passed to DeepSpeed; the message names the case and the field."""


def load_estimators():
    # Without a GPU, DeepSpeed's accelerator probe falls back to the CPU anyway but warns first;
    # naming it keeps the probe quiet and the result the same. Anything DeepSpeed prints while
    # importing goes to stderr, so stdout stays one JSON document.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    return deepspeed.__version__, estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def count(case, index, key, default=None):
    """A positive whole number; JSON's 1e10 (a float) is accepted when it is whole."""
    value = case.get(key, default)
    if value is None:
        raise CaseError(f"case {index}: `{key}` is missing; give a positive whole number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise CaseError(f"case {index}: `{key}` = {value!r}; give a positive whole number")
    return int(value)


def normalise(case, index):
    if not isinstance(case, dict):
        raise CaseError(f"case {index}: expected a JSON object, got {type(case).__name__}")
    known = {"stage", "total_params", "largest_layer_params", "gpus_per_node", "nodes", "offload",
             "additional_buffer_factor"}
    unknown = sorted(set(case) - known)
    if unknown:
        raise CaseError(f"case {index}: unknown key(s) {unknown}; the keys are {sorted(known)}")
    stage = case.get("stage")
    if stage not in (2, 3) or isinstance(stage, bool):
        raise CaseError(f"case {index}: `stage` = {stage!r}; give 2 or 3")
    offload = case.get("offload", "none")
    if offload not in OFFLOADS:
        raise CaseError(f"case {index}: `offload` = {offload!r}; give one of {list(OFFLOADS)}")
    if stage == 2 and offload == "params":
        raise CaseError(f"case {index}: `offload` = \"params\" needs stage 3 (ZeRO-2 keeps the "
                        "parameters on the GPU); use \"optimizer\" or stage 3")
    factor = case.get("additional_buffer_factor", 1.5)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise CaseError(f"case {index}: `additional_buffer_factor` = {factor!r}; give a positive number")
    out = {
        "stage": stage,
        "total_params": count(case, index, "total_params"),
        "gpus_per_node": count(case, index, "gpus_per_node", 1),
        "nodes": count(case, index, "nodes", 1),
        "offload": offload,
        "additional_buffer_factor": factor,
    }
    if stage == 3:
        out["largest_layer_params"] = count(case, index, "largest_layer_params")
    elif "largest_layer_params" in case:
        raise CaseError(f"case {index}: `largest_layer_params` is a stage-3 input (DeepSpeed's "
                        "ZeRO-2 estimator does not take it); drop it or use stage 3")
    return out


def estimate(case, zero2, zero3):
    cpu_offload = case["offload"] in ("optimizer", "params")
    if case["stage"] == 2:
        cpu, gpu = zero2(total_params=case["total_params"],
                         num_gpus_per_node=case["gpus_per_node"],
                         num_nodes=case["nodes"],
                         cpu_offload=cpu_offload,
                         additional_buffer_factor=case["additional_buffer_factor"])
        return {"case": case, "gpu_bytes": gpu, "cpu_bytes": cpu}
    cpu, gpu, largest = zero3(total_params=case["total_params"],
                              largest_layer_params=case["largest_layer_params"],
                              num_gpus_per_node=case["gpus_per_node"],
                              num_nodes=case["nodes"],
                              cpu_offload=cpu_offload,
                              cpu_offload_params=case["offload"] == "params",
                              zero_init=True,
                              additional_buffer_factor=case["additional_buffer_factor"])
    return {"case": case, "gpu_bytes": gpu, "cpu_bytes": cpu, "largest_layer_bytes": largest}


# DeepSpeed's own published output for t5-3b (2851M params, 32M largest layer, 1 node of 8 GPUs),
# docs/code-docs/source/memory.rst, the "_all_cold" examples, printed as GiB with two decimals:
# (stage, offload, per CPU, per GPU). The ZeRO-2 no-offload row is left out: the page still prints
# 15.93GB per GPU from an older formula (4 * params + 16 * params / gpus), while the 0.19.8 code
# computes 2 * params + 18 * params / gpus (11.28GB); see docs/offload-validation/deepspeed-estimators.md.
DOCUMENTED_T5_3B = [
    (3, "params", "71.69", "0.12"),
    (3, "optimizer", "63.72", "0.78"),
    (3, "none", "1.43", "6.09"),
    (2, "optimizer", "127.45", "5.31"),
]


def check(zero2, zero3):
    """Recompute DeepSpeed's documented t5-3b table through this script's mapping; 0 if all agree."""
    failures = 0
    for stage, offload, cpu_doc, gpu_doc in DOCUMENTED_T5_3B:
        case = {"stage": stage, "total_params": 2851e6, "gpus_per_node": 8, "offload": offload}
        if stage == 3:
            case["largest_layer_params"] = 32e6
        out = estimate(normalise(case, 0), zero2, zero3)
        cpu, gpu = f"{out['cpu_bytes'] / 2**30:.2f}", f"{out['gpu_bytes'] / 2**30:.2f}"
        ok = (cpu, gpu) == (cpu_doc, gpu_doc)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} stage {stage} offload={offload:9} per CPU {cpu}GB (doc {cpu_doc}) "
              f"per GPU {gpu}GB (doc {gpu_doc})")
    return failures


def main():
    if sys.argv[1:] == ["--check"]:
        _, zero2, zero3 = load_estimators()
        sys.exit(1 if check(zero2, zero3) else 0)
    if sys.argv[1:]:
        sys.exit("deepspeed_estimators: the only option is --check; cases come on stdin")
    try:
        cases = json.load(sys.stdin)
    except json.JSONDecodeError as err:
        sys.exit(f"deepspeed_estimators: stdin is not JSON ({err}); give a JSON list of cases")
    if not isinstance(cases, list):
        sys.exit("deepspeed_estimators: stdin must be a JSON list of cases, e.g. "
                 '[{"stage": 2, "total_params": 1000000000, "offload": "optimizer"}]')
    try:
        cases = [normalise(case, i) for i, case in enumerate(cases)]
    except CaseError as err:
        sys.exit(f"deepspeed_estimators: {err}")
    version, zero2, zero3 = load_estimators()
    print(f"deepspeed {version}", file=sys.stderr)
    json.dump([estimate(case, zero2, zero3) for case in cases], sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
