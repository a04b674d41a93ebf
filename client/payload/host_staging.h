// Host-side staging for averaging many tensors with one collective: every tensor is packed,
// divided by the group size (as PyTorch does before its SUM all-reduce, so float16 data cannot
// overflow), into one flat buffer of the staging dtype; after the all-reduce the sums are copied
// back, converted to each tensor's dtype. The caller's tensors are only written by Unpack.
#ifndef MODELAVG_CLIENT_PAYLOAD_HOST_STAGING_H_
#define MODELAVG_CLIENT_PAYLOAD_HOST_STAGING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/payload/finite_scan.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// The flat buffer's dtype for `tensors`: float64 if any tensor is float64 (as torch.cat
// promotes), else float32 (float16/bfloat16 are averaged in float32).
DType StagingDType(absl::Span<const TensorView> tensors);

// Total element count; INVALID_ARGUMENT for numel < 0, null data with numel > 0, or a tensor
// not on the host.
absl::StatusOr<int64_t> CheckHostTensors(absl::Span<const TensorView> tensors);

// Writes tensors[i] / divisor (element-wise, converted to `staging_dtype`) to consecutive
// ranges of `staging` (float* or double*, at least the total element count). With `finding`,
// also finds the first tensor with a non-finite element (finite_scan.h), in the same pass: each
// block of the copy is tested while it is in the cache.
void PackDivided(absl::Span<const TensorView> tensors, DType staging_dtype, double divisor,
                 void* staging, NonFiniteFinding* finding = nullptr);

// out[i] = in[i] / divisor for n elements (in and out may be the same buffer). A power-of-two
// divisor multiplies by its exact reciprocal (same bits, faster); otherwise it divides, as
// PyTorch does.
void DivideInto(const float* in, int64_t n, float divisor, float* out);
void DivideInto(const double* in, int64_t n, double divisor, double* out);

// PackDivided's elements [begin, begin + n) of the tensors' concatenation, without the division
// (a copy, converted), written to the same place of `staging`.
void PackRange(absl::Span<const TensorView> tensors, DType staging_dtype, int64_t begin,
               int64_t n, void* staging);

// Unpack's elements [begin, begin + n) of the tensors' concatenation, read from `src` (those n
// elements, of `staging_dtype`).
void UnpackRange(const void* src, DType staging_dtype, absl::Span<const TensorView> tensors,
                 int64_t begin, int64_t n);

// memcpy for a destination that will not be read soon (a backup): on x86-64, non-temporal
// stores skip reading the destination into the cache first.
void CopyToBackup(void* dst, const void* src, size_t bytes);

// The inverse of PackDivided without the division: copies consecutive ranges of `staging` back
// into the tensors, converted to each tensor's dtype.
void Unpack(const void* staging, DType staging_dtype, absl::Span<const TensorView> tensors);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_PAYLOAD_HOST_STAGING_H_
