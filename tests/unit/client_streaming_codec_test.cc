// The fragment split and the payload codecs (streaming sync): pure functions, checked against
// direct restatements of their contracts.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "client/averaging/fragments.h"
#include "client/payload/payload_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/naive_payload.h"

namespace modelavg::client {
namespace {

std::vector<TensorView> Views(const std::vector<int64_t>& numels, DType dtype = DType::kFloat32) {
  std::vector<TensorView> out;
  static float dummy;
  for (int64_t n : numels) out.push_back(TensorView{&dummy, n, dtype});
  return out;
}

// Checks the split's contract: F + 1 bounds, consecutive whole tensors, every tensor's middle
// byte inside its fragment's share [f T / F, (f + 1) T / F].
void ExpectValidSplit(const std::vector<TensorView>& t, int fragments) {
  const FragmentSplit s = SplitIntoFragments(t, fragments);
  ASSERT_EQ(s.fragments(), fragments);
  ASSERT_EQ(s.begin.front(), 0u);
  ASSERT_EQ(s.begin.back(), t.size());
  double total = 0;
  for (const TensorView& v : t) total += static_cast<double>(v.nbytes());
  double start = 0;
  for (int f = 0; f < fragments; ++f) {
    ASSERT_LE(s.begin[f], s.begin[f + 1]);
    for (size_t i = s.begin[f]; i < s.begin[f + 1]; ++i) {
      const double mid = start + t[i].nbytes() / 2.0;
      if (total > 0) {
        EXPECT_GE(mid, f * total / fragments - 1e-9) << "tensor " << i << " fragment " << f;
        EXPECT_LE(mid, (f + 1) * total / fragments + 1e-9) << "tensor " << i;
      }
      start += t[i].nbytes();
    }
  }
}

TEST(FragmentSplitTest, EqualTensors_EqualFragments) {
  const FragmentSplit s = SplitIntoFragments(Views({10, 10, 10, 10, 10, 10, 10, 10}), 4);
  EXPECT_EQ(s.begin, (std::vector<size_t>{0, 2, 4, 6, 8}));
}

TEST(FragmentSplitTest, OneFragment_EverythingInIt) {
  const FragmentSplit s = SplitIntoFragments(Views({3, 1, 4}), 1);
  EXPECT_EQ(s.begin, (std::vector<size_t>{0, 3}));
}

TEST(FragmentSplitTest, UnequalTensors_AboutEqualBytes) {
  // A large tensor, then small ones: the large one is fragment 0 by itself.
  const std::vector<TensorView> t = Views({240, 10, 20, 30, 40, 50, 60, 40});
  const FragmentSplit s = SplitIntoFragments(t, 4);
  EXPECT_EQ(s.begin[1], 1u);
  ExpectValidSplit(t, 4);
}

TEST(FragmentSplitTest, FewerTensorsThanFragments_SomeEmpty) {
  const std::vector<TensorView> t = Views({5, 5});
  const FragmentSplit s = SplitIntoFragments(t, 4);
  EXPECT_EQ(s.begin, (std::vector<size_t>{0, 0, 1, 1, 2}));
  ExpectValidSplit(t, 4);
  const FragmentSplit empty = SplitIntoFragments(Views({0, 0, 0, 0}), 2);
  EXPECT_EQ(empty.begin, (std::vector<size_t>{0, 2, 4}));
}

TEST(FragmentSplitTest, RandomLists_ContractHolds) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int64_t> numels(1 + rng() % 40);
    for (int64_t& n : numels) n = rng() % 5 == 0 ? 0 : 1 + rng() % 100000;
    const int fragments = 1 + rng() % 8;
    SCOPED_TRACE(trial);
    ExpectValidSplit(Views(numels, rng() % 2 ? DType::kFloat32 : DType::kBFloat16), fragments);
  }
}

