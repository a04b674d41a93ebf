# Coordinator integration tests: a real server on loopback (in-process and as a separate
# process), and a reflection-only client like grpcurl.
modelavg_add_gtest(server_grpc_test SOURCES server_grpc_test.cc
  LIBS modelavg_server modelavg_testing LABELS integration TIMEOUT 120)
modelavg_add_gtest(server_process_test SOURCES server_process_test.cc LIBS modelavg_server
  LABELS integration TIMEOUT 120)
target_compile_definitions(server_process_test PRIVATE
  MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>")
add_dependencies(server_process_test modelavg-coordinator)

add_test(NAME server_reflection_test
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/server_reflection_test.py
          --coordinator=$<TARGET_FILE:modelavg-coordinator>)
set_tests_properties(server_reflection_test PROPERTIES TIMEOUT 120 LABELS integration)
add_test(NAME server_reflection_test_reverse_order
  COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/server_reflection_test.py
          --coordinator=$<TARGET_FILE:modelavg-coordinator> --reverse)
set_tests_properties(server_reflection_test_reverse_order PROPERTIES TIMEOUT 120
  LABELS integration)

# Hostile clients: unparseable requests on every RPC and stream, roles, ListJobs pages, the
# expected world size, SIGTERM with calls in flight.
modelavg_add_gtest(server_hostile_test SOURCES server_hostile_test.cc
  LIBS modelavg_server modelavg_testing LABELS integration TIMEOUT 120)
target_compile_definitions(server_hostile_test PRIVATE
  MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>")
add_dependencies(server_hostile_test modelavg-coordinator)

# The HTTP port: idle connections, SIGTERM, the status page's token (a separate process).
modelavg_add_gtest(http_port_test SOURCES http_port_test.cc LIBS modelavg_common
  LABELS integration TIMEOUT 120)
target_compile_definitions(http_port_test PRIVATE
  MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>")
add_dependencies(http_port_test modelavg-coordinator)

# Floods against the coordinator process: unauthenticated big messages (RSS bounded), many
# connections on the gRPC port, HeartbeatStreams held open without a token.
modelavg_add_gtest(server_flood_test SOURCES server_flood_test.cc LIBS modelavg_common
  modelavg_proto_grpc LABELS integration TIMEOUT 120)
target_compile_definitions(server_flood_test PRIVATE
  MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>")
add_dependencies(server_flood_test modelavg-coordinator)
