#!/usr/bin/env bash
# The main job in one command: installs what building needs (deploy/install_deps.sh --demo, not
# the tests' packages), builds the coordinator and the demo, starts a coordinator on loopback
# with the jobs of deploy/jobs/demo-jobs.json, runs four demo workers (a two-level hierarchy:
# pairs average every 4 steps, all four every 20), shows their progress, and stops everything.
#
#   bash examples/run_demo.sh
#
# Environment (all optional):
#   MODELAVG_BUILD_DIR     build directory (default: build)
#   MODELAVG_JOBS          parallel build jobs (default: 2)
#   MODELAVG_DEMO_STEPS    steps per job (default: 201; step 200 is then an all-rank averaging step)
#   MODELAVG_DEMO_BACKEND  auto (default: nccl when this machine has a GPU per rank, else gloo),
#                          gloo or nccl
#   MODELAVG_DEMO_TIMEOUT  seconds before the demo gives up (default: 600)
#   MODELAVG_DEMO_PREBUILT 1: install nothing and build nothing; run the binaries already built
#                          in MODELAVG_BUILD_DIR (how the test suite runs it, after its build)
# Exit status: 0 when every worker finished, non-zero otherwise. Nothing is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${MODELAVG_BUILD_DIR:-build}
jobs=${MODELAVG_JOBS:-2}
steps=${MODELAVG_DEMO_STEPS:-201}
backend=${MODELAVG_DEMO_BACKEND:-auto}
timeout_s=${MODELAVG_DEMO_TIMEOUT:-600}
world=4
if [ "$backend" = auto ]; then
  # NCCL needs one GPU per rank ("Duplicate GPU detected" otherwise).
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)
  if [ "${gpus:-0}" -ge "$world" ]; then backend=nccl; else backend=gloo; fi
fi
case "$backend" in
  gloo|nccl) ;;
  *) echo "run_demo: MODELAVG_DEMO_BACKEND=$backend: expected auto, gloo or nccl" >&2; exit 2 ;;
esac
jobs_file=$root/deploy/jobs/demo-jobs.json

if [ -t 1 ]; then
  say() { printf '\033[1m== %s\033[0m\n' "$*"; }
else
  say() { printf '== %s\n' "$*"; }
fi

if [ "${MODELAVG_DEMO_PREBUILT:-0}" = 1 ]; then
  say "prebuilt binaries in ${build} (MODELAVG_DEMO_PREBUILT=1: nothing installed or built)"
else
  say "dependencies (the build's; tests/run_all.sh installs the tests' own)"
  bash deploy/install_deps.sh --demo

  say "build (${build}, -j${jobs})"
  if [ ! -f "$build/CMakeCache.txt" ]; then
    # Without the tests and benchmarks, which need packages the demo does not (tests/run_all.sh
    # turns them on in the same build directory).
    # Without the etcd store (the demo's coordinator keeps its jobs in memory) and, unless the
    # demo runs on NCCL, without the CUDA path: neither is compiled for nothing.
    cuda=OFF
    [ "$backend" = nccl ] && cuda=AUTO
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMODELAVG_BUILD_TESTS=OFF -DMODELAVG_BUILD_BENCH=OFF -DMODELAVG_WITH_ETCD=OFF \
      -DMODELAVG_WITH_CUDA="$cuda" >/dev/null
  fi
  cmake --build "$build" -j "$jobs" --target modelavg-coordinator modelavg-demo
fi

find_binary() {
  local f
  f=$(find "$build" -type f -name "$1" -perm -u+x -print -quit)
  [ -n "$f" ] || { echo "run_demo: $1 was not built in $build (build it, or unset MODELAVG_DEMO_PREBUILT)" >&2; exit 1; }
  echo "$f"
}
coordinator_bin=$(find_binary modelavg-coordinator)
demo_bin=$(find_binary modelavg-demo)

work=$(mktemp -d "${TMPDIR:-/tmp}/modelavg-demo.XXXXXX")
coordinator_pid=""
worker_pids=()
cleanup() {
  local rc=$?
  for pid in "${worker_pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  if [ -n "$coordinator_pid" ] && kill -0 "$coordinator_pid" 2>/dev/null; then
    kill -TERM "$coordinator_pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$coordinator_pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$coordinator_pid" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
  if [ "$rc" -ne 0 ] && [ -f "$work/coordinator.log" ]; then
    echo "---- last lines of the coordinator's log ----" >&2
    tail -n 20 "$work/coordinator.log" >&2 || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "coordinator (loopback, jobs from ${jobs_file#"$root"/})"
"$coordinator_bin" --listen=127.0.0.1:0 --port_file="$work/port" --jobs_file="$jobs_file" \
  --log_level=info 2>"$work/coordinator.log" &
coordinator_pid=$!
for _ in $(seq 300); do
  [ -s "$work/port" ] && break
  kill -0 "$coordinator_pid" 2>/dev/null || { echo "run_demo: the coordinator exited" >&2; exit 1; }
  sleep 0.1
done
[ -s "$work/port" ] || { echo "run_demo: the coordinator did not start within 30 s" >&2; exit 1; }
address=$(cat "$work/port")
echo "coordinator serving on $address (log: coordinator.log, shown on failure)"

say "${world} demo workers (${backend}): job 'demo' (hierarchical), then 'demo-diloco' (the same with DiLoCo across all four) and 'demo-every-step' (for comparison)"
for rank in $(seq 0 $((world - 1))); do
  "$demo_bin" --coordinator="$address" --job=demo --compare_job=demo-diloco,demo-every-step \
    --rank="$rank" --steps="$steps" --backend="$backend" --log_every=20 &
  worker_pids+=("$!")
done

failed=0
deadline=$(( $(date +%s) + timeout_s ))
for i in "${!worker_pids[@]}"; do
  pid=${worker_pids[$i]}
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "run_demo: rank $i still running after ${timeout_s} s; stopping" >&2
      failed=1
      break 2
    fi
    sleep 0.2
  done
  if ! wait "$pid"; then
    echo "run_demo: rank $i failed" >&2
    failed=1
  fi
done

if [ "$failed" -ne 0 ]; then
  say "demo FAILED"
  exit 1
fi
say "demo finished: all ${world} workers done (rank 0's summary above compares the jobs)"
