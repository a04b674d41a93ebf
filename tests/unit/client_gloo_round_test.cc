// GlooCommunicator rounds of elastic jobs (RoundOptions): the two-phase commit that lets a
// member whose confirmation failed keep the result its peers completed with, the admission of
// a member that contributes nothing, and the step agreement that refuses a mixed average.
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/comm/communicator.h"
#include "client/comm/fault_injection.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/comm/solo_communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;


struct Member {
  std::vector<float> a;
  std::vector<double> b;  // a second tensor: the staging path
  absl::Status status;
  RoundOutcome outcome = RoundOutcome::kCompleted;
  std::vector<TensorView> Views(bool two) {
    std::vector<TensorView> v{TensorView{a.data(), static_cast<int64_t>(a.size()),
                                         DType::kFloat32}};
    if (two) v.push_back(TensorView{b.data(), static_cast<int64_t>(b.size()), DType::kFloat64});
    return v;
  }
};

// Runs one round on every member in parallel with per-member options.
void RunRound(std::vector<std::unique_ptr<GlooCommunicator>>& mesh, std::vector<Member>& m,
              const std::vector<RoundOptions>& options, bool two) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < mesh.size(); ++r) {
    threads.emplace_back([&, r] {
      m[r].status = mesh[r]->AllReduceAverage(m[r].Views(two), options[r], &m[r].outcome);
    });
  }
  for (auto& t : threads) t.join();
}

std::vector<Member> Members(int size, int64_t n) {
  std::vector<Member> m(size);
  for (int r = 0; r < size; ++r) {
    m[r].a.assign(n, static_cast<float>(r + 1));
    m[r].b.assign(n / 2 + 1, 10.0 * (r + 1));
    for (int64_t i = 0; i < n; i += 97) m[r].a[i] = static_cast<float>(i % 5 + r);
  }
  return m;
}

class GlooRoundTest : public ::testing::TestWithParam<bool> {};

// Member 1's confirmation fails after its peers completed (its last receive broke): it keeps
// its parameters and holds the result aside; adopting it gives exactly the peers' average.
TEST_P(GlooRoundTest, CommitLostOnOneMember_PeersCompleteItHoldsAndAdoptsTheResult) {
  const bool two = GetParam();
  auto mesh = MakeGlooMesh(3, absl::Seconds(30));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  constexpr int64_t kN = 300000;  // several ring segments
  std::vector<Member> m = Members(3, kN);
  const std::vector<Member> before = m;
  mesh[1]->set_faults(FaultInjection::LosingNextCommit());
  RoundOptions opts;
  opts.step = 8;
  opts.commit = true;
  RunRound(mesh, m, {opts, opts, opts}, two);
  ASSERT_TRUE(m[0].status.ok()) << m[0].status;
  ASSERT_TRUE(m[2].status.ok()) << m[2].status;
  EXPECT_EQ(m[0].outcome, RoundOutcome::kCompleted);
  EXPECT_EQ(m[2].outcome, RoundOutcome::kCompleted);
  EXPECT_THAT(m[1].status.message(), HasSubstr("injected commit failure"));
  EXPECT_EQ(m[1].outcome, RoundOutcome::kFailedHoldingResult);
  EXPECT_TRUE(m[1].a == before[1].a) << "the failed member's parameters changed";
  EXPECT_TRUE(m[1].b == before[1].b);
  for (int64_t i = 0; i < kN; i += 997) {
    const float mean = (before[0].a[i] + before[1].a[i] + before[2].a[i]) / 3;
    ASSERT_NEAR(m[0].a[i], mean, 1e-5f * std::abs(mean) + 1e-6f) << i;
  }
  ASSERT_TRUE(mesh[1]->AdoptPendingResult(m[1].Views(two)).ok());
  EXPECT_TRUE(m[1].a == m[0].a) << "the adopted result differs from the completed one";
  if (two) EXPECT_TRUE(m[1].b == m[2].b);
  // Adopted once: nothing is kept any more.
  EXPECT_EQ(mesh[1]->AdoptPendingResult(m[1].Views(two)).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A member admitted at this step contributes nothing and receives the others' average.
TEST_P(GlooRoundTest, JoiningMember_ReceivesTheAverageOfTheOthers) {
  const bool two = GetParam();
  auto mesh = MakeGlooMesh(3, absl::Seconds(30));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  constexpr int64_t kN = 50000;
  std::vector<Member> m = Members(3, kN);
  const std::vector<Member> before = m;
  RoundOptions member;
  member.commit = true;
  member.contributors = 2;
  RoundOptions joining = member;
  joining.contribute = false;
  RunRound(mesh, m, {member, joining, member}, two);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(m[r].status.ok()) << r << ": " << m[r].status;
  for (int64_t i = 0; i < kN; i += 331) {
    const float mean = (before[0].a[i] + before[2].a[i]) / 2;
    ASSERT_NEAR(m[1].a[i], mean, 1e-5f * std::abs(mean) + 1e-6f) << i;
    ASSERT_EQ(m[0].a[i], m[1].a[i]) << i;
    ASSERT_EQ(m[2].a[i], m[1].a[i]) << i;
  }
  if (two) EXPECT_DOUBLE_EQ(m[1].b[0], (before[0].b[0] + before[2].b[0]) / 2);
}

// Members that pass different steps on a communicator's first round all fail, untouched.
TEST_P(GlooRoundTest, FirstRoundAtDifferentSteps_InternalErrorAndNoMixedAverage) {
  const bool two = GetParam();
  auto mesh = MakeGlooMesh(2, absl::Seconds(30));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<Member> m = Members(2, 1000);
  const std::vector<Member> before = m;
  RoundOptions at5, at6;
  at5.step = 5;
  at6.step = 6;
  RunRound(mesh, m, {at5, at6}, two);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(m[r].status.code(), absl::StatusCode::kInternal) << m[r].status;
    EXPECT_THAT(m[r].status.message(), HasSubstr("different rounds"));
    EXPECT_TRUE(m[r].a == before[r].a) << r;
  }
}

INSTANTIATE_TEST_SUITE_P(OneBufferAndStaged, GlooRoundTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Staged" : "OneBuffer";
                         });

TEST(SoloRoundTest, JoiningAlone_InvalidArgument) {
  SoloCommunicator solo;
  std::vector<float> v(4, 1.0f);
  RoundOptions joining;
  joining.contribute = false;
  RoundOutcome outcome;
  EXPECT_EQ(solo.AllReduceAverage({TensorView{v.data(), 4, DType::kFloat32}}, joining, &outcome)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outcome, RoundOutcome::kFailedWithoutResult);
}

}  // namespace
}  // namespace modelavg::client
