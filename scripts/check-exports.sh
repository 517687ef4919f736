#!/usr/bin/env bash
# `tessera export`'s texts read by the targets' own code (docs/exports.md, "How the exports are
# checked"). Every check also feeds in a broken variant that must be refused.
#
#   matrix      every plan of the matrix below × every target: the export either succeeds and
#               the target's own code accepts it and reads the plan's values (derived from
#               plan.json), or `tessera export` refuses it (exit 2) naming the feature, as the
#               table says. CI runs this (.ci/run). The engines come from
#               TESSERA_TORCH_PYTHON, else from scripts/check-exports-env.sh (a venv cached
#               outside the clone: torch, DeepSpeed, torchtitan, megatron-core, PyPI only).
#   megatron | deepspeed | torchtitan | kubernetes | peft | torchtune | accelerate | lightning
#               the matrix's column of that target alone
#     megatron    Megatron-LM's parse_args, validate_args, TransformerConfig (megatron-core's
#                 wheel, or the Megatron-LM tree MEGATRON_LM); skipped, with the reason, where
#                 neither is there (megatron-core needs Python >= 3.12)
#     deepspeed   DeepSpeed's DeepSpeedConfig
#     torchtitan  torchtitan 0.2's ConfigManager, ParallelDims' mesh, apply_ac (0.3 reads no TOML)
#     kubernetes  kubernetes-validate --strict, offline, and the pods, ranks, GPUs and token
#     peft        PEFT's LoraConfig.from_pretrained, get_peft_model on the plan's transformers
#                 model (meta device): its trainable count is the plan's (engines venv + peft)
#     torchtune   torchtune 0.6.1's recipe parser and config.instantiate on the meta device: the
#                 model, LoRA and trainable count, batch, dtype, optimizer are the plan's (a venv
#                 of its own: scripts/check-exports-env.sh torchtune)
#     accelerate  accelerate 1.15's config loader, launch parser and launcher environment, and the
#                 FSDP or DeepSpeed plugin its processes build from it (engines venv)
#     lightning   the snippet executed: Lightning 2.6's strategy and Trainer built on the CPU
#                 (no fit), their attributes against the plan (engines venv)
#     (sbatch)    in the matrix: bash -n and the #SBATCH lines against the plan
#   sbatch      the matrix's sbatch column, then every script it exports through `sbatch
#               --test-only` against a slurmctld of its own on loopback (by hand, as root, with
#               Debian's slurmctld, slurm-client and munge)
#   megatron-deepspeed  Megatron-DeepSpeed's parse_args on the flags the deepspeed export prints,
#               by hand, with TESSERA_TORCH_PYTHON (+ transformers, six) and MEGATRON_DEEPSPEED: a
#               Megatron-DeepSpeed tree (not on PyPI)
# The binary is target/release/tessera, or $TESSERA.
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-$PWD/target/release/tessera}
export PYTHONDONTWRITEBYTECODE=1 # no __pycache__ in scripts/
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
TARGETS=(megatron deepspeed torchtitan sbatch kubernetes peft torchtune accelerate lightning)
MODE=${1:-}
case "$MODE" in
matrix) COLUMNS_=("${TARGETS[@]}") ;;
kubernetes | deepspeed | megatron | torchtitan | sbatch | peft | torchtune | accelerate | lightning) COLUMNS_=("$MODE") ;;
megatron-deepspeed) COLUMNS_=() ;;
*)
  echo "usage: $0 matrix|megatron|deepspeed|torchtitan|kubernetes|sbatch|peft|torchtune|accelerate|lightning|megatron-deepspeed" >&2
  exit 2
  ;;
esac

