// The finite check of a round (client/comm/finite_check.h) on the host: the scan itself (which
// values are non-finite, which never are), a finding's code, the staging copy that tests as it
// copies, and Gloo rounds of members as threads. A member with a NaN, +Inf or -Inf makes every
// member's call fail with the same error naming it, its first non-finite tensor and the value,
// with every member's tensors bit-for-bit as before the call, and the communicator usable for
// the next round; finite values near the float limits, denormals and signed zeros pass and are
// averaged; a compressed payload carries the check in its parts; without the check a NaN spreads
// (what the check is for).
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/finite_check.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/payload/finite_scan.h"
#include "client/payload/host_staging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();
constexpr float kDenormal = std::numeric_limits<float>::denorm_min();

// ---- The scan.

TEST(FiniteScanTest, AllFinite_EdgeValuesAreFiniteNonFiniteAreNot) {
  const std::vector<float> edges = {kMax, -kMax, kDenormal, -kDenormal,
                                    std::numeric_limits<float>::min(), 0.0f, -0.0f, 1.0f};
  EXPECT_TRUE(AllFinite(edges.data(), DType::kFloat32, edges.size()));
  const std::vector<double> dedges = {std::numeric_limits<double>::max(),
                                      std::numeric_limits<double>::denorm_min(), -0.0};
  EXPECT_TRUE(AllFinite(dedges.data(), DType::kFloat64, dedges.size()));
  for (float bad : {kNaN, kInf, -kInf}) {
    std::vector<float> v(1000, 1.0f);
    v[777] = bad;
    EXPECT_FALSE(AllFinite(v.data(), DType::kFloat32, v.size())) << bad;
    std::vector<double> d(1000, 1.0);
    d[3] = bad;
    EXPECT_FALSE(AllFinite(d.data(), DType::kFloat64, d.size())) << bad;
  }
  // Half and bfloat16: their largest finite values pass, their Inf and NaN do not.
  const std::vector<uint16_t> half = {FloatToHalf(65504.0f), FloatToHalf(-65504.0f), 0x0001};
  EXPECT_TRUE(AllFinite(half.data(), DType::kFloat16, half.size()));
  const std::vector<uint16_t> half_inf = {FloatToHalf(1.0f), 0x7c00};
  EXPECT_FALSE(AllFinite(half_inf.data(), DType::kFloat16, half_inf.size()));
  const std::vector<uint16_t> bf = {FloatToBFloat16(3.0e38f), 0x0001};
  EXPECT_TRUE(AllFinite(bf.data(), DType::kBFloat16, bf.size()));
  const std::vector<uint16_t> bf_nan = {0x7fc0};
  EXPECT_FALSE(AllFinite(bf_nan.data(), DType::kBFloat16, bf_nan.size()));
  // What the first bad element holds.
  const std::vector<float> mixed = {1.0f, -kInf, kNaN};
  EXPECT_EQ(FirstNonFinite(mixed.data(), DType::kFloat32, 3), NonFiniteValue::kNegInf);
}

TEST(FiniteScanTest, FindingCode_RoundTripsAndSurvivesAnAverage) {
  for (int32_t tensor : {0, 1, 7, 1000, kMaxCodedTensor - 1}) {
    for (NonFiniteValue v :
         {NonFiniteValue::kNaN, NonFiniteValue::kPosInf, NonFiniteValue::kNegInf}) {
      const int64_t code = FindingCode(NonFiniteFinding{tensor, v});
      ASSERT_GT(code, 0);
      EXPECT_EQ(FindingOfCode(code).tensor, tensor);
      EXPECT_EQ(FindingOfCode(code).value, v);
      // Through float32 slots divided by a member count and read back.
      for (int n : {1, 3, 7, 64}) {
        std::vector<float> slots(n, 0.0f);
        WriteFiniteSlots(slots.data(), kStageF32, n, n - 1, code);
        for (float& s : slots) s /= static_cast<float>(n);
        EXPECT_EQ(ReadFiniteSlots(slots.data(), kStageF32, n, 1.0 / n)[n - 1], code);
        // Float16 slots (three digits a member), divided in float16.
        std::vector<uint16_t> half(3 * n, 0);
        WriteFiniteSlots(half.data(), kStageF16, n, n - 1, code);
        for (uint16_t& h : half) {
          h = FloatToHalf(HalfToFloat(h) / static_cast<float>(n));
        }
        EXPECT_EQ(ReadFiniteSlots(half.data(), kStageF16, n, 1.0 / n)[n - 1], code) << n;
      }
    }
  }
  EXPECT_EQ(FindingCode(NonFiniteFinding{}), 0);
  EXPECT_FALSE(FindingOfCode(0).found());
}