TEST(FragmentSplitTest, Signature_SameForSameSizes_DiffersOtherwise) {
  const int64_t a = SplitIntoFragments(Views({4, 8, 16}), 2).signature;
  EXPECT_EQ(a, SplitIntoFragments(Views({4, 8, 16}), 2).signature);
  EXPECT_NE(a, SplitIntoFragments(Views({8, 4, 16}), 2).signature);
  EXPECT_NE(a, SplitIntoFragments(Views({4, 8, 16}), 3).signature);
  EXPECT_NE(a, SplitIntoFragments(Views({4, 8, 16}, DType::kFloat64), 2).signature);
  EXPECT_GE(a, 0);
  EXPECT_LT(a, int64_t{1} << 62);
}

std::vector<float> RoundTrip(Payload p, const std::vector<float>& x) {
  std::vector<uint8_t> wire(EncodedBytes(p, static_cast<int64_t>(x.size())));
  EncodePayload(p, x.data(), static_cast<int64_t>(x.size()), wire.data());
  std::vector<float> out(x.size(), 0.0f);
  DecodePayload(p, wire.data(), static_cast<int64_t>(x.size()), out.data());
  std::vector<float> acc(x.size(), 1.0f);
  DecodeAddPayload(p, wire.data(), static_cast<int64_t>(x.size()), acc.data());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(out[i])) {
      EXPECT_TRUE(std::isnan(acc[i])) << i;
    } else {
      EXPECT_EQ(acc[i], 1.0f + out[i]) << i;
    }
  }
  return out;
}

TEST(PayloadCodecTest, Sizes_WithinTheIssueRatios) {
  const int64_t n = 1 << 20;
  EXPECT_EQ(EncodedBytes(Payload::kFp32, n), 4u * n);
  EXPECT_EQ(EncodedBytes(Payload::kBf16, n), 2u * n);
  EXPECT_EQ(EncodedBytes(Payload::kInt8, n), n + 4u * (n / kInt8Block));
  EXPECT_LE(EncodedBytes(Payload::kBf16, n), 0.55 * EncodedBytes(Payload::kFp32, n));
  EXPECT_LE(EncodedBytes(Payload::kInt8, n), 0.30 * EncodedBytes(Payload::kFp32, n));
  EXPECT_EQ(EncodedBytes(Payload::kInt8, 1025), 1025u + 8u);  // two blocks
}

TEST(PayloadCodecTest, Fp32_Exact) {
  const std::vector<float> x = {1.5f, -2.25f, 3e-30f, 1e30f};
  EXPECT_EQ(RoundTrip(Payload::kFp32, x), x);
}

TEST(PayloadCodecTest, Bf16_RelativeErrorBound) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(5000);
  for (float& v : x) v = normal(rng) * std::pow(10.0f, static_cast<float>(rng() % 20) - 10);
  const std::vector<float> y = RoundTrip(Payload::kBf16, x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::fabs(y[i] - x[i]), std::ldexp(std::fabs(x[i]), -8)) << x[i];
  }
  // Exactly representable values pass unchanged; Inf and NaN survive.
  EXPECT_EQ(RoundTrip(Payload::kBf16, {1.0f, -0.5f, 3.0f}), (std::vector<float>{1.0f, -0.5f, 3.0f}));
  const std::vector<float> odd =
      RoundTrip(Payload::kBf16, {std::numeric_limits<float>::infinity(), std::nanf("")});
  EXPECT_TRUE(std::isinf(odd[0]));
  EXPECT_TRUE(std::isnan(odd[1]));
}

