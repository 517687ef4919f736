#!/usr/bin/env python3
"""Measure one CUDA GPU through PyTorch, for `tessera calibrate --gpu`: the raw times that
the `[calibration]` table of a cluster spec is computed from (src/commands/calibrate_gpu.rs
turns them into efficiencies against the spec's own peaks).

Measured, each as seconds per call (CUDA events, after warm-up):
- bf16 GEMMs (cuBLAS through `a @ b`): square shapes and the four GEMMs of a transformer
  layer (QKV, projection, MLP up and down) at 4096 and 16384 tokens, TP 1, 2 and 8;
- FP8 GEMMs where the GPU has FP8 tensor cores (`torch._scaled_mm`, e4m3, tensorwise scales,
  bf16 out): squares and the TP-1 layer GEMMs of h 4096 and 8192 at 16384 tokens (`gemm_fp8`);
- causal SDPA forward and forward+backward at a few (T, head dimension);
- element-wise bandwidth: a device copy, a layernorm and a tanh GELU (bytes read + written);
- the host's cost per eager op: many tiny ops with autograd, forward and backward, wall clock
  (the GPU idles: what is timed is PyTorch's dispatch, autograd and the launch), and the
  forward's alone with the host time of one cudaLaunchKernel from a profiled chain;
- the loss: `F.cross_entropy` on fp32 logits, forward+backward, at N x V, and a fused variant
  (`torch.compile` of the same function) where it compiles.

Prints one JSON document (schema "tessera-gpu-calibration/1") on standard output; progress on
standard error. Without PyTorch or a CUDA device it prints why on standard error and exits
with NO_GPU (3). Modelled on ../shared/gpu/calibrate_kernels.py (the H100 measurements in
../shared/gpu/h100-kernels.jsonl).
"""
import json
import sys
import time

SCHEMA = "tessera-gpu-calibration/1"
NO_GPU = 3


def log(msg):
    print(msg, file=sys.stderr, flush=True)


try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    log(f"no GPU to measure: PyTorch is not importable by {sys.executable} ({e})")
    sys.exit(NO_GPU)
if not torch.cuda.is_available():
    log(f"no GPU to measure: torch.cuda.is_available() is False (PyTorch {torch.__version__}, "
        f"CUDA build {torch.version.cuda}, {sys.executable})")
    sys.exit(NO_GPU)

dev = "cuda"


