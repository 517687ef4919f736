#!/usr/bin/env python3
"""PyTorch baseline for Tessera's GPT-2 124M run: the same model, batch and sequence, on one GPU.

GPT-2 124M (12 layers, hidden 768, 12 heads, vocab 50257, tied embeddings, learned positions,
LayerNorm, GELU), random tokens (no download), bf16 autocast, scaled-dot-product attention
(causal), fused AdamW. Eager by default; `--compile` wraps the model in torch.compile. After
`--warmup` steps it times `--steps` steps (synchronised) and prints tokens/s and MFU.

MFU counts model FLOPs as Tessera's plans do (docs/plan.md, `flop_convention`): 6 FLOPs per
parameter per token (weights and logits included, recompute excluded) plus the attention matmuls
over the full s×s square (12·layers·seq·hidden per token), over the device's dense bf16 peak (`--peak-tflops`; 989.4 for the H100 SXM, from
NVIDIA's H100 datasheet, dense BF16 Tensor Core).

Run by scripts/gpu-check.sh; by hand: `python3 bench/gpt2_torch.py --steps 30 [--compile]`.
"""

import argparse
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from timing import device_name, optimizer_step, time_steps


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, vocab, positions):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.4)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()

    torch.manual_seed(1234)
    dev = torch.device(a.device)
    model = GPT(a.layers, a.hidden, a.heads, a.vocab, a.seq_len).to(dev)
    params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=6e-4, weight_decay=0.1, fused=dev.type == "cuda"
    )
    step_fn = torch.compile(model) if a.compile else model
    tokens = a.micro_batch * a.seq_len
    gen = torch.Generator(device=dev).manual_seed(0)

    def step():
        idx = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len + 1), device=dev, generator=gen)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            loss = step_fn(idx[:, :-1], idx[:, 1:])
        return optimizer_step(loss, model, opt)

    elapsed, loss = time_steps(step, dev, a.warmup, a.steps)

    per_s = tokens * a.steps / elapsed
    # QK^T and AV (2·2·s·d per token and layer), forward and backward (3×), full s×s square.
    attn = 12 * a.layers * a.seq_len * a.hidden
    flops_per_token = 6 * params + attn
    mfu = per_s * flops_per_token / (a.peak_tflops * 1e12)
    name = device_name(dev)
    print(
        f"pytorch {torch.__version__} {'compile' if a.compile else 'eager'} on {name}: "
        f"{params} parameters, micro-batch {a.micro_batch} × seq {a.seq_len}, "
        f"{a.steps} steps after {a.warmup} warm-up: {elapsed / a.steps * 1e3:.1f} ms/step, "
        f"{per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {a.peak_tflops} TFLOP/s, "
        f"last loss {loss.item():.3f} (ln vocab = {math.log(a.vocab):.3f})"
    )


if __name__ == "__main__":
    main()
