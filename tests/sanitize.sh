#!/usr/bin/env bash
# The tests again under AddressSanitizer + UndefinedBehaviorSanitizer, then each libFuzzer target
# for a bounded time, then the client's threaded tests under ThreadSanitizer. A second and a
# third build directory (clang-14; ccache is used when present but not needed), only the test and
# fuzz binaries. Any sanitizer report, leak or fuzz crash fails it.
#   bash tests/sanitize.sh                      # builds, then runs
#   bash tests/sanitize.sh build                # only the two builds (.ci/run: in the background,
#                                               #   at idle priority, while the main tests run)
#   bash tests/sanitize.sh test                 # the runs (builds what is not built yet first)
#   MODELAVG_FUZZ_SECONDS=600 bash tests/sanitize.sh   # fuzz longer
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/tools/stages.sh
mode=${1:-all}
case "$mode" in
  all|build|test) ;;
  *) echo "usage: $0 [build | test]" >&2; exit 2 ;;
esac
bash deploy/install_deps.sh
build=${MODELAVG_SANITIZE_BUILD_DIR:-build-sanitize}
jobs=${MODELAVG_JOBS:-2}
seconds=${MODELAVG_FUZZ_SECONDS:-30}
stage_begin sanitize-build
sanitize="-fsanitize=address,undefined -fno-sanitize-recover=all"
launcher=()
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -G Ninja "${launcher[@]}" \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="-O1 -g1 -fno-omit-frame-pointer $sanitize -fsanitize=fuzzer-no-link" \
  -DCMAKE_EXE_LINKER_FLAGS="$sanitize" -DCMAKE_SHARED_LINKER_FLAGS="$sanitize" \
  -DMODELAVG_WITH_CUDA=OFF -DMODELAVG_WITH_ETCD=OFF -DMODELAVG_BUILD_BENCH=OFF -DMODELAVG_BUILD_EXAMPLES=OFF \
  -DMODELAVG_BUILD_FUZZERS=ON -DMODELAVG_FUZZ_SECONDS="$seconds" -DMODELAVG_SANITIZER_CANARY=address
# The coordinator's tests (core, jobs file, gRPC service in-process, the daemon as a process, its
# HTTP port and status page, tokens, plan updates), the schedule's and the plan history's, the
# Gloo rounds of elastic jobs (backup, kept result, admission), and the fuzz targets.
# (server_flood_test is left out: its bounds are on the RSS of a build without the sanitizers'
# shadow memory and quarantine.)
targets=(schedule_test job_spec_test plan_history_test server_job_test server_bounds_test
         server_jobs_file_test server_update_test
         server_membership_test server_state_store_test server_elastic_test
         server_credentials_test server_hostile_test server_stream_writes_test
         server_heartbeat_replies_test status_page_test http_port_test service_auth_test
         printable_test
         server_grpc_test server_process_test modelavg-coordinator client_gloo_round_test
         modelavg-cli
         job_spec_fuzzer jobs_file_fuzzer job_handlers_fuzzer
         job_spec_fuzzer_replay jobs_file_fuzzer_replay job_handlers_fuzzer_replay
         modelavg-sanitizer-canary)
cmake --build "$build" -j "$jobs" --target "${targets[@]}"
run_asan_tests() {
stage_begin sanitize-tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Tests whose binaries this build leaves out register as *_NOT_BUILT; so do the Python ones.
# The scripts run binaries that this build leaves out (trace_worker_flags_test: the trace worker).
ctest --test-dir "$build" --output-on-failure -j "$jobs" --timeout 300 -L 'unit|integration' \
  -E '_NOT_BUILT$|_test\.py|reflection|conformance|e2e|client_|status_page_browser|cli_test|pip_venv|torchrun|prometheus_rules|etcd|cluster|trace_worker_flags'
# Each fuzz target is one process on one core: two at a time on two cores.
stage_begin fuzz
ctest --test-dir "$build" --output-on-failure -j "$jobs" -L fuzz
echo "fuzz: ${seconds} s per target"
stage_end
}
[ "$mode" = build ] || run_asan_tests

