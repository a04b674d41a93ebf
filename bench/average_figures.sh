#!/usr/bin/env bash
# The averaging and coordinator figures that a change must not make worse, in one run, each
# against its baseline measured in the same run (docs/benchmarks.md, "Where the time goes"):
#   * the Python drop-in against PyTorch's average_parameters and a raw all_reduce of one flat
#     buffer (torch.distributed, Gloo), in a strict and an elastic job: 1 MiB in 16 tensors and
#     128 MiB in 64 tensors, 2 and 4 processes (bench/python_average_bench.py);
#   * the C++ call against one raw Gloo all-reduce of a flat buffer and against Gloo's ring
#     (the algorithm before the direct exchange), 1 MiB in 16 tensors and 128 MiB in 64, strict
#     and elastic, 2 and 4 processes (modelavg-bench-average);
#   * the coordinator's Step decisions/s at 1024 workers (modelavg-bench-coordinator), and its
#     cost at 1,024 and 16,384 ranks (bench/scale.sh: join, beat, Step, RSS).
# One JSON line per run, prefixed with its name.
#   bash bench/average_figures.sh [build-dir] [--quick]
# --quick: fewer iterations and no 128 MiB Python run (a minute or two instead of ten).
# The Python runs use the tests' Python, the repository's .venv (deploy/install_deps.sh), else a
# python3 with torch; they are skipped without one.
set -euo pipefail
build=${1:-build}
quick=false
[[ "${2:-}" == "--quick" ]] && quick=true
here=$(cd "$(dirname "$0")" && pwd)
py=$here/../.venv/bin/python
if [[ ! -x $py ]]; then
  py=$(command -v python3)
  # Debian's torch is for the system interpreter: prefer it when another python3 comes first.
  if ! "$py" -c 'import torch' 2>/dev/null && [[ -x /usr/bin/python3 ]]; then py=/usr/bin/python3; fi
fi

run() {  # name, command...
  local name=$1
  shift
  local line
  if line=$("$@" 2>/dev/null | tail -n 1); then
    echo "$name $line"
  else
    echo "$name {\"error\": \"exit $?\"}"
  fi
}

small_iters=60 big_iters=8
$quick && small_iters=20 big_iters=3
avg=$build/bench/modelavg-bench-average
phases=average,raw,plain,committed,vote,copies,ring,ring_committed
for world in 2 4; do
  for elastic in false true; do
    run "cpp_1mib_16_w${world}_elastic_${elastic}" "$avg" --world=$world --numel=262144 \
      --tensors=16 --iters=$small_iters --warmup=5 --phases=$phases --elastic=$elastic
    run "cpp_128mib_64_w${world}_elastic_${elastic}" "$avg" --world=$world --numel=33554432 \
      --tensors=64 --iters=$big_iters --warmup=2 --phases=$phases --elastic=$elastic
  done
done

if "$py" -c 'import torch' 2>/dev/null; then
  for world in 2 4; do
    run "python_1mib_16_w${world}" env PYTHONPATH="$build/python" "$py" \
      "$here/python_average_bench.py" --coordinator_bin="$build/server/modelavg-coordinator" \
      --world=$world --mib=1 --tensors=16 --iters=$small_iters --warmup=5 --skip_calls=0 \
      --modes=modelavg,elastic,torch,raw
    $quick && continue
    run "python_128mib_64_w${world}" env PYTHONPATH="$build/python" "$py" \
      "$here/python_average_bench.py" --coordinator_bin="$build/server/modelavg-coordinator" \
      --world=$world --mib=128 --tensors=64 --iters=$big_iters --warmup=2 --skip_calls=0 \
      --modes=modelavg,elastic,torch,raw
  done
else
  echo "python {\"skipped\": \"no torch for $py\"}"
fi

seconds=10
$quick && seconds=3
run coordinator_1024 "$build/bench/modelavg-bench-coordinator" --workers=1024 --seconds=$seconds
# The scale curve's two smallest points (bench/scale.sh; the whole curve in docs/benchmarks.md).
while read -r line; do
  echo "scale_$(sed -n 's/^{"workers": \([0-9]*\).*/\1/p' <<<"$line") $line"
done < <(bash "$here/scale.sh" --build="$build" 1024 16384 || true)
