# Client integration tests: a modelavg-coordinator process and W worker processes (Gloo over
# loopback). Need the coordinator binary from server/.
if(TARGET modelavg-coordinator)
  add_executable(modelavg_client_worker client_worker.cc)
  target_link_libraries(modelavg_client_worker PRIVATE modelavg_client absl::flags
                        absl::flags_parse absl::str_format)
  foreach(t client_averaging_test client_fault_test client_elastic_test)
    modelavg_add_gtest(${t} SOURCES ${t}.cc LIBS modelavg_client LABELS integration TIMEOUT 240)
    target_compile_definitions(${t} PRIVATE
      MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
      MODELAVG_CLIENT_WORKER_BIN="$<TARGET_FILE:modelavg_client_worker>")
    add_dependencies(${t} modelavg-coordinator modelavg_client_worker)
  endforeach()
endif()
