#!/usr/bin/env python3
"""One transformer layer's host work counted from a profiler trace: dispatcher calls and launches.

`host_layer_cost.py` times each framework's layer against a bare op on this host's CPU. This
script counts instead: it runs the same layers (Megatron-Core's TransformerLayer with its local
spec, torchtitan's Llama 3 TransformerBlock, nanoGPT's Block under bf16 autocast) forward and
backward under `torch.profiler` and counts, per layer and pass:

- **dispatches**: the dispatcher calls the host makes for the layer. Forward: the top-level aten
  ops, those with no aten op above them in the trace (what the Python side dispatches; an
  `aten::linear` that calls `aten::addmm` is one). Backward: the autograd nodes the engine runs
  (`autograd::engine::evaluate_function: ...`, one per node, AccumulateGrad included). A custom
  autograd Function's `apply` (Megatron's linear layers and TP regions: `F` whose node is
  `FBackward`) is one more, beside the aten ops it calls, and a `torch.compile`d function
  (Megatron's bias-dropout-add) is one: its `CompiledFunction` call.
- **launches**: the aten ops that have a device kernel of their own (a CPU or CUDA entry in
  the dispatcher's registry, not only a composite of other ops), less views (every overload
  returns an alias of an input: `Tensor(a)`, not `Tensor(a!)`) and NO_KERNEL below (allocation
  and metadata), each counted where no op above it in the trace is itself counted: the op a
  device kernel implements launches for what it calls (an `aten::linear` is a composite, the
  `aten::addmm` it calls launches; the `aten::copy_` a CPU `addmm` may call inside is not
  counted again). Each is taken as one launch: a GPU launches at least one kernel for each
  (cuBLAS's bias copy, FlashAttention's backward and a few others launch more), so the count
  is a floor. Inductor's kernels inside a compiled function are one launch each.

Each count is the difference between a chain of two distinct layers and a chain of one, so the
loss, the graph's root and the input's gradient cancel and each layer has its own parameters'
AccumulateGrad nodes, as a model's layers do. The backward is a step's first micro-batch's: no
gradient yet, so AccumulateGrad takes its gradient over (a later micro-batch adds to it: one more
launch per parameter, not counted).

The counts are taken on CPU tensors. They do not depend on the device except where an op
decomposes differently on it. Two such are counted as on a GPU (ONE_CUDA_KERNEL below):
`dropout` (one `native_dropout` kernel on CUDA; `bernoulli_` and `mul` on CPU) and `rms_norm`
(`_fused_rms_norm` on CUDA). The rest follow the CPU: the SDPA backend
(`_scaled_dot_product_flash_attention_for_cpu` here; FlashAttention, memory-efficient or cuDNN
attention on a GPU, each one op forward and one backward), RMSNorm's backward nodes (the CPU's
decomposition's), autocast's op lists (CPU's and CUDA's differ: e.g. layer_norm), and what
`torch.compile` fuses (Inductor's C++ kernels on CPU, Triton on a GPU). The summary lists every
op by name so these can be read off.

    python3 scripts/host_layer_trace.py [--only NAME] [--json OUT.json]

Needs torch; `megatron-core` and `torchtitan` where those layers are wanted (the engines venv of
scripts/check-exports-env.sh has both). A layer whose package is missing is skipped, named.
"""
import argparse
import collections
import functools
import json

import torch
import torch._inductor.config as inductor
from torch.profiler import ProfilerActivity, profile

import host_layer_cost as layers

# Ops that allocate or read metadata without a kernel; views are found from their schema.
NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::resize_", "aten::set_", "aten::lift_fresh",
    "aten::result_type", "aten::size", "aten::stride", "aten::dim", "aten::is_nonzero",
    "aten::is_same_size", "aten::_has_compatible_shallow_copy_type", "aten::record_stream",
    # Views whose schema carries no alias annotation.
    "aten::_unsafe_view", "aten::_reshape_alias",
}
BACKWARD_NODE = "autograd::engine::evaluate_function: "
# One CUDA kernel each, where the CPU runs `bernoulli_` and `mul` below it: counted once, as on a
# GPU, and what it calls not. On CUDA tensors `dropout` in training calls `native_dropout`
# (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable), one fused_dropout_kernel
# (aten/src/ATen/native/cuda/Dropout.cu); on CPU it does not.
# `rms_norm` likewise calls `_fused_rms_norm` on CUDA tensors (a CUDA kernel, none for CPU),
# where the CPU runs pow, mean, add, rsqrt and mul. (Its backward nodes are still the CPU's
# decomposition's: torchtitan's backward counts are high by those.)
ONE_CUDA_KERNEL = {"aten::dropout", "aten::native_dropout", "aten::rms_norm"}


def overloads(name: str):
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    return [] if packet is None else [(o, getattr(packet, o)._schema) for o in packet.overloads()]


def is_tensors(t) -> bool:
    if isinstance(t, torch._C.ListType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


def is_view(name: str) -> bool:
    """Whether every overload of aten op `name` that returns tensors returns aliases of its
    inputs (`Tensor(a)` or `Tensor(a)[]`, not `Tensor(a!)`): a view, no kernel. (`slice` also
    has list and string overloads; those return no tensor and are left out.)"""
    outs = [r for _, s in overloads(name) for r in s.returns if is_tensors(r.type)]
    return bool(outs) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in outs
    )


