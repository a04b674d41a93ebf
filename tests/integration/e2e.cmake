# End-to-end tests: the Kubernetes manifests checked against the build, the compose topology run
# as plain processes on loopback, and (label `container`) the image built and the compose job run
# in containers. Both need every shipped program, some of which (the demo) are
# defined after tests/, so registration is deferred to the end of the top-level directory.
# They run with Debian's /usr/bin/python3 (python3-yaml, python3-grpcio; no PyTorch).
set(MODELAVG_COORDINATOR_TARGET modelavg-coordinator CACHE STRING
    "CMake target of the coordinator daemon")

function(modelavg_register_e2e_tests)
  set(dir ${CMAKE_CURRENT_FUNCTION_LIST_DIR})
  set(binaries "")
  set(missing "")
  foreach(pair "modelavg-coordinator=${MODELAVG_COORDINATOR_TARGET}"
               "modelavg-demo=modelavg-demo" "modelavg-health=modelavg-health"
               "modelavg-trace-worker=modelavg-trace-worker")
    string(REPLACE "=" ";" pair "${pair}")
    list(GET pair 0 program)
    list(GET pair 1 target)
    if(TARGET ${target})
      list(APPEND binaries "--binary=${program}=$<TARGET_FILE:${target}>")
    else()
      list(APPEND missing ${program})
    endif()
  endforeach()
  if(missing)
    message(STATUS "modelavg: end-to-end tests skipped (not built: ${missing})")
    return()
  endif()
  add_test(NAME e2e.k8s_manifests
    COMMAND /usr/bin/python3 ${dir}/e2e_k8s_manifests_test.py ${binaries})
  set_tests_properties(e2e.k8s_manifests PROPERTIES LABELS "integration;e2e" TIMEOUT 120)
  add_test(NAME e2e.compose_topology
    COMMAND /usr/bin/python3 ${dir}/e2e_compose_topology_test.py ${binaries})
  # Runs etcd and two coordinators on it: skipped (77) without etcd-server, failed instead under
  # MODELAVG_REQUIRE_ETCD=1.
  set_tests_properties(e2e.compose_topology PROPERTIES LABELS "integration;e2e;etcd" TIMEOUT 450
    SKIP_RETURN_CODE 77)
  # The same topology stopped mid-job as `docker compose down` / `podman stop` stop it: SIGTERM
  # to every worker, each of which must leave the job and exit 143 at once; the job FINISHED.
  add_test(NAME e2e.compose_stop
    COMMAND /usr/bin/python3 ${dir}/e2e_compose_topology_test.py ${binaries} --stop_mid_run)
  set_tests_properties(e2e.compose_stop PROPERTIES LABELS "integration;e2e;etcd" TIMEOUT 300
    SKIP_RETURN_CODE 77)
  # The README's first command, on this build's binaries: it installs and builds nothing here
  # (tests never do; the build before ctest made modelavg-demo, which registration requires).
  add_test(NAME e2e.run_demo COMMAND bash ${PROJECT_SOURCE_DIR}/examples/run_demo.sh)
  set_tests_properties(e2e.run_demo PROPERTIES LABELS "integration;e2e" TIMEOUT 600
    ENVIRONMENT
      "MODELAVG_BUILD_DIR=${CMAKE_BINARY_DIR};MODELAVG_DEMO_TIMEOUT=400;MODELAVG_DEMO_PREBUILT=1")
  # Builds the image from this build directory's programs (the Dockerfile's `prebuilt` stage:
  # nothing compiled again) and runs deploy/docker-compose.yml's job. Skipped (77), saying why,
  # when no container engine is usable: bash deploy/container_setup.sh sets one up. The
  # Dockerfile's own compile (its default stage) is e2e_container_test.py without
  # --prebuilt_build (docs/testing.md).
  add_test(NAME e2e.container COMMAND /usr/bin/python3 ${dir}/e2e_container_test.py
    --timeout_s=1100 --prebuilt_build=${CMAKE_BINARY_DIR})
  set_tests_properties(e2e.container PROPERTIES LABELS "integration;e2e;container"
    TIMEOUT 1200 SKIP_RETURN_CODE 77 COST 120)
endfunction()

cmake_language(DEFER DIRECTORY ${PROJECT_SOURCE_DIR} CALL modelavg_register_e2e_tests)