# ---------------------------------------------------------------------------------------------
# The matrix. Each plan is pinned completely (tessera plan evaluates that one layout); the table
# says, for each target, `ok` (exported, and the target's code accepts it and reads the plan's
# values) or `refuse:WORD` (`tessera export` exits 2, writes no file, and its message names WORD,
# case and all; `_` is a space).
# A plan name ending in +force is the plan before it exported with `tessera export --force`.
LLAMA=(specs/models/llama3-8b.toml specs/clusters/dgx-h100-80g.toml)
GPT3=(specs/models/gpt3-175b.toml specs/clusters/dgx-a100-80g.toml)
# Two DGX H100 nodes, for --devices 12 (the preset has one node; --nodes and --devices exclude
# each other).
sed 's/^nodes = 1$/nodes = 2/' specs/clusters/dgx-h100-80g.toml > "$TMP/dgx-h100-80g-2-nodes.toml"
declare -A PLAN
# (a) GPT-3 175B in Megatron-LM's SC'21 layout: TP 8, PP 8 interleaved ×2, SP, full recompute,
# distributed optimizer (tests/common GPT3_MEGATRON_LAYOUT), on 128 DGX A100; (b) the same on 1F1B.
PLAN[gpt3-interleaved]="${GPT3[*]} --nodes 128 --tp 8 --pp 8 --dp 16 --micro-batch 1 --recompute full --zero 1 --sp --schedule interleaved --virtual-stages 2 --no-hybrid-shard"
PLAN[gpt3-1f1b]="${GPT3[*]} --nodes 128 --tp 8 --pp 8 --dp 16 --micro-batch 1 --recompute full --zero 1 --sp --schedule 1f1b --no-hybrid-shard"
# (c) PP = 1 with 256 micro-batches per step: DP 2 × TP 4 + SP, micro-batch 1, global batch 512,
# a 1T-token budget (the exports carry its steps and the preset's checkpoint cadence),
# ZeRO-0 (so that all three engines can take it: ZeRO-0 is DDP for torchtitan).
PLAN[llama-pp1]="${LLAMA[*]} --nodes 1 --dp 2 --tp 4 --pp 1 --micro-batch 1 --sp --zero 0 --recompute full --tokens 1T"
# The same layout planned for torchtitan (`--framework`): its own export runs it; Megatron's and
# DeepSpeed's refuse a plan whose time and memory are another framework's.
PLAN[llama-pp1-torchtitan]="${LLAMA[*]} --nodes 1 --dp 2 --tp 4 --pp 1 --micro-batch 1 --sp --zero 0 --recompute full --framework torchtitan --tokens 1T"
# torch.compile's two torchtitan profiles (issue 41): the blocks and the loss, or the blocks alone
# (`[compile] components`), on PP 1 with many micro-batches, an uneven interleaved split, and 12
# GPUs that do not fill their second node.
PLAN[llama-pp1-titan-compile]="${LLAMA[*]} --nodes 1 --dp 2 --tp 4 --pp 1 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --framework torchtitan-compile"
PLAN[llama-pp1-titan-blocks]="${LLAMA[*]} --nodes 1 --dp 2 --tp 4 --pp 1 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --framework torchtitan-compile-blocks"
PLAN[llama-interleaved-uneven-titan-blocks]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --schedule interleaved --virtual-stages 3 --framework torchtitan-compile-blocks"
# Llama-3 8B as tests/exports.rs plans it: DP 2 × TP 2 + SP × PP 2, stages of 17 and 15 layers
# (Megatron's first/last-stage flags), ZeRO-1; with FSDP (torchtitan), and with selective
# recompute under flash attention (torchtitan's per-op mode).
PLAN[llama-pp2]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 1 --recompute full"
PLAN[llama-pp2-fsdp]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 3 --no-hybrid-shard --recompute full"
PLAN[llama-pp2-fsdp-selective]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 3 --no-hybrid-shard --recompute selective"
# (d) Interleaved with uneven chunks: 32 layers as PP 2 × 3 chunks of 5, 6, 5, 5, 6, 5 (stages of
# 16 and 16, the first chunk of the first stage and the last of the last the short ones); ZeRO-1
# (Megatron: --pipeline-model-parallel-layout) and ZeRO-3 (torchtitan: 6 model parts). And
# Llama 3's layout in small: 32 layers on PP 2 × 17 chunks, the end stages pinned one layer
# short, so that the first chunk holds only the embedding and the last only the loss.
PLAN[llama-interleaved-uneven]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 1 --recompute full --schedule interleaved --virtual-stages 3"
PLAN[llama-interleaved-uneven-fsdp]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --schedule interleaved --virtual-stages 3"
# (d') Context parallelism: Llama-3 8B at 16,384 tokens, CP 2 × TP 2 × DP 2, ZeRO-1 (Megatron:
# --context-parallel-size) and ZeRO-3 (torchtitan: context_parallel_degree).
PLAN[llama-cp]="${LLAMA[*]} --nodes 1 --seq-len 16384 --global-batch 64 --tp 2 --cp 2 --pp 1 --dp 2 --micro-batch 1 --sp --zero 1 --recompute full"
PLAN[llama-cp-fsdp]="${LLAMA[*]} --nodes 1 --seq-len 16384 --global-batch 64 --tp 2 --cp 2 --pp 1 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full"
# The same with K and V all-gathered (Llama 3's CP: Megatron --cp-comm-type all_gather,
# torchtitan context_parallel_rotate_method = "allgather").
PLAN[llama-cp-ag]="${LLAMA[*]} --nodes 1 --seq-len 16384 --global-batch 64 --tp 2 --cp 2 --cp-comm all-gather --pp 1 --dp 2 --micro-batch 1 --sp --zero 1 --recompute full"
PLAN[llama-cp-ag-fsdp]="${LLAMA[*]} --nodes 1 --seq-len 16384 --global-batch 64 --tp 2 --cp 2 --cp-comm all-gather --pp 1 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full"
PLAN[llama-ends-short]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 1 --recompute full --schedule interleaved --virtual-stages 17 --first-stage-layers 16 --last-stage-layers 16"
# ZeRO-3 over 2 nodes (DP 16), and (e) HSDP: the same sharded within each node, replicated across.
PLAN[llama-zero3-2-nodes]="${LLAMA[*]} --nodes 2 --dp 16 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 1 --recompute full"
PLAN[llama-hsdp]="${LLAMA[*]} --nodes 2 --dp 16 --tp 1 --pp 1 --zero 3 --hybrid-shard --micro-batch 1 --recompute full"
# (f) Full recompute of every 4th layer: on one stage (Megatron's block method), on an even
# split of 16 + 16 (torchtitan's layer mode), and on GPT-3 13B's uneven split of 8, 12, 12, 8
# layers (every chunk a multiple of 4; Megatron's one K cannot state 2, 3, 3, 2).
PLAN[llama-every4]="${LLAMA[*]} --nodes 1 --tp 2 --pp 1 --dp 4 --micro-batch 1 --sp --zero 1 --recompute full --recompute-every 4"
PLAN[llama-every4-pp2-fsdp]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --recompute-every 4 --schedule 1f1b"
PLAN[gpt3-13b-every4-uneven]="specs/models/gpt3-13b.toml specs/clusters/dgx-a100-80g.toml --nodes 1 --tp 2 --pp 4 --dp 1 --micro-batch 1 --sp --zero 1 --recompute full --recompute-every 4 --schedule 1f1b"
PLAN[gpt3-13b-every4-uneven-fsdp]="specs/models/gpt3-13b.toml specs/clusters/dgx-a100-80g.toml --nodes 1 --tp 2 --pp 4 --dp 1 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --recompute-every 4 --schedule 1f1b"
# (g) 12 GPUs on 8-GPU nodes: the last node holds 4 ranks. DP 3 × TP 4 + SP, global batch 768.
PLAN[llama-12-gpus]="specs/models/llama3-8b.toml $TMP/dgx-h100-80g-2-nodes.toml --devices 12 --global-batch 768 --tp 4 --pp 1 --dp 3 --micro-batch 1 --sp --zero 0 --recompute full"
# The same 12 GPUs as DP 12 with ZeRO-3 (PP 1, 32 micro-batches): what the trainer targets could run,
# refused for the node they leave short.
PLAN[llama-12-gpus-fsdp]="specs/models/llama3-8b.toml $TMP/dgx-h100-80g-2-nodes.toml --devices 12 --global-batch 768 --tp 1 --pp 1 --dp 12 --micro-batch 2 --zero 3 --no-hybrid-shard --recompute full"
PLAN[llama-12-gpus-titan-blocks]="specs/models/llama3-8b.toml $TMP/dgx-h100-80g-2-nodes.toml --devices 12 --global-batch 768 --tp 1 --pp 1 --dp 12 --micro-batch 2 --zero 3 --no-hybrid-shard --recompute full --framework torchtitan-compile-blocks"
# (h) The README's CPU plan: the tiny model on the 8-device CPU cluster, DP 2 × PP 2 × TP 2.
PLAN[tiny-cpu]="specs/models/tiny.toml specs/clusters/cpu-8.toml --dp 2 --pp 2 --tp 2 --no-sp --micro-batch 2 --schedule 1f1b --zero 1"
# (i) Mixture of experts: Mixtral-8x7B in Megatron-Core's MoE benchmark layout (TP 1, EP 8, PP 4
# interleaved × 8, global batch 256 × 4096; docs/moe-figures.md row 3), and DeepSeek-V3 on its
# 2048 H800s as its report describes it (PP 16, EP 64, ZeRO-1; MLA, sigmoid router with score
# bias, group-limited top-8, a shared expert, the first 3 layers dense).
PLAN[mixtral-ep]="specs/models/mixtral-8x7b.toml specs/clusters/dgx-h100-80g.toml --nodes 8 --seq-len 4096 --global-batch 256 --tp 1 --pp 4 --dp 16 --ep 8 --micro-batch 1 --zero 1 --recompute none --schedule interleaved --virtual-stages 8 --no-hybrid-shard"
# (i') Zero-bubble schedules (issue 41): Llama-3 8B on PP 2 under ZB-V planned for torchtitan (its
# ZBVZeroBubble, two model parts per rank in a V), and under ZB-H1 planned for tessera (no
# engine export runs a one-chunk zero-bubble schedule).
PLAN[llama-zbv-fsdp]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 3 --no-hybrid-shard --recompute full --schedule zb-v --framework torchtitan"
PLAN[llama-zbh1]="${LLAMA[*]} --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --zero 1 --recompute full --schedule zb-h1 --framework tessera"
PLAN[deepseek-v3-ep]="specs/models/deepseek-v3.toml specs/clusters/h800-deepseek.toml --tp 1 --pp 16 --ep 64 --dp 128 --zero 1 --micro-batch 1 --schedule 1f1b --recompute full --no-hybrid-shard"
# Fine-tuning (docs/finetuning.md): Llama 3 8B with adapters as torchtune's
# llama3/8B_lora_single_device runs it (specs/finetune/llama3-8b-lora-torchtune.toml: pure bf16,
# rank 8 on q, v, o and the MLP, cosine to 0), LoRA and QLoRA on one RTX 4090, LoRA with 8-bit
# Adam states, LoRA on a DGX H100 with FSDP (ZeRO-3), and refused by torchtune with ZeRO-1 or TP;
# the QLoRA spec as given (its "default" mixed precision: torchtune has no fp32 master weights);
# GPT-2 LoRA from its HF config (PEFT's Conv1D names; torchtune has no GPT-2); and the full
# fine-tune of the same spec (decay on every tensor, as torchtune's optimizer takes
# model.parameters()), on one H100 and with FSDP.
FT=specs/finetune/llama3-8b-lora-torchtune.toml
sed -e 's/^method = "lora"/method = "full"/' -e 's/^weight_decay = 0.01$/&\ndecay_on = "all"/' -e '/^# PEFT/,$d' "$FT" > "$TMP/llama3-8b-full-torchtune.toml"
FULL=$TMP/llama3-8b-full-torchtune.toml
PLAN[ft-lora-1gpu]="$FT specs/clusters/rtx4090-24g.toml --devices 1 --micro-batch 2 --recompute full"
PLAN[ft-qlora-1gpu]="$FT specs/clusters/rtx4090-24g.toml --devices 1 --method qlora --micro-batch 2 --recompute full"
PLAN[ft-lora-8bit]="$FT specs/clusters/rtx4090-24g.toml --devices 1 --optimizer-states 8bit --micro-batch 2 --recompute full"
PLAN[ft-lora-fsdp]="$FT specs/clusters/dgx-h100-80g.toml --nodes 1 --dp 8 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 2 --recompute none"
PLAN[ft-lora-zero1]="$FT specs/clusters/dgx-h100-80g.toml --nodes 1 --dp 8 --tp 1 --pp 1 --zero 1 --micro-batch 2 --recompute none"
PLAN[ft-lora-tp]="$FT specs/clusters/dgx-h100-80g.toml --nodes 1 --dp 4 --tp 2 --pp 1 --sp --zero 3 --no-hybrid-shard --micro-batch 2 --recompute none"
PLAN[ft-qlora-spec]="specs/finetune/llama3-8b-qlora.toml specs/clusters/rtx4090-24g.toml --devices 1 --micro-batch 1 --recompute full"
PLAN[ft-gpt2-lora]="tests/fixtures/hf/gpt2/config.json specs/clusters/rtx4090-24g.toml --devices 1 --seq-len 1024 --global-batch 8 --method lora --lora-rank 4 --lora-targets all --micro-batch 1 --recompute none"
PLAN[ft-full-1gpu]="$FULL specs/clusters/dgx-h100-80g.toml --devices 1 --micro-batch 1 --recompute full"
PLAN[ft-full-fsdp]="$FULL specs/clusters/dgx-h100-80g.toml --nodes 1 --dp 8 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 2 --recompute full"
# Offload (issue 38): each mode on the same base plans, so that a plan differs from its base in
# the offload alone (whichever framework profile would run it): the plans above with
# parallel.offload, offload_to and offload_activations set, edited here (DERIVE: the base plan
# and the parallel fields). Llama-3 8B ZeRO-3 on 2 nodes with params, optimizer, NVMe and
# activation offload; ZeRO-1 with optimizer offload (Megatron's --optimizer-cpu-offload); the
# full fine-tune with FSDP and params + activation offload (torchtune), or optimizer offload. (LoRA
# with offload is not planned: the planner refuses it, docs/offload.md.)
declare -A DERIVE
DERIVE[llama-off-params]="llama-zero3-2-nodes offload=params"
DERIVE[llama-off-opt]="llama-zero3-2-nodes offload=optimizer"
DERIVE[llama-off-nvme]="llama-zero3-2-nodes offload=params offload_to=nvme"
DERIVE[llama-off-act]="llama-zero3-2-nodes offload_activations=true"
DERIVE[llama-every4-off-opt]="llama-every4 offload=optimizer"
DERIVE[ft-full-fsdp-off]="ft-full-fsdp offload=params offload_activations=true"
DERIVE[ft-full-fsdp-off-opt]="ft-full-fsdp offload=optimizer"
# FP8 (issue 41): llama-pp1's layout with each recipe (`--fp8`). Megatron-LM 0.19 runs
# tensorwise, delayed and blockwise (Transformer Engine), torchtitan 0.2.2 tensorwise and rowwise
# (torchao); every other target refuses. And ZeRO-3 on 2 nodes with tensorwise: torchtitan's
# float8 all-gather under FSDP.
for r in tensorwise rowwise delayed blockwise; do
  PLAN[llama-fp8-$r]="${PLAN[llama-pp1]} --fp8 $r"
