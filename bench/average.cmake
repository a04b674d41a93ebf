# modelavg-bench-average: averaging throughput next to a raw all-reduce of the same size, same
# backend, same run (needs the in-process coordinator from server/).
if(TARGET modelavg_server)
  add_executable(modelavg-bench-average average_bench.cc)
  target_link_libraries(modelavg-bench-average PRIVATE modelavg_client modelavg_server
                        absl::flags absl::flags_parse absl::str_format)
endif()
