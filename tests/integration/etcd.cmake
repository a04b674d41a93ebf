# Coordinator high availability on etcd (label etcd): etcd-server members, coordinators and
# trace workers started by the test on loopback. Skipped without etcd-server, failed instead
# with MODELAVG_REQUIRE_ETCD=1 (.ci/run). Without etcd support in the build, a placeholder says
# so (and fails under MODELAVG_REQUIRE_ETCD=1).
if(MODELAVG_HAVE_ETCD AND TARGET modelavg-coordinator AND TARGET modelavg_client)
  modelavg_add_gtest(etcd_ha_test SOURCES etcd_ha_test.cc
    LIBS modelavg_client modelavg_server_etcd LABELS integration etcd TIMEOUT 400 COST 30)
  target_compile_definitions(etcd_ha_test PRIVATE
    MODELAVG_COORDINATOR_BIN="$<TARGET_FILE:modelavg-coordinator>"
    MODELAVG_TRACE_WORKER_BIN="$<TARGET_FILE:modelavg-trace-worker>"
    MODELAVG_HEALTH_BIN="$<TARGET_FILE:modelavg-health>")
  add_dependencies(etcd_ha_test modelavg-coordinator modelavg-trace-worker modelavg-health)
elseif(NOT MODELAVG_HAVE_ETCD)
  add_test(NAME etcd_ha_test_not_built COMMAND sh -c
    "echo 'etcd HA tests not built: configure found no etcd protos (bash deploy/install_deps.sh, then reconfigure)'; [ \"$MODELAVG_REQUIRE_ETCD\" = 1 ] && exit 1; exit 77")
  set_tests_properties(etcd_ha_test_not_built PROPERTIES SKIP_RETURN_CODE 77 LABELS "integration;etcd")
endif()
