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
#include "tests/reference/naive_payload.h"
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
//   INT8: (mean_i M_i + M') / 254, M_i the largest |x_i| of the element's block (blocks of 1024
//         from the buffer's start, whatever the member count) in member i's encoding, M' the
//         largest |m| of its block in the result's; bounded here by 2 max_i M_i / 254.
//   INT4: the same with 14 for 254.
double Bound(Payload p, const std::vector<std::vector<float>>& xs, int64_t i) {
  const int n = static_cast<int>(xs.size());
  double mean = 0, mean_abs = 0;
  for (const auto& x : xs) {
    mean += x[i] / n;
    mean_abs += std::fabs(x[i]) / n;
  }
  const double rounding = 1e-6 * (mean_abs + 1e-30);
  if (p == Payload::kBf16) return std::ldexp(mean_abs + std::fabs(mean), -8) * 1.01 + rounding;
  const int64_t lo = i / kInt8Block * kInt8Block;
  const int64_t hi = std::min<int64_t>(lo + kInt8Block, static_cast<int64_t>(xs[0].size()));
  double max_abs = 0;
  for (const auto& x : xs) {
    for (int64_t k = lo; k < hi; ++k) max_abs = std::max(max_abs, double{std::fabs(x[k])});
  }
  return 2 * max_abs / (p == Payload::kInt4 ? 14 : 254) * 1.001 + rounding;
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
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(std::memcmp(outputs[r].data(), outputs[0].data(), numel * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
    int64_t exact = 0;
    for (int64_t i = 0; i < numel; ++i) {
      double mean = 0;
      for (int k = 0; k < n; ++k) mean += double{inputs[k][i]} / n;
      const double err = std::fabs(outputs[r][i] - mean);
      ASSERT_LE(err, Bound(payload, inputs, i)) << "rank " << r << " element " << i;
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
  EXPECT_LE(compressed, (payload == Payload::kBf16   ? 0.55
                         : payload == Payload::kInt8 ? 0.30
                                                     : 0.15) *
                            fp32)
      << compressed << " vs " << fp32;
}

INSTANTIATE_TEST_SUITE_P(Payloads, CompressedTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Payload::kBf16, Payload::kInt8,
                                                              Payload::kInt4)));

// TOPK: every member sends its k largest per block; the result is the float32 mean of the
// members' decoded pieces, each non-zero rounded to bfloat16 (the all-gather keeps up to n k a
// block), bit-identical on every rank. Checked against a naive restatement.
TEST(CompressedRoundTest, Topk_MeanOfEachMembersTopK_EveryRankIdentical) {
  for (int n : {2, 4}) {
    SCOPED_TRACE(n);
    const int64_t numel = 2 * kInt8Block + 300;
    const int32_t k = TopkPerBlock(0.02);
    auto mesh = MakeGlooMesh(n, absl::Seconds(30));
    for (auto& c : mesh) ASSERT_NE(c, nullptr);
    std::vector<std::vector<float>> inputs, v(n);
    for (int r = 0; r < n; ++r) inputs.push_back(Input(r, numel));
    std::vector<absl::Status> status(n);
    OnRanks(n, [&](int r) {
      v[r] = inputs[r];
      RoundOptions o;
      o.payload = Payload::kTopk;
      o.topk = k;
      status[r] = mesh[r]->AllReduceAverage({TensorView{v[r].data(), numel, DType::kFloat32}},
                                            o, nullptr);
    });
    // The reference: each member's top k per block (ties: lower index), mean over members.
    std::vector<double> want(numel, 0.0), want_abs(numel, 0.0);
    for (int r = 0; r < n; ++r) {
      for (int64_t lo = 0; lo < numel; lo += kInt8Block) {
        const int64_t hi = std::min(numel, lo + kInt8Block);
        std::vector<int64_t> order;
        for (int64_t i = lo; i < hi; ++i) order.push_back(i);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          return std::fabs(inputs[r][a]) > std::fabs(inputs[r][b]);
        });
        for (int64_t e = 0; e < std::min<int64_t>(k, hi - lo); ++e) {
          want[order[e]] += double{inputs[r][order[e]]} / n;
          want_abs[order[e]] += std::fabs(double{inputs[r][order[e]]}) / n;
        }
      }
    }
    int64_t nonzero = 0;
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r];
      EXPECT_EQ(std::memcmp(v[r].data(), v[0].data(), numel * sizeof(float)), 0) << r;
      for (int64_t i = 0; i < numel; ++i) {
        // bfloat16 twice (each member's value, the mean's) and float32 sums.
        ASSERT_NEAR(v[r][i], want[i],
                    std::ldexp(want_abs[i] + std::fabs(want[i]), -8) * 1.01 + 1e-9)
            << "rank " << r << " element " << i;
        nonzero += r == 0 && v[r][i] != 0;
      }
    }
    EXPECT_GT(nonzero, k);
    EXPECT_LE(nonzero, 3 * n * k);
  }
}

