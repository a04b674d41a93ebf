# What `cmake --install` and CPack ship, in one place. Included at the end of the top-level
# CMakeLists.txt, once every target exists.
#
#   component  Debian package                 contents
#   runtime    libmodelavg-client<SOVERSION>  libmodelavg_client.so.<SOVERSION> (one shared library:
#                                             client, schedule and generated gRPC code)
#   dev        libmodelavg-client-dev         <modelavg/...> headers, the .so link, the CMake
#                                             package (modelavg::client) and modelavg.pc
#   tools      modelavg                       modelavg-coordinator, modelavg (the CLI),
#                                             modelavg-health, modelavg-rpc,
#                                             modelavg-demo, modelavg-trace-worker,
#                                             modelavg-bench-coordinator
#   python     python3-modelavg               whatever python/ installs with COMPONENT python
#
# In the build tree nothing changes for the project's own targets: they keep linking the static
# libraries (one per folder of client/, modelavg_common, modelavg_proto). The shared library is
# linked from those same objects (no second compile), so tests and installed library run the
# same code.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# While the major version is 0 every minor release may change the API, so the SONAME carries
# major.minor (libmodelavg_client.so.0.1); from 1.0 on, only the major.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(MODELAVG_SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
else()
  set(MODELAVG_SOVERSION ${PROJECT_VERSION_MAJOR})
endif()

# ---- Public headers: what a trainer includes, as <modelavg/...>: the folder include/modelavg/,
# installed as it is (the project's own code includes them by the same names). Everything else
# is private. The generated API headers go beside them as <modelavg/v1/...>. ----
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/modelavg DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        COMPONENT dev FILES_MATCHING PATTERN "*.h")
set(MODELAVG_PROTO_HEADERS
  ${PROJECT_BINARY_DIR}/proto/gen/modelavg/v1/coordinator.pb.h
  ${PROJECT_BINARY_DIR}/proto/gen/modelavg/v1/coordinator.grpc.pb.h)
