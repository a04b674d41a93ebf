#!/usr/bin/env bash
# The GPU checks as one script, for a machine with a CUDA device.
#
#   bash bench/gpu_bench.sh [BUILD_DIR]          build mode: configures and builds the NCCL path
#                                                 (needs the build dependencies), then checks
#   bash bench/gpu_bench.sh --prebuilt DIR       prebuilt mode: DIR holds client_nccl_gpu_test,
#                                                 modelavg-coordinator, modelavg-trace-worker and
#                                                 modelavg-bench-gpu (see bench/gpu_pack.sh); an
#                                                 env.sh beside DIR is sourced first
#
# The checks: print the driver, runtime and NCCL versions; run every gpu test with
# MODELAVG_REQUIRE_GPU=1 (no usable device fails instead of skipping) and NCCL_DEBUG=WARN;
# start a coordinator on loopback with a one-rank job and run modelavg-trace-worker
# --backend=nccl against it; run the GPU benchmark (JSON lines). Exits non-zero on any failure,
# any SKIPPED test, any NCCL WARN line (except from the two tests that abort a communicator on
# purpose, whose warnings are shown) and any illegal memory access. Takes ~2-4 minutes on an
# H200. Environment: GPU_BENCH_ITERS (benchmark iterations, default 20), GPU_BENCH_SIZES_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu_bench: FAILED: $*" >&2; exit 1; }

prebuilt=""
build="build-gpu"
if [ "${1:-}" = "--prebuilt" ]; then
  prebuilt=${2:?"--prebuilt needs the directory of the prebuilt programs"}
  [ -d "$prebuilt" ] || die "--prebuilt $prebuilt: no such directory"
  prebuilt=$(cd "$prebuilt" && pwd)
  if [ -f "$prebuilt/../env.sh" ]; then
    # shellcheck disable=SC1091
    source "$prebuilt/../env.sh"
  fi
  gpu_test=$prebuilt/client_nccl_gpu_test
  coordinator=$prebuilt/modelavg-coordinator
  trace_worker=$prebuilt/modelavg-trace-worker
  bench=$prebuilt/modelavg-bench-gpu
else
  build=${1:-build-gpu}
  cmake -S . -B "$build" -G Ninja -DMODELAVG_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DMODELAVG_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$build" -j "$(nproc)" --target client_nccl_gpu_test modelavg-coordinator \
    modelavg-trace-worker modelavg-bench-gpu
  gpu_test=$build/tests/gpu/client_nccl_gpu_test
  coordinator=$build/server/modelavg-coordinator
  trace_worker=$build/tests/tools/modelavg-trace-worker
  bench=$build/bench/modelavg-bench-gpu
fi
for p in "$gpu_test" "$coordinator" "$trace_worker" "$bench"; do
  [ -x "$p" ] || die "missing program $p"
done

work=$(mktemp -d)
coord_pid=""
cleanup() {
  if [ -n "$coord_pid" ]; then kill "$coord_pid" 2>/dev/null || true; wait "$coord_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Fails on SKIPPED tests, NCCL WARN lines (unless $2 = allow-warn) and illegal accesses in $1.
scan() {
  local log=$1 allow=${2:-}
  if grep -q "SKIPPED" "$log"; then grep "SKIPPED" "$log" >&2; die "a test was skipped ($log)"; fi
  if grep -qiE "illegal (memory access|address|instruction)|cudaErrorIllegal" "$log"; then
    grep -iE "illegal" "$log" >&2; die "an illegal access ($log)"
  fi
  if [ "$allow" != allow-warn ] && grep -q "NCCL WARN" "$log"; then
    grep "NCCL WARN" "$log" >&2; die "NCCL warned ($log)"
  fi
}

echo "== device"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv ||
  die "nvidia-smi cannot talk to the driver"
nvidia-smi | head -n 4 | tail -n 2 || true
if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null || true
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

export MODELAVG_REQUIRE_GPU=1 NCCL_DEBUG=WARN
aborting='*Create_PeerNeverArrives*:*Create_GenerationMovesOnWhileWaiting*'

echo "== gpu tests (MODELAVG_REQUIRE_GPU=1 NCCL_DEBUG=WARN)"
"$gpu_test" --gtest_filter="-$aborting" 2>&1 | tee "$work/tests.log" ||
  die "gpu tests failed"
scan "$work/tests.log"
echo "== gpu tests that abort a communicator on purpose (NCCL may warn)"
"$gpu_test" --gtest_filter="$aborting" 2>&1 | tee "$work/abort_tests.log" ||
  die "gpu abort tests failed"
scan "$work/abort_tests.log" allow-warn
grep -q "PASSED" "$work/tests.log" || die "the gpu tests printed no PASSED line"

echo "== trace worker, --backend=nccl, world 1"
cat >"$work/jobs.json" <<'JSON'
{"jobs": [{"job_id": "gpu-trace", "world_size": 1, "mode": "PERIODIC",
           "levels": [{"period": 1, "group_size": 1}]}]}
JSON
"$coordinator" --listen=127.0.0.1:0 --port_file="$work/port" --jobs_file="$work/jobs.json" \
  --log_level=warn >"$work/coordinator.log" 2>&1 &
coord_pid=$!
for _ in $(seq 300); do
  [ -s "$work/port" ] && break
  kill -0 "$coord_pid" 2>/dev/null || { cat "$work/coordinator.log" >&2; die "the coordinator exited"; }
  sleep 0.1
done
[ -s "$work/port" ] || die "the coordinator wrote no port file within 30 s"
address=$(cat "$work/port")  # HOST:PORT, or a bare port
case $address in *:*) ;; *) address=127.0.0.1:$address ;; esac
steps=8
timeout 120 "$trace_worker" --coordinator="$address" --job=gpu-trace --rank=0 \
  --world_size=1 --steps=$steps --numel=4096 --backend=nccl --join_timeout_ms=30000 \
  --collective_timeout_ms=30000 \
  >"$work/trace.out" 2>"$work/trace.err" || {
  cat "$work/trace.out" "$work/trace.err" >&2; die "modelavg-trace-worker --backend=nccl failed"; }
cat "$work/trace.out"
cat "$work/trace.err" >&2
scan "$work/trace.err"
# World 1: every step averages; after step s the value is 0.5 * (1 + ... + (s + 1)).
[ "$(grep -c '"action": "AVERAGE"' "$work/trace.out")" = "$steps" ] ||
  die "expected $steps AVERAGE lines from the trace worker"
last=$(tail -n 1 "$work/trace.out" | sed -E 's/.*"value": ([-0-9.e+]+).*/\1/')
awk -v v="$last" -v n="$steps" 'BEGIN { want = 0.25 * n * (n + 1); exit !(v == want) }' ||
  die "trace worker's last value $last, expected $(awk -v n=$steps 'BEGIN{print 0.25*n*(n+1)}')"

echo "== benchmark"
"$bench" --iters="${GPU_BENCH_ITERS:-20}" \
  ${GPU_BENCH_SIZES_MIB:+--sizes_mib="$GPU_BENCH_SIZES_MIB"} 2>&1 | tee "$work/bench.log" ||
  die "modelavg-bench-gpu failed"
scan "$work/bench.log"
echo "gpu_bench: all GPU checks passed"
