// Membership and generations as a plain value class (no threads, no clock), and the changes it
// hands to its writer before they take effect.
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/membership/member_credential.h"
#include "server/membership/membership.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

std::vector<int32_t> Ranks(const MembershipChange& change) {
  std::vector<int32_t> ranks;
  for (const Member& m : change.members) ranks.push_back(m.rank);
  return ranks;
}

// A writer that keeps what it was handed and fails while `fail` is set.
struct RecordingWriter {
  std::vector<MembershipChange> written;
  absl::Status fail;
  MembershipWriter writer() {
    return [this](const MembershipChange& c) {
      if (!fail.ok()) return fail;
      written.push_back(c);
      return absl::OkStatus();
    };
  }
};

// Joins ranks 0..world-1 as workers "w<r>"; the last completes the round.
void JoinAll(Membership& m) {
  for (int32_t r = 0; r < m.world_size(); ++r) {
    // Member r's credential is "c<r>".
    absl::StatusOr<Membership::JoinResult> j = m.Join("w" + std::to_string(r), "h", r, kT0, "j",
                                                      "", CredentialDigest("c" + std::to_string(r)));
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->change.world_complete, r == m.world_size() - 1);
  }
}

// The ranks of an assembling round are written only once it completes, all at once.
TEST(MembershipTest, Join_LastRank_CompletesWorldAndWritesHeaderAndEveryMember) {
  RecordingWriter w;
  Membership m(3, 0, w.writer());
  for (int32_t r = 0; r < 2; ++r) {
    absl::StatusOr<Membership::JoinResult> j = m.Join("w" + std::to_string(r), "h", r, kT0, "j");
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_FALSE(j->change.changes_hard_state());
  }
  EXPECT_TRUE(w.written.empty());
  absl::StatusOr<Membership::JoinResult> last = m.Join("w2", "h", 2, kT0, "j");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.generation(), 1);
  EXPECT_EQ(m.round_size(), 3);
  const MembershipChange& change = last->change;
  EXPECT_TRUE(change.world_complete);
  ASSERT_TRUE(change.header.has_value());
  EXPECT_EQ(change.header->state, v1::RUNNING);
  EXPECT_EQ(change.header->generation, 1);
  EXPECT_THAT(Ranks(change), ElementsAre(0, 1, 2));
  EXPECT_EQ(change.members[1].worker_id, "w1");
  EXPECT_EQ(change.members[1].generation, 1);
  ASSERT_EQ(w.written.size(), 1u);
  EXPECT_THAT(Ranks(w.written[0]), ElementsAre(0, 1, 2));
}

TEST(MembershipTest, HeartbeatAndStep_WriteNoHardState) {
  RecordingWriter w;
  Membership m(2, 0, w.writer());
  JoinAll(m);
  ASSERT_EQ(w.written.size(), 1u);
  m.Heartbeat(0, 1, 5, kT0 + absl::Seconds(1));
  m.RecordStep(1, 6, kT0 + absl::Seconds(1));
  EXPECT_EQ(w.written.size(), 1u);
  EXPECT_EQ(m.member(0).last_step, 5);
  EXPECT_EQ(m.member(1).last_step, 6);
}

TEST(MembershipTest, Heartbeat_OtherGeneration_KeepsNobodyAlive) {
  Membership m(2);
  JoinAll(m);
  m.Heartbeat(0, 7, 5, kT0 + absl::Seconds(10));
  EXPECT_EQ(m.member(0).last_heartbeat, kT0);
}

TEST(MembershipTest, Stale_OnlyRunningRoundMembersPastTimeout) {
  Membership m(2);
  ASSERT_TRUE(m.Join("w0", "h", 0, kT0, "j").ok());
  EXPECT_TRUE(m.Stale(kT0 + absl::Hours(1), absl::Seconds(3)).empty());  // PENDING
  ASSERT_TRUE(m.Join("w1", "h", 1, kT0, "j").ok());
  m.Heartbeat(1, 1, 0, kT0 + absl::Seconds(2));
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(4), absl::Seconds(3)), ElementsAre(0));
}

