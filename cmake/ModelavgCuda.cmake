# Decides whether the NCCL/CUDA path is built. Sets MODELAVG_HAVE_CUDA (ON/OFF) and, when ON,
# the imported target modelavg::nccl. AUTO builds it when the toolkit, nvcc and NCCL are found;
# ON fails the configure if any is missing; OFF never looks.
set(MODELAVG_HAVE_CUDA OFF)
if(NOT MODELAVG_WITH_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MODELAVG_WITH_CUDA must be AUTO, ON or OFF, got '${MODELAVG_WITH_CUDA}'")
endif()
if(NOT MODELAVG_WITH_CUDA STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS ${CUDAToolkit_ROOT}/bin/nvcc)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_ROOT}/bin/nvcc)
  endif()
  find_package(CUDAToolkit QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_ROOT}/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_ROOT}/lib64)
  include(CheckLanguage)
  check_language(CUDA)
  if(CUDAToolkit_FOUND AND NCCL_INCLUDE_DIR AND NCCL_LIBRARY AND CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper (H100/H200) and Ampere; PTX for newer parts.
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    # One CUDA runtime: the shared libcudart that CUDA::cudart (and NCCL) use. nvcc's default,
    # the static cudart, would link a second copy with its own state beside it.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    add_library(modelavg_nccl_imported INTERFACE)
    target_include_directories(modelavg_nccl_imported INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(modelavg_nccl_imported INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
    add_library(modelavg::nccl ALIAS modelavg_nccl_imported)
    set(MODELAVG_HAVE_CUDA ON)
  elseif(MODELAVG_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MODELAVG_WITH_CUDA=ON but the CUDA toolkit (${CUDAToolkit_FOUND}), nvcc "
                        "(${CMAKE_CUDA_COMPILER}) or NCCL (${NCCL_INCLUDE_DIR}, ${NCCL_LIBRARY}) "
                        "was not found; set CUDAToolkit_ROOT or use -DMODELAVG_WITH_CUDA=OFF")
  endif()
endif()
