#!/usr/bin/env bash
# The engines' own code for scripts/check-exports.sh, from PyPI only, at pinned versions, in a
# cache outside the clone that later runs on the same machine reuse (docs/exports.md, "How the
# exports are checked"):
#   bash scripts/check-exports-env.sh engines      a venv with torch, DeepSpeed, torchtitan,
#                                                  megatron-core (Megatron-LM's megatron/training;
#                                                  Python >= 3.12 only), kubernetes-validate,
#                                                  transformers, peft with bitsandbytes, and
#                                                  lightning (each
#                                                  added to an existing venv by a step of its
#                                                  own); prints its python
#   bash scripts/check-exports-env.sh kubernetes   kubernetes-validate alone (pip --target); prints
#                                                  the directory to put on PYTHONPATH
#   bash scripts/check-exports-env.sh torchtune    a venv of its own with torchtune 0.6.1 (its last
#                                                  release), the torch, torchao and bitsandbytes it
#                                                  runs with; prints its python
# The cache is $TESSERA_CHECK_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/tessera-ci; each install
# lives in a directory named by its pins and is used only once complete (a marker file written
# last), so an interrupted install is redone. The Python is $TESSERA_CHECK_PYTHON, else the first
# python3.12 or python3.13 found (PATH, then pyenv's versions), else python3 (then without
# megatron-core, which needs 3.12). Progress goes to stderr; stdout is the one path.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.15.0
DEEPSPEED=0.19.8
TORCHTITAN=0.2.2
MEGATRON_CORE=0.19.0
KUBERNETES_VALIDATE=1.37.0
# Hugging Face transformers for scripts/check_hf_export.py (tests/checkpoint_hf.rs), installed into
# the engines venv as a second step with its own marker, so adding it never rebuilds the venv.
TRANSFORMERS=5.23.0
HF_PINS=("transformers==$TRANSFORMERS" safetensors==0.8.0 regex==2026.11.19)
# peft and bitsandbytes for scripts/check_nf4.py (runtime/tests/nf4_bitsandbytes.rs), the peft
# export's check (scripts/check_exports_peft.py) and scripts/peft_counts.py: a third step
# with its own marker, after transformers (peft needs it). accelerate, which peft needs and the
# constraints file does not pin, is pinned here.
PEFT=0.21.2
BITSANDBYTES=0.50.2
PEFT_PINS=("peft==$PEFT" "bitsandbytes==$BITSANDBYTES" accelerate==1.15.0)
# Lightning for the lightning export's check (scripts/check_exports_lightning.py, which builds
# its Trainer and strategy on the CPU): a fourth step with its own marker. 2.6.6 is its latest
# release (it takes torch < 4.0); what it pulls in that the constraints file does not pin is
# pinned here (fsspec[http]'s aiohttp and its own dependencies).
LIGHTNING=2.6.6
LIGHTNING_PINS=("lightning==$LIGHTNING" "pytorch-lightning==$LIGHTNING" lightning-utilities==0.15.3
  torchmetrics==1.9.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1)
# torchtune's last release pins torchdata 0.11.0 and imports torchao at its top; it predates the
# engines' torch 2.15 by far, so it gets a venv of its own: torch 2.7.1 (torchtune 0.6's),
# torchao 0.11.0 (built for torch 2.7), bitsandbytes 0.46.1 (its 8-bit AdamW, which the exports
# name for optimizer_states = "8bit"; it imports without a GPU).
TORCHTUNE=0.6.1
TORCHTUNE_PINS=("torchtune==$TORCHTUNE" torch==2.7.1 torchao==0.11.0 torchdata==0.11.0 bitsandbytes==0.46.1)
# Every other package of that venv (torchtune's dependencies are unpinned: datasets,
# huggingface_hub, omegaconf, …), as the engines' are.
TORCHTUNE_CONSTRAINTS=$PWD/scripts/check-exports-torchtune-constraints.txt
CONSTRAINTS=$PWD/scripts/check-exports-constraints.txt
CACHE=${TESSERA_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera-ci}
PIP=(-m pip install --no-cache-dir --disable-pip-version-check --progress-bar off --quiet)
log() { echo "check-exports-env: $*" >&2; }

find_python() {
  if [ -n "${TESSERA_CHECK_PYTHON:-}" ]; then
    echo "$TESSERA_CHECK_PYTHON"
    return
  fi
  local v p
  for v in 3.12 3.13; do
    if p=$(command -v "python$v" 2> /dev/null) && "$p" -c '' 2> /dev/null; then
      echo "$p"
      return
    fi
    for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v"; do
      if [ -x "$p" ]; then
        echo "$p"
        return
      fi
    done
  done
  command -v python3
}

