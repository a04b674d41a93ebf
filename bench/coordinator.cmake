# modelavg-bench-coordinator: N simulated workers against a coordinator; prints one JSON line.
add_executable(modelavg-bench-coordinator ${CMAKE_CURRENT_LIST_DIR}/bench_coordinator.cc)
target_link_libraries(modelavg-bench-coordinator PRIVATE modelavg_server modelavg_client_flags
  absl::flags
  absl::flags_parse)

# modelavg-soak-coordinator: minutes of churn (joins, deaths, leaves, restarts) and hostile
# requests against the daemon; prints RSS and Ping latency per window.
add_executable(modelavg-soak-coordinator ${CMAKE_CURRENT_LIST_DIR}/soak_coordinator.cc)
target_link_libraries(modelavg-soak-coordinator PRIVATE modelavg_proto_grpc gRPC::grpc++ absl::flags
  absl::flags_parse absl::strings absl::synchronization absl::time)
add_dependencies(modelavg-soak-coordinator modelavg-coordinator)
