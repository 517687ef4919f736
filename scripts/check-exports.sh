#!/usr/bin/env bash
# `tessera export`'s texts read by the targets' own code (docs/exports.md, "How the exports are
# checked"). One target a run; each also feeds in a broken variant that must be refused.
#   kubernetes  kubernetes-validate --strict, offline (installed into .tools/ if missing); CI runs it
#   deepspeed   DeepSpeed's DeepSpeedConfig      } by hand, with TESSERA_TORCH_PYTHON: a Python that
#   megatron    Megatron-LM's parse_args,        } has torch and deepspeed; megatron also needs
#               validate_args, TransformerConfig } MEGATRON_LM: a Megatron-LM tree
#   megatron-deepspeed  Megatron-DeepSpeed's parse_args on the flags the deepspeed export prints,
#               by hand, with TESSERA_TORCH_PYTHON and MEGATRON_DEEPSPEED: a Megatron-DeepSpeed tree
#   torchtitan  torchtitan's ConfigManager (--job.config_file), by hand, with TESSERA_TORCH_PYTHON:
#               a Python with torch and torchtitan 0.2.x (0.3 reads no TOML job config)
#   sbatch      sbatch --test-only against a slurmctld of its own on loopback (by hand, as root,
#               with Debian's slurmctld, slurm-client and munge)
# The binary is target/release/tessera, or $TESSERA.
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-$PWD/target/release/tessera}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
case "${1:-}" in
kubernetes | deepspeed | megatron | megatron-deepspeed | torchtitan | sbatch) ;;
*)
  echo "usage: $0 kubernetes|deepspeed|megatron|megatron-deepspeed|torchtitan|sbatch" >&2
  exit 2
  ;;
esac

plan() { # NAME PLAN-ARGS...: $TMP/NAME.json
  local name=$1
  shift
  "$TESSERA" plan "$@" -o "$TMP/$name.json" > /dev/null
}
export_to() { # NAME TARGET: $TMP/NAME.TARGET
  "$TESSERA" export "$TMP/$1.json" --to "$2" -o "$TMP/$1.$2" > /dev/null
}
LLAMA=(specs/models/llama3-8b.toml specs/clusters/dgx-h100-80g.toml)
# GPT-3 175B in Megatron-LM's SC'21 layout (tests/common GPT3_MEGATRON_LAYOUT, no hybrid sharding).
plan gpt3 specs/models/gpt3-175b.toml specs/clusters/dgx-a100-80g.toml --nodes 128 --tp 8 --pp 8 \
  --dp 16 --micro-batch 1 --recompute full --zero 1 --sp --schedule interleaved --virtual-stages 2 \
  --no-hybrid-shard
# The same on the 1F1B schedule, for DeepSpeed (its pipeline engine has no interleaving).
plan gpt3-1f1b specs/models/gpt3-175b.toml specs/clusters/dgx-a100-80g.toml --nodes 128 --tp 8 \
  --pp 8 --dp 16 --micro-batch 1 --recompute full --zero 1 --sp --schedule 1f1b --no-hybrid-shard

case "$1" in
kubernetes)
  KV=.tools/kubernetes-validate-1.37.0
  if [ ! -d "$KV/kubernetes_validate" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$KV" kubernetes-validate==1.37.0
  fi
  export_to gpt3 kubernetes
  validate() { PYTHONPATH="$KV" python3 -m kubernetes_validate --strict -k 1.37.0 "$@"; }
  validate "$TMP/gpt3.kubernetes"
  # The check can fail: a misspelt field is refused.
  sed 's/completionMode:/completionMod:/' "$TMP/gpt3.kubernetes" > "$TMP/misspelt.yaml"
  if validate --quiet "$TMP/misspelt.yaml" > /dev/null; then
    echo "kubernetes-validate accepted a misspelt field" >&2
    exit 1
  fi
  echo "ok: kubernetes-validate refuses the manifest with completionMode misspelt"
  ;;
deepspeed)
  : "${TESSERA_TORCH_PYTHON:?set it to a Python with torch and deepspeed}"
  # Llama-3 8B on two DGX H100, DP 16 with ZeRO-3 (hybrid sharding is refused: not hpZ).
  plan llama-zero3 "${LLAMA[@]}" --nodes 2 --dp 16 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 1
  # The interleaved plan is refused (exit 2).
  if "$TESSERA" export "$TMP/gpt3.json" --to deepspeed > /dev/null 2>&1; then
    echo "the interleaved plan was exported to deepspeed" >&2
    exit 1
  fi
  for name in gpt3-1f1b llama-zero3; do
    export_to "$name" deepspeed
    PATH="$(dirname "$TESSERA_TORCH_PYTHON"):$PATH" \
      "$TESSERA_TORCH_PYTHON" scripts/check_exports_deepspeed.py "$TMP/$name.deepspeed" "$TMP/$name.json"
  done
  ;;
