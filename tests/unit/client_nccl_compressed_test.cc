// Compressed payloads on the NCCL path (RoundOptions::payload: BF16, INT8, INT4; NcclCore's
// all-to-all / float32 sum / all-gather round) with simulated members as threads on the fake
// device of tests/testing/fake_nccl_device.h. Every member's every element against the exact mean
// (double precision) within the documented bound (docs/streaming.md): BF16 <= 2^-7 M, INT8 <=
// 2 M / 254, INT4 <= 2 M / 14, M the largest |d| of the element's block over the members; every
// member's result bit-identical; the bytes on the wire (the fake transport's count, and the
// core's) BF16 <= 0.55x, INT8 <= 0.30x and INT4 <= 0.17x of FP32's (the parts are cut at
// block boundaries: at most n - 1 zero blocks more, small beside 52k elements). TOPK's rounds
// are checked against the rule itself in client_nccl_core_test.cc. Runs without a GPU;
// tests/gpu runs the kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/comm/communicator.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/testing/fake_nccl_group.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// A group whose members' rounds run at once, as threads.
struct World : FakeNcclGroup {
  using FakeNcclGroup::FakeNcclGroup;
  std::vector<absl::Status> Run(std::vector<Params>& params, const RoundOptions& options) {
    std::vector<absl::Status> out(cores.size());
    std::vector<std::thread> threads;
    for (size_t m = 0; m < cores.size(); ++m) {
      threads.emplace_back([&, m] { out[m] = cores[m]->Run(params[m].views, options, nullptr); });
    }
    for (auto& t : threads) t.join();
    return out;
  }
};

// Member m's element e of a flat buffer: magnitudes that differ by block (so that INT8's
// per-block scale matters) and by member, signs mixed.
double Value(int m, int64_t e) {
  const double magnitude = std::ldexp(1.0, static_cast<int>((e / 700) % 9) - 4);
  return magnitude * std::sin(0.37 * e + 1.3 * m + 0.1) * (1.0 + 0.25 * m);
}

// Every member's buffer filled with Value, flat over its tensors.
std::vector<Params> Make(int n, bool contiguous, const std::vector<int64_t>& sizes) {
  std::vector<Params> out;
  for (int m = 0; m < n; ++m) {
    std::vector<std::pair<DType, int64_t>> spec;
    for (int64_t k : sizes) spec.emplace_back(DType::kFloat32, k);
    Params p = contiguous ? Params::Contiguous(DType::kFloat32, sizes) : Params::Separate(spec);
    int64_t e = 0;
    for (const TensorView& v : p.views) {
      for (int64_t i = 0; i < v.numel; ++i, ++e) static_cast<float*>(v.data)[i] = Value(m, e);
    }
    out.push_back(std::move(p));
  }
  return out;
}

// The buffer a compressed round reduces, as the core lays it out: the tensors back to back, in
// place or staged (a compressed round stages the unpadded layout).
std::vector<float> AsReduced(const Params& p) {
  const StagingLayout layout = BuildStagingLayout(p.views, kStageF32, /*pad=*/false);
  std::vector<float> out(static_cast<size_t>(layout.elems), std::nanf(""));
  for (const StagingChunk& c : layout.chunks) {
    std::memcpy(out.data() + c.staging_offset, c.tensor, c.numel * sizeof(float));
  }
  return out;
}

struct Case {
  int members;
  bool contiguous;
};

class NcclCompressedTest : public ::testing::TestWithParam<Case> {};

// The error of every element against the exact mean, within the payload's bound; the members
// agree bit for bit; something was actually lost to compression.
void ExpectWithinBound(Payload payload, int n, const std::vector<std::vector<float>>& inputs,
                       const std::vector<Params>& results) {
  const int64_t count = static_cast<int64_t>(inputs[0].size());
  for (int m = 1; m < n; ++m) {
    ASSERT_EQ(Flat(results[m]), Flat(results[0])) << "member " << m << " differs from member 0";
  }
  const std::vector<float> first = AsReduced(results[0]);
  ASSERT_EQ(static_cast<int64_t>(first.size()), count);
  // The blocks are the whole buffer's (the round cuts its parts at block boundaries): each
  // block's largest |d| over the members.
  std::vector<double> block_big(static_cast<size_t>((count + kInt8Block - 1) / kInt8Block), 0.0);
  for (int m = 0; m < n; ++m) {
    for (int64_t k = 0; k < count; ++k) {
      double& big = block_big[k / kInt8Block];
      big = std::max(big, std::fabs(double{inputs[m][k]}));
    }
  }
  double worst = 0;
  for (int64_t e = 0; e < count; ++e) {
    const double big = block_big[e / kInt8Block];
    double mean = 0;
    for (int m = 0; m < n; ++m) mean += double{inputs[m][e]} / n;
    const double bound = payload == Payload::kBf16   ? std::ldexp(big, -7)
                         : payload == Payload::kInt4 ? 2 * big / 14
                                                     : 2 * big / 254;
    const double err = std::fabs(first[e] - mean);
    // Plus float32 rounding of the sum and the scale.
    ASSERT_LE(err, bound + 1e-6 * big) << PayloadName(payload) << " element " << e;
    worst = std::max(worst, err);
  }
  EXPECT_GT(worst, 0) << "nothing was compressed";
}