def has_kernel(name: str) -> bool:
    """Whether some overload of `name` has a kernel of its own for a device (CPU or CUDA), not
    only a composite made of other ops (`linear`, `type_as`, `_to_copy`, `clone`, `slice`).
    `copy_` is composite in the registry but launches through its own device stub."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key

    def on(o, key):
        try:
            return has(name if o == "default" else f"{name}.{o}", key)
        except RuntimeError:  # an overload the registry does not name
            return False

    return name == "aten::copy_" or any(
        on(o, k) for o, _ in overloads(name) for k in ("CPU", "CUDA")
    )


@functools.cache
def launches_kernel(name: str) -> bool:
    return (
        name.startswith("aten::")
        and name not in NO_KERNEL
        and not is_view(name)
        and has_kernel(name)
    )


def is_op(e) -> bool:
    return e.name.startswith("aten::")


def launches_above(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if (is_op(p) and launches_kernel(p.name)) or p.name in ONE_CUDA_KERNEL:
            return True
        p = p.cpu_parent
    return False


def is_fused(e) -> bool:
    """An Inductor kernel (Megatron's torch.compile'd fusions): one launch each."""
    return "cpp_fused" in e.name or e.name.startswith("triton_")


def op_above(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if is_op(p) or p.name == "CompiledFunction" or p.name.startswith(BACKWARD_NODE):
            return True
        p = p.cpu_parent
    return False


def count(events, backward: bool, functions=frozenset()):
    """(dispatches, launches) of one profiled pass, each a Counter by op name. `functions`: the
    custom autograd Functions (Megatron's linear layers, its TP regions), known by their
    backward nodes; each `apply` in the forward is one dispatch, beside the aten ops it calls."""
    dispatches, launches = collections.Counter(), collections.Counter()
    for e in events:
        if backward and e.name.startswith(BACKWARD_NODE):
            dispatches[e.name.removeprefix(BACKWARD_NODE)] += 1
        elif not backward and e.name in functions:
            dispatches[e.name] += 1
        elif not backward and (is_op(e) or e.name == "CompiledFunction") and not op_above(e):
            dispatches[e.name] += 1
        if launches_above(e):
            continue  # inside a kernel's op: its launch is that op's
        if is_fused(e):
            launches["inductor kernel"] += 1
        elif e.name in ONE_CUDA_KERNEL or (is_op(e) and launches_kernel(e.name)):
            launches[e.name] += 1
    return dispatches, launches


def leaves(loss):
    """The tensors whose gradients `loss`'s backward accumulates (its AccumulateGrad nodes)."""
    seen, todo, out = set(), [loss.grad_fn], []
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            out.append(n.variable)
        todo.extend(f for f, _ in n.next_functions)
    return out


def profiled(fwd):
    """The forward's and the backward's (dispatches, launches) of one call of `fwd`."""
    for _ in range(3):  # warm-up: lazy inits, torch.compile of Megatron's fusions
        fwd().backward()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        loss = fwd()
    forward = p.events()
    # A step's first micro-batch: no gradient yet (zero_grad(set_to_none=True)), so each
    # AccumulateGrad takes its gradient over instead of adding to one.
    accumulated = leaves(loss)
    for t in accumulated:
        t.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as p:
        loss.backward()
    backward = count(p.events(), backward=True)
    nodes = {n.removesuffix("Backward") for n in backward[0] if n.endswith("Backward")}
    return count(forward, backward=False, functions=nodes), backward


def per_layer(build):
    """Each pass's counts of one layer: a chain of two distinct layers less a chain of one, so
    the loss's own ops, the graph's root and the input's AccumulateGrad cancel, and each layer
    keeps its own parameters' AccumulateGrad nodes, as a model's layers do."""
    layers.DISTINCT = True
    passes = []
    for n in (1, 2):
        layers.CHAIN = n
        passes.append(profiled(build("cpu")))
    (f1, b1), (f2, b2) = passes
    out = {}
    for pas, a, b in (("forward", f1, f2), ("backward", b1, b2)):
        for kind, ca, cb in (("dispatches", a[0], b[0]), ("launches", a[1], b[1])):
            d = cb.copy()
            d.subtract(ca)
            if any(v < 0 for v in d.values()):
                raise SystemExit(f"{pas} {kind}: two layers counted fewer than one: {dict(d)}")
            out[f"{kind}_{pas}"] = {k: v for k, v in sorted(d.items()) if v}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="a substring of the layer's name")
    p.add_argument("--json", default=None, help="write the per-op summary here")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Inductor's C++ kernels (Megatron's torch.compile'd bias-GeLU and bias-dropout-add) show in
    # the trace only with this on: each is one launch, as each Triton kernel is on a GPU.
    inductor.cpp.enable_kernel_profile = True
    summary = {
        "what": "one layer's host work per pass, counted by scripts/host_layer_trace.py",
        "torch": torch.__version__,
        "shapes": {"hidden": layers.H, "tokens": layers.S, "micro_batch": layers.B},
        "layers": {},
    }
    for name, build in layers.LAYERS.items():
        if a.only and a.only not in name:
            continue
        try:
            counts = per_layer(build)
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        totals = {k: sum(v.values()) for k, v in counts.items()}
        summary["layers"][name] = {"totals": totals, "ops": counts}
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
