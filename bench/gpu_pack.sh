#!/usr/bin/env bash
# Builds the programs that `bench/gpu_bench.sh --prebuilt` runs and packs them, with the shared
# libraries they load, for a GPU machine that lacks the build dependencies:
#
#   bash bench/gpu_pack.sh [PACK_SCRIPT] [BUILD_DIR]      (from anywhere; works in the repo root)
#
# PACK_SCRIPT (default: ../shared/device/pack.sh beside the repository) is called as
# `PACK_SCRIPT BUILD_DIR PROGRAM...` from the repository root and writes .devpack/ (bin/, lib/,
# env.sh). BUILD_DIR (default: build) must be configured with CUDA. Debug info is stripped so
# that the pack stays small (it fails above 60 MiB). Then, on the GPU machine:
#   bash bench/gpu_bench.sh --prebuilt .devpack/bin
set -euo pipefail
cd "$(dirname "$0")/.."
pack=${1:-../shared/device/pack.sh}
build=${2:-build}
programs=(client_nccl_gpu_test nccl_multirank_gpu_test modelavg-coordinator modelavg-trace-worker
          modelavg-bench-gpu)
[ -f "$pack" ] || { echo "gpu_pack: no pack script at $pack" >&2; exit 1; }
[ -f "$build/CMakeCache.txt" ] || { echo "gpu_pack: $build is not a configured build" >&2; exit 1; }
cmake --build "$build" -j 2 --target "${programs[@]}" ||
  { echo "gpu_pack: building ${programs[*]} in $build failed (configured with CUDA?)" >&2; exit 1; }
bash "$pack" "$build" "${programs[@]}"
chmod -R u+w .devpack
strip --strip-debug .devpack/bin/* .devpack/lib/*
# Keep the pack out of git's view (it is carried as an ignored path).
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [ -n "$exclude" ] && ! grep -qx '/.devpack/' "$exclude" 2>/dev/null; then
  mkdir -p "$(dirname "$exclude")" && echo /.devpack/ >>"$exclude"
fi
kib=$(du -sk .devpack | cut -f1)
echo "gpu_pack: .devpack holds $((kib / 1024)) MiB: ${programs[*]} and $(find .devpack/lib -type f | wc -l) libraries"
[ "$kib" -le $((60 * 1024)) ] || { echo "gpu_pack: .devpack exceeds 60 MiB" >&2; exit 1; }
