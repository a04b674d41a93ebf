// GlooCommunicator rounds of elastic jobs (RoundOptions): the two-phase commit that lets a
// member whose confirmation failed keep the result its peers completed with (a lost commit made
// by tests/testing/faulty_communicator.h around a real member, and a link broken between the
// data all-reduce and the commit, through tests/testing/gloo_link_proxy.h), the admission of a
// member that contributes nothing, and the step agreement that refuses a mixed average.
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/comm/solo_communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/faulty_communicator.h"
#include "tests/testing/gloo_link_proxy.h"
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
void RunRound(const std::vector<Communicator*>& mesh, std::vector<Member>& m,
              const std::vector<RoundOptions>& options, bool two) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < mesh.size(); ++r) {
    threads.emplace_back([&, r] {
      m[r].status = mesh[r]->AllReduceAverage(m[r].Views(two), options[r], &m[r].outcome);
    });
  }
  for (auto& t : threads) t.join();
}
void RunRound(std::vector<std::unique_ptr<GlooCommunicator>>& mesh, std::vector<Member>& m,
              const std::vector<RoundOptions>& options, bool two) {
  std::vector<Communicator*> members;
  for (auto& c : mesh) members.push_back(c.get());
  RunRound(members, m, options, two);
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

// Member 1's confirmation fails after its peers completed (its last receive broke; made by a
// FaultyCommunicator around it): it keeps its parameters and holds the result aside; adopting it
// gives exactly the peers' average.
TEST_P(GlooRoundTest, CommitLostOnOneMember_PeersCompleteItHoldsAndAdoptsTheResult) {
  const bool two = GetParam();
  auto mesh = MakeGlooMesh(3, absl::Seconds(30));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  constexpr int64_t kN = 300000;  // several ring segments
  std::vector<Member> m = Members(3, kN);
  const std::vector<Member> before = m;
  auto faults = std::make_shared<modelavg::testing::CommunicatorFaults>();
  faults->LoseCommitAt(modelavg::testing::CommunicatorFaults::kAnyStep);
  modelavg::testing::FaultyCommunicator faulty1(std::move(mesh[1]), faults);
  RoundOptions opts;
  opts.step = 8;
  opts.commit = true;
  RunRound({mesh[0].get(), &faulty1, mesh[2].get()}, m, {opts, opts, opts}, two);
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
  ASSERT_TRUE(faulty1.AdoptPendingResult(m[1].Views(two)).ok());
  EXPECT_TRUE(m[1].a == m[0].a) << "the adopted result differs from the completed one";
  if (two) EXPECT_TRUE(m[1].b == m[2].b);
  // Adopted once: nothing is kept any more.
  EXPECT_EQ(faulty1.AdoptPendingResult(m[1].Views(two)).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Member 1's links break right after the data all-reduce of a committed round, before any byte
// of the commit vote: every member's data all-reduce succeeded but no vote completes, so every
// member keeps its parameters, holds the result aside (the communicator's own kept result) and
// adopting it gives exactly the average. The bytes of the data all-reduce are measured on the
// same communicator by a plain round of the same layout first.
TEST_P(GlooRoundTest, LinksBrokenBetweenDataAndCommit_EveryMemberHoldsTheResultAndAdoptsIt) {
  const bool two = GetParam();
  modelavg::testing::DroppingStore::Shared shared;
  shared.size = 3;
  shared.silent = 1;
  std::vector<std::unique_ptr<modelavg::testing::DroppingStore>> stores;
  for (int r = 0; r < 3; ++r) {
    stores.push_back(std::make_unique<modelavg::testing::DroppingStore>(&shared, r));
  }
  // Gloo's ring, whose vote follows the data (the exchanges' own cut between data and vote:
  // client_gloo_direct_test's VoteMissingAfterTheData).
  GlooAlgorithms ring;
  ring.direct_max_bytes = 0;
  ring.scatter_max_bytes = 0;
  auto mesh = MakeGlooMesh(3, absl::Seconds(30), [&](int r) { return stores[r].get(); }, false,
                           ring);
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  const std::vector<modelavg::testing::LinkProxy*> links = stores[0]->proxies();
  ASSERT_EQ(links.size(), 2u) << "both links of member 1 pass a proxy";
  constexpr int64_t kN = 300000;  // several ring segments
  RoundOptions plain;
  plain.step = 7;
  std::vector<Member> m = Members(3, kN);
  RunRound(mesh, m, {plain, plain, plain}, two);  // the agreement, then the data
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(m[r].status.ok()) << m[r].status;
  std::vector<int64_t> data_bytes;
  for (auto* l : links) data_bytes.push_back(l->forwarded());
  m = Members(3, kN);
  RunRound(mesh, m, {plain, plain, plain}, two);  // the data only
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(m[r].status.ok()) << m[r].status;
  for (size_t k = 0; k < links.size(); ++k) {
    data_bytes[k] = links[k]->forwarded() - data_bytes[k];
    ASSERT_GT(data_bytes[k], 0);
    links[k]->DropAfter(data_bytes[k]);
  }
  m = Members(3, kN);
  const std::vector<Member> before = m;
  RoundOptions committed = plain;
  committed.commit = true;
  RunRound(mesh, m, {committed, committed, committed}, two);
  for (auto* l : links) EXPECT_TRUE(l->dropped());
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(absl::StrCat("member ", r, ": ", m[r].status.ToString()));
    EXPECT_EQ(m[r].status.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(m[r].status.message(), HasSubstr("commit"));
    EXPECT_EQ(m[r].outcome, RoundOutcome::kFailedHoldingResult);
    EXPECT_TRUE(m[r].a == before[r].a) << "a member that holds the result changed its parameters";
    EXPECT_TRUE(m[r].b == before[r].b);
    ASSERT_TRUE(mesh[r]->AdoptPendingResult(m[r].Views(two)).ok());
    for (int64_t i = 0; i < kN; i += 997) {
      const float mean = (before[0].a[i] + before[1].a[i] + before[2].a[i]) / 3;
      ASSERT_NEAR(m[r].a[i], mean, 1e-5f * std::abs(mean) + 1e-6f) << i;
    }
    if (two) {
      EXPECT_DOUBLE_EQ(m[r].b[0], (before[0].b[0] + before[1].b[0] + before[2].b[0]) / 3);
    }
  }
  EXPECT_TRUE(m[0].a == m[1].a && m[1].a == m[2].a) << "the adopted results differ";
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

// The round protocol's agreement on Gloo (client/comm/round_agreement.h): a member whose own
// preparation fails (a divisor that cannot be) tells its peers in the agreement. Nobody averages,
// each peer names it, and the communicator stays usable for the next round.
TEST_P(GlooRoundTest, LocalFailureOnOneMember_CarriedInTheAgreement_NobodyAveragesNextRoundDoes) {
  const bool two = GetParam();
  auto mesh = MakeGlooMesh(3, absl::Seconds(30));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<Member> m = Members(3, 1000);
  const std::vector<Member> before = m;
  RoundOptions fine, impossible;
  impossible.contributors = 4;  // of 3 members
  RunRound(mesh, m, {fine, impossible, fine}, two);
  EXPECT_EQ(m[1].status.code(), absl::StatusCode::kInvalidArgument) << m[1].status;
  EXPECT_THAT(m[1].status.message(), HasSubstr("no valid divisor"));
  for (int r : {0, 2}) {
    EXPECT_EQ(m[r].status.code(), absl::StatusCode::kAborted) << m[r].status;
    EXPECT_THAT(m[r].status.message(), HasSubstr("member 1 of this subgroup failed"));
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(m[r].a == before[r].a) << "member " << r;
    EXPECT_EQ(m[r].outcome, RoundOutcome::kFailedWithoutResult);
  }
  RunRound(mesh, m, {fine, fine, fine}, two);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(m[r].status.ok()) << r << ": " << m[r].status;
  for (int64_t i = 0; i < 1000; i += 37) {
    const float mean = (before[0].a[i] + before[1].a[i] + before[2].a[i]) / 3;
    ASSERT_NEAR(m[1].a[i], mean, 1e-5f * std::abs(mean) + 1e-6f) << i;
  }
}

// A member whose layout changed after the agreement cannot tell its peers in band (they enter the
// data all-reduce): it fails alone (kLayoutMismatch) and asks for a new generation, and its
// closed mesh fails the peers' collective at once, long before the collective timeout.
TEST_P(GlooRoundTest, LayoutChangedAfterTheAgreement_FailsAloneAsksForANewGeneration) {
  const bool two = GetParam();
  constexpr absl::Duration kTimeout = absl::Seconds(30);
  auto mesh = MakeGlooMesh(3, kTimeout);
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<absl::Status> asked(3);
  for (int r = 0; r < 3; ++r) {
    mesh[r]->SetNewGenerationRequest([&asked, r](const absl::Status& why) { asked[r] = why; });
  }
  std::vector<Member> m = Members(3, 1000);
  RunRound(mesh, m, {RoundOptions{}, RoundOptions{}, RoundOptions{}}, two);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(m[r].status.ok()) << m[r].status;
  m[1].a.resize(999);  // member 1 alone drops an element
  const std::vector<Member> before = m;
  const absl::Time start = absl::Now();
  RunRound(mesh, m, {RoundOptions{}, RoundOptions{}, RoundOptions{}}, two);
  EXPECT_LT(absl::Now() - start, kTimeout / 3);
  EXPECT_EQ(m[1].status.code(), absl::StatusCode::kInvalidArgument) << m[1].status;
  EXPECT_EQ(ErrorKindOf(m[1].status), ErrorKind::kLayoutMismatch) << m[1].status;
  EXPECT_THAT(m[1].status.message(), HasSubstr("changed after its Gloo communicator agreed"));
  EXPECT_EQ(asked[1], m[1].status);
  for (int r : {0, 2}) {
    EXPECT_EQ(m[r].status.code(), absl::StatusCode::kUnavailable) << m[r].status;
    EXPECT_TRUE(asked[r].ok()) << "member " << r << " asked: " << asked[r];
  }
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(m[r].a == before[r].a) << "member " << r;
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
