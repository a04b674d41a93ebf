#!/usr/bin/env bash
# Runs modelavg-bench-average over buffer sizes 4 KiB .. 256 MiB and many small tensors, for
# 2 and 4 processes (Gloo). One JSON line per run.
#   bash bench/average_sweep.sh [build-dir]
set -euo pipefail
bin=${1:-build}/bench/modelavg-bench-average
for world in 2 4; do
  #        numel     tensors iters
  while read -r numel tensors iters; do
    "$bin" --world="$world" --numel="$numel" --tensors="$tensors" --iters="$iters" \
      --backend=gloo 2>/dev/null
  done <<'RUNS'
1024 1 50
16384 1 50
262144 1 30
4194304 1 10
16777216 1 5
67108864 1 3
262144 1000 30
4194304 1000 10
16777216 10000 5
RUNS
done
