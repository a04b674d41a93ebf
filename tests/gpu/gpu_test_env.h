// Whether this machine has a usable CUDA device, for the gpu-labelled tests: they skip, saying
// why, when it has none, and fail instead when MODELAVG_REQUIRE_GPU=1 (on a machine that must
// have one, a skip would hide a broken driver or runtime behind a green run).
#ifndef MODELAVG_TESTS_GPU_GPU_TEST_ENV_H_
#define MODELAVG_TESTS_GPU_GPU_TEST_ENV_H_

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace modelavg::testing {

// Empty when device 0 is usable; otherwise what is wrong, with the driver and runtime versions.
inline std::string CudaDeviceProblem() {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  const std::string versions = absl::StrCat(
      " (CUDA driver API version ", driver, ", runtime ", runtime,
      driver == 0 ? "; no CUDA driver is installed" : "",
      driver != 0 && driver < runtime ? "; the driver is older than the runtime: upgrade it" : "",
      ")");
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::StrCat("cudaGetDeviceCount failed with ", cudaGetErrorName(err), ": ",
                        cudaGetErrorString(err), versions);
  }
  if (count == 0) return absl::StrCat("cudaGetDeviceCount found no device", versions);
  err = cudaSetDevice(0);
  if (err == cudaSuccess) err = cudaFree(nullptr);  // creates the context
  if (err != cudaSuccess) {
    return absl::StrCat("device 0 is unusable: ", cudaGetErrorName(err), ": ",
                        cudaGetErrorString(err), versions);
  }
  return "";
}

inline bool GpuRequired() {
  const char* v = std::getenv("MODELAVG_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace modelavg::testing

// In a test's SetUp: skip (or, with MODELAVG_REQUIRE_GPU=1, fail) without a usable device.
#define MODELAVG_REQUIRE_OR_SKIP_GPU()                                                       \
  do {                                                                                       \
    const std::string _problem = ::modelavg::testing::CudaDeviceProblem();                  \
    if (!_problem.empty()) {                                                                 \
      if (::modelavg::testing::GpuRequired()) {                                              \
        FAIL() << "MODELAVG_REQUIRE_GPU=1 but there is no usable CUDA device: " << _problem; \
      }                                                                                      \
      GTEST_SKIP() << "no usable CUDA device: " << _problem                                  \
                   << " (set MODELAVG_REQUIRE_GPU=1 to fail instead)";                       \
    }                                                                                        \
  } while (0)

#endif  // MODELAVG_TESTS_GPU_GPU_TEST_ENV_H_
