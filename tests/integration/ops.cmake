# Operators' tools against a running coordinator: the status page in a real browser (headless
# Chromium; skips without it unless MODELAVG_REQUIRE_BROWSER=1). Its screenshot is kept in
# <build>/artifacts/.
if(TARGET modelavg-coordinator AND TARGET modelavg_client)
  add_test(NAME status_page_browser_test
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/status_page_browser_test.py
            --coordinator=$<TARGET_FILE:modelavg-coordinator>
            --trace_worker=$<TARGET_FILE:modelavg-trace-worker>
            --artifacts_dir=${PROJECT_BINARY_DIR}/artifacts)
  set_tests_properties(status_page_browser_test PROPERTIES TIMEOUT 180 SKIP_RETURN_CODE 77
    LABELS "integration;browser")
endif()

# deploy/prometheus/: promtool check rules / check config / test rules (skips without promtool
# unless MODELAVG_REQUIRE_PROMTOOL=1).
add_test(NAME prometheus_rules_test
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/prometheus_rules_test.sh)
set_tests_properties(prometheus_rules_test PROPERTIES TIMEOUT 60 SKIP_RETURN_CODE 77
  LABELS "integration")

# The operators' command line (tools/modelavg_cli.cc) against a real coordinator; `update`
# against a running job of four trace workers (about 20 s of the test).
if(TARGET modelavg-coordinator AND TARGET modelavg-cli)
  add_test(NAME cli_test
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli_test.py
            --coordinator=$<TARGET_FILE:modelavg-coordinator> --cli=$<TARGET_FILE:modelavg-cli>
            --trace_worker=$<TARGET_FILE:modelavg-trace-worker>)
  set_tests_properties(cli_test PROPERTIES TIMEOUT 180 LABELS "integration")
  # Control characters in stored names (an old state file) come out of every table escaped.
  add_test(NAME cli_escape_test
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/cli_escape_test.py
            --coordinator=$<TARGET_FILE:modelavg-coordinator> --cli=$<TARGET_FILE:modelavg-cli>)
  set_tests_properties(cli_escape_test PROPERTIES TIMEOUT 120 LABELS "integration")
endif()

# deploy/build_wheel.sh → a manylinux wheel (auditwheel, from .venv) → a clean venv → its own
# coordinator and a 2-rank drop-in job with .venv's PyTorch (compiles in this build directory,
# so it costs no second build).
if(TARGET modelavg-coordinator AND MODELAVG_HAVE_PYTHON AND TARGET modelavg-cli)
  add_test(NAME pip_venv_test
    COMMAND /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/pip_venv_test.py
            --build_dir=${PROJECT_BINARY_DIR})
  set_tests_properties(pip_venv_test PROPERTIES TIMEOUT 600 LABELS "integration;python" COST 65)
endif()

# Launching like PyTorch: python -m modelavg.run and that Python's torchrun, 2 ranks each, with
# the PyTorch the Python tests use (${MODELAVG_PYTHON}).
if(TARGET modelavg-coordinator AND MODELAVG_HAVE_PYTHON)
  add_test(NAME torchrun_test
    COMMAND ${MODELAVG_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/torchrun_test.py
            --coordinator=$<TARGET_FILE:modelavg-coordinator> --python_dir=${MODELAVG_PYTHON_DIR})
  set_tests_properties(torchrun_test PROPERTIES TIMEOUT 300 LABELS "integration;python")
endif()