done
PLAN[llama-fp8-fsdp]="${PLAN[llama-zero3-2-nodes]} --fp8 tensorwise"
# TP collectives overlapped with their GEMMs (training.tp_comm_overlap): Megatron-LM's
# --tp-comm-overlap on llama-pp1's TP 4 with SP, torchtitan 0.2.2's async TP on the compiled
# plan; every other target refuses (torchtitan too for the Megatron-Core plan: async TP needs
# the compiled model).
PLAN[llama-tp-overlap]="${PLAN[llama-pp1]} --tp-comm-overlap"
PLAN[llama-tp-overlap-titan]="${PLAN[llama-pp1-titan-compile]} --tp-comm-overlap"
# And on the uneven interleaved pipeline and the 12-GPU world that leaves its second node half
# empty: the flag changes only the overlap, every target decides the same.
PLAN[llama-tp-overlap-uneven]="${PLAN[llama-interleaved-uneven]} --tp-comm-overlap"
PLAN[llama-tp-overlap-12-gpus]="${PLAN[llama-12-gpus]} --tp-comm-overlap"
# A layout that does not fit, written with --force ("feasible": false): refused by every target;
# exported with `tessera export --force` it is an ordinary DDP plan every target takes.
PLAN[llama-infeasible]="${LLAMA[*]} --nodes 1 --dp 8 --tp 1 --pp 1 --micro-batch 4 --zero 0 --recompute none --force"

