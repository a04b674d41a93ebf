#!/usr/bin/env bash
# Runs modelavg-bench-average over buffer sizes 4 KiB .. 256 MiB (one tensor: averaged in place
# after a backup copy; and with --in_place), and many small tensors (packed into one staging
# buffer), for 2 and 4 processes (Gloo). One JSON line per run.
#   bash bench/average_sweep.sh [build-dir]
set -euo pipefail
bin=${1:-build}/bench/modelavg-bench-average
for world in 2 4; do
  #        numel     tensors iters in_place
  while read -r numel tensors iters in_place; do
    "$bin" --world="$world" --numel="$numel" --tensors="$tensors" --iters="$iters" \
      --in_place="$in_place" --backend=gloo 2>/dev/null
  done <<'RUNS'
1024 1 50 false
16384 1 50 false
262144 1 30 false
4194304 1 15 false
16777216 1 7 false
67108864 1 5 false
4194304 1 15 true
67108864 1 5 true
262144 1000 30 false
4194304 1000 15 false
16777216 10000 7 false
RUNS
done
