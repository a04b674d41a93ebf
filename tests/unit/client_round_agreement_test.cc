// The round protocol both backends speak (client/comm/round_agreement.h), on its own: members as
// plain values whose words are combined by an element-wise max, as the backends' all-reduce does.
// The decision is checked against a naive restatement of the rule over every member's layout,
// on every member; then when an agreement is due, the local comparison between agreements, the
// commit vote and the kept result.
#include "client/comm/round_agreement.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

struct Member {
  RoundLayout layout;
  absl::Status local;
};

// The element-wise max over every member's words: what the max all-reduce leaves on each.
LayoutSignature Reduce(const std::vector<Member>& members) {
  LayoutSignature r = EncodeLayout(members[0].layout, !members[0].local.ok(), 0);
  for (size_t m = 1; m < members.size(); ++m) {
    const LayoutSignature w =
        EncodeLayout(members[m].layout, !members[m].local.ok(), static_cast<int>(m));
    for (int i = 0; i < kLayoutWords; ++i) r[i] = std::max(r[i], w[i]);
  }
  return r;
}

// The rule, restated from the members' layouts directly.
struct Naive {
  absl::StatusCode code = absl::StatusCode::kOk;
  ErrorKind kind = ErrorKind::kUnknown;
  bool unpadded = false;
};
Naive NaiveDecision(const std::vector<Member>& members, size_t me) {
  Naive n;
  int failed = -1;
  std::set<int64_t> totals, dtypes, signatures, steps, divisors, counts;
  for (size_t m = 0; m < members.size(); ++m) {
    const RoundLayout& l = members[m].layout;
    if (!members[m].local.ok()) failed = static_cast<int>(m);
    totals.insert(l.total);
    dtypes.insert(l.dtype);
    signatures.insert(l.fragment_signature);
    if (l.step >= 0) steps.insert(l.step);
    divisors.insert(l.divisor);
    counts.insert(l.count);
  }
  if (failed >= 0) {
    n.code = members[me].local.ok() ? absl::StatusCode::kAborted : members[me].local.code();
  } else if (totals.size() > 1 || dtypes.size() > 1) {
    n.code = absl::StatusCode::kInvalidArgument;
    n.kind = ErrorKind::kLayoutMismatch;
  } else if (signatures.size() > 1) {
    n.code = absl::StatusCode::kInvalidArgument;
    n.kind = ErrorKind::kLayoutMismatch;
  } else if (steps.size() > 1 || divisors.size() > 1) {
    n.code = absl::StatusCode::kInternal;
    n.kind = ErrorKind::kRoundMismatch;
  } else {
    n.unpadded = counts.size() > 1 || *counts.begin() != members[me].layout.count;
  }
  return n;
}

TEST(DecideLayoutTest, RandomMembers_EveryMemberDecidesAsTheNaiveRule) {
  std::mt19937 gen(7);
  const auto pick = [&gen](std::vector<int64_t> v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(gen)];
  };
  int disagreements_seen = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int n = static_cast<int>(pick({1, 2, 3, 5}));
    std::vector<Member> members(n);
    for (int m = 0; m < n; ++m) {
      RoundLayout& l = members[m].layout;
      // Mostly agreeing members, so that every branch of the rule is reached.
      l.total = pick({900, 900, 900, 901});
      l.dtype = static_cast<int32_t>(pick({1, 1, 1, 2}));
      l.count = l.total + pick({0, 0, 7});
      l.divisor = static_cast<int>(pick({n, n, n, std::max(1, n - 1)}));
      l.step = pick({-1, 12, 12, 12, 13});
      l.fragment_signature =
          pick({0, 0, 0, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()});
      if (pick({0, 0, 0, 0, 0, 0, 0, 1}) == 1) members[m].local = absl::UnavailableError("no");
    }
    const LayoutSignature reduced = Reduce(members);
    for (int m = 0; m < n; ++m) {
      SCOPED_TRACE(absl::StrCat("trial ", trial, " member ", m, " of ", n));
      const LayoutDecision d = DecideLayout(reduced, members[m].layout, members[m].local);
      const Naive want = NaiveDecision(members, m);
      ASSERT_EQ(d.status.code(), want.code) << d.status;
      EXPECT_EQ(ErrorKindOf(d.status), want.kind) << d.status;
      if (want.code == absl::StatusCode::kOk) EXPECT_EQ(d.unpadded, want.unpadded);
      if (want.code != absl::StatusCode::kOk) ++disagreements_seen;
    }
  }
  EXPECT_GT(disagreements_seen, 1000);
}