TEST(MembershipTest, Die_MarksDeadAndBumpsGenerationClearingIds) {
  Membership m(2);
  JoinAll(m);
  const MembershipChange change = m.Die({1}, "rank 1 heartbeat timeout", kT0).value();
  EXPECT_TRUE(change.generation_changed);
  EXPECT_EQ(change.old_generation, 1);
  EXPECT_EQ(change.changed_by_rank, 1);
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(m.round_size(), 0);
  EXPECT_EQ(m.member(1).state, v1::DEAD);
  ASSERT_TRUE(m.last_change().has_value());
  EXPECT_EQ(m.last_change()->reason(), "rank 1 heartbeat timeout");
  ASSERT_TRUE(change.header.has_value());
  EXPECT_EQ(change.header->generation, 2);
  ASSERT_TRUE(change.header->last_change.has_value());
  EXPECT_THAT(Ranks(change), ElementsAre(1));
  EXPECT_EQ(change.members[0].state, v1::DEAD);
}

TEST(MembershipTest, Join_RejoinWhileRunning_BumpsThenJoinsNewRound) {
  Membership m(2);
  JoinAll(m);
  // Only the holder (its credential) re-takes a live rank.
  EXPECT_EQ(m.Join("intruder", "h", 1, kT0, "j").status().code(), absl::StatusCode::kAlreadyExists);
  absl::StatusOr<Membership::JoinResult> j = m.Join("w1-restarted", "h", 1, kT0, "j", "c1");
  ASSERT_TRUE(j.ok());
  EXPECT_TRUE(j->change.generation_changed);
  EXPECT_EQ(j->rank, 1);
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.round_size(), 1);
  EXPECT_FALSE(m.InRound(0));
}

TEST(MembershipTest, Join_RunningWithoutRank_FailedPreconditionForStranger) {
  Membership m(2);
  JoinAll(m);
  absl::StatusOr<Membership::JoinResult> j = m.Join("stranger", "h", std::nullopt, kT0, "j");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(j.status().message()), HasSubstr("re-joins by naming its rank"));
}

TEST(MembershipTest, Join_TakenRank_AlreadyExists_SameWorkerWasInRound) {
  Membership m(3);
  ASSERT_TRUE(m.Join("a", "h", 0, kT0, "j").ok());
  EXPECT_EQ(m.Join("b", "h", 0, kT0, "j").status().code(), absl::StatusCode::kAlreadyExists);
  absl::StatusOr<Membership::JoinResult> again = m.Join("a", "h", 0, kT0, "j");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->was_in_round);
  EXPECT_EQ(m.round_size(), 1);
}

// A Join waiting in an assembling round was superseded by any Join naming its worker id (read
// from GetJob or WatchJob), which took its rank. A Join that sent a nonce is retried only with
// it; a seat taken without one (an older client) is still retried by the worker id.
TEST(MembershipTest, Join_AssemblingRoundSeatTakenWithANonce_OnlyItsRetryTakesItAgain) {
  Membership m(3);
  ASSERT_TRUE(m.Join("a", "h", 0, kT0, "j", "", "", "nonce-a").ok());
  for (const std::string& nonce : {std::string(), std::string("nonce-x")}) {
    EXPECT_EQ(m.Join("a", "h", 0, kT0, "j", "", "", nonce).status().code(),
              absl::StatusCode::kAlreadyExists)
        << "nonce \"" << nonce << "\"";
  }
  absl::StatusOr<Membership::JoinResult> other = m.Join("a", "h", std::nullopt, kT0, "j");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->rank, 1) << "a Join without the nonce took the waiting seat";
  absl::StatusOr<Membership::JoinResult> again = m.Join("a", "h", 0, kT0, "j", "", "", "nonce-a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->was_in_round);
  absl::StatusOr<Membership::JoinResult> unasked =
      m.Join("a", "h", std::nullopt, kT0, "j", "", "", "nonce-a");
  ASSERT_TRUE(unasked.ok()) << unasked.status();
  EXPECT_EQ(unasked->rank, 0);
}