TEST(FiniteScanTest, PackDivided_FindsTheFirstBadTensorAndStillCopiesEverything) {
  std::vector<float> a(20000, 2.0f), b(50000, 4.0f), c(10, 6.0f);
  b[40001] = kInf;
  c[2] = kNaN;
  std::vector<TensorView> tensors = {{a.data(), 20000, DType::kFloat32},
                                     {b.data(), 50000, DType::kFloat32},
                                     {c.data(), 10, DType::kFloat32}};
  std::vector<float> staging(70010);
  NonFiniteFinding finding;
  PackDivided(tensors, DType::kFloat32, 2.0, staging.data(), &finding);
  EXPECT_EQ(finding.tensor, 1);
  EXPECT_EQ(finding.value, NonFiniteValue::kPosInf);
  EXPECT_EQ(staging[0], 1.0f);
  EXPECT_EQ(staging[20000 + 40000], 2.0f);
  EXPECT_EQ(staging[70009], 3.0f);
  // Without a finding the copy is the same.
  std::vector<float> plain(70010);
  PackDivided(tensors, DType::kFloat32, 2.0, plain.data());
  EXPECT_EQ(std::memcmp(plain.data(), staging.data(), plain.size() * sizeof(float)), 0);
  // All finite: no finding.
  b[40001] = 4.0f;
  c[2] = kMax;
  NonFiniteFinding none;
  PackDivided(tensors, DType::kFloat32, 2.0, staging.data(), &none);
  EXPECT_FALSE(none.found());
}

// ---- Gloo rounds.

// Gloo's ring (GlooAlgorithms without the direct exchange: the staged round with one slot per
// member) and the default choice, which sends these small rounds through the direct exchange
// (gloo_exchange.h: each member's code as one word after its pieces): the check holds on both.
struct Algorithm {
  const char* name;
  GlooAlgorithms algorithms;
};
std::vector<Algorithm> Algorithms() {
  GlooAlgorithms ring;
  ring.direct_pairs = false;
  ring.direct_max_bytes = 0;
  return {{"ring", ring}, {"direct", GlooAlgorithms{}}};
}

// Each member's tensors: `tensors` float32 tensors of `numel` elements, member r's values
// r + 1 + i / 1000.
std::vector<std::vector<float>> MakeValues(int members, int tensors, int64_t numel) {
  std::vector<std::vector<float>> v;
  for (int r = 0; r < members; ++r) {
    for (int t = 0; t < tensors; ++t) {
      std::vector<float> x(numel);
      for (int64_t i = 0; i < numel; ++i) x[i] = static_cast<float>(r + 1) + i / 1000.0f;
      v.push_back(std::move(x));
    }
  }
  return v;
}

std::vector<TensorView> ViewsOf(std::vector<std::vector<float>>& values, int member,
                                int tensors) {
  std::vector<TensorView> out;
  for (int t = 0; t < tensors; ++t) {
    std::vector<float>& x = values[member * tensors + t];
    out.push_back({x.data(), static_cast<int64_t>(x.size()), DType::kFloat32});
  }
  return out;
}

