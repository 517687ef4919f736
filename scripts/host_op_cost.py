#!/usr/bin/env python3
"""Host cost per eager PyTorch op, forward and backward: `[calibration] host_op_us`, and on a GPU
host its two parts, `host_dispatch_us` and `host_launch_us`.

Times N tiny element-wise ops on 1-element tensors with autograd recording (so the GPU work is
negligible and what is measured is Python, the dispatcher, autograd and the launch), then the
backward through their autograd nodes, and prints microseconds per op for each and their mean
(the value `host_op_us` takes; planner/src/cost/host.rs). Run it on the GPU machine's host
(`tessera calibrate` would); on a CPU-only machine it measures that CPU's dispatch, not a GPU
host's.

With `--device cuda` it also splits the forward op into its dispatch and its launch, the two
costs a profile's counted dispatches and launches are multiplied by (docs/host-floor.md):
- `host_launch_us`: the median host duration of the `cudaLaunchKernel` calls in a
  `torch.profiler` trace of the same chain (CUPTI's own callback adds a little to each);
- `host_dispatch_us`: the forward's time per op less its one launch.
No GPU was lent when this was written: these two have not been run yet.

    python3 scripts/host_op_cost.py [--ops 2000] [--repeats 20] [--device cuda]
"""
import argparse
import statistics
import time

import torch


def chain(x, ops: int):
    y = x
    for _ in range(ops):
        y = y * 1.0001  # one op, one autograd node (MulBackward0), one kernel on a GPU
    return y


def run(ops: int, device: str) -> tuple[float, float]:
    x = torch.ones(1, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    y = chain(x, ops)
    t1 = time.perf_counter()  # the host's time: the GPU's is ~1 µs per tiny kernel and async
    y.sum().backward()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / ops * 1e6, (t2 - t1) / ops * 1e6


def launch_us(ops: int, device: str) -> tuple[float, int]:
    """The median host microseconds of one kernel launch in a profiled forward chain, and how
    many launches the trace holds."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1, device=device, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        chain(x, ops)
        torch.cuda.synchronize()
    times = [e.cpu_time_total for e in p.events() if e.name.startswith("cudaLaunchKernel")]
    if not times:
        raise SystemExit("no cudaLaunchKernel in the trace: is this a CUDA build of PyTorch?")
    return statistics.median(times), len(times)


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
    if a.device.startswith("cuda"):
        launch, n = launch_us(a.ops, a.device)
        print(f"# cudaLaunchKernel: median {launch:.2f} us over {n} launches ({a.ops} ops)")
        print(f"host_launch_us = {launch:.2f}")
        print(f"host_dispatch_us = {f - launch * n / a.ops:.2f}")


if __name__ == "__main__":
    main()