EXPECTED=$(
  cat << 'TABLE'
# plan                         megatron                  deepspeed                 torchtitan                sbatch                    kubernetes                peft                      torchtune                 accelerate                lightning
gpt3-interleaved               ok                        refuse:interleaved        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:gpt_family         refuse:tensor             refuse:tensor
gpt3-1f1b                      ok                        ok                        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:gpt_family         refuse:tensor             refuse:tensor
llama-pp1                      ok                        ok                        ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-pp1-torchtitan           refuse:framework_profile  refuse:framework_profile  ok                        ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
llama-pp1-titan-compile        refuse:framework_profile  refuse:framework_profile  ok                        ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
llama-pp1-titan-blocks         refuse:framework_profile  refuse:framework_profile  ok                        ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
llama-interleaved-uneven-titan-blocks refuse:framework_profile  refuse:framework_profile  ok                        ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
llama-pp2                      ok                        refuse:uneven             refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-pp2-fsdp                 refuse:ZeRO-3             refuse:ZeRO-3             ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-pp2-fsdp-selective       refuse:ZeRO-3             refuse:selective          ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-interleaved-uneven       ok                        refuse:interleaved        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-interleaved-uneven-fsdp  refuse:ZeRO-3             refuse:interleaved        ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-ends-short               ok                        refuse:interleaved        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-cp                       ok                        refuse:context            refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-cp-fsdp                  refuse:ZeRO-3             refuse:context            ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-cp-ag                    ok                        refuse:context            refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-cp-ag-fsdp               refuse:ZeRO-3             refuse:context            ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-zero3-2-nodes            refuse:ZeRO-3             ok                        ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          ok                        ok
llama-hsdp                     refuse:ZeRO-3             refuse:hybrid             ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          ok                        ok
llama-every4                   ok                        refuse:some_layers        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-every4-pp2-fsdp          refuse:ZeRO-3             refuse:some_layers        ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
gpt3-13b-every4-uneven         refuse:every_4th          refuse:some_layers        refuse:ZeRO-1             ok                        ok                        refuse:full_fine-tune     refuse:gpt_family         refuse:tensor             refuse:tensor
gpt3-13b-every4-uneven-fsdp    refuse:ZeRO-3             refuse:some_layers        ok                        ok                        ok                        refuse:full_fine-tune     refuse:gpt_family         refuse:tensor             refuse:tensor
llama-12-gpus                  ok                        ok                        ok                        refuse:12_ranks           refuse:12_ranks           refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
llama-12-gpus-fsdp             refuse:ZeRO-3             ok                        ok                        refuse:12_ranks           refuse:12_ranks           refuse:full_fine-tune     refuse:precision          refuse:12_ranks           refuse:12_ranks
llama-12-gpus-titan-blocks     refuse:framework_profile  refuse:framework_profile  ok                        refuse:12_ranks           refuse:12_ranks           refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
mixtral-ep                     ok                        refuse:mixture            refuse:mixture            ok                        ok                        refuse:full_fine-tune     refuse:mixture            refuse:mixture            refuse:mixture
deepseek-v3-ep                 ok                        refuse:Latent             refuse:Latent             ok                        ok                        refuse:full_fine-tune     refuse:Latent             refuse:Latent             refuse:Latent
llama-zbv-fsdp                 refuse:framework_profile  refuse:framework_profile  ok                        ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
llama-zbh1                     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile  ok                        ok                        refuse:full_fine-tune     refuse:framework_profile  refuse:framework_profile  refuse:framework_profile
tiny-cpu                       refuse:CPU                refuse:CPU                refuse:CPU                ok                        ok                        refuse:full_fine-tune     refuse:CPU                refuse:CPU                refuse:CPU
ft-lora-1gpu                   refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        ok                        refuse:precision          refuse:adapters
ft-qlora-1gpu                  refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        ok                        refuse:precision          refuse:adapters
ft-lora-8bit                   refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        ok                        refuse:precision          refuse:adapters
ft-lora-fsdp                   refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        ok                        refuse:precision          refuse:adapters
ft-lora-zero1                  refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        refuse:ZeRO-1             refuse:precision          refuse:adapters
ft-lora-tp                     refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        refuse:tensor             refuse:tensor             refuse:adapters
ft-qlora-spec                  refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        refuse:precision          ok                        refuse:adapters
ft-gpt2-lora                   refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           refuse:adapters           ok                        refuse:gpt_family         ok                        refuse:adapters
ft-full-1gpu                   refuse:every_tensor       refuse:every_tensor       refuse:clipping           ok                        ok                        refuse:full_fine-tune     ok                        refuse:precision          ok
ft-full-fsdp                   refuse:ZeRO-3             refuse:every_tensor       refuse:clipping           ok                        ok                        refuse:full_fine-tune     ok                        refuse:precision          ok
llama-off-params               refuse:ZeRO-3             ok                        ok                        refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:precision          ok                        ok
llama-off-opt                  refuse:ZeRO-3             ok                        refuse:optimizer_offload  refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:precision          ok                        ok
llama-off-nvme                 refuse:ZeRO-3             ok                        refuse:NVMe               refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:precision          refuse:NVMe               ok
llama-off-act                  refuse:ZeRO-3             ok                        refuse:activation_offload refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:precision          refuse:activation_offload refuse:activation_offload
llama-every4-off-opt           ok                        refuse:some_layers        refuse:ZeRO-1             refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:precision          refuse:tensor             refuse:tensor
ft-full-fsdp-off               refuse:ZeRO-3             refuse:every_tensor       refuse:activation_offload refuse:offload            refuse:offload            refuse:full_fine-tune     ok                        refuse:activation_offload refuse:activation_offload
ft-full-fsdp-off-opt           refuse:ZeRO-3             refuse:every_tensor       refuse:optimizer_offload  refuse:offload            refuse:offload            refuse:full_fine-tune     refuse:optimizer_offload  refuse:precision          ok
llama-fp8-tensorwise           ok                        refuse:FP8                ok                        refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8
llama-fp8-rowwise              refuse:rowwise            refuse:FP8                ok                        refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8
llama-fp8-delayed              ok                        refuse:FP8                refuse:delayed            refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8
llama-fp8-blockwise            ok                        refuse:FP8                refuse:blockwise          refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8
llama-fp8-fsdp                 refuse:ZeRO-3             refuse:FP8                ok                        refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8                refuse:FP8
llama-tp-overlap               ok                        refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped
llama-tp-overlap-titan         refuse:framework_profile  refuse:overlapped         ok                        refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped
llama-tp-overlap-uneven        ok                        refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped
llama-tp-overlap-12-gpus       ok                        refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped         refuse:overlapped
llama-infeasible               refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible           refuse:feasible
llama-infeasible+force         ok                        ok                        ok                        ok                        ok                        refuse:full_fine-tune     refuse:precision          ok                        ok
TABLE
)
column_of() { # TARGET: its column in the table (plan is 1)
  local i
  for i in "${!TARGETS[@]}"; do
    if [ "${TARGETS[i]}" = "$1" ]; then echo $((i + 2)); fi
  done
}