TEST(DecideLayoutTest, PaddedAndUnpaddedMembers_BothFallBackToTheUnpaddedLayout) {
  // Counts 12 (padded) and 9 (in place), totals 9 and 9, the same dtype.
  std::vector<Member> m(2);
  m[0].layout = {9, 1, 12, 2, -1, 0};
  m[1].layout = {9, 1, 9, 2, -1, 0};
  LayoutSignature r = Reduce(m);
  const LayoutDecision da = DecideLayout(r, m[0].layout, absl::OkStatus());
  const LayoutDecision db = DecideLayout(r, m[1].layout, absl::OkStatus());
  EXPECT_TRUE(da.status.ok());
  EXPECT_TRUE(da.unpadded);
  EXPECT_TRUE(db.unpadded);
  // A local failure of member 1 reaches member 0, which names it.
  m[1].local = absl::UnavailableError("x");
  r = Reduce(m);
  const absl::Status s0 = DecideLayout(r, m[0].layout, absl::OkStatus()).status;
  EXPECT_EQ(s0.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s0.message(), HasSubstr("member 1 of this subgroup failed"));
  EXPECT_EQ(DecideLayout(r, m[1].layout, m[1].local).status.code(),
            absl::StatusCode::kUnavailable);
}

TEST(DecideLayoutTest, Mismatches_MessagesSayWhatDiffers) {
  std::vector<Member> m(2);
  m[0].layout = {10, 1, 10, 2, 5, 0};
  m[1].layout = {11, 1, 11, 2, 5, 0};
  absl::Status s = DecideLayout(Reduce(m), m[0].layout, absl::OkStatus()).status;
  EXPECT_THAT(s.message(), HasSubstr("different parameter layouts"));
  EXPECT_THAT(s.message(), HasSubstr("range from 10 to 11"));
  m[1].layout = {10, 1, 10, 2, 5, 77};
  s = DecideLayout(Reduce(m), m[0].layout, absl::OkStatus()).status;
  EXPECT_THAT(s.message(), HasSubstr("fragments differently"));
  m[1].layout = {10, 1, 10, 2, 6, 0};
  s = DecideLayout(Reduce(m), m[0].layout, absl::OkStatus()).status;
  EXPECT_THAT(s.message(), HasSubstr("averaging different rounds: steps range from 5 to 6"));
  m[1].layout = {10, 1, 10, 1, 5, 0};
  s = DecideLayout(Reduce(m), m[0].layout, absl::OkStatus()).status;
  EXPECT_THAT(s.message(), HasSubstr("divisors (contributing members) range from 1 to 2"));
}

TEST(RoundAgreementTest, Due_FirstRoundFragmentRoundsAndANewDivisor) {
  RoundAgreement a(0, 3, "Test");
  EXPECT_TRUE(a.Due(0, 3));
  const RoundLayout agreed{100, 1, 100, 3, 4, 0};
  a.Record(agreed, /*fingerprint=*/42, /*unpadded=*/false, /*tensors=*/2);
  EXPECT_TRUE(a.agreed());
  EXPECT_FALSE(a.Due(0, 3));
  EXPECT_TRUE(a.Due(99, 3)) << "every fragment round agrees";
  EXPECT_TRUE(a.Due(0, 2)) << "a round after an admission divides by another number";
}

TEST(RoundAgreementTest, CheckUnchanged_ChangedLayoutFailsNamingBoth_WorldOfOneAgreesAgain) {
  RoundAgreement a(1, 3, "Test");
  a.Record({100, 1, 100, 3, -1, 0}, 42, false, 2);
  bool again = false;
  EXPECT_TRUE(a.CheckUnchanged(42, 2, 100, &again).ok());
  EXPECT_FALSE(again);
  const absl::Status s = a.CheckUnchanged(43, 3, 120, &again);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ErrorKindOf(s), ErrorKind::kLayoutMismatch);
  EXPECT_THAT(s.message(), HasSubstr("agreed: 2 tensors, 100 elements; now 3 tensors, 120"));
  EXPECT_FALSE(again);
  RoundAgreement alone(0, 1, "Test");
  alone.Record({100, 1, 100, 1, -1, 0}, 42, false, 2);
  EXPECT_TRUE(alone.CheckUnchanged(43, 3, 120, &again).ok());
  EXPECT_TRUE(again);
}