TEST(MembershipTest, Withdraw_FreesRank_RemovalWrittenWithTheNextChange) {
  RecordingWriter w;
  Membership m(4, 0, w.writer());
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(m.Join(std::string(1, static_cast<char>('a' + r)), "h", r, kT0, "j").ok());
  }
  m.Withdraw(0);
  EXPECT_EQ(m.round_size(), 2);
  EXPECT_FALSE(m.member(0).present());
  EXPECT_TRUE(w.written.empty());
  // A Join into the assembling round writes nothing, the removal included.
  absl::StatusOr<Membership::JoinResult> d = m.Join("d", "h", 3, kT0, "j");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->change.changes_hard_state());
  EXPECT_TRUE(w.written.empty());
  // The next change that writes anything carries it.
  absl::StatusOr<Membership::LeaveResult> l = m.Leave(1, "rank 1 left", kT0, "j");
  ASSERT_TRUE(l.ok());
  ASSERT_THAT(Ranks(l->change), ElementsAre(0, 1));
  EXPECT_TRUE(l->change.members[0].worker_id.empty());  // removed
  EXPECT_EQ(l->change.members[1].state, v1::LEFT);
  ASSERT_EQ(w.written.size(), 1u);
  absl::StatusOr<Membership::JoinResult> j = m.Join("e", "h", std::nullopt, kT0, "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->rank, 0);
  EXPECT_FALSE(j->change.changes_hard_state());
}

// A Join that names no rank: its own rank again (a retry, or a survivor of an earlier
// generation), else the lowest free one, also after ranks below those taken were freed.
TEST(MembershipTest, Join_NoRank_OwnRankElseLowestFree_AfterWithdrawLeaveAndBump) {
  RecordingWriter w;
  Membership m(6, 0, w.writer());
  const auto join = [&](const std::string& worker) {
    absl::StatusOr<Membership::JoinResult> j = m.Join(worker, "h", std::nullopt, kT0, "j");
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? j->rank : -1;
  };
  EXPECT_EQ(join("a"), 0);
  EXPECT_EQ(join("b"), 1);
  EXPECT_EQ(join("c"), 2);
  EXPECT_EQ(join("b"), 1);  // a retry keeps its rank
  m.Withdraw(1);
  EXPECT_EQ(join("d"), 1);
  EXPECT_EQ(join("e"), 3);
  ASSERT_TRUE(m.Leave(0, "rank 0 left", kT0, "j").ok());
  EXPECT_EQ(join("f"), 0);
  EXPECT_EQ(join("g"), 4);
  // The Join that completes the round is written; when that fails the round is as it was, and
  // the rank it took is free again.
  w.fail = absl::UnavailableError("disk full");
  EXPECT_FALSE(m.Join("h", "h", std::nullopt, kT0, "j").ok());
  w.fail = absl::OkStatus();
  EXPECT_EQ(m.round_size(), 5);
  EXPECT_EQ(join("i"), 5);
  EXPECT_EQ(m.state(), v1::RUNNING);
  // A death moves the generation on (a strict job): every rank is free again; a worker that
  // names none finds its old rank back, anyone else the lowest free one.
  ASSERT_TRUE(m.Die({3}, "rank 3 died", kT0).ok());
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(join("d"), 1);
  EXPECT_EQ(join("x"), 0);  // rank 0's member "f" has not come back yet
  EXPECT_EQ(join("f"), 2);  // its rank taken: the lowest free one
  EXPECT_EQ(join("c"), 3);  // likewise (rank 2 was its own)
  EXPECT_EQ(join("g"), 4);
}