install(FILES ${MODELAVG_PROTO_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/modelavg/v1
        COMPONENT dev)

# ---- The shared client library: modelavg::client for other projects. ----
set(_modelavg_static ${MODELAVG_CLIENT_LIBRARIES} modelavg_common modelavg_proto modelavg_proto_grpc)
add_library(modelavg_client_shared SHARED)
foreach(lib ${_modelavg_static})
  target_sources(modelavg_client_shared PRIVATE $<TARGET_OBJECTS:${lib}>)
  # Whatever the static libraries link (now or after someone adds a dependency), minus
  # themselves: the shared library links it privately. --no-undefined below turns a missed one
  # into a link error here rather than in a user's build.
  # (Entries "::@..." are CMake's markers of a call from another directory.)
  get_target_property(_deps ${lib} LINK_LIBRARIES)
  foreach(dep ${_deps})
    if(NOT dep IN_LIST _modelavg_static AND NOT dep MATCHES "^(modelavg::(client|common|proto)$|::@)")
      target_link_libraries(modelavg_client_shared PRIVATE ${dep})
    endif()
  endforeach()
endforeach()
# What the public headers need (absl, protobuf and the generated gRPC code): a user's target gets
# these with modelavg::client. Gloo, spdlog and CUDA/NCCL are private (no public header names them).
target_link_libraries(modelavg_client_shared PUBLIC
  protobuf::libprotobuf gRPC::grpc++ absl::base absl::status absl::statusor absl::span
  absl::strings absl::synchronization absl::time Threads::Threads)
target_include_directories(modelavg_client_shared INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
  $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/proto/gen>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(modelavg_client_shared INTERFACE cxx_std_17)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_link_options(modelavg_client_shared PRIVATE LINKER:--no-undefined)
endif()
set_target_properties(modelavg_client_shared PROPERTIES
  OUTPUT_NAME modelavg_client
  EXPORT_NAME client
  LINKER_LANGUAGE CXX
  VERSION ${PROJECT_VERSION}
  SOVERSION ${MODELAVG_SOVERSION}
  # Keep non-system library directories (CUDA/NCCL under /usr/local/cuda) in the installed RUNPATH.
  INSTALL_RPATH_USE_LINK_PATH ON)

install(TARGETS modelavg_client_shared EXPORT modelavgTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)

# ---- The CMake package: find_package(modelavg CONFIG REQUIRED), relocatable. ----
set(_modelavg_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/modelavg)
install(EXPORT modelavgTargets NAMESPACE modelavg:: DESTINATION ${_modelavg_cmake_dir}
        COMPONENT dev)
set(MODELAVG_CONFIG_CUDA ${MODELAVG_HAVE_CUDA})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/modelavgConfig.cmake.in
  ${PROJECT_BINARY_DIR}/modelavgConfig.cmake INSTALL_DESTINATION ${_modelavg_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/modelavgConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/modelavgConfig.cmake
              ${PROJECT_BINARY_DIR}/modelavgConfigVersion.cmake
        DESTINATION ${_modelavg_cmake_dir} COMPONENT dev)
# The same package straight from this build tree:
#   find_package(modelavg CONFIG REQUIRED PATHS /path/to/modelavg/build)
export(EXPORT modelavgTargets NAMESPACE modelavg:: FILE ${PROJECT_BINARY_DIR}/modelavgTargets.cmake)

# ---- pkg-config: pkg-config --cflags --libs modelavg ----
file(RELATIVE_PATH MODELAVG_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${PROJECT_SOURCE_DIR}/cmake/modelavg.pc.in ${PROJECT_BINARY_DIR}/modelavg.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/modelavg.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig
        COMPONENT dev)

# ---- Programs ----
set(_modelavg_programs "")
foreach(program modelavg-coordinator modelavg-cli modelavg-health modelavg-rpc modelavg-demo
                modelavg-trace-worker modelavg-bench-coordinator)
  if(TARGET ${program})
    list(APPEND _modelavg_programs ${program})
  else()
    message(STATUS "modelavg: ${program} is not built, so not installed")
  endif()
endforeach()
# No shipped program links the tests' fakes (modelavg_testing, tests/testing/): a configure error
# names the program and the library that brought them in.
function(_modelavg_test_code_in target chain out)
  get_property(seen GLOBAL PROPERTY _MODELAVG_LINKS_SEEN)
  if(target IN_LIST seen)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY _MODELAVG_LINKS_SEEN ${target})
  get_target_property(type ${target} TYPE)
  set(libs "")
  if(NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(direct ${target} LINK_LIBRARIES)
    if(direct)
      list(APPEND libs ${direct})
    endif()
  endif()
  get_target_property(iface ${target} INTERFACE_LINK_LIBRARIES)
  if(iface)
    list(APPEND libs ${iface})
  endif()
  foreach(lib IN LISTS libs)
    string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" lib "${lib}")
    if(lib STREQUAL "modelavg_testing")
      set(${out} "${chain} -> modelavg_testing" PARENT_SCOPE)
      return()
    endif()
    if(TARGET ${lib})
      set(found "")
      _modelavg_test_code_in(${lib} "${chain} -> ${lib}" found)
      if(found)
        set(${out} "${found}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()
foreach(program ${_modelavg_programs})
  set_property(GLOBAL PROPERTY _MODELAVG_LINKS_SEEN "")
  _modelavg_test_code_in(${program} ${program} found)
  if(found)
    message(FATAL_ERROR "modelavg: the shipped program ${program} links the tests' fakes "
                        "(${found}): link them only into tests and tests/tools' programs")
  endif()
endforeach()
set_target_properties(${_modelavg_programs} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ${_modelavg_programs} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT tools)

# ---- The Python package (python/): the importable package the build leaves in
# ${MODELAVG_PYTHON_DIR}/modelavg, installed where Debian's python3 finds packages. ----
set(MODELAVG_INSTALL_PYTHONDIR lib/python3/dist-packages CACHE STRING
    "Where the Python package is installed, relative to the prefix")
if(TARGET modelavg_python_core AND MODELAVG_PYTHON_DIR)
  set_target_properties(modelavg_python_core PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS modelavg_python_core
          LIBRARY DESTINATION ${MODELAVG_INSTALL_PYTHONDIR}/modelavg COMPONENT python)
  install(DIRECTORY ${MODELAVG_PYTHON_DIR}/modelavg/ DESTINATION ${MODELAVG_INSTALL_PYTHONDIR}/modelavg
          COMPONENT python FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi" PATTERN "py.typed"
          PATTERN "__pycache__" EXCLUDE)
endif()

include(${PROJECT_SOURCE_DIR}/cmake/ModelavgPackaging.cmake)