TEST(PayloadCodecTest, Int8_BlockErrorBound) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Blocks of very different magnitudes, and a short last block.
  std::vector<float> x(3 * kInt8Block + 77);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = normal(rng) * std::pow(10.0f, static_cast<float>(i / kInt8Block) * 3 - 4);
  }
  const std::vector<float> y = RoundTrip(Payload::kInt8, x);
  for (size_t lo = 0; lo < x.size(); lo += kInt8Block) {
    const size_t hi = std::min(x.size(), lo + kInt8Block);
    float max_abs = 0;
    for (size_t i = lo; i < hi; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
    const double bound = max_abs / 254.0 * (1 + 1e-5) + 1e-7 * max_abs;
    for (size_t i = lo; i < hi; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), bound) << i;
    // The block's largest value is hit exactly (up to float rounding of 127 * s).
  }
  // Zeros stay zeros; a block with a NaN decodes as NaN, the other blocks are unaffected.
  EXPECT_EQ(RoundTrip(Payload::kInt8, {0.0f, 0.0f}), (std::vector<float>{0.0f, 0.0f}));
  std::vector<float> bad(2 * kInt8Block, 1.0f);
  bad[5] = std::nanf("");
  const std::vector<float> z = RoundTrip(Payload::kInt8, bad);
  EXPECT_TRUE(std::isnan(z[0]));
  EXPECT_FLOAT_EQ(z[kInt8Block], 1.0f);
}

// INT4 against a naive restatement of its documented decode: per block of 1024 from the start,
// s = max|x| / 7, q = round-half-even(x / s) in [-7, 7], decode q * s; ceil(n / 2) bytes plus
// 4 a block.
TEST(PayloadCodecTest, Int4_MatchesDocumentedRuleAndBound) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(3 * kInt8Block + 77);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = normal(rng) * std::pow(10.0f, static_cast<float>(i / kInt8Block) * 3 - 4);
  }
  const std::vector<float> y = RoundTrip(Payload::kInt4, x);
  int64_t exact = 0;
  for (size_t lo = 0; lo < x.size(); lo += kInt8Block) {
    const size_t hi = std::min(x.size(), lo + kInt8Block);
    double max_abs = 0;
    for (size_t i = lo; i < hi; ++i) max_abs = std::max(max_abs, double{std::fabs(x[i])});
    const double s = max_abs / 7;
    for (size_t i = lo; i < hi; ++i) {
      const double q = std::max(-7.0, std::min(7.0, std::nearbyint(x[i] / s)));
      // The reference decode, to float32 rounding of the scale.
      EXPECT_NEAR(y[i], q * s, 1e-6 * max_abs) << i;
      EXPECT_LE(std::fabs(y[i] - x[i]), max_abs / 14 * (1 + 1e-5)) << i;
      exact += y[i] == x[i];
    }
  }
  EXPECT_LT(exact, static_cast<int64_t>(x.size()) / 2);
  EXPECT_EQ(EncodedBytes(Payload::kInt4, 1025), 513u + 8u);
  EXPECT_EQ(EncodedBytes(Payload::kInt4, 1), 1u + 4u);
  EXPECT_LE(EncodedBytes(Payload::kInt4, 1 << 20), 0.15 * EncodedBytes(Payload::kFp32, 1 << 20));
  // The grid's values pass unchanged: -7..7 times a scale of 1.
  std::vector<float> grid;
  for (int q = -7; q <= 7; ++q) grid.push_back(static_cast<float>(q));
  EXPECT_EQ(RoundTrip(Payload::kInt4, grid), grid);
  // Zeros stay zeros; a block with a NaN decodes as NaN, the other blocks are unaffected.
  EXPECT_EQ(RoundTrip(Payload::kInt4, {0.0f, 0.0f, 0.0f}), (std::vector<float>{0.0f, 0.0f, 0.0f}));
  std::vector<float> bad(2 * kInt8Block + 1, 1.0f);
  bad[5] = std::nanf("");
  const std::vector<float> z = RoundTrip(Payload::kInt4, bad);
  EXPECT_TRUE(std::isnan(z[0]));
  EXPECT_FLOAT_EQ(z[kInt8Block], 1.0f);
  EXPECT_FLOAT_EQ(z[2 * kInt8Block], 1.0f);
}

