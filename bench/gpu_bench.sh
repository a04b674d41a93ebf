#!/usr/bin/env bash
# The GPU checks as one script, for a machine with a CUDA device: builds the NCCL path, runs
# the gpu-labelled tests and the GPU benchmark. JSON lines of the benchmark go to stdout.
#   bash bench/gpu_bench.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
cmake -S . -B "$build" -G Ninja -DMODELAVG_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DMODELAVG_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target client_nccl_gpu_test modelavg-bench-gpu
ctest --test-dir "$build" -L gpu --output-on-failure --timeout 300
"$build/bench/modelavg-bench-gpu" --iters=50