TEST_P(NcclCompressedTest, Bf16Int8Int4_WithinBound_BitIdentical_FewerBytes) {
  const Case c = GetParam();
  // 52004: not a multiple of n nor of the block.
  const std::vector<int64_t> sizes = {1, 30000, 33, 20470, 1500};
  int64_t sent[4] = {0, 0, 0, 0};
  int64_t wire[4] = {0, 0, 0, 0};
  const Payload payloads[4] = {Payload::kFp32, Payload::kBf16, Payload::kInt8, Payload::kInt4};
  for (int k = 0; k < 4; ++k) {
    World w(c.members);
    std::vector<Params> params = Make(c.members, c.contiguous, sizes);
    std::vector<std::vector<float>> inputs;
    for (const Params& p : params) inputs.push_back(AsReduced(p));
    for (int m = 0; m < c.members; ++m) {
      w.ops[m]->SetParams(params[m].views[0].data, params[m].views[0].nbytes());
    }
    RoundOptions options;
    options.payload = payloads[k];
    for (int round = 0; round < 2; ++round) {  // the second without the layout agreement
      if (round == 1) {
        params = Make(c.members, c.contiguous, sizes);
        for (int m = 0; m < c.members; ++m) {
          w.ops[m]->SetParams(params[m].views[0].data, params[m].views[0].nbytes());
        }
      }
      const std::vector<absl::Status> out = w.Run(params, options);
      for (int m = 0; m < c.members; ++m) ASSERT_TRUE(out[m].ok()) << "member " << m << ": " << out[m];
      EXPECT_FALSE(w.world->mismatch());
      EXPECT_FALSE(w.world->hang());
      if (payloads[k] != Payload::kFp32) {
        ExpectWithinBound(payloads[k], c.members, inputs, params);
        if (HasFatalFailure()) return;
      }
    }
    for (int m = 0; m < c.members; ++m) {
      ASSERT_FALSE(w.ops[m]->illegal);
      // The core's count is what the transport saw.
      EXPECT_EQ(w.cores[m]->bytes_sent(), w.ops[m]->wire_bytes) << "member " << m;
    }
    sent[k] = w.cores[0]->bytes_sent();
    wire[k] = w.ops[0]->wire_bytes;
    if (payloads[k] != Payload::kFp32) {
      EXPECT_THAT(w.ops[0]->ops, ::testing::Contains("alltoall"));
      EXPECT_THAT(w.ops[0]->ops, ::testing::Contains("allgather"));
    }
  }
  ASSERT_GT(wire[0], 0);
  EXPECT_LE(wire[1], 0.55 * wire[0]) << "BF16 " << wire[1] << " bytes, FP32 " << wire[0];
  EXPECT_LE(wire[2], 0.30 * wire[0]) << "INT8 " << wire[2] << " bytes, FP32 " << wire[0];
  EXPECT_LE(wire[3], 0.17 * wire[0]) << "INT4 " << wire[3] << " bytes, FP32 " << wire[0];
  EXPECT_EQ(sent[1], wire[1]);
}

INSTANTIATE_TEST_SUITE_P(Members, NcclCompressedTest,
                         ::testing::Values(Case{2, true}, Case{3, false}, Case{4, true},
                                           Case{4, false}),
                         [](const auto& info) {
                           return std::to_string(info.param.members) +
                                  (info.param.contiguous ? "_ZeroCopy" : "_Staged");
                         });

// A member admitted at this step contributes nothing: the others' mean, divided by their
// number, within the bound.
TEST(NcclCompressed, NonContributingMember_AveragesTheOthers) {
  const int n = 3;
  World w(n);
  std::vector<Params> params = Make(n, true, {5000});
  std::vector<std::vector<float>> inputs;
  for (const Params& p : params) inputs.push_back(Flat(p));
  for (int m = 0; m < n; ++m) {
    w.ops[m]->SetParams(params[m].views[0].data, params[m].views[0].nbytes());
  }
  std::vector<absl::Status> out(n);
  std::vector<std::thread> threads;
  for (int m = 0; m < n; ++m) {
    threads.emplace_back([&, m] {
      RoundOptions o;
      o.payload = Payload::kInt8;
      o.contributors = 2;
      o.contribute = m != 2;
      out[m] = w.cores[m]->Run(params[m].views, o, nullptr);
    });
  }
  for (auto& t : threads) t.join();
  for (int m = 0; m < n; ++m) ASSERT_TRUE(out[m].ok()) << out[m];
  const std::vector<float> got = Flat(params[2]);
  for (int64_t e = 0; e < 5000; e += 7) {
    const double mean = (double{inputs[0][e]} + inputs[1][e]) / 2;
    double big = 0;
    for (int m = 0; m < 2; ++m) {
      for (int64_t k = 0; k < 5000; ++k) big = std::max(big, std::fabs(double{inputs[m][k]}));
    }
    ASSERT_NEAR(got[e], mean, 2 * big / 254 + 1e-6 * big) << "element " << e;
  }
  EXPECT_EQ(0, std::memcmp(Flat(params[0]).data(), got.data(), got.size() * sizeof(float)));
}

// float64 tensors cannot travel compressed: INVALID_ARGUMENT on every member, and nobody enters
// the data collective (the communicator stays usable).
TEST(NcclCompressed, Float64_InvalidArgumentEverywhere_NoDataCollective) {
  const int n = 2;
  World w(n);
  std::vector<Params> params;
  for (int m = 0; m < n; ++m) params.push_back(Params::Contiguous(DType::kFloat64, {100}));
  RoundOptions o;
  o.payload = Payload::kBf16;
  const std::vector<absl::Status> out = w.Run(params, o);
  for (int m = 0; m < n; ++m) {
    EXPECT_EQ(out[m].code(), absl::StatusCode::kInvalidArgument) << out[m];
    EXPECT_THAT(w.ops[m]->ops, ::testing::Not(::testing::Contains("alltoall")));
  }
  EXPECT_THAT(std::string(out[0].message()), HasSubstr("float64"));
  EXPECT_FALSE(w.world->mismatch());
}

}  // namespace
}  // namespace modelavg::client
