// The tensors a trainer hands to the averagers: a view of memory it owns (pointer, element count,
// dtype, device, and the CUDA stream that orders work on it). modelavg never allocates or frees
// the caller's parameters; it reads and writes them in place.
#ifndef MODELAVG_CLIENT_TENSOR_H_
#define MODELAVG_CLIENT_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace modelavg::client {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16 };

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
// "float32", "float64", "float16", "bfloat16".
absl::string_view DTypeName(DType dtype);

struct Device {
  enum class Kind { kHost, kCuda };
  Kind kind = Kind::kHost;
  // CUDA device ordinal; 0 for the host.
  int index = 0;

  static Device Host() { return Device{}; }
  static Device Cuda(int index) { return Device{Kind::kCuda, index}; }

  bool is_host() const { return kind == Kind::kHost; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  // "host" or "cuda:N".
  std::string ToString() const;
};

// A non-owning view of one parameter tensor (dense, contiguous).
struct TensorView {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
  Device device;
  // cudaStream_t on which the caller orders work on `data` (CUDA tensors only; nullptr: the
  // legacy default stream). Averaging is enqueued on the first tensor's stream.
  void* cuda_stream = nullptr;

  size_t nbytes() const { return static_cast<size_t>(numel) * DTypeSize(dtype); }
};

// INVALID_ARGUMENT naming tensor `index` if its element count is negative or it has elements but
// no data pointer.
absl::Status ValidateTensorView(size_t index, const TensorView& t);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_TENSOR_H_
