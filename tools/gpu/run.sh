#!/usr/bin/env bash
# The GPU kit: megarl's GPU checks on one lent GPU in one command of at most 7 minutes (see tools/gpu/README.md).
#
#   bash tools/gpu/run.sh [--dry-run] [PART ...]        on the GPU machine, from anywhere
#
# PARTs, in the order they run (default: all but the extras): device, install, first, guards, archs,
# bench-train-step, bench-refit, summary; extras: extras, collect. The summary always comes last; install is added when
# SITE does not hold this carry yet, so `run.sh guards` reruns one part, also on a fresh machine.
# Each step has its own time limit; `--dry-run` prints the steps, their limits and commands, and `total limit: N s`.
#
# Environment (relative paths are taken from the current folder):
#   CARRY   the folder `python tools/gpu/prepare.py --out .gpu-carry` filled (default: the repo's .gpu-carry)
#   OUT     where the results go: status.tsv, kit.log, junit-*.xml, bench.jsonl, gpu-results.json (default: gpu-out)
#   SITE    where the carry is installed, outside CARRY (default /tmp/megarl-gpu-site)
#   PYTHON  the GPU machine's Python with its CUDA torch (default python3)
#   LIMIT_SCALE  every step's time limit times this, for a slower machine (default 1)
# Exit code: 0 when every check passed; 1 otherwise, "no GPU visible" included.
set -uo pipefail
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd) || exit 2
export CARRY OUT SITE PYTHONUNBUFFERED=1
CARRY=$(absolute "${CARRY:-$ROOT/.gpu-carry}")
OUT=$(absolute "${OUT:-$ROOT/gpu-out}")
SITE=$(absolute "${SITE:-/tmp/megarl-gpu-site}")
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" > /dev/null || { echo "run.sh: no $PYTHON here: set PYTHON to the Python that has torch" >&2; exit 2; }
mkdir -p "$OUT"
cd "$ROOT" || exit 2
exec "$PYTHON" tools/gpu/kit.py run "$@"