TEST(RoundAgreementTest, Agree_ExchangeFailure_IsNotADecision) {
  RoundAgreement a(0, 2, "Test");
  const auto failing = [](LayoutSignature&) { return absl::UnavailableError("peer gone"); };
  absl::StatusOr<LayoutDecision> d = a.Agree({1, 1, 1, 2, -1, 0}, absl::OkStatus(), failing);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  // The exchange carries this member's words: the failed flag names it (member 0 -> 1).
  LayoutSignature seen{};
  const auto echo = [&seen](LayoutSignature& w) {
    seen = w;
    return absl::OkStatus();
  };
  d = a.Agree({1, 1, 1, 2, -1, 0}, absl::InternalError("oom"), echo);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(seen[6], 1);
}

TEST(RoundAgreementTest, FailedAlone_AsksForANewGenerationWithTheError) {
  RoundAgreement a(2, 4, "Test");
  std::vector<absl::Status> asked;
  a.SetNewGenerationRequest([&asked](const absl::Status& why) { asked.push_back(why); });
  const absl::Status s = a.FailedAlone(absl::InvalidArgumentError("changed"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], s);
  RoundAgreement quiet(0, 2, "Test");  // no request: the error still comes back
  EXPECT_EQ(quiet.FailedAlone(absl::InternalError("x")).code(), absl::StatusCode::kInternal);
}

TEST(CommitVoteTest, AllMembersVote_OK_ElseInternalOrTheCollectivesError) {
  // Three members each add their vote of 1.
  EXPECT_TRUE(CommitVote(3, [](int64_t& v) {
                v = 3 * v;
                return absl::OkStatus();
              }).ok());
  const absl::Status short_count = CommitVote(3, [](int64_t& v) {
    v = 2 * v;
    return absl::OkStatus();
  });
  EXPECT_EQ(short_count.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(short_count.message(), HasSubstr("counted 2 of 3 members"));
  EXPECT_EQ(CommitVote(3, [](int64_t&) { return absl::UnavailableError("broke"); }).code(),
            absl::StatusCode::kUnavailable);
}

TEST(KeptResultTest, HeldOnce_OnlyForTheRoundsLayout) {
  KeptResult k;
  EXPECT_EQ(k.CheckHeld().code(), absl::StatusCode::kFailedPrecondition);
  k.Keep(KeptResult::Form::kOneBuffer, 79, 1);
  EXPECT_TRUE(k.CheckHeld().ok());
  EXPECT_TRUE(k.CheckLayout(79, 1, /*one_buffer=*/true).ok());
  EXPECT_EQ(k.CheckLayout(79, 1, /*one_buffer=*/false).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(k.CheckLayout(80, 1, true).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(k.CheckLayout(79, 2, true).code(), absl::StatusCode::kInvalidArgument);
  k.Keep(KeptResult::Form::kStaged, 9, 1, 12, /*padded=*/true);
  EXPECT_TRUE(k.CheckLayout(9, 1, /*one_buffer=*/false).ok());
  EXPECT_EQ(k.staged_elems(), 12);
  EXPECT_TRUE(k.padded());
  k.Forget();
  EXPECT_FALSE(k.held());
}

TEST(LayoutFingerprintTest, SizesDtypesAndPlanCount_NotTheAddresses) {
  float a[8], b[8];
  const std::vector<TensorView> here = {{a, 3, DType::kFloat32}, {a + 3, 5, DType::kFloat32}};
  const std::vector<TensorView> there = {{b, 3, DType::kFloat32}, {b + 3, 5, DType::kFloat32}};
  const std::vector<TensorView> split = {{a, 4, DType::kFloat32}, {a + 4, 4, DType::kFloat32}};
  const std::vector<TensorView> other = {{a, 3, DType::kFloat32}, {a + 3, 5, DType::kFloat16}};
  EXPECT_EQ(LayoutFingerprint(here, 1, 8), LayoutFingerprint(there, 1, 8));
  EXPECT_NE(LayoutFingerprint(here, 1, 8), LayoutFingerprint(split, 1, 8));
  EXPECT_NE(LayoutFingerprint(here, 1, 8), LayoutFingerprint(other, 1, 8));
  EXPECT_NE(LayoutFingerprint(here, 1, 8), LayoutFingerprint(here, 1, 16));
  EXPECT_NE(LayoutFingerprint(here, 1, 8), LayoutFingerprint(here, 2, 8));
}

}  // namespace
}  // namespace modelavg::client