def timeit(fn, reps=20):
    """Seconds per call of fn, by CUDA events around reps calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def gemm(m, k, n):
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    return {"m": m, "k": k, "n": n, "dtype": "bf16", "seconds": timeit(lambda: a @ b)}


def gemms():
    out = []
    # Squares from 1024: below it cuBLAS is launch-bound, which a fraction of peak cannot
    # express (../shared/gpu/README.md); the host per-op cost measures that floor.
    for d in [1024, 2048, 4096, 8192, 16384]:
        out.append(gemm(d, d, d))
        log(f"gemm {d}^3")
    for tokens in [4096, 16384]:
        for h in [768, 1600, 2048, 4096, 8192, 12288]:
            for tp in [1, 2, 8]:
                if h % tp or h // tp < 128:
                    continue
                for k, n in [(h, 3 * h // tp), (h // tp, h), (h, 4 * h // tp), (4 * h // tp, h)]:
                    out.append(gemm(tokens, k, n))
            log(f"gemm layer shapes, {tokens} tokens, h {h}")
    return out


def gemm_fp8():
    """FP8 GEMMs (cuBLASLt through torch._scaled_mm: e4m3 operands, tensorwise scales, bf16
    out) on a GPU with FP8 tensor cores (compute capability 8.9 and up): squares and the four
    TP-1 layer GEMMs of h 4096 and 8192 at 16384 tokens. None where the GPU has none or the
    call fails (the measurement then has no `gemm_fp8`)."""
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (8, 9) or not hasattr(torch, "_scaled_mm"):
        log("no FP8 GEMMs: compute capability below 8.9 or no torch._scaled_mm")
        return None
    one = torch.tensor(1.0, device=dev)

    def fp8(m, k, n):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        # cuBLASLt's FP8 GEMM takes the second operand column-major (TN).
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn).t()
        f = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return {"m": m, "k": k, "n": n, "dtype": "fp8", "seconds": timeit(f)}

    out = []
    try:
        for d in [2048, 4096, 8192, 16384]:
            out.append(fp8(d, d, d))
            log(f"fp8 gemm {d}^3")
        for h in [4096, 8192]:
            for k, n in [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]:
                out.append(fp8(16384, k, n))
            log(f"fp8 gemm layer shapes, 16384 tokens, h {h}")
    except Exception as e:  # an FP8 path this PyTorch or driver lacks: no FP8 figures
        log(f"FP8 GEMMs not measured: {type(e).__name__}: {e}")
        return None
    return out


def attention():
    out = []
    for b, nh, t, d in [(8, 12, 1024, 64), (4, 32, 2048, 128), (2, 32, 4096, 128),
                        (1, 32, 8192, 128), (1, 16, 16384, 128)]:
        q = torch.randn(b, nh, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn_like(q, requires_grad=True)
        fwd = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

        def fb():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o))

        out.append({"b": b, "heads": nh, "seq": t, "dhead": d, "causal": True,
                    "fwd_seconds": fwd, "fwd_bwd_seconds": timeit(fb, 10)})
        log(f"sdpa T {t} d {d}")
    return out


def elementwise():
    out = []
    x = torch.empty(2**30 // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    out.append({"op": "copy", "bytes": 2 * x.numel() * 2, "seconds": timeit(lambda: y.copy_(x))})
    del x, y
    h = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    out.append({"op": "layernorm", "bytes": 2 * h.numel() * 2,
                "seconds": timeit(lambda: F.layer_norm(h, (4096,), w))})
    out.append({"op": "gelu", "bytes": 2 * h.numel() * 2,
                "seconds": timeit(lambda: F.gelu(h, approximate="tanh"))})
    log("element-wise")
    return out


def host_op(chain=200, reps=50):
    """Wall-clock seconds of `reps` forward+backward passes through a chain of `chain` tiny
    multiplies (8 elements) with autograd: each op costs one forward and one backward kernel,
    and the GPU finishes each in far less time than the host takes to issue it. Also the
    forwards' seconds alone and the median host seconds of one cudaLaunchKernel in a profiled
    forward chain: the forward op's launch, the rest of it its dispatch (host_launch_us,
    host_dispatch_us)."""
    x = torch.randn(8, device=dev, requires_grad=True)

    def forward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    def step():
        forward().sum().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(reps):
        forward()
    torch.cuda.synchronize()
    forward_seconds = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        forward()
        torch.cuda.synchronize()
    launches = sorted(e.cpu_time_total for e in p.events() if e.name.startswith("cudaLaunchKernel"))
    log("host per-op cost")
    out = {"what": "y = y * c on 8 elements with autograd, forward and backward",
           "ops": chain * reps, "seconds": seconds}
    if launches:
        out.update(forward_seconds=forward_seconds,
                   launch_seconds=launches[len(launches) // 2] * 1e-6)
    return out


def loss(n=8192, v=50257):
    logits = torch.randn(n, v, device=dev, dtype=torch.float32, requires_grad=True)
    target = torch.randint(0, v, (n,), device=dev)

    def run(f):
        def fb():
            f(logits, target).backward()
        return fb

    out = [{"variant": "F.cross_entropy", "n": n, "vocab": v, "dtype": "fp32",
            "seconds": timeit(run(F.cross_entropy), 10)}]
    try:
        fused = torch.compile(F.cross_entropy)
        out.append({"variant": "torch.compile(F.cross_entropy)", "n": n, "vocab": v,
                    "dtype": "fp32", "seconds": timeit(run(fused), 10)})
    except Exception as e:  # no Triton, no compiler: the eager figure stands alone
        log(f"fused loss not measured: {type(e).__name__}: {e}")
    log("loss")
    return out


def main():
    p = torch.cuda.get_device_properties(0)
    doc = {
        "schema": SCHEMA,
        "device": {"name": p.name, "capability": f"{p.major}.{p.minor}",
                   "memory_gib": p.total_memory / 2**30, "torch": torch.__version__,
                   "cuda": torch.version.cuda},
        "gemm": gemms(),
        "attention": attention(),
        "elementwise": elementwise(),
        "host_op": host_op(),
        "loss": loss(),
    }
    fp8 = gemm_fp8()
    if fp8:
        doc["gemm_fp8"] = fp8
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
