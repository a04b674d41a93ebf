#!/usr/bin/env bash
# deploy/prometheus/: the scrape config and the alerting rules pass promtool's checks, and the
# rules' unit tests (alerts_test.yml: each alert fires on its synthetic series, and not before).
# Without promtool it skips (exit 77) saying why; MODELAVG_REQUIRE_PROMTOOL=1 makes that a failure.
set -euo pipefail
dir="$(cd "$(dirname "$0")/../../deploy/prometheus" && pwd)"
if ! command -v promtool >/dev/null; then
  if [ "${MODELAVG_REQUIRE_PROMTOOL:-0}" = 1 ]; then
    echo "FAIL: MODELAVG_REQUIRE_PROMTOOL=1 but there is no promtool (apt-get install prometheus)" >&2
    exit 1
  fi
  echo "SKIP: no promtool (apt-get install prometheus, or bash deploy/install_deps.sh)"
  exit 77
fi
cd "$dir"
promtool check rules alerts.yml
promtool check config prometheus.yml
promtool test rules alerts_test.yml
# Every metric the rules use is one the coordinator exports (docs/operations.md lists them).
for metric in $(grep -o 'modelavg_[a-z_]*' alerts.yml | sort -u); do
  grep -q "\"$metric\"" "$dir/../../server/rpc/rpc_metrics.cc" ||
    { echo "FAIL: alerts.yml uses $metric, which server/rpc/rpc_metrics.cc does not export" >&2; exit 1; }
done
echo "prometheus rules: 1 passed, 0 failed"
