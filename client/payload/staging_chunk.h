// The chunk table entry and dtype codes shared by the staging layout (host) and the staging
// kernels (device). Plain C++: no CUDA, no Abseil.
#ifndef MODELAVG_CLIENT_PAYLOAD_STAGING_CHUNK_H_
#define MODELAVG_CLIENT_PAYLOAD_STAGING_CHUNK_H_

#include <cstddef>
#include <cstdint>

namespace modelavg::client {

// dtype codes shared with the kernels (same order as DType).
enum StagingDTypeCode : int32_t { kStageF32 = 0, kStageF64 = 1, kStageF16 = 2, kStageBF16 = 3 };

// One piece of work: `numel` elements of tensor memory at `tensor` (dtype `tensor_dtype`)
// that sit at element `staging_offset` of the staging buffer. Large tensors are split into
// several chunks so that blocks get even work.
struct StagingChunk {
  void* tensor;
  int64_t staging_offset;
  int64_t numel;
  int32_t tensor_dtype;
  // The tensor's index in the call's list (the finite check names it).
  int32_t tensor_index;
};

// Elements per chunk (a block's work): a multiple of 16 bytes in every dtype.
inline constexpr int64_t kStagingChunkElems = 1 << 16;
// Every tensor starts at a staging offset that is a multiple of this many bytes, so that the
// kernels' 16-byte vector path applies whenever the tensor's own pointer is aligned too.
inline constexpr size_t kStagingAlignBytes = 16;

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_PAYLOAD_STAGING_CHUNK_H_