RESULTS=$TMP/results.tsv
: > "$RESULTS"
result() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$RESULTS"; }

# Plans.
mapfile -t NAMES < <(grep -v '^#' <<< "$EXPECTED" | awk 'NF { print $1 }')
for name in "${NAMES[@]}"; do
  base=${name%+force}
  [ -n "${DERIVE[$base]:-}" ] && continue
  [ -n "${PLAN[$base]:-}" ] || { echo "no plan for $name in the table" >&2; exit 1; }
  [ "$base" != "$name" ] && continue
  # shellcheck disable=SC2086 # the arguments hold no spaces
  "$TESSERA" plan ${PLAN[$name]} -o "$TMP/$name.json" > "$TMP/$name.plan.log" 2>&1 ||
    { cat "$TMP/$name.plan.log" >&2; echo "tessera plan failed for $name" >&2; exit 1; }
done
for name in "${!DERIVE[@]}"; do
  read -r from fields <<< "${DERIVE[$name]}"
  # shellcheck disable=SC2086 # KEY=VALUE words
  python3 - "$TMP/$from.json" "$TMP/$name.json" $fields << 'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
for kv in sys.argv[3:]:
    k, v = kv.split("=")
    plan["parallel"][k] = {"true": True, "false": False}.get(v, v)
# A DGX node's host tier (2 TiB of DRAM, PCIe Gen5 per GPU, 8 NVMe drives), whatever the base
# plan's cluster states: its numbers size and cost offload, which the exports do not read.
plan["job"]["cluster"]["host"] = {"memory_gib": 2048.0, "link_gbps": 55.0, "nvme_gbps": 50.0,
                                  "nvme_gib": 28000.0, "adamw_gparams_per_s": 2.0}
