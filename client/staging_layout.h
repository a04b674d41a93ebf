// The private layout of the NCCL path's staging buffer: which dtype the members reduce in, and
// where each tensor's elements sit. Host code only (no CUDA), so that unit tests cover it; the
// kernels in staging_kernels.cu read the chunk table built here.
#ifndef MODELAVG_CLIENT_STAGING_LAYOUT_H_
#define MODELAVG_CLIENT_STAGING_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "client/staging_chunk.h"
#include "client/tensor.h"

namespace modelavg::client {

int32_t StagingCodeOf(DType dtype);
// Bytes per element of a staging code.
size_t StagingCodeSize(int32_t code);

// The dtype the members reduce in: the common dtype of the tensors when there is one, except
// bfloat16, which is reduced in float32 (NCCL's ncclAvg pre-multiplies bfloat16 inputs by a
// bfloat16-rounded 1/n, e.g. 0.333984 for 1/3: a +0.2% bias that compounds over many averages);
// float64 if the dtypes differ and one is float64; float32 otherwise.
int32_t StagingCode(absl::Span<const TensorView> tensors);

// Whether the tensors can be reduced in place (zero copy): back to back in memory, one dtype,
// and that dtype is the staging dtype.
bool IsZeroCopy(absl::Span<const TensorView> tensors);

struct StagingLayout {
  std::vector<StagingChunk> chunks;
  // Elements of the staging buffer, padding included: the all-reduce's count.
  int64_t elems = 0;
};

// The chunk table for `tensors` in a staging buffer of `staging_code`. With `pad`, every tensor
// starts at a multiple of kStagingAlignBytes (the gaps hold zeros and are reduced along, never
// copied back); without, tensors are back to back (the layout every member can agree on when
// their padded sizes differ, e.g. one member reduces in place).
StagingLayout BuildStagingLayout(absl::Span<const TensorView> tensors, int32_t staging_code,
                                 bool pad);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_STAGING_LAYOUT_H_
