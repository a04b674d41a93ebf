// GlooCommunicator's compressed rounds (RoundOptions::payload) and the fragment layout
// agreement (RoundOptions::layout_signature), ranks as threads over loopback. The compressed
// average is checked against the exact (float64) mean within the bound of docs/streaming.md,
// every rank; every rank's result must be bit-identical to every other's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/averaging/fragments.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/payload/payload_codec.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// Runs fn(rank) on one thread per member.
void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Member r's pseudo-gradient: values of very different magnitudes per block, member-dependent.
std::vector<float> Input(int r, int64_t numel) {
  std::mt19937 rng(100 + r);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(numel);
  for (int64_t i = 0; i < numel; ++i) {
    x[i] = normal(rng) * std::pow(10.0f, static_cast<float>((i / kInt8Block) % 5) - 3);
  }
  return x;
}

// The documented bound of one element of the averaged pseudo-gradient (docs/streaming.md):
//   BF16: 2^-8 (mean_i |x_i| + |m|) + float32 rounding,
//   INT8: (mean_i M_i + M') / 254, M_i the largest |x_i| of the element's block in member i's
//         chunk encoding, M' the largest |m| of its block in the result's encoding; bounded here
//         by 2 max_i M_i / 254 over the element's 1024-block of the chunk.
double Bound(Payload p, const std::vector<std::vector<float>>& xs, int64_t i, int64_t chunk) {
  const int n = static_cast<int>(xs.size());
  double mean = 0, mean_abs = 0;
  for (const auto& x : xs) {
    mean += x[i] / n;
    mean_abs += std::fabs(x[i]) / n;
  }
  const double rounding = 1e-6 * (mean_abs + 1e-30);
  if (p == Payload::kBf16) return std::ldexp(mean_abs + std::fabs(mean), -8) * 1.01 + rounding;
  const int64_t j = i / chunk;
  const int64_t lo = j * chunk + ((i - j * chunk) / kInt8Block) * kInt8Block;
  const int64_t hi = std::min<int64_t>(std::min<int64_t>(lo + kInt8Block, (j + 1) * chunk),
                                       static_cast<int64_t>(xs[0].size()));
  double max_abs = 0;
  for (const auto& x : xs) {
    for (int64_t k = lo; k < hi; ++k) max_abs = std::max(max_abs, double{std::fabs(x[k])});
  }
  return 2 * max_abs / 254 * 1.001 + rounding;
}

class CompressedTest : public ::testing::TestWithParam<std::tuple<int, Payload>> {};

TEST_P(CompressedTest, AverageWithinBound_EveryRankIdentical) {
  const auto [n, payload] = GetParam();
  const int64_t numel = 5 * kInt8Block + 333;  // chunks that do not fall on block boundaries
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> inputs, outputs(n);
  for (int r = 0; r < n; ++r) inputs.push_back(Input(r, numel));
  std::vector<absl::Status> status(n);
  OnRanks(n, [&](int r) {
    outputs[r] = inputs[r];
    // Two tensors, so that the packed path is used.
    TensorView a{outputs[r].data(), 1000, DType::kFloat32};
    TensorView b{outputs[r].data() + 1000, numel - 1000, DType::kFloat32};
    RoundOptions o;
    o.payload = payload;
    status[r] = mesh[r]->AllReduceAverage({a, b}, o, nullptr);
  });
  const int64_t chunk = (numel + n - 1) / n;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(std::memcmp(outputs[r].data(), outputs[0].data(), numel * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
    int64_t exact = 0;
    for (int64_t i = 0; i < numel; ++i) {
      double mean = 0;
      for (int k = 0; k < n; ++k) mean += double{inputs[k][i]} / n;
      const double err = std::fabs(outputs[r][i] - mean);
      ASSERT_LE(err, Bound(payload, inputs, i, chunk)) << "rank " << r << " element " << i;
      exact += err == 0;
    }
    EXPECT_LT(exact, numel / 2) << "the payload was not compressed";
  }
  // Bytes on the wire, against a FP32 round of the same buffer.
  const int64_t compressed = mesh[0]->bytes_sent();
  OnRanks(n, [&](int r) { status[r] = mesh[r]->AllReduceAverage({TensorView{
                              outputs[r].data(), numel, DType::kFloat32}}); });
  for (int r = 0; r < n; ++r) ASSERT_TRUE(status[r].ok()) << status[r];
  const int64_t fp32 = mesh[0]->bytes_sent() - compressed;
  EXPECT_LE(compressed, (payload == Payload::kBf16 ? 0.55 : 0.30) * fp32)
      << compressed << " vs " << fp32;
}

INSTANTIATE_TEST_SUITE_P(Payloads, CompressedTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Payload::kBf16, Payload::kInt8)));