json.dump(plan, open(sys.argv[2], "w"), indent=2)
PY
  # The prediction follows the edited layout: derived again, as `tessera plan --offload` would.
  "$TESSERA" repredict "$TMP/$name.json" -o "$TMP/$name.repredicted.json" ||
    { echo "tessera repredict failed for $name" >&2; exit 1; }
  mv "$TMP/$name.repredicted.json" "$TMP/$name.json"
done

# Exports: each against the table. What is exported goes to the target's check below.
declare -A CHECK # target -> "NAME PLAN EXPORT ..." for the check scripts
for target in "${COLUMNS_[@]}"; do
  col=$(column_of "$target")
  for name in "${NAMES[@]}"; do
    base=${name%+force}
    force=()
    [ "$base" != "$name" ] && force=(--force)
    want=$(grep -v '^#' <<< "$EXPECTED" | awk -v n="$name" -v c="$col" '$1 == n { print $c }')
    out=$TMP/$name.$target
    set +e
    "$TESSERA" export "$TMP/$base.json" --to "$target" "${force[@]}" -o "$out" > /dev/null 2> "$out.stderr"
    rc=$?
    set -e
    # The message without the plan's path (whose name could hold the word looked for).
    text=$(grep -v '^wrote ' "$out.stderr" | sed "s|$TMP/$base.json|PLAN|g" || true)
    msg=$(head -n 1 <<< "$text")
    case "$want:$rc" in
    ok:0) CHECK[$target]+=" $name $TMP/$base.json $out" ;;
    ok:*) result "$name" "$target" FAIL "expected an export, refused (exit $rc): $msg" ;;
    refuse:*:2)
      word=${want#refuse:}
      word=${word//_/ }
      if grep -qF -- "$word" <<< "$text" && [ ! -e "$out" ]; then
        result "$name" "$target" refused "$msg"
      else
        result "$name" "$target" FAIL "refused, but the message does not name '$word' (or a file was written): $msg"
      fi
      ;;
    refuse:*:0) result "$name" "$target" FAIL "expected a refusal (${want#refuse:}), exported" ;;
    *) result "$name" "$target" FAIL "tessera export exited $rc: $msg" ;;
    esac
  done
done

