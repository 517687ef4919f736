#!/usr/bin/env python3
"""Host cost per eager PyTorch op, forward and backward: `[calibration] host_op_us`.

Times N tiny element-wise ops on 1-element tensors with autograd recording (so the GPU work is
negligible and what is measured is Python, the dispatcher, autograd and the launch), then the
backward through their autograd nodes, and prints microseconds per op for each and their mean
(the value `host_op_us` takes; planner/src/cost/host.rs). Run it on the GPU machine's host
(`tessera calibrate` would); on a CPU-only machine it measures that CPU's dispatch, not a GPU
host's.

    python3 scripts/host_op_cost.py [--ops 2000] [--repeats 20] [--device cuda]
"""
import argparse
import statistics
import time

import torch


def run(ops: int, device: str) -> tuple[float, float]:
    x = torch.ones(1, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    y = x
    for _ in range(ops):
        y = y * 1.0001  # one op, one autograd node (MulBackward0)
    t1 = time.perf_counter()  # the host's time: the GPU's is ~1 µs per tiny kernel and async
    y.sum().backward()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / ops * 1e6, (t2 - t1) / ops * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    a = p.parse_args()
    run(a.ops, a.device)  # warm-up: allocator, CUDA context, autograd engine threads
    fwd, bwd = zip(*(run(a.ops, a.device) for _ in range(a.repeats)))
    f, b = statistics.median(fwd), statistics.median(bwd)
    print(f"device {a.device}, torch {torch.__version__}, {a.ops} ops x {a.repeats}")
    print(f"forward  {f:.2f} us/op (dispatch + autograd recording)")
    print(f"backward {b:.2f} us/op (autograd engine, one node per op)")
    print(f"host_op_us = {(f + b) / 2:.2f}")


if __name__ == "__main__":
    main()
