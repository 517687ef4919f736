"""The timing loop the PyTorch baselines share (bench/gpt2_torch.py, bench/llama_torch.py)."""

import time

import torch


def optimizer_step(loss, model, opt):
    """Backward, clip the gradient norm at 1.0, AdamW step, drop the gradients."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def time_steps(step, dev, warmup, steps):
    """Run `warmup` steps, then time `steps` steps (synchronised on a GPU).

    Returns (seconds, the last step's loss)."""

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = step()
    sync()
    return time.perf_counter() - start, loss


def device_name(dev):
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
