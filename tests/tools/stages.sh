# Stage timing for .ci/run, tests/run_all.sh and tests/sanitize.sh (sourced, not run).
#   stage_begin NAME   ... work ...   stage_end
# prints "== NAME: N s" when a stage ends and appends "NAME N" to $MODELAVG_STAGE_LOG (when set),
# so that .ci/run can print every stage's time at the end, the failed run's too:
#   stage_summary FILE   prints the table, the total and the budget of each stage (docs/testing.md).
_stage_name=""
_stage_start=0
_stage_cpu=""
# "BUSY TOTAL": the machine's CPU time (all cores, in clock ticks) spent busy and in all, from
# /proc/stat; a stage's share of busy time says whether its waits leave the cores idle.
_stage_cpu_now() {
  awk '/^cpu / {t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t; exit}' \
    /proc/stat 2>/dev/null || true
}
stage_begin() {
  [ -z "$_stage_name" ] || stage_end
  _stage_name=$1
  _stage_start=$(date +%s)
  _stage_cpu=$(_stage_cpu_now)
  echo "== $_stage_name: started at $(date -u +%H:%M:%S)"
}
stage_end() {
  [ -n "$_stage_name" ] || return 0
  local took=$(( $(date +%s) - _stage_start )) busy=""
  if [ -n "$_stage_cpu" ]; then
    busy=$(echo "$_stage_cpu $(_stage_cpu_now)" |
           awk '$4 > $2 {printf " (the cores %d%% busy)", 100 * ($3 - $1) / ($4 - $2)}')
  fi
  echo "== $_stage_name: $took s$busy"
  if [ -n "${MODELAVG_STAGE_LOG:-}" ]; then echo "$_stage_name $took" >>"$MODELAVG_STAGE_LOG"; fi
  _stage_name=""
}
# The budget per stage in seconds on CI's machine (2 cores, a fresh clone, empty caches); the
# table in docs/testing.md says the same. A stage over its budget is printed with "over", not
# failed: a regression shows in the submission that causes it.
stage_budget() {
  case "$1" in
    packages) echo 180 ;;
    build) echo 450 ;;
    container-setup) echo 30 ;;
    ctest) echo 750 ;;
    install-check) echo 60 ;;
    sanitize-wait) echo 300 ;;
    figures) echo 180 ;;
    sanitize-tests) echo 90 ;;
    fuzz) echo 90 ;;
    tsan-tests) echo 240 ;;
    *) echo 0 ;;
  esac
}
stage_summary() {
  local file=$1 background=${2:-} total=0 name took budget mark
  [ -f "$file" ] || return 0
  echo "== stages (seconds; budget from docs/testing.md)"
  # A stage that ran in several parts (packages: .ci/run's and tests/run_all.sh's) is one line.
  while read -r name took; do
    budget=$(stage_budget "$name")
    mark=""
    [ "$budget" -gt 0 ] && [ "$took" -gt "$budget" ] && mark="  over its budget of $budget s"
    printf '   %-16s %5d%s\n' "$name" "$took" "$mark"
    total=$((total + took))
  done < <(_stage_sums "$file")
  printf '   %-16s %5d s (%d min; budget 2100 s)\n' total "$total" $(( (total + 59) / 60 ))
  # Stages that ran in the background, overlapped with the ones above (their time is in the
  # total only as far as a foreground stage waited for them).
  if [ -n "$background" ] && [ -s "$background" ]; then
    echo "   in the background, beside the stages above:"
    while read -r name took; do
      printf '   %-16s %5d\n' "$name" "$took"
    done < <(_stage_sums "$background")
  fi
}
_stage_sums() {
  awk '!($1 in t) {order[n++] = $1} {t[$1] += $2} END {for (i = 0; i < n; i++) print order[i], t[order[i]]}' "$1"
}
