#!/usr/bin/env python3
"""PyTorch baseline for Tessera's Llama-shaped 1B run: transformers' LlamaForCausalLM on one GPU.

The model is bench/llama-1b/config.json (Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 heads
with 8 KV heads (GQA), SwiGLU 8192, RMSNorm, RoPE θ 500000, vocab 128256, tied embeddings), built
from the config with random weights (no download), the same file `tessera plan` reads. Random
tokens, bf16 autocast over fp32 weights, SDPA attention, fp32 cross-entropy, fused AdamW, gradient
clipping at 1.0. Eager by default; `--compile` wraps the model in torch.compile. After `--warmup`
steps it times `--steps` steps (synchronised) and prints tokens/s and MFU, counted as
bench/gpt2_torch.py counts them (6 FLOPs per parameter per token plus the attention matmuls over
the full s×s square, 12·layers·seq·heads·head_dim per token).

Run by scripts/gpu-check.sh; by hand: `python3 bench/llama_torch.py --steps 10 [--compile]`.
"""

import argparse
import json
import math
import os
import torch
import torch.nn.functional as F
from timing import device_name, optimizer_step, time_steps


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(here, "llama-1b", "config.json"))
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.4)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    with open(a.config) as f:
        cfg = LlamaConfig(**json.load(f))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    dev = torch.device(a.device)
    model = LlamaForCausalLM(cfg).to(dev)
    params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, weight_decay=0.1, fused=dev.type == "cuda"
    )
    fwd = torch.compile(model) if a.compile else model
    tokens = a.micro_batch * a.seq_len
    gen = torch.Generator(device=dev).manual_seed(0)

    def step():
        idx = torch.randint(
            0, cfg.vocab_size, (a.micro_batch, a.seq_len + 1), device=dev, generator=gen
        )
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            logits = fwd(input_ids=idx[:, :-1]).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        return optimizer_step(loss, model, opt)

    elapsed, loss = time_steps(step, dev, a.warmup, a.steps)

    per_s = tokens * a.steps / elapsed
    width = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * a.seq_len * width
    mfu = per_s * flops_per_token / (a.peak_tflops * 1e12)
    name = device_name(dev)
    print(
        f"pytorch {torch.__version__} {'compile' if a.compile else 'eager'} llama on {name}: "
        f"{params} parameters, micro-batch {a.micro_batch} × seq {a.seq_len}, "
        f"{a.steps} steps after {a.warmup} warm-up: {elapsed / a.steps * 1e3:.1f} ms/step, "
        f"{per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {a.peak_tflops} TFLOP/s, "
        f"last loss {loss.item():.3f} (ln vocab = {math.log(cfg.vocab_size):.3f})"
    )


if __name__ == "__main__":
    main()
