// The private layout of the NCCL path's staging buffer: which dtype the members reduce in, and
// where each tensor's elements sit. Host code only (no CUDA), so that unit tests cover it; the
// kernels in staging_kernels.cu read the chunk table built here.
#ifndef MODELAVG_CLIENT_PAYLOAD_STAGING_LAYOUT_H_
#define MODELAVG_CLIENT_PAYLOAD_STAGING_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "client/payload/staging_chunk.h"
#include "modelavg/client/tensor.h"

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

// One bucket of the staged path's pipeline: the data all-reduce's elements [begin, end) of the
// staging buffer, and the chunks [first_chunk, first_chunk + num_chunks) of the layout that are
// gathered into it (none may straddle two buckets).
struct StagingBucket {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t first_chunk = 0;
  int64_t num_chunks = 0;
};

struct StagingLayout {
  std::vector<StagingChunk> chunks;
  // Elements of the staging buffer, padding included: the all-reduce's count.
  int64_t elems = 0;
  // Filled by SplitIntoBuckets; empty otherwise.
  std::vector<StagingBucket> buckets;
};

// The data all-reduce's buckets: [0, elems) cut every `bucket_elems` elements (the last bucket
// shorter; one bucket when bucket_elems <= 0). A function of the reduced count and the bucket
// size alone, so that every member that agreed on the count issues the same all-reduces
// whatever its tensors (in place or staged, padded or not).
std::vector<std::pair<int64_t, int64_t>> BucketRanges(int64_t elems, int64_t bucket_elems);

// Cuts `layout`'s chunks at BucketRanges(layout->elems, bucket_elems)'s boundaries and fills
// layout->buckets, so that each bucket can be gathered on its own.
void SplitIntoBuckets(StagingLayout* layout, int64_t bucket_elems);

// The chunk table for `tensors` in a staging buffer of `staging_code`. With `pad`, every tensor
// starts at a multiple of kStagingAlignBytes (the gaps hold zeros and are reduced along, never
// copied back); without, tensors are back to back (the layout every member can agree on when
// their padded sizes differ, e.g. one member reduces in place).
StagingLayout BuildStagingLayout(absl::Span<const TensorView> tensors, int32_t staging_code,
                                 bool pad);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_PAYLOAD_STAGING_LAYOUT_H_
