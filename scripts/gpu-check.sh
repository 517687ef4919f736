#!/usr/bin/env bash
# Run on a GPU machine from the repository root, after scripts/gpu-build.sh built .gpu/ elsewhere.
# Everything goes to one log: $OUT/gpu-check.log when $OUT is set (the device tool), else
# ./gpu-check.log. Each step runs even if an earlier one failed; the summary at the end lists
# which failed. The paths are the ones that worked on the device machine (../shared/gpu/README.md):
# the CUDA 13.0 toolkit's libraries, NVRTC first, and the system NCCL under the name cudarc looks for.
set -u
cd "$(dirname "$0")/.."
LOG="${OUT:-.}/gpu-check.log"
exec > >(tee "$LOG") 2>&1

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda-13.0}"
CUDA_LIB="$CUDA_HOME/targets/x86_64-linux/lib"
mkdir -p .gpu/lib
for nccl in /usr/lib/x86_64-linux-gnu/libnccl.so.2 \
  "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)/lib/libnccl.so.2"; do
  if [ -f "$nccl" ]; then ln -sf "$nccl" .gpu/lib/libnccl.so; break; fi
done
export LD_LIBRARY_PATH="$CUDA_LIB:$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TESSERA_PTXAS="$CUDA_HOME/bin/ptxas" TESSERA_REQUIRE_NVRTC=1 TESSERA_KERNEL_CACHE=off
echo "== $(date -u) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

failed=()
step() {
  local name="$1"
  shift
  echo
  echo "== $name: $*"
  local start=$SECONDS
  if "$@"; then
    echo "== $name: ok ($((SECONDS - start)) s)"
  else
    echo "== $name: FAILED (exit $?, $((SECONDS - start)) s)"
    failed+=("$name")
  fi
}

T=.gpu/tests
step doctor .gpu/tessera doctor
step library "$T/lib" --nocapture backend::cuda::
step nvrtc "$T/nvrtc" --nocapture
step ops "$T/ops" --nocapture
step cuda-local "$T/cuda_local" --nocapture
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck initcheck synccheck; do
    step "sanitizer-$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 "$T/ops" cuda
  done
else
  echo "compute-sanitizer not found: skipped"
fi
# The executor on the GPU: the tiny model 1×1×1 and 2×2×2 (every rank on GPU 0) against the
# CPU backend at bf16 tolerance, as tests/executor_emulated.rs checks it on the emulator in CI.
step executor env TESSERA_REQUIRE_GPU=1 "$T/executor_cuda" --nocapture
# `tessera run` on the GPU: the README's tiny plan with --backend cuda, then GPT-2 124M planned
# for one H100 (sequence 1024; the planner picks the micro-batch), with the planner's predicted
# step time printed next to the measured one.
step run-tiny sh -c '.gpu/tessera plan specs/models/tiny.toml specs/clusters/cpu-8.toml --dp 2 --pp 2 --tp 2 --no-sp --micro-batch 2 --schedule 1f1b --zero 1 -o .gpu/tiny-plan.json && .gpu/tessera run .gpu/tiny-plan.json --backend cuda --steps 20'
step run-gpt2 sh -c '.gpu/tessera plan specs/models/gpt2-124m.toml specs/clusters/dgx-h100-80g.toml --devices 1 -o .gpu/gpt2-plan.json && .gpu/tessera run .gpu/gpt2-plan.json --steps 20'
# NCCL on device buffers needs a GPU per rank: with 2 or more GPUs, the tiny model with DP over
# all of them, compared with the same plan through host memory (losses agree within bf16).
ngpu=$(nvidia-smi -L 2> /dev/null | wc -l)
if [ "$ngpu" -ge 2 ]; then
  step run-nccl sh -c ".gpu/tessera plan specs/models/tiny.toml specs/clusters/cpu-8.toml --devices $ngpu --dp $ngpu --pp 1 --tp 1 --zero 0 -o .gpu/nccl-plan.json && .gpu/tessera run .gpu/nccl-plan.json --backend cuda --collectives nccl --steps 20 --metrics .gpu/nccl.jsonl && .gpu/tessera run .gpu/nccl-plan.json --backend cuda --collectives staged --steps 20 --metrics .gpu/staged.jsonl && paste .gpu/nccl.jsonl .gpu/staged.jsonl | tail -3"
else
  echo "one GPU: NCCL on device buffers skipped (it needs a GPU per rank)"
fi
if python3 -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
  step torch-eager python3 bench/gpt2_torch.py --steps 30
  step torch-compile python3 bench/gpt2_torch.py --steps 30 --compile
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "== all steps passed"
else
  echo "== failed: ${failed[*]}"
  exit 1
fi
