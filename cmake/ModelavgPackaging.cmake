# Debian packages of what ModelavgInstall.cmake installs, one per install component:
#   cpack --config build/CPackConfig.cmake -B build/packages     (after the build)
# The runtime dependencies of the library and the programs are computed by dpkg-shlibdeps from the
# shared libraries they load, so they name exactly the Debian runtime packages needed (libgrpc++1.51,
# libprotobuf32, libgloo0, ...). Libraries that no Debian package owns (CUDA/NCCL under
# /usr/local/cuda) are not dependencies: the machine provides them.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME modelavg)
set(CPACK_PACKAGE_VENDOR modelavg)
set(CPACK_PACKAGE_CONTACT "modelavg developers")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
# (No CPACK_PACKAGE_DESCRIPTION_SUMMARY: the first line of each component's description is its
# package's synopsis.)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# A shlibs file for the library package, so that packages built against it depend on it.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(_modelavg_deb_version ${CPACK_PACKAGE_VERSION}-${CPACK_DEBIAN_PACKAGE_RELEASE})
if(MODELAVG_HAVE_CUDA AND NCCL_LIBRARY)
  # CUDA and NCCL are not Debian packages: dpkg-shlibdeps treats their directory as private.
  get_filename_component(_nccl_dir ${NCCL_LIBRARY} DIRECTORY)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${_nccl_dir} ${CUDAToolkit_LIBRARY_DIR})
endif()

# The runtime library: named after its SONAME, as Debian does (libmodelavg-client0.1).
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libmodelavg-client${MODELAVG_SOVERSION})
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_COMPONENT_RUNTIME_DESCRIPTION
  "modelavg client library: periodic and hierarchical model averaging\nThe library a trainer links to average its parameters with the other workers of a\nmodelavg job (Gloo over TCP for host memory, NCCL for CUDA memory).")

# Headers, CMake package and pkg-config file. find_package(gRPC CONFIG) on Debian checks that gRPC's
# code generators exist, hence protobuf-compiler-grpc.
set(CPACK_DEBIAN_DEV_PACKAGE_NAME libmodelavg-client-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
  "libmodelavg-client${MODELAVG_SOVERSION} (= ${_modelavg_deb_version}), libgrpc++-dev, protobuf-compiler-grpc, libprotobuf-dev, libabsl-dev")
set(CPACK_COMPONENT_DEV_DESCRIPTION
  "modelavg client library: development files\nHeaders (<modelavg/...>), the CMake package (find_package(modelavg CONFIG), target\nmodelavg::client) and modelavg.pc.")

set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME modelavg)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION net)
set(CPACK_COMPONENT_TOOLS_DESCRIPTION
  "modelavg coordinator and tools\nmodelavg-coordinator (the gRPC service that runs model-averaging jobs), modelavg\n(the operators' command line), modelavg-health (gRPC health probe), modelavg-rpc\n(a reflection-only gRPC client) and, when built, modelavg-demo (a small trainer),\nmodelavg-trace-worker and modelavg-bench-coordinator.")

# The Python package: python/ installs it with COMPONENT python; then it is packaged here too.
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-modelavg)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS python3)
set(CPACK_DEBIAN_PYTHON_PACKAGE_RECOMMENDS python3-torch)
set(CPACK_COMPONENT_PYTHON_DESCRIPTION
  "modelavg client library for Python\nModel averaging for PyTorch trainers through the modelavg coordinator.")

get_cmake_property(_modelavg_components COMPONENTS)
set(CPACK_COMPONENTS_ALL "")
foreach(component runtime dev tools python)
  if(component IN_LIST _modelavg_components)
    list(APPEND CPACK_COMPONENTS_ALL ${component})
  endif()
endforeach()
foreach(component ${_modelavg_components})
  if(NOT component IN_LIST CPACK_COMPONENTS_ALL)
    message(WARNING "modelavg: install component '${component}' is in no Debian package; "
                    "give the install() rule one of: runtime dev tools python")
  endif()
endforeach()
if("python" IN_LIST CPACK_COMPONENTS_ALL AND MODELAVG_PYTHON)
  # The extension module is built for one Python minor version (Debian 12: 3.11).
  execute_process(COMMAND ${MODELAVG_PYTHON} -c
                  "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]} {sys.version_info[0]}.{sys.version_info[1] + 1}')"
                  OUTPUT_VARIABLE _py OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _py_rc)
  if(_py_rc EQUAL 0)
    separate_arguments(_py UNIX_COMMAND "${_py}")
    list(GET _py 0 _py_this)
    list(GET _py 1 _py_next)
    set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS "python3 (>= ${_py_this}), python3 (<< ${_py_next})")
  endif()
endif()
include(CPack)
