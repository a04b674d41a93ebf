# cmake -DBUILD_FILE=<build.ninja> -P check_shared_cudart.cmake
# Fails when any link line names the static CUDA runtime: the project links one runtime, the
# shared libcudart that NCCL and CUDA::cudart use (CMAKE_CUDA_RUNTIME_LIBRARY Shared).
file(STRINGS "${BUILD_FILE}" static_lines REGEX "cudart_static")
list(LENGTH static_lines n)
if(n GREATER 0)
  list(GET static_lines 0 first)
  message(FATAL_ERROR "${n} line(s) of ${BUILD_FILE} link cudart_static beside libcudart.so, "
                      "e.g.: ${first}")
endif()
message(STATUS "no link line names cudart_static")
