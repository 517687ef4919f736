#!/usr/bin/env bash
# Run on a GPU machine from the repository root, after scripts/gpu-build.sh built .gpu/ elsewhere.
# Everything goes to one log, $OUT/gpu-check.log when $OUT is set (the device tool), else
# ./gpu-check.log, and a JSON summary beside it (gpu-check.json), rewritten after every step so a
# run cut short keeps what it measured. Each step runs under its own time limit and even if an
# earlier one failed; the summary lists which failed. The whole script takes at most about 8
# minutes (the limits add up to less). Order: correctness first (doctor, libraries, NVRTC, the op
# tests, cuda-local, the executor against the CPU, `tessera run` of the tiny plan and GPT-2), then
# speed side by side (GPT-2 124M and a Llama-shaped 1B, Tessera against PyTorch eager and
# torch.compile in the same call), then compute-sanitizer over the op tests, then
# `tessera calibrate --gpu` with what time is left. The paths are the ones that worked on the device machine (../shared/gpu/README.md):
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

SUMMARY="${OUT:-.}/gpu-check.json"
failed=()
steps_json=""
step() {
  # step NAME LIMIT_SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  echo
  echo "== $name (limit ${limit} s): $*"
  local start=$SECONDS rc=0
  timeout -k 10 "$limit" "$@" || rc=$?
  local took=$((SECONDS - start)) status=ok
  if [ "$rc" -eq 0 ]; then
    echo "== $name: ok ($took s)"
  else
    status=failed
    [ "$rc" -eq 124 ] && status=timeout
    echo "== $name: FAILED (exit $rc, $took s)"
    failed+=("$name")
  fi
  steps_json="${steps_json:+$steps_json,}{\"step\":\"$name\",\"status\":\"$status\",\"exit\":$rc,\"seconds\":$took}"
  printf '{"host":"%s","gpu":"%s","steps":[%s]}\n' "$(hostname)" "$GPU_NAME" "$steps_json" > "$SUMMARY"
}
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)"
# The cluster spec of the GPU found: its plans' predictions and `calibrate --gpu` read it
# (calibrate refuses another GPU's spec).
case "$GPU_NAME" in
  *H200*) SPEC=specs/clusters/dgx-h200-141g.toml ;;
  *) SPEC=specs/clusters/dgx-h100-80g.toml ;;
esac
echo "cluster spec for $GPU_NAME: $SPEC"

T=.gpu/tests
G=.gpu/tessera
# 1. Correctness.
step doctor 60 $G doctor
step library 60 "$T/lib" --nocapture backend::cuda::
step nvrtc 60 "$T/nvrtc" --nocapture
step ops 90 "$T/ops" --nocapture
# Context parallelism's ring-attention ops (ring_attention.cu) against the CPU backend's.
step ops-ring 60 env TESSERA_REQUIRE_GPU=1 "$T/ops_ring" --nocapture gpu
# The tensorwise FP8 linear (fp8.cu's amax, scale and cast, cuBLASLt's FP8 GEMM) against the CPU
# reference quant::fp8: amax, scales and every E4M3 code bit for bit, y within the bound
# tests/fp8_gemm.rs derives (it prints the share of the bound used).
step fp8-gemm 60 env TESSERA_REQUIRE_GPU=1 "$T/fp8_gemm" --nocapture gpu
step cuda-local 60 "$T/cuda_local" --nocapture
# The executor on the GPU: the tiny model 1×1×1 and 2×2×2 (every rank on GPU 0) against the
# CPU backend at bf16 tolerance, as tests/executor_emulated.rs checks it on the emulator in CI.
step executor 90 env TESSERA_REQUIRE_GPU=1 "$T/executor_cuda" --nocapture
# `tessera run` on the GPU: the README's tiny plan with --backend cuda, then GPT-2 124M planned
# for this GPU (sequence 1024, micro-batch 32 as the PyTorch baseline, 2 micro-batches a step),
# with the planner's predicted step time printed next to the measured one.
step run-tiny 60 sh -c "$G plan specs/models/tiny.toml specs/clusters/cpu-8.toml --dp 2 --pp 2 --tp 2 --no-sp --micro-batch 2 --schedule 1f1b --zero 1 -o .gpu/tiny-plan.json && $G run .gpu/tiny-plan.json --backend cuda --steps 20"
step run-gpt2 120 sh -c "$G plan specs/models/gpt2-124m.toml $SPEC --devices 1 --global-batch 64 --micro-batch 32 -o .gpu/gpt2-plan.json && $G run .gpu/gpt2-plan.json --steps 12 --metrics \${OUT:-.gpu}/gpt2-tessera.jsonl"
# NCCL on device buffers needs a GPU per rank: with 2 or more GPUs, the tiny model with DP over
# all of them, compared with the same plan through host memory (losses agree within bf16).
ngpu=$(nvidia-smi -L 2> /dev/null | wc -l)
if [ "$ngpu" -ge 2 ]; then
  step run-nccl 90 sh -c ".gpu/tessera plan specs/models/tiny.toml specs/clusters/cpu-8.toml --devices $ngpu --dp $ngpu --pp 1 --tp 1 --zero 0 -o .gpu/nccl-plan.json && .gpu/tessera run .gpu/nccl-plan.json --backend cuda --collectives nccl --steps 20 --metrics .gpu/nccl.jsonl && .gpu/tessera run .gpu/nccl-plan.json --backend cuda --collectives staged --steps 20 --metrics .gpu/staged.jsonl && paste .gpu/nccl.jsonl .gpu/staged.jsonl | tail -3"
else
  echo "one GPU: NCCL on device buffers skipped (it needs a GPU per rank)"
fi
# 2. Speed side by side: the same model, micro-batch, sequence, bf16 and fused AdamW.
if python3 -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
  step torch-gpt2-eager 60 python3 bench/gpt2_torch.py --steps 20 --micro-batch 32
  step torch-gpt2-compile 150 python3 bench/gpt2_torch.py --steps 20 --micro-batch 32 --compile
  step run-llama1b 120 sh -c "$G plan bench/llama-1b/config.json $SPEC --devices 1 --seq-len 2048 --global-batch 8 --micro-batch 4 -o .gpu/llama-plan.json && $G run .gpu/llama-plan.json --steps 6 --metrics \${OUT:-.gpu}/llama-tessera.jsonl"
  step torch-llama1b-eager 90 python3 bench/llama_torch.py --steps 10 --micro-batch 4 --seq-len 2048
  step torch-llama1b-compile 150 python3 bench/llama_torch.py --steps 10 --micro-batch 4 --seq-len 2048 --compile
else
  echo "no PyTorch with CUDA: the baselines skipped"
fi
# 3. compute-sanitizer over the op tests on the GPU.
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck initcheck synccheck; do
    step "sanitizer-$tool" 60 compute-sanitizer --tool "$tool" --error-exitcode 1 "$T/ops" cuda
    step "sanitizer-ring-$tool" 45 compute-sanitizer --tool "$tool" --error-exitcode 1 "$T/ops_ring" gpu
  done
  step sanitizer-fp8-memcheck 45 compute-sanitizer --tool memcheck --error-exitcode 1 "$T/fp8_gemm" gpu
else
  echo "compute-sanitizer not found: skipped"
fi
# 4. The GPU's calibration table, with what time is left.
step calibrate-gpu 120 sh -c "$G calibrate --gpu $SPEC --timeout 110 -o \${OUT:-.gpu}/calibrated.toml"

echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "== all steps passed"
else
  echo "== failed: ${failed[*]}"
  exit 1
fi
