#!/usr/bin/env bash
# The PyTorch example in one command: installs what is missing, builds the coordinator and the
# Python package, then trains examples/train_torch.py with 4 processes (hierarchical averaging
# through modelavg's drop-in) on 127.0.0.1 and stops everything.
#
#   bash examples/run_train_torch.sh [--steps=N]
#
# Environment: MODELAVG_BUILD_DIR (default build), MODELAVG_JOBS (parallel build jobs, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MODELAVG_BUILD_DIR:-build}
jobs=${MODELAVG_JOBS:-2}
bash deploy/install_deps.sh
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j "$jobs" --target modelavg-coordinator modelavg-python
# The tests' Python (.venv, with PyTorch 2.x: deploy/install_deps.sh made it), else Debian's.
py=.venv/bin/python
[ -x "$py" ] || py=/usr/bin/python3
PYTHONPATH="$build/python" MODELAVG_BUILD_DIR="$build" exec "$py" \
  examples/train_torch.py --coordinator_bin="$build/server/modelavg-coordinator" "$@"
