# The coordinator killed and restarted under running workers (modelavg-trace-worker, defined in
# tests/tools, after this file: referenced through generator expressions).
if(TARGET modelavg-coordinator AND TARGET modelavg_client)
  modelavg_add_gtest(coordinator_restart_test SOURCES coordinator_restart_test.cc
    LIBS modelavg_client LABELS integration TIMEOUT 300)
  target_compile_definitions(coordinator_restart_test PRIVATE
    MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
    MODELAVG_TRACE_WORKER_BIN="$<TARGET_FILE:modelavg-trace-worker>")
  add_dependencies(coordinator_restart_test modelavg-coordinator modelavg-trace-worker)
endif()