megatron)
  : "${TESSERA_TORCH_PYTHON:?set it to a Python with torch and deepspeed}"
  : "${MEGATRON_LM:?set it to a Megatron-LM tree}"
  # Llama-3 8B as tests/exports.rs plans it: DP 2 × TP 2 + SP × PP 2 (stages of 17 and 15
  # layers), ZeRO-1, full recompute; and on one stage (DP 4 × TP 2 + SP) with every 4th layer.
  plan llama-uneven "${LLAMA[@]}" --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b \
    --zero 1 --recompute full
  plan llama-every "${LLAMA[@]}" --nodes 1 --tp 2 --pp 1 --dp 4 --micro-batch 1 --sp \
    --zero 1 --recompute full --recompute-every 4
  for name in gpt3 llama-uneven llama-every; do
    export_to "$name" megatron
    mapfile -d '' args < <(bash -c 'source "$1"; printf "%s\0" "${MEGATRON_ARGS[@]}"' _ "$TMP/$name.megatron")
    PYTHONPATH="$MEGATRON_LM" "$TESSERA_TORCH_PYTHON" -W ignore \
      scripts/check_exports_megatron.py "$TMP/$name.json" "${args[@]}"
  done
  ;;
megatron-deepspeed)
  : "${TESSERA_TORCH_PYTHON:?set it to a Python with torch, deepspeed, transformers and six}"
  : "${MEGATRON_DEEPSPEED:?set it to a Megatron-DeepSpeed tree}"
  # GPT-3 on 1F1B: the flags the DeepSpeed export prints on stderr, the model-shape and batch flags of the
  # Megatron export of the same plan that Megatron-DeepSpeed also has, and the config.
  "$TESSERA" export "$TMP/gpt3-1f1b.json" --to deepspeed -o "$TMP/gpt3-1f1b.deepspeed" > /dev/null 2> "$TMP/gpt3-1f1b.stderr"
  read -ra flags < <(sed -n 's/^Megatron-DeepSpeed flags the config cannot hold: //p' "$TMP/gpt3-1f1b.stderr")
  [ ${#flags[@]} -gt 0 ] || { cat "$TMP/gpt3-1f1b.stderr" >&2; exit 1; }
  export_to gpt3-1f1b megatron
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
  ;;
torchtitan)
  : "${TESSERA_TORCH_PYTHON:?set it to a Python with torch and torchtitan 0.2.x}"
  # Llama-3 8B as tests/exports.rs plans it (fsdp_layout): DP 2 × TP 2 + SP × PP 2 (stages of 17
  # and 15 layers), ZeRO-3 (FSDP), full recompute; and with selective recompute (flash
  # attention: torchtitan's per-op mode).
  for recompute in full selective; do
    plan "llama-$recompute" "${LLAMA[@]}" --nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp \
      --schedule 1f1b --zero 3 --recompute "$recompute"
    export_to "llama-$recompute" torchtitan
    "$TESSERA_TORCH_PYTHON" -W ignore scripts/check_exports_torchtitan.py \
      "$TMP/llama-$recompute.torchtitan" "$TMP/llama-$recompute.json"
  done
  ;;
sbatch)
  # Our own Slurm controller on loopback (Debian's slurmctld, slurm-client and munge; as root),
  # with the plan's nodes as powered-down cloud nodes, so that no slurmd is needed: sbatch
  # --test-only parses the script's #SBATCH lines and asks it where the job would start.
  export_to gpt3 sbatch
  S=$TMP/slurm
  mkdir -p "$S/state"
  read -r nodes gpus < <(python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))["job"]["cluster"]
print(c["nodes"], c["gpus_per_node"])' "$TMP/gpt3.json")
  cat > "$S/slurm.conf" <<CONF
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
NodeName=node[1-$nodes] NodeAddr=127.0.0.1 CPUs=128 RealMemory=1000000 Gres=gpu:$gpus State=CLOUD
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
  sbatch --test-only "$TMP/gpt3.sbatch"
  # The check can fail: one GPU a node more than the nodes have is refused.
  sed "s/gpus-per-node=$gpus/gpus-per-node=$((gpus + 1))/" "$TMP/gpt3.sbatch" > "$S/more.sbatch"
  if sbatch --test-only "$S/more.sbatch" 2> /dev/null; then
    echo "sbatch --test-only accepted $((gpus + 1)) GPUs a node" >&2
    exit 1
  fi
  echo "ok: sbatch --test-only refuses the script with --gpus-per-node=$((gpus + 1))"
  ;;
esac
