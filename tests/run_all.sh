#!/usr/bin/env bash
# Installs what is missing, configures, builds (one build dir, -j2) and runs every test that this
# machine can run. GPU tests run when a device is present and skip, saying why, when not.
#   bash tests/run_all.sh            # everything
#   bash tests/run_all.sh -L unit    # extra arguments go to ctest
# With no arguments it then checks the installation: tests/install/install_test.sh installs into a
# temporary prefix, builds the Debian packages, and builds and runs the README's example from each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh
build=${MODELAVG_BUILD_DIR:-build}
jobs=${MODELAVG_JOBS:-2}
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${MODELAVG_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
echo "build: $(( $(date +%s) - start )) s"
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 300 "$@"
if [ $# -eq 0 ]; then
  bash tests/install/install_test.sh "$build"
fi
