#!/usr/bin/env python3
"""Host time of one transformer layer as each framework's own code dispatches it, in bare ops.

`host_op_cost.py` times the cheapest op there is (`y = y * c`, one autograd node). A framework's
layer pays more per op than that: module calls, hooks, custom autograd Functions, autocast's casts,
its own Python between ops. This script builds one layer of each framework below (from the
installed package where there is one; nanoGPT is not a package, so its Block is written out here)
with tiny shapes so the kernels cost next to nothing, and times its forward and its backward on the
host. Each is divided by the bare op's forward and backward time measured back to back with it, so
the result is in *bare-op equivalents*: what `host_ops_forward` / `host_ops_backward` of
specs/frameworks/*.toml carry, multiplied by the host's per-op cost (`[calibration] host_op_us`).
A ratio of two timings taken side by side on one CPU depends far less on that CPU than either
timing (docs/host-floor.md has the runs).

On a CPU-only machine the layers run on CPU tensors, and their tiny kernels run inline where a GPU
host would launch them (cudaLaunchKernel, a few µs each); `--device cuda` on a GPU machine times
the real thing.

    python3 scripts/host_layer_cost.py [--repeats 30] [--device cpu] [--only NAME] [--tp N]

Needs torch; `megatron-core` and `torchtitan` where those layers are wanted (the engines venv of
scripts/check-exports-env.sh has both). A layer whose package is missing is skipped, named.
"""
import argparse
import contextlib
import os
import statistics
import time

import torch

B, S, H, HEADS = 1, 4, 16, 4  # tiny: the host's time, not the kernels'
TP = 1  # Megatron's tensor-parallel degree (--tp)
CHAIN = 8  # layers per forward, so one backward's start-up is shared by eight layers
DISTINCT = False  # the chain's layers are distinct modules (host_layer_trace.py), not one reused


def bare(device: str, ops: int = 400):
    x = torch.ones(1, device=device, requires_grad=True)

    def fwd():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        return y.sum()

    return fwd, ops


def once(fwd, sync) -> tuple[float, float]:
    """Host seconds of one fwd() and of its backward."""
    sync()
    t0 = time.perf_counter()
    loss = fwd()
    t1 = time.perf_counter()
    loss.backward()
    sync()
    return t1 - t0, time.perf_counter() - t1


def ratios(layer, bare_fwd, ops: int, device: str, repeats: int):
    """Per repeat, the bare ops and the layer timed back to back; the medians of the layer's
    times and of its per-repeat ratios to one bare op (forward to forward, backward to
    backward), so a slow spell of the machine moves both sides of a ratio."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for i in range(repeats + 3):
        bf, bb = once(bare_fwd, sync)
        lf, lb = once(layer, sync)
        if i >= 3:  # warm-up: allocator, autograd engine threads, lazy inits, compiles
            rows.append((lf / CHAIN, lb / CHAIN, lf / CHAIN / (bf / ops), lb / CHAIN / (bb / ops)))
    med = [statistics.median(c) for c in zip(*rows)]
    q = [statistics.quantiles(c, n=4) for c in zip(*rows)]
    return med, q, (bf / ops, bb / ops)


def chain(build):
    """The CHAIN layers of a forward: one module reused CHAIN times, or CHAIN distinct ones
    (DISTINCT) built by `build(index)`."""
    if DISTINCT:
        return [build(i) for i in range(CHAIN)]
    return [build(0)] * CHAIN


def nanogpt_block(device: str):
    """GPT-2 block as nanoGPT writes it (karpathy/nanoGPT model.py: LayerNorm, c_attn, SDPA,
    c_proj, GELU MLP, residuals), run under bf16 autocast as its train.py does. Plain PyTorch:
    the pytorch-eager profile."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(H, 3 * H)
            self.c_proj = nn.Linear(H, H)

        def forward(self, x):
            b, t, c = x.size()
            q, k, v = self.c_attn(x).split(H, dim=2)
            k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            return self.c_proj(y)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(H, 4 * H)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * H, H)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(H)
            self.attn = Attn()
            self.ln_2 = nn.LayerNorm(H)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    blks = chain(lambda _: Block().to(device))
    x = torch.randn(B, S, H, device=device, requires_grad=True)
    dev = "cuda" if device.startswith("cuda") else "cpu"

    def fwd():
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = x
            for blk in blks:
                y = blk(y)
            return y.float().sum()

    return fwd


