#!/usr/bin/env bash
# Build, on a machine with Rust (no GPU needed), what scripts/gpu-check.sh runs on a GPU machine
# that has no Rust toolchain: `tessera` and the `--features cuda` test binaries, stripped, in the
# ignored folder .gpu/. Carry .gpu/ to the device (the device tool's `carry`), then run
# `bash scripts/gpu-check.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --features cuda --bin tessera
cp target/release/tessera .gpu/tessera
# The test binaries of the runtime that scripts/gpu-check.sh runs with the CUDA backend: the op
# tests (CPU, emulator, GPU), the ring ops and the FP8 linear, cuda-local and NCCL, the
# real-compiler check, the executor on the GPU, and the library's own tests (probe, doctor). Only these: every test binary together is
# 150 MB, over the 64 MiB that travels to the device machine.
cargo test --release -p tessera-runtime --features cuda --no-run --message-format=json \
  | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["profile"]["test"]:
        kind = m["target"]["kind"][0]
        name = "lib" if kind == "lib" else m["target"]["name"]
        if name not in ("lib", "ops", "ops_ring", "fp8_gemm", "cuda_local", "nvrtc", "executor_cuda"):
            continue
        shutil.copy(exe, os.path.join(".gpu/tests", name))
        print("carried", name)
'
strip .gpu/tessera .gpu/tests/* 2>/dev/null || true
du -sh .gpu
