// CUDA kernels of the compressed payloads on the NCCL path (RoundOptions::payload,
// DeviceOps::EncodeParts and the decodes, nccl_core.h): the wire encodings of
// payload_codec.h, bit for bit, on device buffers cut into `parts` parts of `part` float32
// elements, part j's encoding at byte j * stride (a multiple of 16). Only built with
// MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_PAYLOAD_KERNELS_H_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_PAYLOAD_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace modelavg::client {

// `payload`: a Payload's value (modelavg/common/payload.h); the kernels hold one entry per
// payload beside its code (payload_kernels.cu).
// `topk`: TOPK's entries per block (WireFormat::topk); ignored by the other payloads.
// wire part j := encode(in[j * part, (j + 1) * part)), elements past `numel` as zeros; the
// bytes of a part past its encoding are zeroed.
cudaError_t LaunchEncodeParts(int32_t payload, int32_t topk, const float* in, int64_t numel,
                              int64_t part, int parts, size_t stride, void* wire,
                              cudaStream_t stream);
// out[i] := (sum over j in order of decode(wire part j)[i]) * scale, for i < part.
cudaError_t LaunchDecodeSumParts(int32_t payload, int32_t topk, const void* wire, int parts,
                                 int64_t part, size_t stride, float scale, float* out,
                                 cudaStream_t stream);
// out[j * part + i] := decode(wire part j)[i], for the first `numel` elements.
cudaError_t LaunchDecodeParts(int32_t payload, int32_t topk, const void* wire, int64_t numel,
                              int64_t part, size_t stride, float* out, cudaStream_t stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_PAYLOAD_KERNELS_H_
