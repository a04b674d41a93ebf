// A fixture base for the gpu-labelled tests that run kernels on device 0: SetUp skips (or, with
// MODELAVG_REQUIRE_GPU=1, fails) without a usable device (gpu_test_env.h), selects device 0 and
// makes the test's non-blocking stream; Alloc hands out device memory that TearDown frees before
// it destroys the stream. `Base` is ::testing::Test or a ::testing::TestWithParam<T>.
#ifndef MODELAVG_TESTS_GPU_CUDA_DEVICE_TEST_H_
#define MODELAVG_TESTS_GPU_CUDA_DEVICE_TEST_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_env.h"

namespace modelavg::testing {

template <typename Base = ::testing::Test>
class CudaDeviceTest : public Base {
 protected:
  void SetUp() override {
    MODELAVG_REQUIRE_OR_SKIP_GPU();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
    allocations_.clear();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  // `bytes` of device memory (one byte for none, so that every tensor has an address), freed in
  // TearDown.
  void* Alloc(size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes > 0 ? bytes : 1), cudaSuccess);
    allocations_.push_back(d);
    return d;
  }

  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_GPU_CUDA_DEVICE_TEST_H_