// One round on every member at once; each member's status.
std::vector<absl::Status> RoundOnAll(std::vector<std::unique_ptr<GlooCommunicator>>& mesh,
                                     std::vector<std::vector<float>>& values, int tensors,
                                     const std::vector<RoundOptions>& options) {
  std::vector<absl::Status> out(mesh.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < mesh.size(); ++r) {
    threads.emplace_back([&, r] {
      RoundOutcome outcome;
      out[r] = mesh[r]->AllReduceAverage(ViewsOf(values, static_cast<int>(r), tensors),
                                         options[r], &outcome);
      if (!out[r].ok() && outcome != RoundOutcome::kFailedWithoutResult) {
        out[r] = absl::InternalError("a failed round kept a result");
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

bool SameBits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

struct Case {
  const char* name;
  float bad;
  const char* value;
  bool one_buffer;  // one tensor (Gloo's in-place path without the check)
  bool commit;
  Payload payload;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class GlooFiniteCheckTest : public ::testing::TestWithParam<Case> {};

TEST_P(GlooFiniteCheckTest, OneMemberNonFinite_EveryCallFailsNamingItNothingChanges) {
  const Case& c = GetParam();
  constexpr int kMembers = 4;
  const int tensors = c.one_buffer ? 1 : 3;
  constexpr int64_t kNumel = 3000;
  for (const Algorithm& a : Algorithms()) {
    SCOPED_TRACE(a.name);
    auto mesh = MakeGlooMesh(kMembers, absl::Seconds(30), nullptr, false, a.algorithms);
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    std::vector<std::vector<float>> values = MakeValues(kMembers, tensors, kNumel);
    const int bad_tensor = tensors - 1;
    values[2 * tensors + bad_tensor][1234] = c.bad;  // member 2, its last tensor
    const std::vector<std::vector<float>> before = values;
    RoundOptions o;
    o.check_finite = true;
    o.commit = c.commit;
    o.step = 30;
    o.payload = c.payload;
    std::vector<absl::Status> s = RoundOnAll(mesh, values, tensors, {o, o, o, o});
    for (int r = 0; r < kMembers; ++r) {
      ASSERT_FALSE(s[r].ok()) << "member " << r;
      EXPECT_EQ(s[r].code(), absl::StatusCode::kInvalidArgument) << s[r];
      EXPECT_EQ(ErrorKindOf(s[r]), ErrorKind::kNonFinite) << s[r];
      EXPECT_EQ(ErrorPeerOf(s[r]), 2) << s[r];
      std::optional<NonFiniteDetail> d = NonFiniteDetailOf(s[r]);
      ASSERT_TRUE(d.has_value()) << s[r];
      EXPECT_EQ(d->tensor, bad_tensor);
      EXPECT_EQ(d->value, c.value);
      EXPECT_EQ(d->step, 30);
      EXPECT_THAT(std::string(s[r].message()),
                  HasSubstr(absl::StrCat(
                      "member 2 of this subgroup contributed non-finite values: ", c.value,
                      " in tensor ", bad_tensor)));
    }
    // Not one bit of any member changed (the NaN member's NaN included).
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(std::memcmp(values[i].data(), before[i].data(), kNumel * sizeof(float)), 0)
          << "tensor " << i % tensors << " of member " << i / tensors << " changed";
    }
    // The member repairs its value; the communicator averages the next round, exactly.
    values[2 * tensors + bad_tensor][1234] = before[tensors + bad_tensor][1234];
    s = RoundOnAll(mesh, values, tensors, {o, o, o, o});
    for (int r = 0; r < kMembers; ++r) ASSERT_TRUE(s[r].ok()) << "member " << r << s[r];
    if (c.payload == Payload::kFp32) {
      // (1 + 2 + 3 + 4) / 4 + i / 1000 at every element but the repaired one.
      EXPECT_NEAR(values[0][10], 2.5f + 0.01f, 1e-5);
      EXPECT_TRUE(values[0] == values[3 * tensors]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GlooFiniteCheckTest,
    ::testing::Values(Case{"nan_staged", kNaN, "NaN", false, false, Payload::kFp32},
                      Case{"inf_one_buffer", kInf, "+Inf", true, false, Payload::kFp32},
                      Case{"neg_inf_committed", -kInf, "-Inf", true, true, Payload::kFp32},
                      Case{"nan_committed_staged", kNaN, "NaN", false, true, Payload::kFp32},
                      Case{"inf_int8", kInf, "+Inf", false, false, Payload::kInt8},
                      Case{"nan_bf16_committed", kNaN, "NaN", true, true, Payload::kBf16}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(GlooFiniteCheck, EdgeFiniteValues_NeverFlaggedAndAveragedWithoutOverflow) {
  constexpr int kMembers = 3;
  for (const Algorithm& a : Algorithms()) {
    SCOPED_TRACE(a.name);
    auto mesh = MakeGlooMesh(kMembers, absl::Seconds(30), nullptr, false, a.algorithms);
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    // Every member holds the largest float, its negative, denormals and signed zeros.
    const std::vector<float> edge = {kMax, -kMax, kDenormal, -kDenormal, 0.0f, -0.0f,
                                     std::numeric_limits<float>::min(), 1.5f};
    std::vector<std::vector<float>> values(kMembers, edge);
    RoundOptions o;
    o.check_finite = true;
    std::vector<absl::Status> s = RoundOnAll(mesh, values, 1, {o, o, o});
    for (int r = 0; r < kMembers; ++r) {
      ASSERT_TRUE(s[r].ok()) << "member " << r << ": " << s[r];
      // Divided before the sum (as PyTorch does): the mean of three largest floats is finite.
      EXPECT_TRUE(std::isfinite(values[r][0])) << values[r][0];
      EXPECT_NEAR(values[r][0] / kMax, 1.0, 1e-6);
      EXPECT_NEAR(values[r][1] / kMax, -1.0, 1e-6);
      EXPECT_EQ(values[r][7], 1.5f);
    }
  }
}

TEST(GlooFiniteCheck, MembersThatDifferOnTheCheck_LayoutMismatchEverywhere) {
  auto mesh = MakeGlooMesh(2, absl::Seconds(30));
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<std::vector<float>> values = MakeValues(2, 1, 100);
  const auto before = values;
  RoundOptions on;
  on.check_finite = true;
  std::vector<absl::Status> s = RoundOnAll(mesh, values, 1, {on, RoundOptions{}});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(s[r].code(), absl::StatusCode::kInvalidArgument) << s[r];
    EXPECT_EQ(ErrorKindOf(s[r]), ErrorKind::kLayoutMismatch) << s[r];
    EXPECT_THAT(std::string(s[r].message()), HasSubstr("finite check"));
  }
  EXPECT_TRUE(SameBits(values, before));
}

TEST(GlooFiniteCheck, WithoutTheCheck_ANaNReachesEveryMember) {
  // What the check prevents: the plain round averages a NaN into every member.
  auto mesh = MakeGlooMesh(3, absl::Seconds(30));
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<std::vector<float>> values = MakeValues(3, 1, 100);
  values[1][50] = kNaN;
  std::vector<absl::Status> s = RoundOnAll(mesh, values, 1, {{}, {}, {}});
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(s[r].ok()) << s[r];
    EXPECT_TRUE(std::isnan(values[r][50])) << "member " << r;
  }
}

TEST(GlooFiniteCheck, TwoMembersNonFinite_TheLowestIsNamedAndTheCountGiven) {
  for (const Algorithm& a : Algorithms()) {
    SCOPED_TRACE(a.name);
    auto mesh = MakeGlooMesh(4, absl::Seconds(30), nullptr, false, a.algorithms);
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    std::vector<std::vector<float>> values = MakeValues(4, 2, 500);
    values[3 * 2 + 0][0] = kNaN;   // member 3, tensor 0
    values[1 * 2 + 1][499] = -kInf;  // member 1, tensor 1
    RoundOptions o;
    o.check_finite = true;
    std::vector<absl::Status> s = RoundOnAll(mesh, values, 2, {o, o, o, o});
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(ErrorPeerOf(s[r]), 1) << s[r];
      EXPECT_EQ(NonFiniteDetailOf(s[r])->tensor, 1);
      EXPECT_EQ(NonFiniteDetailOf(s[r])->value, "-Inf");
      EXPECT_THAT(std::string(s[r].message()), HasSubstr("1 more member(s)"));
    }
  }
}

TEST(GlooFiniteCheck, AJoiningMember_ContributesNothingAndIsNeverFlagged) {
  // A replacement receives the others' average: its own (here NaN) values go into nothing.
  for (const Algorithm& a : Algorithms()) {
    SCOPED_TRACE(a.name);
    auto mesh = MakeGlooMesh(3, absl::Seconds(30), nullptr, false, a.algorithms);
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    std::vector<std::vector<float>> values = MakeValues(3, 1, 100);
    std::fill(values[2].begin(), values[2].end(), kNaN);
    RoundOptions o;
    o.check_finite = true;
    o.contributors = 2;
    RoundOptions joining = o;
    joining.contribute = false;
    std::vector<absl::Status> s = RoundOnAll(mesh, values, 1, {o, o, joining});
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(s[r].ok()) << "member " << r << ": " << s[r];
      EXPECT_NEAR(values[r][0], 1.5f, 1e-6);
    }
  }
}

}  // namespace
}  // namespace modelavg::client