# ThreadSanitizer over the client's threaded tests (the heartbeat thread against an in-process
# coordinator, aborts from another thread, the cancel of a communicator's set-up): a third build
# directory, only those binaries. Debian's Abseil is not built for TSan: the test binaries link
# tests/tools/tsan_absl_sync.cc, which makes its Mutex and Notification visible to it.
tsan_build=${MODELAVG_TSAN_BUILD_DIR:-build-tsan}
tsan="-fsanitize=thread"
stage_begin tsan-build
cmake -S . -B "$tsan_build" -G Ninja "${launcher[@]}" \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="-O1 -g1 -fno-omit-frame-pointer $tsan" \
  -DCMAKE_EXE_LINKER_FLAGS="$tsan" -DCMAKE_SHARED_LINKER_FLAGS="$tsan" \
  -DMODELAVG_WITH_CUDA=OFF -DMODELAVG_WITH_ETCD=OFF -DMODELAVG_BUILD_BENCH=OFF -DMODELAVG_BUILD_EXAMPLES=OFF \
  -DMODELAVG_TSAN_ABSL_SHIM=ON -DMODELAVG_SANITIZER_CANARY=thread
tsan_targets=(client_gloo_abort_test client_gloo_setup_test client_coordinator_test
  client_shared_heartbeat_test modelavg-sanitizer-canary)
# The Python package's threads (each averaging call on a thread of its own, Ctrl-C abandoning
# one, two ranks on two Python threads, streaming sync's background all-reduces): the module
# built for TSan, run by an interpreter that carries the sanitizer (tests/tools/tsan_python.cc).
tsan_python=OFF
if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import torch, pytest' 2>/dev/null; then
  tsan_python=ON
  tsan_targets+=(modelavg-python modelavg-tsan-python)
fi
cmake --build "$tsan_build" -j "$jobs" --target "${tsan_targets[@]}"
stage_end
[ "$mode" != build ] || exit 0
stage_begin tsan-tests
# Races inside the uninstrumented system libraries are theirs (tests/tools/tsan.supp). The tests
# against the in-process coordinator (ClientCoordinatorTest, ClientAuthTest, SharedHeartbeatTest) stretch the
# timeouts they grant under TSan (tests/tools/time_scale.h; MODELAVG_TEST_TIME_SCALE overrides).
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tools/tsan.supp"
# TSan's shadow memory sits at fixed addresses; with address-space randomization a library or
# a thread stack can land there, and the process dies at start ("ThreadSanitizer failed to
# allocate ... errno 12"). The TSan runs go without randomization where the kernel lets us (a
# container's seccomp may not: then as before).
no_aslr=()
if setarch "$(uname -m)" -R true 2>/dev/null; then no_aslr=(setarch "$(uname -m)" -R); fi
"${no_aslr[@]}" ctest --test-dir "$tsan_build" --output-on-failure -j "$jobs" --timeout 300 \
  -R '^(sanitizer_canary_tsan|GlooAbortTest|GlooSetupTest|SilenceAndRandomBytes|ErrorKindTest|ClientHeartbeatTest|ClientCoordinatorTest|ClientAuthTest|SharedHeartbeatTest)'
if [[ $tsan_python == ON ]]; then
  # Ranks start as new processes (spawn): TSan cannot follow a fork of a threaded process. The
  # coordinator is the ASan build's (the first stage built it). A report fails the run (exit 66).
  export MODELAVG_TEST_START_METHOD=spawn
  # errors_test's `interrupt`: calls abandoned by Ctrl-C, then the interpreter's exit (which
  # waits for them, so that none runs while logging is torn down).
  # pytest's node ids (tests/python/conftest.py takes the build from the environment).
  py_checks=("errors_test.py::test_api[jobs_and_client]" "errors_test.py::test_api[interrupt]"
             "dropin_test.py::test_dropin[features_periodic_w2_p2]"
             "diloco_test.py::test_diloco[periodic_w2_dropin_backup_cpu]"
             "streaming_test.py::test_streaming[delay_dropin_w2]"
             "streaming_test.py::test_streaming[int8_delay_w4]")
  for check in "${py_checks[@]}"; do
    MODELAVG_PYTHON_DIR="$tsan_build/python" \
      MODELAVG_COORDINATOR_BIN="$build/server/modelavg-coordinator" \
      timeout 600 "${no_aslr[@]}" "$tsan_build/python/modelavg-tsan-python" -m pytest -q \
      "tests/python/$check" \
      >"$tsan_build/python-tsan.log" 2>&1 || {
        tail -80 "$tsan_build/python-tsan.log"
        echo "FAIL under TSan: tests/python/$check"
        exit 1
      }
    echo "tsan python: $check passed"
  done
  unset MODELAVG_TEST_START_METHOD
elif [[ ${CI:-} == true ]]; then
  echo "FAIL: CI runs the Python package under TSan, but /usr/bin/python3 cannot import torch and pytest"
  exit 1
else
  echo "SKIP: the Python package under TSan needs /usr/bin/python3 with torch and pytest (python3-torch, python3-pytest)"
fi
stage_end
