#!/usr/bin/env bash
# Installs what is missing, configures, builds (one build dir, -j2; ctest -j3) and runs every
# test that this machine can run. GPU tests run when a device is present and skip, saying why,
# when not. The container tests (label `container`) run when a container engine is usable
# (deploy/container_setup.sh --check) and skip, saying why, when not; MODELAVG_CONTAINER_SETUP=1
# sets one up first (bash deploy/container_setup.sh; .ci/run does).
#   bash tests/run_all.sh            # everything
#   bash tests/run_all.sh -L unit    # extra arguments go to ctest
# With no arguments it then checks the installation: tests/install/install_test.sh installs into a
# temporary prefix, builds the Debian packages, and builds and runs the README's example from each.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/tools/stages.sh
stage_begin packages
bash deploy/install_deps.sh
stage_end
# The container engine and its base image download while the build compiles (mostly the network's
# time); the tests wait for them (stage container-setup: the part not hidden by the build).
container_pid=""
if [ "${MODELAVG_CONTAINER_SETUP:-0}" = 1 ]; then
  container_log=$(mktemp "${TMPDIR:-/tmp}/container-setup.XXXXXX")
  bash deploy/container_setup.sh >"$container_log" 2>&1 &
  container_pid=$!
  # (a failed build does not leave it running)
  trap '[ -z "$container_pid" ] || kill "$container_pid" 2>/dev/null || true' EXIT
fi
build=${MODELAVG_BUILD_DIR:-build}
jobs=${MODELAVG_JOBS:-2}
# ctest runs one test more than the build's jobs: many tests spend most of their time waiting
# (a heartbeat timeout, an etcd lease, a killed process's replacement), leaving a core idle.
test_jobs=${MODELAVG_TEST_JOBS:-$((jobs + 1))}
stage_begin build
launcher=()
# ccache: paths relative to the checkout, so that clones in other folders share objects.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Tests, benchmarks, the etcd store and the CUDA path (when found) on, also in a build directory
# that examples/run_demo.sh configured without them.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
  -DMODELAVG_BUILD_TESTS=ON -DMODELAVG_BUILD_BENCH=ON -DMODELAVG_WITH_ETCD=AUTO \
  -DMODELAVG_WITH_CUDA="${MODELAVG_WITH_CUDA:-AUTO}" ${MODELAVG_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
stage_end
if [ -n "$container_pid" ]; then
  stage_begin container-setup
  container_rc=0
  wait "$container_pid" || container_rc=$?
  container_pid=""
  cat "$container_log"
  rm -f "$container_log"
  stage_end
  [ "$container_rc" -eq 0 ] || { echo "FAIL: deploy/container_setup.sh exited $container_rc"; exit 1; }
fi
if containers=$(bash deploy/container_setup.sh --check 2>&1); then
  echo "container tests: will run ($(echo "$containers" | tr '\n' ' '))"
else
  echo "container tests: will be skipped: $containers"
fi

# The tests run with a private TMPDIR; afterwards nothing of theirs may be left: no process
# started from this build or from the repository's test scripts, no temporary folder (in the
# private TMPDIR, or a new modelavg* one in the shared temp folder for a test that ignores
# TMPDIR). MODELAVG_LEFTOVER_CHECK=0 skips the check (e.g. on a machine where other runs of
# modelavg share the temp folder).
shared_tmp=${TMPDIR:-/tmp}
run_tmp=$(mktemp -d "$shared_tmp/modelavg-run.XXXXXX")
shared_before=$(find "$shared_tmp" -maxdepth 1 -name 'modelavg*' ! -path "$run_tmp" | sort)
rc=0
stage_begin ctest
TMPDIR=$run_tmp ctest --test-dir "$build" --output-on-failure -j "$test_jobs" --timeout 300 "$@" ||
  rc=$?
# With no ctest arguments, then the installation as users get it: cmake --install into a temporary
# prefix and the Debian packages, each used to build and run the README's example.
if [ $# -eq 0 ]; then
  stage_begin install-check
  TMPDIR=$run_tmp bash tests/install/install_test.sh "$build" || rc=1
fi
stage_end

# Prints "PID COMMAND" for every live process whose program is in the build folder or whose
# command line runs a script of tests/ or examples/.
leftover_processes() {
  local build_abs repo_re self=$BASHPID pid cmd
  build_abs=$(cd "$build" && pwd -P)
  repo_re=$(pwd -P | sed 's/[][\.*^$+?(){}|]/\\&/g')
  for pid in $( {
    find /proc -mindepth 2 -maxdepth 2 -name exe -lname "$build_abs/*" 2>/dev/null
    # (the pattern does not match this grep's own command line)
    grep -l -a -E "$repo_re/(tests|examples)/" /proc/[0-9]*/cmdline 2>/dev/null
  } | cut -d/ -f3 | sort -un); do
    [ "$pid" = "$$" ] || [ "$pid" = "$self" ] && continue
    # (.ci/run's sanitizer builds, running in the background meanwhile, are not the tests')
    grep -qz '^MODELAVG_BACKGROUND_BUILD=1$' "/proc/$pid/environ" 2>/dev/null && continue
    cmd=$( { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue
    [ -n "$cmd" ] && echo "$pid $cmd"
  done
  return 0
}
if [ "${MODELAVG_LEFTOVER_CHECK:-1}" != 0 ]; then
  end=$((SECONDS + 10))  # processes that are exiting get 10 s
  while true; do
    left=$(leftover_processes)
    [ -z "$left" ] || [ "$SECONDS" -ge "$end" ] && break
    sleep 0.2
  done
  if [ -n "$left" ]; then
    echo "leftovers: the tests left these processes running (killed now):" >&2
    echo "$left" >&2
    for pid in $(echo "$left" | cut -d' ' -f1); do kill -KILL "$pid" 2>/dev/null || true; done
    rc=1
  fi
  files=$(find "$run_tmp" -mindepth 1 -maxdepth 1 | sort)
  if [ -n "$files" ]; then
    echo "leftovers: the tests left these in their TMPDIR:" >&2
    echo "$files" >&2
    rc=1
  fi
  shared_new=$(comm -13 <(echo "$shared_before") \
    <(find "$shared_tmp" -maxdepth 1 -name 'modelavg*' ! -path "$run_tmp" | sort))
  if [ -n "$shared_new" ]; then
    echo "leftovers: new in $shared_tmp during the tests (a test ignoring TMPDIR?):" >&2
    echo "$shared_new" >&2
    rc=1
  fi
  [ "$rc" -ne 0 ] || echo "leftovers: none (no process, no temporary folder)"
fi
rm -rf "$run_tmp"
exit "$rc"
