// The split of a level's parameters into fragments (streaming sync, docs/streaming.md): F runs
// of whole tensors, in their order, of about equal bytes. It is a function of the tensors' sizes
// alone, so every member that passes the same list computes the same split; the split's
// signature rides on the communicator's layout agreement, so members whose splits differ fail
// loudly instead of averaging different tensors together.
#ifndef MODELAVG_CLIENT_AVERAGING_FRAGMENTS_H_
#define MODELAVG_CLIENT_AVERAGING_FRAGMENTS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// Fragment f holds tensors [begin[f], begin[f + 1]). begin has F + 1 entries, begin[0] = 0,
// begin[F] = the tensor count.
struct FragmentSplit {
  std::vector<size_t> begin;
  // A 62-bit fingerprint of the whole list's sizes and dtypes and F: equal on two members iff
  // (with overwhelming probability) their splits are.
  int64_t signature = 0;

  int fragments() const { return static_cast<int>(begin.size()) - 1; }
  absl::Span<const TensorView> Fragment(absl::Span<const TensorView> tensors, int f) const {
    return tensors.subspan(begin[f], begin[f + 1] - begin[f]);
  }
};

// Tensor i, spanning bytes [c_i, c_i + b_i) of the concatenated list (T bytes in all), goes to
// fragment floor((c_i + b_i / 2) * F / T): the fragment its middle byte falls in. The fragments
// are consecutive runs; each is within one tensor's size of T / F bytes. A fragment may be
// empty (fewer tensors than fragments, or one tensor larger than T / F). With T = 0 the tensors
// are dealt by count. Precondition: fragments >= 1.
FragmentSplit SplitIntoFragments(absl::Span<const TensorView> tensors, int fragments);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_FRAGMENTS_H_
