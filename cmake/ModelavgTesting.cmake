# modelavg_add_gtest(NAME SOURCES src... LIBS lib... [LABELS l...] [TIMEOUT s] [COST s])
# Builds one GoogleTest binary and registers each of its tests with CTest. Every test has a
# timeout, so a hang is a failure, never a stuck CI. COST: about how long each test takes (s),
# for the slow ones: ctest starts the costliest first, also in a fresh build directory that has no
# timings of its own yet, so that a long test does not start last and run alone.
function(modelavg_add_gtest name)
  cmake_parse_arguments(ARG "" "TIMEOUT;COST" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  # ThreadSanitizer build (tests/sanitize.sh): the system's Abseil made visible to TSan.
  if(MODELAVG_TSAN_ABSL_SHIM)
    target_sources(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/tools/tsan_absl_sync.cc)
    target_link_libraries(${name} PRIVATE ${CMAKE_DL_LIBS})
  endif()
  set(_labels ${ARG_LABELS})
  if(NOT _labels)
    set(_labels unit)
  endif()
  set(_cost)
  if(ARG_COST)
    set(_cost COST ${ARG_COST})
  endif()
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${_labels}" ${_cost})
endfunction()

# PyTorch keeps its compiler's cache in $TMPDIR/torchinductor_<user> as soon as torch._dynamo is
# imported (FSDP2 and torchft do): the tests of the calling directory keep it in the build
# directory instead, so that they leave nothing in the temporary folder (tests/run_all.sh checks).
# Called at the end of each directory whose tests run PyTorch.
function(modelavg_torch_cache_in_build)
  get_property(_tests DIRECTORY PROPERTY TESTS)
  if(_tests)
    set_property(TEST ${_tests} APPEND PROPERTY ENVIRONMENT
                 "TORCHINDUCTOR_CACHE_DIR=${PROJECT_BINARY_DIR}/torchinductor")
  endif()
endfunction()