# The targets' own code.
run_check() { # TARGET PYTHON-COMMAND...: the target's check script on its exports
  local target=$1
  shift
  [ -n "${CHECK[$target]:-}" ] || return 0
  echo
  echo "=== $target"
  local rc=0
  # shellcheck disable=SC2086 # the names and paths hold no spaces
  "$@" "scripts/check_exports_$target.py" --results "$RESULTS" ${CHECK[$target]} || rc=$?
  # An export the check did not report on (it died before, e.g. on an import) is a failure.
  # shellcheck disable=SC2086
  set -- ${CHECK[$target]}
  while [ $# -gt 0 ]; do
    if ! awk -F '\t' -v n="$1" -v t="$target" '$1 == n && $2 == t { found = 1 } END { exit !found }' "$RESULTS"; then
      result "$1" "$target" FAIL "the check exited $rc without a result for it"
    fi
    shift 3
  done
}
skip() { # TARGET REASON: every export of the target is recorded as skipped
  # shellcheck disable=SC2086
  set -- "$1" "$2" ${CHECK[$1]:-}
  local target=$1 reason=$2
  shift 2
  while [ $# -gt 0 ]; do
    result "$1" "$target" skipped "$reason"
    shift 3
  done
  echo "=== $target: skipped: $reason"
}
PY=${TESSERA_TORCH_PYTHON:-}
for target in "${COLUMNS_[@]}"; do
  case $target in megatron | deepspeed | torchtitan | peft | accelerate | lightning)
    [ -n "${CHECK[$target]:-}" ] && [ -z "$PY" ] && PY=$(bash scripts/check-exports-env.sh engines) ;;
  esac
done
for target in "${COLUMNS_[@]}"; do
  case $target in
  sbatch) run_check sbatch python3 ;;
  kubernetes)
    KV=$(bash scripts/check-exports-env.sh kubernetes)
    run_check kubernetes env PYTHONPATH="$KV" python3
    ;;
  deepspeed)
    # DeepSpeed's CPU accelerator compiles its shared-memory op at the first init (ninja from
    # the venv, the system's C++ compiler); the result is kept beside the venv.
    run_check deepspeed env PATH="$(dirname "$PY"):$PATH" \
      TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(dirname "$(dirname "$PY")")/torch_extensions}" \
      "$PY" -W ignore
    ;;
  torchtitan)
    run_check torchtitan "$PY" -W ignore
    ;;
  peft)
    # PEFT is a step of its own in the engines venv (check-exports-env.sh); a
    # TESSERA_TORCH_PYTHON needs transformers and peft.
    run_check peft "$PY" -W ignore
    ;;
  accelerate)
    # accelerate and peft are a step of the engines venv; DeepSpeed's config models check the
    # DeepSpeed plugin's section.
    run_check accelerate "$PY" -W ignore
    ;;
  lightning)
    # Lightning is a step of its own in the engines venv (check-exports-env.sh).
    run_check lightning "$PY" -W ignore
    ;;
  torchtune)
    # torchtune 0.6.1 pins its own torch (2.7): a venv of its own, whatever TESSERA_TORCH_PYTHON is.
    if [ -n "${CHECK[torchtune]:-}" ]; then
      TT_PY=${TESSERA_TORCHTUNE_PYTHON:-$(bash scripts/check-exports-env.sh torchtune)}
      run_check torchtune "$TT_PY" -W ignore
    fi
    ;;
  megatron)
    # Megatron-LM's code: a tree (MEGATRON_LM) ahead of megatron-core's wheel. Skipped, with the
    # reason, only where there is neither (megatron-core needs Python >= 3.12); where there is
    # one, a failure to import it fails its exports.
    if [ -n "${MEGATRON_LM:-}" ] || "$PY" -c 'import importlib.metadata as m; m.version("megatron-core")' 2> /dev/null; then
      run_check megatron env PYTHONPATH="${MEGATRON_LM:-}" "$PY" -W ignore
    else
      skip megatron "$PY has no megatron-core (0.19.0 needs Python >= 3.12: TESSERA_CHECK_PYTHON) and MEGATRON_LM is not set"
    fi
    ;;
  esac
done

# sbatch, by hand: every exported script through a real controller.
if [ "$MODE" = sbatch ] && [ -n "${CHECK[sbatch]:-}" ]; then
  # Our own Slurm controller on loopback (Debian's slurmctld, slurm-client and munge; as root),
  # with nodes as powered-down cloud nodes, so that no slurmd is needed: sbatch --test-only
  # parses each script's #SBATCH lines and asks it where the job would start. The cluster is the
  # largest the matrix's plans use (128 nodes of 8 GPUs); the plan has no CPU count, so 128 CPUs
  # a node is this script's choice.
  S=$TMP/slurm
  mkdir -p "$S/state"
  cat > "$S/slurm.conf" << CONF
