#!/usr/bin/env bash
# The GPU checks as one script, for a machine with a CUDA device.
#
#   bash bench/gpu_bench.sh [--out DIR] [BUILD_DIR]     build mode: configures and builds the NCCL
#                                                        path (needs the build dependencies)
#   bash bench/gpu_bench.sh [--out DIR] --prebuilt DIR  prebuilt mode: DIR holds the programs of
#                                                        bench/gpu_pack.sh; an env.sh beside DIR is
#                                                        sourced first
#
# The checks: print the driver, runtime and NCCL versions; run every gpu test with
# MODELAVG_REQUIRE_GPU=1 (no usable device fails instead of skipping) and NCCL_DEBUG=WARN: the
# one-rank tests, then the multi-rank ones (nccl_multirank_gpu_test: 2/4/8 real NCCL ranks on
# this GPU, one process and NCCL_HOSTID each, over NCCL's socket transport; a hierarchical job;
# in place and staged; a killed and a stopped rank); start a coordinator on loopback with a
# one-rank job and run modelavg-trace-worker --backend=nccl against it; run the world-1
# benchmark (raw / zero-copy / staged, committed over plain, the per-call cost, bf16, staging
# kernel bandwidth: JSON lines); then the socket-transport table: 2, 4 and 8 trace workers on
# this GPU averaging GPU_BENCH_SOCKET_MIB MiB (default 16) in place and staged (256 tensors),
# the slowest rank's median call; then sharded replicas with FSDP inside each replica
# (tests/python/sharded_test.py::test_sharded[fsdp_cpu], where this machine's PyTorch runs FSDP
# and the Python package is there: MODELAVG_PYTHON_DIR). Exits non-zero on any failure, any SKIPPED
# test, any NCCL WARN line (except from the tests that abort a communicator on purpose, whose
# warnings are shown) and any illegal memory access. Every phase has a time limit: at most ~8 minutes on an
# H200. Writes DIR/gpu_bench.log (everything printed) and DIR/gpu_bench.json (the figures);
# DIR defaults to gpu-bench-out. Environment: GPU_BENCH_ITERS (benchmark iterations, default
# 20), GPU_BENCH_SIZES_MIB, GPU_BENCH_SOCKET_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests' Python: the repository's .venv (PyTorch 2.x from PyPI, deploy/install_deps.sh), else
# the system's python3.
py=.venv/bin/python
[ -x "$py" ] || py=python3

die() { echo "gpu_bench: FAILED: $*" >&2; exit 1; }

prebuilt=""
build="build-gpu"
out_dir="gpu-bench-out"
if [ "${1:-}" = "--out" ]; then
  out_dir=${2:?"--out needs a directory for the log and the JSON"}
  shift 2
fi
mkdir -p "$out_dir" || die "cannot create the output directory $out_dir"
out_dir=$(cd "$out_dir" && pwd)
# Everything printed from here on also goes to the log.
exec > >(tee "$out_dir/gpu_bench.log") 2>&1
started=$SECONDS
if [ "${1:-}" = "--prebuilt" ]; then
  prebuilt=${2:?"--prebuilt needs the directory of the prebuilt programs"}
  [ -d "$prebuilt" ] || die "--prebuilt $prebuilt: no such directory"
  prebuilt=$(cd "$prebuilt" && pwd)
  if [ -f "$prebuilt/../env.sh" ]; then
    # shellcheck disable=SC1091
    source "$prebuilt/../env.sh"
  fi
  gpu_test=$prebuilt/client_nccl_gpu_test
  multirank_test=$prebuilt/nccl_multirank_gpu_test
  coordinator=$prebuilt/modelavg-coordinator
  trace_worker=$prebuilt/modelavg-trace-worker
  bench=$prebuilt/modelavg-bench-gpu
else
  build=${1:-build-gpu}
  cmake -S . -B "$build" -G Ninja -DMODELAVG_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DMODELAVG_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$build" -j "$(nproc)" --target client_nccl_gpu_test nccl_multirank_gpu_test \
    modelavg-coordinator modelavg-trace-worker modelavg-bench-gpu
  gpu_test=$build/tests/gpu/client_nccl_gpu_test
  multirank_test=$build/tests/gpu/nccl_multirank_gpu_test
  coordinator=$build/server/modelavg-coordinator
  trace_worker=$build/tools/modelavg-trace-worker
  bench=$build/bench/modelavg-bench-gpu