# A step added to an existing engines venv ($dir, Python $pyv): installs the pins given after
# its marker name unless $dir/.complete-MARKER exists, then replaces the markers of its older
# pins (those that start with the same word).
added_step() {
  local marker=$1
  shift
  if [ ! -f "$dir/.complete-$marker" ]; then
    log "$* into $dir"
    local c=()
    case $pyv in 3.12 | 3.13) c=(-c "$CONSTRAINTS") ;; esac
    "$dir/bin/python" "${PIP[@]}" "${c[@]}" "$@"
    rm -f "$dir/.complete-${marker%%-*}"-*
    touch "$dir/.complete-$marker"
  fi
}

mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9 # one install at a time; a second run waits, then finds it done

case "${1:-}" in
kubernetes)
  dir=$CACHE/kubernetes-validate-$KUBERNETES_VALIDATE
  if [ ! -f "$dir/.complete" ]; then
    log "installing kubernetes-validate $KUBERNETES_VALIDATE into $dir"
    rm -rf "$dir"
    python3 "${PIP[@]}" --target "$dir" "kubernetes-validate==$KUBERNETES_VALIDATE"
    touch "$dir/.complete"
  fi
  echo "$dir"
  ;;
engines)
  py=$(find_python)
  pyv=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  lock=$(sha256sum "$CONSTRAINTS" | cut -c1-12)
  key=engines-py$pyv-torch$TORCH-deepspeed$DEEPSPEED-torchtitan$TORCHTITAN-megatron$MEGATRON_CORE-kv$KUBERNETES_VALIDATE-$lock
  dir=$CACHE/$key
  if [ ! -f "$dir/.complete" ]; then
    start=$SECONDS
    # One engines venv at a time (about 6 GB): older ones, of other pins, go.
    for old in "$CACHE"/engines-*; do
      [ "$old" = "$dir" ] || [ ! -d "$old" ] || { log "removing $old"; rm -rf "$old"; }
    done
    rm -rf "$dir"
    log "creating $dir with $py (Python $pyv)"
    "$py" -m venv "$dir"
    vpy=$dir/bin/python
    # The exact versions of every dependency where the lock was made (Python 3.12); on another
    # Python some pins may have no wheel, so only the engines are pinned there.
    c=()
    case $pyv in 3.12 | 3.13) c=(-c "$CONSTRAINTS") ;; esac
    # torch from PyPI is a CUDA build (+cu132) with NVIDIA's libraries as wheels (libtorch_cuda
    # needs them to load, even without a GPU: `--no-deps` does not import); it computes on the
    # CPU. DeepSpeed is an sdist: built against that torch, without its ops (DS_BUILD_OPS=0).
    log "torch $TORCH"
    "$vpy" "${PIP[@]}" "${c[@]}" "torch==$TORCH"
    log "deepspeed $DEEPSPEED"
    DS_BUILD_OPS=0 "$vpy" "${PIP[@]}" "${c[@]}" --no-build-isolation "deepspeed==$DEEPSPEED"
    rest=("torchtitan==$TORCHTITAN" "kubernetes-validate==$KUBERNETES_VALIDATE")
    if "$vpy" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
      rest+=("megatron-core==$MEGATRON_CORE")
    else
      log "Python $pyv: no megatron-core $MEGATRON_CORE (it needs Python >= 3.12); the Megatron checks will be skipped"
    fi
    log "${rest[*]}"
    "$vpy" "${PIP[@]}" "${c[@]}" "${rest[@]}"
    touch "$dir/.complete"
    log "done in $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1)"
  fi
  added_step "transformers-$TRANSFORMERS" "${HF_PINS[@]}"
  added_step "peft-$PEFT-bitsandbytes-$BITSANDBYTES" "${PEFT_PINS[@]}"
  added_step "lightning-$LIGHTNING" "${LIGHTNING_PINS[@]}"
  echo "$dir/bin/python"
  ;;
torchtune)
  py=$(find_python)
  pyv=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  key=torchtune-py$pyv-torchtune$TORCHTUNE-$(cat <(printf '%s\n' "${TORCHTUNE_PINS[@]}") "$TORCHTUNE_CONSTRAINTS" | sha256sum | cut -c1-12)
  dir=$CACHE/$key
  if [ ! -f "$dir/.complete" ]; then
    start=$SECONDS
    for old in "$CACHE"/torchtune-*; do
      [ "$old" = "$dir" ] || [ ! -d "$old" ] || { log "removing $old"; rm -rf "$old"; }
    done
    rm -rf "$dir"
    log "creating $dir with $py (Python $pyv): ${TORCHTUNE_PINS[*]}"
    "$py" -m venv "$dir"
    c=()
    case $pyv in 3.12 | 3.13) c=(-c "$TORCHTUNE_CONSTRAINTS") ;; esac
    "$dir/bin/python" "${PIP[@]}" "${c[@]}" "${TORCHTUNE_PINS[@]}"
    touch "$dir/.complete"
    log "done in $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1)"
  fi
  echo "$dir/bin/python"
  ;;
*)
  echo "usage: $0 engines|kubernetes|torchtune" >&2
  exit 2
  ;;
esac