// TOPK against a naive restatement: per block of 1024, the k entries of largest |x| (ties: lower
// index), each rounded to bfloat16 (relative error <= 2^-8), the others 0; 4 bytes an entry.
TEST(PayloadCodecTest, Topk_KeepsLargestPerBlock) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(2 * kInt8Block + 100);
  for (float& v : x) v = normal(rng);
  x[7] = x[9] = 50.0f;  // a tie: both kept (k >= 2)
  const int32_t k = TopkPerBlock(0.02);
  EXPECT_EQ(k, 21);  // ceil(0.02 * 1024)
  const WireFormat f(Payload::kTopk, k);
  std::vector<uint8_t> wire(EncodedBytes(f, static_cast<int64_t>(x.size())));
  EXPECT_EQ(wire.size(), 4u * (21 + 21 + 21));
  EncodePayload(f, x.data(), static_cast<int64_t>(x.size()), wire.data());
  std::vector<float> y(x.size(), -1.0f);
  DecodePayload(f, wire.data(), static_cast<int64_t>(x.size()), y.data());
  for (size_t lo = 0; lo < x.size(); lo += kInt8Block) {
    const size_t hi = std::min(x.size(), lo + kInt8Block);
    std::vector<size_t> order;
    for (size_t i = lo; i < hi; ++i) order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    std::vector<bool> kept(x.size(), false);
    for (size_t e = 0; e < std::min<size_t>(k, order.size()); ++e) kept[order[e]] = true;
    for (size_t i = lo; i < hi; ++i) {
      if (kept[i]) {
        EXPECT_LE(std::fabs(y[i] - x[i]), std::ldexp(std::fabs(x[i]), -8)) << i;
        EXPECT_NE(y[i], 0.0f) << i;
      } else {
        EXPECT_EQ(y[i], 0.0f) << i;
      }
    }
  }
  EXPECT_EQ(y[7], 50.0f);
  EXPECT_EQ(y[9], 50.0f);
  // Decode-add adds the kept values only.
  std::vector<float> acc(x.size(), 1.0f);
  DecodeAddPayload(f, wire.data(), static_cast<int64_t>(x.size()), acc.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(acc[i], 1.0f + y[i]) << i;
  // A block shorter than k keeps everything; densities round up and stay in [1, 1024].
  EXPECT_EQ(EncodedBytes(WireFormat(Payload::kTopk, 21), 5), 20u);
  EXPECT_EQ(TopkPerBlock(1e-9), 1);
  EXPECT_EQ(TopkPerBlock(0.999), 1023);
  EXPECT_LE(EncodedBytes(f, 1 << 20), 0.025 * EncodedBytes(Payload::kFp32, 1 << 20));
}