fi
for p in "$gpu_test" "$multirank_test" "$coordinator" "$trace_worker" "$bench"; do
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
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null || true
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

export MODELAVG_REQUIRE_GPU=1 NCCL_DEBUG=WARN
aborting='*Create_PeerNeverArrives*:*Create_GenerationMovesOnWhileWaiting*'

echo "== gpu tests (MODELAVG_REQUIRE_GPU=1 NCCL_DEBUG=WARN)"
timeout 90 "$gpu_test" --gtest_filter="-$aborting" 2>&1 | tee "$work/tests.log" ||
  die "gpu tests failed (or ran past 90 s)"
scan "$work/tests.log"
echo "== gpu tests that abort a communicator on purpose (NCCL may warn)"
timeout 60 "$gpu_test" --gtest_filter="$aborting" 2>&1 | tee "$work/abort_tests.log" ||
  die "gpu abort tests failed (or ran past 60 s)"
scan "$work/abort_tests.log" allow-warn
grep -q "PASSED" "$work/tests.log" || die "the gpu tests printed no PASSED line"

echo "== multi-rank gpu tests: real NCCL ranks on this GPU, one NCCL_HOSTID each"
# The killed and the stopped rank make NCCL warn (a peer's socket closed) and abort on purpose.
MODELAVG_COORDINATOR_BIN=$coordinator MODELAVG_TRACE_WORKER_BIN=$trace_worker \
  timeout 210 "$multirank_test" 2>&1 | tee "$work/multirank.log" ||
  die "multi-rank gpu tests failed (or ran past 210 s)"
scan "$work/multirank.log" allow-warn
grep -q "PASSED" "$work/multirank.log" || die "the multi-rank gpu tests printed no PASSED line"

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

echo "== benchmark, world 1"
timeout 120 "$bench" --iters="${GPU_BENCH_ITERS:-20}" \
  ${GPU_BENCH_SIZES_MIB:+--sizes_mib="$GPU_BENCH_SIZES_MIB"} 2>&1 | tee "$work/bench.log" ||
  die "modelavg-bench-gpu failed (or ran past 120 s)"
scan "$work/bench.log"

echo "== socket transport: 2, 4 and 8 ranks on this GPU (one NCCL_HOSTID each)"
socket_mib=${GPU_BENCH_SOCKET_MIB:-16}
socket_numel=$((socket_mib * 262144))
socket_steps=15
jobs=""
for w in 2 4 8; do
  for kind in zc st; do
    jobs="$jobs${jobs:+,}{\"job_id\": \"sock$w$kind\", \"world_size\": $w, \"mode\": \"PERIODIC\", \"levels\": [{\"period\": 1, \"group_size\": $w}]}"
  done
done
echo "{\"jobs\": [$jobs]}" >"$work/socket_jobs.json"
kill "$coord_pid" 2>/dev/null || true
wait "$coord_pid" 2>/dev/null || true
rm -f "$work/port"
"$coordinator" --listen=127.0.0.1:0 --port_file="$work/port" --jobs_file="$work/socket_jobs.json" \
  --log_level=warn >"$work/socket_coordinator.log" 2>&1 &
