// The INT4, TOPK and TOPK_INT2 payloads' rule (docs/streaming.md, client/payload/payload_codec.h)
// restated naively for the tests, apart from the codec: decode(encode(x)) of a whole float32
// buffer, block by block (blocks of 1024 of the whole buffer, the last one shorter).
#ifndef MODELAVG_TESTS_REFERENCE_NAIVE_PAYLOAD_H_
#define MODELAVG_TESTS_REFERENCE_NAIVE_PAYLOAD_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "client/base/half.h"
#include "modelavg/common/schedule.h"

namespace modelavg::testing {

// INT4: per block s = max|x| / 7 (NaN when a value is not finite), q = round-half-even(x / s)
// in [-7, 7], decoded q s. TOPK: per block the `topk` largest magnitudes (NaN as large as Inf;
// ties: the lower index first; a shorter block keeps min(topk, its length)) as bfloat16, the
// others 0. TOPK_INT2: the same entries, each as one of the four levels -s, -s/3, s/3, s of the
// block's s = the largest kept |x| (NaN when a kept value is not finite): +-s when |x| / s
// >= 2/3 (float32), else +-s/3, the sign x's sign bit; 0 when s is 0.
inline std::vector<float> NaivePayloadRoundTrip(Payload payload, int32_t topk,
                                                const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> out(x.size(), 0.0f);
  for (int64_t lo = 0; lo < n; lo += 1024) {
    const int64_t hi = std::min<int64_t>(n, lo + 1024);
    if (payload == Payload::kInt4) {
      float big = 0.0f;
      bool finite = true;
      for (int64_t i = lo; i < hi; ++i) {
        finite = finite && std::isfinite(x[i]);
        big = std::max(big, std::fabs(x[i]));
      }
      const float s = finite ? big / 7.0f : std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = lo; i < hi; ++i) {
        float q = s > 0.0f ? std::nearbyint(x[i] / s) : 0.0f;  // half to even
        q = std::min(7.0f, std::max(-7.0f, q));
        out[i] = q * s;
      }
      continue;
    }
    std::vector<int64_t> order;
    for (int64_t i = lo; i < hi; ++i) order.push_back(i);
    const auto mag = [&](int64_t i) {
      return std::isnan(x[i]) ? std::numeric_limits<float>::infinity() : std::fabs(x[i]);
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return mag(a) > mag(b); });
    const int64_t k = std::min<int64_t>(topk, hi - lo);
    if (payload == Payload::kTopkInt2) {
      float s = 0.0f;
      for (int64_t e = 0; e < k; ++e) {
        const float v = x[order[e]];
        s = std::isfinite(v) && std::isfinite(s) ? std::max(s, std::fabs(v))
                                                  : std::numeric_limits<float>::quiet_NaN();
      }
      for (int64_t e = 0; e < k; ++e) {
        const float v = x[order[e]];
        const bool big = s > 0.0f && std::fabs(v) / s >= 2.0f / 3.0f;
        const float level = big ? s : s / 3.0f;
        out[order[e]] = 0.0f + (std::signbit(v) ? -level : level);
      }
      continue;
    }
    for (int64_t e = 0; e < k; ++e) {
      out[order[e]] = 0.0f + client::BFloat16ToFloat(client::FloatToBFloat16(x[order[e]]));
    }
  }
  return out;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_NAIVE_PAYLOAD_H_
