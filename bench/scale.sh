#!/usr/bin/env bash
# How the coordinator's cost grows with the world (issue #52, docs/benchmarks.md "Scale"): one job
# of N ranks whose beats come as a host's ranks do (--heartbeat=host, 8 ranks a stream), for
# each N given; past one job's world_size bound (65,536) the N ranks are split into N/65,536
# jobs on the one coordinator. One JSON line per size:
#   workers              N
#   jobs                 the jobs they form (1 up to 65,536 ranks)
#   join_all_s           every Join sent at once, until the last answer (the whole rendezvous)
#   join_cpu_us_per_rank the coordinator's CPU over that, per rank
#   heartbeat_cpu_us     the coordinator's CPU per beat, heartbeats only (1 beat/s a rank)
#   step_p50_us, step_p99_us  Step latency with 64 Steps in flight (not N: queueing would say
#                        nothing of the cost of one), over the same beats
#   trivial_p99_us       Ping's p99 meanwhile, on the same channels
#   decisions_per_s      Step decisions a second meanwhile
#   coordinator_rss_mb   the coordinator's resident memory with the world joined and beating
#   bash bench/scale.sh [--build=DIR] [--out=FILE] [N ...]     (default N: 1024 4096 16384 65536 262144)
# --out: also append the lines to FILE (bench/scale_plot.py draws them). Asserts nothing about
# speed; exits non-zero only when a run fails (its line then says "error").
set -uo pipefail
build=build
out=""
sizes=()
for arg in "$@"; do
  case "$arg" in
    --build=*) build=${arg#--build=} ;;
    --out=*) out=${arg#--out=} ;;
    *) sizes+=("$arg") ;;
  esac
done
[[ ${#sizes[@]} -gt 0 ]] || sizes=(1024 4096 16384 65536 262144)
bench=$build/bench/modelavg-bench-coordinator
[[ -x $bench ]] || { echo "scale.sh: no $bench (build modelavg-bench-coordinator)" >&2; exit 2; }
rc=0
for n in "${sizes[@]}"; do
  log=$(mktemp "${TMPDIR:-/tmp}/scale.XXXXXX")
  jobs=1
  (( n <= 65536 )) || jobs=$(( (n + 65535) / 65536 ))
  if "$bench" --workers="$n" --jobs="$jobs" --heartbeat=host --ranks_per_stream=8 --heartbeat_hz=1 \
      --heartbeat_seconds=3 --seconds=2 --max_inflight_steps=64 --latency_jobs=0 \
      >"$log.out" 2>"$log" && line=$(grep '^{' "$log.out" | tail -n 1) && [[ -n $line ]]; then
    line=$(python3 - "$line" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
n = d["workers"]
print(json.dumps({
    "workers": n,
    "jobs": d["jobs"],
    "join_all_s": d["join_all_s"],
    "join_cpu_us_per_rank": round(d["join_all_cpu_s"] / n * 1e6, 1),
    "heartbeat_cpu_us": d["heartbeat_cpu_us"],
    "step_p50_us": d["step_p50_us"],
    "step_p99_us": d["step_p99_us"],
    "trivial_p99_us": d["trivial_p99_us"],
    "decisions_per_s": d["decisions_per_s"],
    "coordinator_rss_mb": d["coordinator_rss_mb"],
    "errors": d["errors"],
}))
PY
)
  else
    rc=1
    line="{\"workers\": $n, \"error\": \"$(tail -n 1 "$log" | tr -d '"\\')\"}"
  fi
  echo "$line"
  [[ -z $out ]] || echo "$line" >>"$out"
  rm -f "$log" "$log.out"
done
exit $rc