coord_pid=$!
for _ in $(seq 300); do [ -s "$work/port" ] && break; sleep 0.1; done
[ -s "$work/port" ] || die "the socket-table coordinator wrote no port file within 30 s"
address=$(cat "$work/port")
case $address in *:*) ;; *) address=127.0.0.1:$address ;; esac
# The slowest rank's median call time (s) over the steps after the first three.
median_call_s() {
  local job=$1 w=$2 worst=0 r m
  for r in $(seq 0 $((w - 1))); do
    m=$(sed -n 's/.*"step": \([0-9]*\).*"call_us": \([0-9]*\).*/\1 \2/p' "$work/$job-$r.out" |
      awk '$1 >= 3 {print $2}' | sort -n | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]; else print -1}')
    [ "$m" -ge 0 ] || die "$job rank $r printed no timed step: $(tail -n 3 "$work/$job-$r.err")"
    [ "$m" -gt "$worst" ] && worst=$m
  done
  awk -v us="$worst" 'BEGIN { printf "%.6g", us / 1e6 }'
}
: >"$work/socket.jsonl"
for w in 2 4 8; do
  for kind in zc st; do
    job=sock$w$kind
    extra=""
    [ "$kind" = st ] && extra="--tensors=256 --cuda_gap_elems=3"
    pids=""
    for r in $(seq 0 $((w - 1))); do
      # shellcheck disable=SC2086
      NCCL_HOSTID="modelavg-bench-$job-$r" timeout 60 "$trace_worker" --coordinator="$address" \
        --job="$job" --rank="$r" --world_size="$w" --steps=$socket_steps --numel=$socket_numel \
        --backend=nccl --unix_ms --join_timeout_ms=30000 --collective_timeout_ms=30000 $extra \
        >"$work/$job-$r.out" 2>"$work/$job-$r.err" &
      pids="$pids $!"
    done
    for p in $pids; do
      wait "$p" || { tail -n 5 "$work/$job"-*.err >&2; die "socket table: $job failed"; }
    done
  done
  zc=$(median_call_s "sock${w}zc" "$w")
  st=$(median_call_s "sock${w}st" "$w")
  line=$(awk -v w="$w" -v b="$((socket_numel * 4))" -v zc="$zc" -v st="$st" \
    'BEGIN { printf "{\"socket_world\": %d, \"bytes\": %d, \"zero_copy_s\": %s, \"staged_s\": %s, \"staged_over_zero_copy\": %.4f}", w, b, zc, st, st / zc }')
  echo "$line" | tee -a "$work/socket.jsonl"
done

echo "== sharded replicas: FSDP inside each replica, modelavg across (sharded_test.py fsdp_cpu)"
# Where CI's PyTorch cannot run FSDP on CPU (Debian's 1.13) that test skips, saying so; a GPU
# machine with PyTorch 2.1 or later runs it here. It needs the Python package: MODELAVG_PYTHON_DIR,
# or the build's python/ (build mode builds it when pybind11 is there).
python_dir=${MODELAVG_PYTHON_DIR:-}
if [ -z "$python_dir" ] && [ -z "$prebuilt" ]; then
  cmake --build "$build" -j "$(nproc)" --target modelavg-python >/dev/null 2>&1 &&
    python_dir=$build/python
fi
if [ -z "$python_dir" ] || [ ! -d "$python_dir/modelavg" ]; then
  echo "sharded FSDP check not run: no Python package (set MODELAVG_PYTHON_DIR)"
else
  set +e
  MODELAVG_PYTHON_DIR="$python_dir" MODELAVG_COORDINATOR_BIN="$coordinator" \
    timeout 180 "$py" -m pytest -q -rs "tests/python/sharded_test.py::test_sharded[fsdp_cpu]" \
    2>&1 | tee "$work/fsdp.log"
  fsdp_rc=${PIPESTATUS[0]}
  set -e
  if [ "$fsdp_rc" -ne 0 ]; then
    die "sharded_test.py::test_sharded[fsdp_cpu] failed (exit $fsdp_rc)"
  elif grep -q '1 skipped' "$work/fsdp.log"; then
    echo "sharded FSDP check not run: this machine's PyTorch cannot either (above)"
  fi
fi

# The figures as one JSON document.
json_array() { grep -h '^{' "$@" 2>/dev/null | paste -sd, -; }
{
  echo "{\"world1\": [$(json_array "$work/bench.log")],"
  echo " \"socket\": [$(json_array "$work/socket.jsonl")],"
  echo " \"trace_worker_world1_steps\": $steps, \"seconds\": $((SECONDS - started))}"
} >"$out_dir/gpu_bench.json"
echo "gpu_bench: wrote $out_dir/gpu_bench.json and $out_dir/gpu_bench.log in $((SECONDS - started)) s"
[ $((SECONDS - started)) -le 480 ] || echo "gpu_bench: WARNING: took more than 8 minutes"
echo "gpu_bench: all GPU checks passed"