def torchtitan_block(device: str):
    """torchtitan 0.2.x Llama 3 TransformerBlock (RMSNorm, GQA attention with RoPE through
    SDPA, SwiGLU), as its own package builds it: the torchtitan profile's layer, without FSDP2's
    hooks."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis

    args = TransformerModelArgs(
        dim=H, n_layers=1, n_heads=HEADS, n_kv_heads=HEADS // 2, vocab_size=256,
        max_seq_len=S, multiple_of=16,
    )
    def block(i):
        blk = TransformerBlock(i, args).to(device)
        with torch.no_grad():
            blk.init_weights()
        return blk

    blks = chain(block)
    freqs = precompute_freqs_cis(H // HEADS, S, args.rope_theta).to(device)
    x = torch.randn(B, S, H, device=device, requires_grad=True)

    def fwd():
        y = x
        for blk in blks:
            y = blk(y, freqs, None)
        return y.sum()

    return fwd


def megatron_core_layer(device: str):
    """Megatron-Core's TransformerLayer with its local (no Transformer Engine) spec, GPT as
    Megatron builds it (LayerNorm, bias, GeLU, dropout 0.1, bias-dropout-add fusion), TP 1 in a
    one-process group: the megatron-core profile's layer with Megatron's own Python modules in
    place of TE's."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not dist.is_initialized():
        if TP == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29531")
            dist.init_process_group("gloo", rank=0, world_size=1)
        else:
            # TP > 1 in one process: rank 0 of a fake process group, whose collectives return at
            # once. The host's side of each TP collective call (c10d's Python and dispatch) is
            # timed; NCCL's own enqueue is not.
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", rank=0, world_size=TP, store=FakeStore())
        parallel_state.initialize_model_parallel(TP, 1)
    if not device.startswith("cuda"):
        # Megatron's buffers and RNG ask for the current CUDA device; on a CPU-only host they
        # get this run's device.
        torch.cuda.current_device = lambda: torch.device(device)
        # Megatron forks a CUDA RNG state around its dropouts; on CPU the fork is a no-op
        # context, which leaves its cost (two get/set calls on a GPU host) out.
        class NoFork:
            def fork(self, *_a, **_k):
                return contextlib.nullcontext()

        tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoFork()
        tensor_parallel.random.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.1, attention_dropout=0.1, bias_dropout_fusion=True,
        bias_activation_fusion=True, masked_softmax_fusion=False, params_dtype=torch.float32,
        tensor_model_parallel_size=TP,
    )
    layers = chain(lambda _: TransformerLayer(cfg, get_gpt_layer_local_spec().submodules).to(device))
    x = torch.randn(S, B, H, device=device, requires_grad=True)  # Megatron is [s, b, h]
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool, device=device), diagonal=1)

    def fwd():
        y = x
        for layer in layers:
            y = layer(y, attention_mask=mask)
            y = y[0] if isinstance(y, tuple) else y
        return y.sum()

    return fwd


LAYERS = {
    "pytorch-eager (nanoGPT block, bf16 autocast)": nanogpt_block,
    "torchtitan (Llama 3 TransformerBlock)": torchtitan_block,
    "megatron-core (TransformerLayer, local spec)": megatron_core_layer,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default=None, help="a substring of the layer's name")
    p.add_argument("--hidden", type=int, default=16, help="hidden size (tiny: host-bound)")
    p.add_argument("--tokens", type=int, default=4, help="sequence length, micro-batch 1")
    p.add_argument("--tp", type=int, default=1, help="Megatron's TP degree (a fake group)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads on CPU")
    a = p.parse_args()
    globals().update(H=a.hidden, S=a.tokens, TP=a.tp)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    fwd, ops = bare(a.device)
    print(f"device {a.device}, torch {torch.__version__}, hidden {H}, tokens {S}, "
          f"TP {TP} (Megatron), median of {a.repeats}, each layer chained {CHAIN}x")
    for name, build in LAYERS.items():
        if a.only and a.only not in name:
            continue
        try:
            layer = build(a.device)
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        (lf, lb, rf, rb), q, (bf, bb) = ratios(layer, fwd, ops, a.device, a.repeats)
        print(
            f"{name}: forward {lf * 1e6:.0f} us = {rf:.0f} bare ops "
            f"(quartiles {q[2][0]:.0f}-{q[2][2]:.0f}), "
            f"backward {lb * 1e6:.0f} us = {rb:.0f} bare ops ({q[3][0]:.0f}-{q[3][2]:.0f}); "
            f"bare op {bf * 1e6:.2f} / {bb * 1e6:.2f} us"
        )


if __name__ == "__main__":
    main()
