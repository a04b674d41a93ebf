# modelavg_add_gtest(NAME SOURCES src... LIBS lib... [LABELS l...] [TIMEOUT s])
# Builds one GoogleTest binary and registers each of its tests with CTest. Every test has a
# timeout, so a hang is a failure, never a stuck CI.
function(modelavg_add_gtest name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  set(_labels ${ARG_LABELS})
  if(NOT _labels)
    set(_labels unit)
  endif()
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${_labels}")
endfunction()