TEST(MembershipTest, Leave_RunningThenAll_BumpsThenFinishes) {
  Membership m(2);
  JoinAll(m);
  absl::StatusOr<Membership::LeaveResult> l0 = m.Leave(0, "rank 0 left", kT0, "j");
  ASSERT_TRUE(l0.ok());
  EXPECT_TRUE(l0->left);
  EXPECT_TRUE(l0->change.generation_changed);
  EXPECT_FALSE(l0->change.finished);
  absl::StatusOr<Membership::LeaveResult> l1 = m.Leave(1, "rank 1 left", kT0, "j");
  ASSERT_TRUE(l1.ok());
  EXPECT_TRUE(l1->change.finished);
  EXPECT_FALSE(l1->change.generation_changed);
  EXPECT_EQ(m.state(), v1::FINISHED);
  EXPECT_EQ(m.Join("w0", "h", 0, kT0, "j").status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<Membership::LeaveResult> again = m.Leave(1, "rank 1 left", kT0, "j");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->left);
}

TEST(MembershipTest, Leave_NeverJoined_FailedPrecondition) {
  Membership m(2);
  EXPECT_EQ(m.Leave(1, "x", kT0, "j").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MembershipTest, Leave_PendingRound_FreesRankWithoutBump) {
  Membership m(3);
  ASSERT_TRUE(m.Join("a", "h", 0, kT0, "j").ok());
  ASSERT_TRUE(m.Join("b", "h", 1, kT0, "j").ok());
  absl::StatusOr<Membership::LeaveResult> l = m.Leave(0, "rank 0 left", kT0, "j");
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(l->left_pending_round);
  EXPECT_FALSE(l->change.generation_changed);
  EXPECT_EQ(m.generation(), 1);
  EXPECT_EQ(m.round_size(), 1);
}

TEST(MembershipTest, Restore_ContinuesGenerationAndRound) {
  Membership m(2);
  JoinAll(m);
  ASSERT_TRUE(m.Die({0}, "rank 0 heartbeat timeout", kT0).ok());
  ASSERT_TRUE(m.Join("w0", "h", 0, kT0, "j").ok());
  ASSERT_TRUE(m.Join("w1", "h", 1, kT0, "j").ok());
  ASSERT_EQ(m.generation(), 2);
  ASSERT_EQ(m.state(), v1::RUNNING);

  // What a store would hold: the header and every member.
  MembershipHeader header;
  header.state = m.state();
  header.generation = m.generation();
  header.last_change = m.last_change();
  std::vector<Member> members;
  for (int32_t r = 0; r < 2; ++r) members.push_back(m.member(r));
  RecordingWriter w;
  Membership restored(2, 0, w.writer());
  const absl::Time later = kT0 + absl::Minutes(5);
  restored.Restore(header, members, later);
  EXPECT_EQ(restored.state(), v1::RUNNING);
  EXPECT_EQ(restored.generation(), 2);
  EXPECT_EQ(restored.round_size(), 2);
  EXPECT_EQ(restored.member(1).last_heartbeat, later);
  EXPECT_TRUE(restored.Stale(later + absl::Seconds(1), absl::Seconds(3)).empty());
  EXPECT_TRUE(w.written.empty());
  // Numbering continues: the next change is generation 3, never 2 again.
  EXPECT_EQ(restored.Die({1}, "x", later).value().old_generation, 2);
  EXPECT_EQ(restored.generation(), 3);
}

// Stale() skips its scan until the earliest member can expire; the skip never hides a death,
// also not one that a broken stream brings forward.
TEST(MembershipTest, Stale_SkippedScansStillFindEveryExpiry) {
  Membership m(3);
  JoinAll(m);
  const absl::Duration timeout = absl::Seconds(3), grace = absl::Milliseconds(500);
  EXPECT_TRUE(m.Stale(kT0 + absl::Seconds(1), timeout, grace).empty());
  m.Heartbeat(1, 1, 0, kT0 + absl::Seconds(2));
  m.Heartbeat(2, 1, 0, kT0 + absl::Seconds(2));
  EXPECT_TRUE(m.Stale(kT0 + absl::Seconds(2), timeout, grace).empty());
  m.StreamLost(2, kT0 + absl::Milliseconds(2100));
  EXPECT_THAT(m.Stale(kT0 + absl::Milliseconds(2700), timeout, grace), ElementsAre(2));
  EXPECT_THAT(m.Stale(kT0 + absl::Milliseconds(3100), timeout, grace), ElementsAre(0, 2));
}

// A rank of a round that was assembling when an older coordinator stored it had no answered
// Join: restored, it is nobody's (it came back as a ghost member that held the rank).
TEST(MembershipTest, Restore_AssemblingRoundRanks_AreFree) {
  Membership m(2);
  MembershipHeader header;
  header.state = v1::PENDING;
  header.generation = 2;
  Member pending{0, "w0", "h", v1::ALIVE, 2, 2, "", -1};
  Member dead{1, "w1", "h", v1::DEAD, 1, 1, "", -1};
  m.Restore(header, {pending, dead}, kT0);
  EXPECT_EQ(m.round_size(), 0);
  EXPECT_FALSE(m.member(0).present());
  EXPECT_TRUE(m.member(1).present());
  absl::StatusOr<Membership::JoinResult> j = m.Join("someone-else", "h", 0, kT0, "j");
  ASSERT_TRUE(j.ok()) << j.status();
}

// A change takes effect only once its writer accepted it: a rejected one fails the operation
// with the writer's error and leaves the membership exactly as before.
TEST(MembershipTest, Die_WriterFails_ErrorAndNothingChanged_ThenWrittenOnRetry) {
  RecordingWriter w;
  Membership m(2, 0, w.writer());
  JoinAll(m);
  w.fail = absl::UnavailableError("disk full");
  absl::StatusOr<MembershipChange> died = m.Die({1}, "rank 1 heartbeat timeout", kT0);
  EXPECT_EQ(died.status(), w.fail);
  EXPECT_EQ(m.generation(), 1);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 2);
  EXPECT_EQ(m.member(1).state, v1::ALIVE);
  EXPECT_EQ(m.member(1).generation, 1);
  EXPECT_FALSE(m.last_change().has_value());
  w.fail = absl::OkStatus();
  died = m.Die({1}, "rank 1 heartbeat timeout", kT0);
  ASSERT_TRUE(died.ok()) << died.status();
  EXPECT_EQ(died->old_generation, 1);  // the generation was not issued by the refused one
  EXPECT_EQ(m.generation(), 2);
  ASSERT_EQ(w.written.size(), 2u);  // the round's completion, then the death
  EXPECT_THAT(Ranks(w.written[1]), ElementsAre(1));
}

