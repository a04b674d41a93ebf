# Client integration tests: a modelavg-coordinator process and W worker processes (Gloo over
# loopback). Need the coordinator binary from server/.
if(TARGET modelavg-coordinator)
  add_executable(modelavg_client_worker client_worker.cc)
  target_link_libraries(modelavg_client_worker PRIVATE modelavg_client modelavg_testing
                        absl::flags absl::flags_parse absl::str_format)
  foreach(t client_averaging_test client_fault_test client_elastic_test
            client_heartbeat_relay_test)
    modelavg_add_gtest(${t} SOURCES ${t}.cc LIBS modelavg_client LABELS integration TIMEOUT 240)
    target_compile_definitions(${t} PRIVATE
      MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
      MODELAVG_CLIENT_WORKER_BIN="$<TARGET_FILE:modelavg_client_worker>")
    add_dependencies(${t} modelavg-coordinator modelavg_client_worker)
  endforeach()
  # Elastic jobs of modelavg-trace-worker processes (tools/; its tests' variant in tests/tools,
  # after this file: referenced through generator expressions): client_elastic_regrow_test, 8
  # ranks, each test a few seconds to ~20 s; client_elastic_adopt_test, a round kept by a member that lost its
  # confirmation (4 ranks, a few seconds); client_outer_test, DiLoCo levels against a naive
  # reference (worlds 2-8, a few seconds each); client_streaming_test, fragments, mix and
  # compressed payloads against a naive reference (worlds 2-4, a few seconds each);
  # client_stop_signal_test, workers stopped by SIGTERM/SIGINT (a few seconds each);
  # client_nonfinite_test, a rank's NaN in a strict and an elastic job (a few seconds each);
  # client_nonfinite_delayed_test, the NaN in a streaming level's background round
  # (sync_delay), strict and elastic; client_nonfinite_replicas_test, the NaN in one shard of
  # a sharded replica; client_nonfinite_handover_test, a live member's NaN in what it hands a
  # replacement (a few seconds each);
  # client_sharded_test, sharded replicas (worlds 8 and 12, a few seconds each; a replica lost
  # and replaced in an elastic job, ~10 s); client_feedback_elastic_test, error feedback's
  # residual through a retried round, a lost commit and a replacement (~15 s each);
  # client_update_test, plans changed while the job runs (UpdateJob; 4 ranks, a few seconds each);
  # client_paced_test, paced rounds of ranks of unequal speed against a naive reference (3-4
  # ranks, 1-3 s each); client_paced_elastic_test, a paced member killed and replaced, and one
  # failed out by max_lag (3 ranks, ~5 s each).
  foreach(t client_elastic_regrow_test client_elastic_adopt_test client_outer_test
            client_nonfinite_delayed_test client_nonfinite_replicas_test
            client_nonfinite_handover_test
            client_outer_elastic_test client_streaming_test client_stop_signal_test
            client_nonfinite_test client_sharded_test client_feedback_elastic_test
            client_update_test client_paced_test client_paced_elastic_test)
    modelavg_add_gtest(${t} SOURCES ${t}.cc LIBS modelavg_client LABELS integration TIMEOUT 120)
    # Those that lose a commit (--testing_fail_commit_at_step) run the tests' variant of the
    # worker (tests/tools), the others the shipped program.
    set(worker modelavg-trace-worker)
    if(t MATCHES "^client_(elastic_adopt|outer_elastic|feedback_elastic)_test$")
      set(worker modelavg-trace-worker-faults)
    endif()
    target_compile_definitions(${t} PRIVATE
      MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
      MODELAVG_CLIENT_WORKER_BIN="$<TARGET_FILE:modelavg_client_worker>"
      MODELAVG_TRACE_WORKER_BIN="$<TARGET_FILE:${worker}>")
    add_dependencies(${t} modelavg-coordinator ${worker})
  endforeach()
  # Churn: a rank killed and replaced per cycle (MODELAVG_CHURN_CYCLES, default 100, ~2 s each).
  modelavg_add_gtest(client_elastic_churn_test SOURCES client_elastic_churn_test.cc
    LIBS modelavg_client LABELS "integration;elastic" TIMEOUT 600 COST 180)
  target_compile_definitions(client_elastic_churn_test PRIVATE
    MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
    MODELAVG_CLIENT_WORKER_BIN="$<TARGET_FILE:modelavg_client_worker>"
    MODELAVG_TRACE_WORKER_BIN="$<TARGET_FILE:modelavg-trace-worker>")
  add_dependencies(client_elastic_churn_test modelavg-coordinator modelavg-trace-worker)
endif()

# The trace checker (trace_check.h) on synthetic traces: fast, no processes.
modelavg_add_gtest(trace_check_test SOURCES trace_check_test.cc
  LIBS modelavg_proto protobuf::libprotobuf absl::status absl::statusor absl::strings absl::str_format
  LABELS unit TIMEOUT 60)
target_include_directories(trace_check_test PRIVATE ${PROJECT_SOURCE_DIR})
