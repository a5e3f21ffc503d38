#!/usr/bin/env bash
# The GPU kit: verify megarl's GPU tier on one lent GPU in one command (see tools/gpu/README.md).
#
#   bash tools/gpu/run.sh [--dry-run] [PART ...]      from the repo root, on the GPU machine
#
# PARTs, in order (default: all): install, tests, train-step, refit, summary. Each check has its own time limit
# and all of them fit the GPU machine's 10 minutes per command; a part can be rerun alone (install stays done).
# CARRY (default .gpu-carry): the folder `python tools/gpu/prepare.py` filled on a machine with PyPI.
# OUT (default gpu-out): where gpu-results.json, the pytest log and each benchmark's output go.
# Installs offline from CARRY without touching torch, runs `pytest -m gpu`, then the GPU benchmarks, and prints
# one summary line per check. --dry-run prints every command instead of running it (checked by the CPU tests).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
CARRY=${CARRY:-.gpu-carry}
OUT=${OUT:-gpu-out}
DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
PARTS=${*:-install tests train-step refit summary}
mkdir -p "$OUT"
want() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

run() {  # run (or, dry, print) a command; its exit code is the caller's
  if [ "$DRY" = 1 ]; then echo "+ $*"; return 0; fi
  "$@"
}

step() {  # step NAME TIMEOUT_S COMMAND...: one check, its output in $OUT/NAME.log, its status in $OUT/status.tsv
  local name=$1 limit=$2; shift 2
  local start=$SECONDS code
  if [ "$DRY" = 1 ]; then echo "+ timeout $limit $* > $OUT/$name.log"; return 0; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  code=$?
  printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" >> "$OUT/status.tsv"
  return 0
}

[ -f "$CARRY/manifest.json" ] || { echo "no $CARRY/manifest.json: run python tools/gpu/prepare.py --out $CARRY first" >&2; exit 2; }
export PYTHONPATH="$PWD:$PWD/$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"

# 1. Offline install: sums checked, wheels without dependencies (torch is never among them), Ray unpacked.
if want install; then
  run python tools/gpu/kit.py verify "$CARRY" || exit 2
  torch_before=$(python -c 'import torch; print(torch.__version__)')
  run python -m pip install --no-index --no-deps "$CARRY"/wheels/*.whl || exit 2
  run mkdir -p "$CARRY/site"
  run tar -xJf "$CARRY/ray-slim.tar.xz" -C "$CARRY/site" || exit 2
  torch_after=$(python -c 'import torch; print(torch.__version__)')
  [ "$torch_before" = "$torch_after" ] || { echo "torch changed: $torch_before -> $torch_after" >&2; exit 2; }
  [ "$DRY" = 1 ] || : > "$OUT/status.tsv"
fi

# 2. The GPU tests, then the GPU benchmarks (limits add up to 9.5 minutes with the install).
want tests && step pytest-gpu 330 python -m pytest tests -m gpu -q -rA --junitxml="$OUT/pytest-gpu.xml"
want train-step && step bench-train-step 120 python tools/bench/gpu_train_step.py --json "$OUT/bench-train-step.json"
want refit && step bench-refit 90 python tools/bench/gpu_refit.py --json "$OUT/bench-refit.json"

# 3. One JSON with everything ($OUT/gpu-results.json), one line per check.
if want summary; then run python tools/gpu/kit.py summarize "$OUT"; fi
