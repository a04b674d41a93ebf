#!/usr/bin/env bash
# modelavg-trace-worker's paced-rounds flags (/work/shared/DESIGN.md's contract, docs/paced.md):
# each bad combination exits 1 before joining anything, with one line on stderr that names the
# flag (or variable) and nothing on stdout. The coordinator given is never reached.
#   trace_worker_flags_test.sh PATH/TO/modelavg-trace-worker
set -u
worker=$1
common=(--coordinator=127.0.0.1:1 --job=paced --world_size=2 --rank=0 --join_timeout_ms=200)
failures=0

# expect_error "what the line must contain" [VAR=value] -- flags...
expect_error() {
  local want=$1; shift
  local envs=()
  while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local out err rc
  out=$(mktemp) err=$(mktemp)
  env -u MODELAVG_TOKENS_PER_STEP "${envs[@]}" "$worker" "${common[@]}" "$@" >"$out" 2>"$err"
  rc=$?
  local lines
  lines=$(wc -l <"$err")
  if [[ $rc -ne 1 ]] || ! grep -qF -- "$want" "$err" || [[ $lines -ne 1 ]] || [[ -s $out ]]; then
    echo "FAIL: ${envs[*]} $*: exit $rc, stderr ($lines lines): $(cat "$err"); stdout: $(cat "$out")"
    failures=$((failures + 1))
  else
    echo "ok: ${envs[*]} $* -> $(cat "$err")"
  fi
  rm -f "$out" "$err"
}

expect_error "--rounds=3 and --steps=5 together: give one" -- --rounds=3 --steps=5
expect_error "--rounds must be >= 1" -- --rounds=-1
for bad in 0 -2 abc nan inf 1e13; do
  expect_error "--tokens_per_step=$bad: the tokens of one step are a finite number in (0, 1e12]" \
    -- --rounds=2 --tokens_per_step=$bad
done
expect_error "MODELAVG_TOKENS_PER_STEP=-4" MODELAVG_TOKENS_PER_STEP=-4 -- --rounds=2
# The flag beats the variable: a valid flag passes its check (the worker then fails to join the
# coordinator that is not there, which says nothing of tokens).
out=$(env MODELAVG_TOKENS_PER_STEP=-4 "$worker" "${common[@]}" --rounds=2 --tokens_per_step=8 2>&1)
if grep -q "TOKENS_PER_STEP\|tokens_per_step" <<<"$out"; then
  echo "FAIL: --tokens_per_step=8 with a bad MODELAVG_TOKENS_PER_STEP: $out"
  failures=$((failures + 1))
else
  echo "ok: --tokens_per_step=8 beats MODELAVG_TOKENS_PER_STEP=-4"
fi
exit $((failures > 0))
