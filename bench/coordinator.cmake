# modelavg-bench-coordinator: N simulated workers against a coordinator; prints one JSON line.
add_executable(modelavg-bench-coordinator ${CMAKE_CURRENT_LIST_DIR}/bench_coordinator.cc)
target_link_libraries(modelavg-bench-coordinator PRIVATE modelavg_server absl::flags
  absl::flags_parse)
