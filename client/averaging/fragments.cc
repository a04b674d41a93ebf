#include "client/averaging/fragments.h"

#include <algorithm>

namespace modelavg::client {
namespace {

// FNV-1a over 64-bit words.
uint64_t Mix(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xFFu;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

FragmentSplit SplitIntoFragments(absl::Span<const TensorView> tensors, int fragments) {
  const int f_count = std::max(1, fragments);
  const size_t n = tensors.size();
  FragmentSplit split;
  uint64_t h = Mix(14695981039346656037ull, static_cast<uint64_t>(f_count));
  h = Mix(h, n);
  unsigned __int128 total = 0;
  for (const TensorView& t : tensors) {
    total += t.nbytes();
    h = Mix(h, static_cast<uint64_t>(t.numel));
    h = Mix(h, static_cast<uint64_t>(t.dtype));
  }
  split.signature = static_cast<int64_t>(h & ((uint64_t{1} << 62) - 1));
  // owner[i]: the fragment of tensor i, non-decreasing in i.
  std::vector<int> owner(n, 0);
  unsigned __int128 start = 0;
  for (size_t i = 0; i < n; ++i) {
    int f;
    if (total == 0) {
      f = static_cast<int>(i * f_count / n);
    } else {
      const unsigned __int128 mid2 = 2 * start + tensors[i].nbytes();  // twice the middle byte
      f = static_cast<int>(mid2 * f_count / (2 * total));
    }
    owner[i] = std::min(f, f_count - 1);
    start += tensors[i].nbytes();
  }
  split.begin.assign(f_count + 1, n);
  split.begin[0] = 0;
  // begin[f] = the first tensor whose fragment is >= f.
  size_t i = 0;
  for (int f = 1; f <= f_count; ++f) {
    while (i < n && owner[i] < f) ++i;
    split.begin[f] = i;
  }
  split.begin[f_count] = n;
  return split;
}

}  // namespace modelavg::client