TEST(CompressedRoundTest, NonContributingMember_ReceivesOthersAverage) {
  const int n = 3;
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> v(n);
  std::vector<absl::Status> status(n);
  OnRanks(n, [&](int r) {
    v[r].assign(2000, r == 2 ? 1000.0f : static_cast<float>(r + 1));  // 1 and 2: mean 1.5
    RoundOptions o;
    o.payload = Payload::kInt8;
    o.contribute = r != 2;
    o.contributors = 2;
    o.commit = true;
    status[r] = mesh[r]->AllReduceAverage({TensorView{v[r].data(), 2000, DType::kFloat32}}, o,
                                          nullptr);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    for (float x : v[r]) ASSERT_NEAR(x, 1.5f, 1.5 / 127) << r;
  }
}

TEST(CompressedRoundTest, Float64Tensors_InvalidArgument) {
  auto mesh = MakeGlooMesh(1, absl::Seconds(5));
  ASSERT_NE(mesh[0], nullptr);
  std::vector<double> x(10, 1.0);
  RoundOptions o;
  o.payload = Payload::kBf16;
  absl::Status s =
      mesh[0]->AllReduceAverage({TensorView{x.data(), 10, DType::kFloat64}}, o, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("float64"));
}

TEST(FragmentLayoutTest, DifferingSplit_FailsLoudlyOnEveryMember_NothingWritten) {
  // Same total element count in fragment 0 on both members, but different tensor lists: the
  // split's signature differs, and neither member averages.
  const int n = 2;
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> v(n);
  std::vector<absl::Status> status(n);
  OnRanks(n, [&](int r) {
    v[r].assign(40, static_cast<float>(r));
    std::vector<TensorView> list;
    if (r == 0) {
      list = {{v[r].data(), 10}, {v[r].data() + 10, 10}, {v[r].data() + 20, 20}};
    } else {
      list = {{v[r].data(), 20}, {v[r].data() + 20, 10}, {v[r].data() + 30, 10}};
    }
    const FragmentSplit split = SplitIntoFragments(list, 2);
    RoundOptions o;
    o.layout_signature = split.signature;
    status[r] = mesh[r]->AllReduceAverage(split.Fragment(list, 0), o, nullptr);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument) << status[r];
    EXPECT_THAT(std::string(status[r].message()), HasSubstr("fragments differently"));
    for (float x : v[r]) EXPECT_EQ(x, static_cast<float>(r));
  }
}

TEST(FragmentLayoutTest, AlternatingFragments_EveryFragmentRoundAgreed_ValuesExact) {
  const int n = 2;
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> v(n);
  std::vector<absl::Status> status(n);
  OnRanks(n, [&](int r) {
    v[r].assign(60, static_cast<float>(2 * r));
    std::vector<TensorView> list = {{v[r].data(), 30}, {v[r].data() + 30, 20},
                                    {v[r].data() + 50, 10}};
    const FragmentSplit split = SplitIntoFragments(list, 2);
    RoundOptions o;
    o.layout_signature = split.signature;
    for (int call = 0; call < 6 && status[r].ok(); ++call) {
      for (TensorView& t : list) {  // a different local update each call
        for (int64_t i = 0; i < t.numel; ++i) static_cast<float*>(t.data)[i] += r + 1;
      }
      status[r] = mesh[r]->AllReduceAverage(split.Fragment(list, call % 2), o, nullptr);
    }
  });
  // Fragment 0 = tensor 0 (30 of 60 elements' middle at 15 < 30), fragment 1 = tensors 1, 2.
  // After 6 calls each fragment was averaged 3 times, the last time after the same local
  // updates: start 0 / 2, +1 / +2 per call; averaged at its last sync, then not updated.
  for (int r = 0; r < n; ++r) ASSERT_TRUE(status[r].ok()) << status[r];
  for (int r = 0; r < n; ++r) {
    // Fragment 0 last synced at call 4 (5 updates applied), fragment 1 at call 5 (6 updates):
    // mean after k updates = (0 + 2) / 2 + k * (1 + 2) / 2.
    EXPECT_EQ(v[r][0], 1.0f + 5 * 1.5f + (r + 1)) << r;  // one update after its last sync
    EXPECT_EQ(v[r][30], 1.0f + 6 * 1.5f) << r;
    EXPECT_EQ(v[r][59], 1.0f + 6 * 1.5f) << r;
  }
}

}  // namespace
}  // namespace modelavg::client
