#!/usr/bin/env bash
# Installs what is missing, configures, builds (one build dir, -j2) and runs every test that this
# machine can run. GPU tests run when a device is present and skip, saying why, when not. The
# container tests (label `container`) run when a container engine is usable
# (deploy/container_setup.sh --check) and skip, saying why, when not; MODELAVG_CONTAINER_SETUP=1
# sets one up first (bash deploy/container_setup.sh; .ci/run does).
#   bash tests/run_all.sh            # everything
#   bash tests/run_all.sh -L unit    # extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh
if [ "${MODELAVG_CONTAINER_SETUP:-0}" = 1 ]; then
  setup_start=$(date +%s)
  bash deploy/container_setup.sh
  echo "container setup: $(( $(date +%s) - setup_start )) s"
fi
if containers=$(bash deploy/container_setup.sh --check 2>&1); then
  echo "container tests: will run ($(echo "$containers" | tr '\n' ' '))"
else
  echo "container tests: will be skipped: $containers"
fi
build=${MODELAVG_BUILD_DIR:-build}
jobs=${MODELAVG_JOBS:-2}
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${MODELAVG_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
echo "build: $(( $(date +%s) - start )) s"
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 300 "$@"