// TOPK_INT2 over 2, 3 and 4 members, five steps, with error feedback (beta 1 and 0.9) and
// without (0): each member sends U = beta E + D (its step's D), keeps C = its own round trip
// (RoundTripPayload, what the averager keeps) and E := U - C. Every member, every step, bit for
// bit against the rule restated (tests/reference/naive_payload.h): C is TOPK_INT2's naive round
// trip of U, and the result the float32 mean, in member order, of the members' C, sent back as
// TOPK with min(1024, n k) entries a block (bfloat16).
TEST(CompressedRoundTest, TopkInt2_EveryMemberEveryStep_WithAndWithoutFeedback) {
  const int64_t numel = 2 * kInt8Block + 300;
  const int32_t k = TopkPerBlock(0.02);
  const WireFormat format(Payload::kTopkInt2, k);
  for (int n : {2, 3, 4}) {
    auto mesh = MakeGlooMesh(n, absl::Seconds(30));
    for (auto& c : mesh) ASSERT_NE(c, nullptr);
    for (float beta : {1.0f, 0.9f, 0.0f}) {
      SCOPED_TRACE(absl::StrCat("n=", n, " beta=", beta));
      std::vector<std::vector<float>> e(n, std::vector<float>(numel, 0.0f));
      for (int step = 0; step < 5; ++step) {
        SCOPED_TRACE(step);
        std::vector<std::vector<float>> u(n, std::vector<float>(numel)), v(n), c(n);
        for (int r = 0; r < n; ++r) {
          const std::vector<float> d = Input(r + 10 * step, numel);
          for (int64_t i = 0; i < numel; ++i) u[r][i] = beta * e[r][i] + d[i];
        }
        std::vector<absl::Status> status(n);
        OnRanks(n, [&](int r) {
          v[r] = u[r];
          c[r].resize(numel);
          RoundTripPayload(format, u[r].data(), numel, c[r].data());
          RoundOptions o;
          o.payload = Payload::kTopkInt2;
          o.topk = k;
          status[r] = mesh[r]->AllReduceAverage(
              {TensorView{v[r].data(), numel, DType::kFloat32}}, o, nullptr);
        });
        std::vector<float> mean(numel, 0.0f);
        for (int r = 0; r < n; ++r) {
          ASSERT_TRUE(status[r].ok()) << status[r];
          const std::vector<float> sent =
              testing::NaivePayloadRoundTrip(Payload::kTopkInt2, k, u[r]);
          ASSERT_EQ(std::memcmp(c[r].data(), sent.data(), numel * sizeof(float)), 0)
              << "member " << r << "'s own round trip";
          for (int64_t i = 0; i < numel; ++i) {
            mean[i] += sent[i];
            e[r][i] = u[r][i] - sent[i];
          }
        }
        const float inv = 1.0f / static_cast<float>(n);
        for (float& m : mean) m *= inv;
        const std::vector<float> want = testing::NaivePayloadRoundTrip(
            Payload::kTopk, std::min<int32_t>(kInt8Block, n * k), mean);
        for (int r = 0; r < n; ++r) {
          ASSERT_EQ(std::memcmp(v[r].data(), want.data(), numel * sizeof(float)), 0)
              << "member " << r;
        }
      }
      // Something was dropped and, with feedback, kept.
      double kept = 0;
      for (float x : e[0]) kept += std::fabs(x);
      EXPECT_GT(kept, 0);
    }
  }
}

// Error feedback's premise: a member's own decode(encode(x)) (RoundTripPayload) is exactly what
// its peers decode from it, whatever the member count. One member contributes x, the others
// zeros (divisor 1): the result is decode(encode(decode(encode(x)))) on every rank, which a
// block payload's second encoding leaves unchanged (its values are already on the grid).
TEST(CompressedRoundTest, OneContributor_ResultIsItsRoundTrip_AnyMemberCount) {
  for (Payload payload : {Payload::kInt8, Payload::kInt4}) {
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(absl::StrCat(PayloadName(payload), " n=", n));
      const int64_t numel = 3 * kInt8Block + 77;
      const std::vector<float> x = Input(0, numel);
      std::vector<float> want(numel);
      RoundTripPayload(payload, x.data(), numel, want.data());
      auto mesh = MakeGlooMesh(n, absl::Seconds(30));
      for (auto& c : mesh) ASSERT_NE(c, nullptr);
      std::vector<std::vector<float>> v(n);
      std::vector<absl::Status> status(n);
      OnRanks(n, [&](int r) {
        v[r] = r == 0 ? x : std::vector<float>(numel, 0.0f);
        RoundOptions o;
        o.payload = payload;
        o.contributors = 1;
        status[r] = mesh[r]->AllReduceAverage(
            {TensorView{v[r].data(), numel, DType::kFloat32}}, o, nullptr);
      });
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(status[r].ok()) << status[r];
        for (int64_t i = 0; i < numel; ++i) {
          // The re-encoded block keeps its largest value, so its scale: q * s again, to
          // float32 rounding of the scale.
          ASSERT_NEAR(v[r][i], want[i], 1e-6 * std::fabs(want[i]) + 1e-30)
              << "rank " << r << " element " << i;
        }
      }
    }
  }
}

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