// TOPK_INT2 bit for bit against its naive restatement (tests/reference/naive_payload.h): random
// blocks, ties, a short last block, a block of zeros, k from 1 to 1024; decode-add adds the same.
TEST(PayloadCodecTest, TopkInt2_EqualsNaiveRestatement_BitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(4 * kInt8Block + 100);
  for (float& v : x) v = normal(rng);
  x[7] = x[9] = -50.0f;     // a tie at the top
  x[20] = 50.0f * 2 / 3;    // near the 2/3 boundary
  x[1030] = -0.0f;          // a signed zero in a kept-everything case below
  std::fill(x.begin() + 2 * kInt8Block, x.begin() + 3 * kInt8Block, 0.0f);  // all zeros
  const int64_t n = static_cast<int64_t>(x.size());
  for (int32_t k : {1, 21, 308, 1024}) {
    SCOPED_TRACE(k);
    const WireFormat f(Payload::kTopkInt2, k);
    std::vector<uint8_t> wire(EncodedBytes(f, n));
    EncodePayload(f, x.data(), n, wire.data());
    std::vector<float> y(x.size(), -1.0f);
    DecodePayload(f, wire.data(), n, y.data());
    const std::vector<float> want = testing::NaivePayloadRoundTrip(Payload::kTopkInt2, k, x);
    ASSERT_EQ(std::memcmp(y.data(), want.data(), x.size() * sizeof(float)), 0);
    std::vector<float> acc(x.size(), 1.0f);
    DecodeAddPayload(f, wire.data(), n, acc.data());
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(acc[i], 1.0f + want[i]) << i;
    std::vector<float> rt(x.size());
    RoundTripPayload(f, x.data(), n, rt.data());
    ASSERT_EQ(std::memcmp(rt.data(), want.data(), x.size() * sizeof(float)), 0);
  }
  // Bytes: a scale, k indices and k 2-bit codes a block; 52 a full block at density 0.02
  // (0.0508 bytes an element, 0.0127 of FP32).
  EXPECT_EQ(EncodedBytes(WireFormat(Payload::kTopkInt2, 21), kInt8Block), 4u + 42u + 6u);
  EXPECT_EQ(EncodedBytes(WireFormat(Payload::kTopkInt2, 21), n), 5u * 52u);
  EXPECT_EQ(EncodedBytes(WireFormat(Payload::kTopkInt2, 21), 5), 4u + 10u + 2u);
  EXPECT_EQ(PayloadBlock(Payload::kTopkInt2), kInt8Block);
  EXPECT_STREQ(PayloadName(Payload::kTopkInt2), "TOPK_INT2");
}

// The layout, by hand: 8 elements, k 3 keep -5 (index 1), 2 (3) and 4 (7); s 5; codes 0 (-s),
// 2 (s/3: 2 / 5 < 2/3), 3 (s: 4 / 5 >= 2/3), four to a byte from the low bits.
TEST(PayloadCodecTest, TopkInt2_Layout_ScaleIndicesCodes) {
  const std::vector<float> x = {0.1f, -5.0f, 0.0f, 2.0f, -1.6f, 0.0f, 0.0f, 4.0f};
  const WireFormat f(Payload::kTopkInt2, 3);
  std::vector<uint8_t> wire(EncodedBytes(f, 8));
  ASSERT_EQ(wire.size(), 4u + 6u + 1u);
  EncodePayload(f, x.data(), 8, wire.data());
  float s;
  std::memcpy(&s, wire.data(), 4);
  EXPECT_EQ(s, 5.0f);
  EXPECT_EQ(std::vector<uint8_t>(wire.begin() + 4, wire.end()),
            (std::vector<uint8_t>{1, 0, 3, 0, 7, 0, 0x38}));
  std::vector<float> y(8);
  DecodePayload(f, wire.data(), 8, y.data());
  EXPECT_EQ(y, (std::vector<float>{0, -5.0f, 0, 5.0f / 3.0f, 0, 0, 0, 5.0f}));
  // A non-finite value is kept (the largest magnitude): the block's kept entries decode as NaN.
  std::vector<float> bad = x;
  bad[4] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> w2(wire.size());
  EncodePayload(f, bad.data(), 8, w2.data());
  DecodePayload(f, w2.data(), 8, y.data());
  EXPECT_TRUE(std::isnan(y[1]) && std::isnan(y[4]) && std::isnan(y[7]));
  EXPECT_EQ(y[3], 0.0f);
}

TEST(PayloadCodecTest, RoundTripPayload_EqualsEncodeThenDecode) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(2 * kInt8Block + 5);
  for (float& v : x) v = normal(rng);
  for (Payload p : {Payload::kFp32, Payload::kBf16, Payload::kInt8, Payload::kInt4}) {
    std::vector<float> got(x.size());
    RoundTripPayload(p, x.data(), static_cast<int64_t>(x.size()), got.data());
    EXPECT_EQ(got, RoundTrip(p, x)) << PayloadName(p);
  }
  EXPECT_EQ(PayloadBlock(Payload::kInt4), kInt8Block);
  EXPECT_EQ(PayloadBlock(Payload::kBf16), 1);
}

}  // namespace
}  // namespace modelavg::client