ClusterName=tessera-check
SlurmctldHost=localhost
SlurmctldPort=16817
AuthType=auth/munge
AuthInfo=socket=$S/munge.sock
SlurmUser=root
StateSaveLocation=$S/state
SlurmctldPidFile=$S/slurmctld.pid
SlurmctldLogFile=$S/slurmctld.log
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
GresTypes=gpu
SuspendProgram=/bin/true
ResumeProgram=/bin/true
NodeName=node[1-128] NodeAddr=127.0.0.1 CPUs=128 RealMemory=1000000 Gres=gpu:8 State=CLOUD
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  stop() { # the two daemons this run started, then the temp dir
    local pid
    for pid in $(cat "$S/slurmctld.pid" "$S/munged.pid" 2> /dev/null); do
      kill "$pid" 2> /dev/null || continue
      for _ in $(seq 50); do kill -0 "$pid" 2> /dev/null || break; sleep 0.2; done
    done
    rm -rf "$TMP"
  }
  trap stop EXIT
  mungekey --create --keyfile "$S/munge.key"
  /usr/sbin/munged --force --key-file "$S/munge.key" --socket "$S/munge.sock" \
    --pid-file "$S/munged.pid" --log-file "$S/munged.log" --seed-file "$S/munge.seed"
  export SLURM_CONF=$S/slurm.conf
  slurmctld -c -i
  for _ in $(seq 30); do scontrol ping > /dev/null 2>&1 && break; sleep 1; done
  echo
  echo "=== sbatch --test-only"
  # shellcheck disable=SC2086
  set -- ${CHECK[sbatch]}
  while [ $# -gt 0 ]; do
    if out=$(sbatch --test-only "$3" 2>&1); then
      echo "  $1: $out"
    else
      echo "  $1: $out"
      result "$1" "sbatch --test-only" FAIL "$out"
    fi
    shift 3
  done
  # The check can fail: one GPU a node more than the nodes have is refused.
  sed 's/gpus-per-node=8/gpus-per-node=9/' "$TMP/gpt3-interleaved.sbatch" > "$S/more.sbatch"
  if sbatch --test-only "$S/more.sbatch" 2> /dev/null; then
    result gpt3-interleaved "sbatch --test-only" FAIL "accepted 9 GPUs a node"
  else
    echo "  ok: sbatch --test-only refuses the script with --gpus-per-node=9"
  fi
fi

# Megatron-DeepSpeed, by hand.
if [ "$MODE" = megatron-deepspeed ]; then
  : "${TESSERA_TORCH_PYTHON:?set it to a Python with torch, deepspeed, transformers and six}"
  : "${MEGATRON_DEEPSPEED:?set it to a Megatron-DeepSpeed tree}"
  # GPT-3 on 1F1B (planned above): the flags the DeepSpeed export prints on stderr, the
  # model-shape and batch flags of the Megatron export of the same plan that Megatron-DeepSpeed
  # also has, and the config.
  "$TESSERA" export "$TMP/gpt3-1f1b.json" --to deepspeed -o "$TMP/gpt3-1f1b.deepspeed" > /dev/null 2> "$TMP/gpt3-1f1b.stderr"
  read -ra flags < <(sed -n 's/^Megatron-DeepSpeed flags the config cannot hold: //p' "$TMP/gpt3-1f1b.stderr")
  [ ${#flags[@]} -gt 0 ] || { cat "$TMP/gpt3-1f1b.stderr" >&2; exit 1; }
  "$TESSERA" export "$TMP/gpt3-1f1b.json" --to megatron -o "$TMP/gpt3-1f1b.megatron" > /dev/null
  mapfile -d '' margs < <(bash -c 'source "$1"; printf "%s\0" "${MEGATRON_ARGS[@]}"' _ "$TMP/gpt3-1f1b.megatron")
  shape=()
  for ((i = 0; i < ${#margs[@]}; i++)); do
    case "${margs[i]}" in
    --num-layers | --hidden-size | --num-attention-heads | --ffn-hidden-size | --seq-length | \
      --max-position-embeddings | --attention-dropout | --hidden-dropout | \
      --make-vocab-size-divisible-by | --micro-batch-size | --global-batch-size)
      shape+=("${margs[i]}" "${margs[i + 1]}") ;;
    --bf16) shape+=(--bf16) ;;
    esac
  done
  PYTHONPATH="$MEGATRON_DEEPSPEED" "$TESSERA_TORCH_PYTHON" -W ignore \
    scripts/check_exports_megatron_deepspeed.py "$TMP/gpt3-1f1b.json" "$TMP/gpt3-1f1b.deepspeed" \
    "${flags[@]}" "${shape[@]}" --deepspeed --deepspeed_config "$TMP/gpt3-1f1b.deepspeed"
  exit 0
fi

# The outcome of every pair: a table, then each failure.
echo
echo "=== plan × target (ok: exported, and the target's code reads the plan; refused: exit 2 as expected)"
python3 - "$RESULTS" "${COLUMNS_[*]}" "${NAMES[*]}" << 'PY'
import sys
path, cols, names = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
cell, fails, refusals = {}, [], []
for line in open(path):
    name, target, status, detail = line.rstrip("\n").split("\t", 3)
    if status == "FAIL":
        fails.append(f"{name} -> {target}: {detail}")
    elif status != "ok":
        refusals.append(f"{status} {name} -> {target}: {detail.removeprefix('error: PLAN: ')}")
    if target in cols and cell.get((name, target)) != "FAIL":
        cell[(name, target)] = status
    if target == "sbatch --test-only" and status == "FAIL":
        cell[(name, "sbatch")] = "FAIL"
w = max(map(len, names))
print(f"{'':{w}}  " + "".join(f"{c:<12}" for c in cols))
for n in names:
    print(f"{n:{w}}  " + "".join(f"{cell.get((n, c), '-'):<12}" for c in cols))
print()
for r in refusals:
    print(r)
for f in fails:
    print("FAIL " + f)
sys.exit(1 if fails else 0)
PY