// A refused completion leaves the round assembling without the last rank; its retry completes
// it as a first Join (no re-join that would move the generation).
TEST(MembershipTest, Join_CompletionRefused_RoundStillAssembling_RetryCompletes) {
  RecordingWriter w;
  Membership m(2, 0, w.writer());
  ASSERT_TRUE(m.Join("w0", "h", 0, kT0, "j").ok());
  w.fail = absl::UnavailableError("read-only");
  absl::StatusOr<Membership::JoinResult> refused =
      m.Join("w1", "h", 1, kT0 + absl::Seconds(1), "j");
  EXPECT_EQ(refused.status(), w.fail);
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(m.round_size(), 1);
  EXPECT_FALSE(m.member(1).present());
  EXPECT_EQ(m.member(0).last_heartbeat, kT0);
  w.fail = absl::OkStatus();
  absl::StatusOr<Membership::JoinResult> retried =
      m.Join("w1", "h", 1, kT0 + absl::Seconds(2), "j");
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_TRUE(retried->change.world_complete);
  EXPECT_FALSE(retried->change.generation_changed);
  EXPECT_EQ(m.generation(), 1);
  EXPECT_EQ(m.member(0).last_heartbeat, kT0 + absl::Seconds(2));
}

}  // namespace
}  // namespace modelavg::server
