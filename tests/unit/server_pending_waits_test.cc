// PendingWaits: what each Take takes, in arrival order, also with a world of waits pending.
#include "server/job/pending_waits.h"

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace modelavg::server {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

JoinWait Join(WaitId id, int32_t rank, absl::Time deadline, bool for_replica = false) {
  JoinWait w;
  w.id = id;
  w.rank = rank;
  w.deadline = deadline;
  w.for_replica = for_replica;
  return w;
}

CommIdWait CommId(WaitId id, CommKey key, absl::Time deadline) {
  CommIdWait w;
  w.id = id;
  w.key = std::move(key);
  w.deadline = deadline;
  return w;
}

std::vector<WaitId> Ids(const std::vector<JoinWait>& waits) {
  std::vector<WaitId> ids;
  for (const JoinWait& w : waits) ids.push_back(w.id);
  return ids;
}

std::vector<WaitId> Ids(const std::vector<CommIdWait>& waits) {
  std::vector<WaitId> ids;
  for (const CommIdWait& w : waits) ids.push_back(w.id);
  return ids;
}

TEST(PendingWaitsTest, TakeJoinOfRank_TheEarliestOfThatRank) {
  PendingWaits waits;
  waits.AddJoin(Join(1, 5, kT0));
  waits.AddJoin(Join(2, 3, kT0));
  waits.AddJoin(Join(3, 5, kT0));
  EXPECT_FALSE(waits.TakeJoinOfRank(4).has_value());
  EXPECT_EQ(waits.TakeJoinOfRank(5)->id, 1u);
  EXPECT_EQ(waits.TakeJoinOfRank(5)->id, 3u);
  EXPECT_FALSE(waits.TakeJoinOfRank(5).has_value());
  EXPECT_EQ(waits.size(), 1u);
}

TEST(PendingWaitsTest, TakeJoinById_AndTakeCommIdById) {
  PendingWaits waits;
  waits.AddJoin(Join(7, 0, kT0));
  waits.AddCommId(CommId(8, CommKey{0, 0, "k"}, kT0));
  EXPECT_FALSE(waits.TakeJoin(8).has_value());
  EXPECT_FALSE(waits.TakeCommId(7).has_value());
  EXPECT_EQ(waits.TakeJoin(7)->rank, 0);
  EXPECT_EQ(std::get<2>(waits.TakeCommId(8)->key), "k");
  EXPECT_EQ(waits.size(), 0u);
}

TEST(PendingWaitsTest, TakeExpired_DueOnesInArrivalOrder) {
  PendingWaits waits;
  waits.AddJoin(Join(1, 0, kT0 + absl::Seconds(3)));
  waits.AddJoin(Join(2, 1, kT0 + absl::Seconds(1)));
  waits.AddJoin(Join(3, 2, kT0 + absl::Seconds(2)));
  waits.AddJoin(Join(4, 3, absl::InfiniteFuture()));
  EXPECT_TRUE(waits.TakeExpiredJoins(kT0).empty());
  EXPECT_EQ(Ids(waits.TakeExpiredJoins(kT0 + absl::Seconds(2))), (std::vector<WaitId>{2, 3}));
  EXPECT_EQ(Ids(waits.TakeExpiredJoins(kT0 + absl::Seconds(9))), (std::vector<WaitId>{1}));
  EXPECT_EQ(waits.size(), 1u);
  waits.AddCommId(CommId(5, CommKey{0, 1, "a"}, kT0 + absl::Seconds(1)));
  waits.AddCommId(CommId(6, CommKey{0, 1, "a"}, kT0));
  EXPECT_EQ(Ids(waits.TakeExpiredCommIds(kT0 + absl::Seconds(1))),
            (std::vector<WaitId>{5, 6}));
}

TEST(PendingWaitsTest, TakeRoundJoins_LeavesReplicaWaitsInOrder) {
  PendingWaits waits;
  waits.AddJoin(Join(1, 0, kT0));
  waits.AddJoin(Join(2, 1, kT0, /*for_replica=*/true));
  waits.AddJoin(Join(3, 2, kT0));
  waits.AddJoin(Join(4, 3, kT0, /*for_replica=*/true));
  EXPECT_EQ(Ids(waits.TakeRoundJoins()), (std::vector<WaitId>{1, 3}));
  EXPECT_TRUE(waits.TakeRoundJoins().empty());
  // The replica waits are still found by rank, id and deadline.
  EXPECT_EQ(waits.TakeJoinOfRank(3)->id, 4u);
  EXPECT_EQ(Ids(waits.TakeAllJoins()), (std::vector<WaitId>{2}));
  EXPECT_TRUE(waits.TakeExpiredJoins(absl::InfiniteFuture()).empty());
}

TEST(PendingWaitsTest, TakeCommIds_ThoseOfTheKeyInArrivalOrder) {
  PendingWaits waits;
  waits.AddCommId(CommId(1, CommKey{0, 1, "a"}, kT0));
  waits.AddCommId(CommId(2, CommKey{0, 2, "a"}, kT0));
  waits.AddCommId(CommId(3, CommKey{0, 1, "a"}, kT0));
  waits.AddCommId(CommId(4, CommKey{0, 1, "b"}, kT0));
  EXPECT_EQ(Ids(waits.TakeCommIds(CommKey{0, 1, "a"})), (std::vector<WaitId>{1, 3}));
  EXPECT_TRUE(waits.TakeCommIds(CommKey{0, 1, "a"}).empty());
  EXPECT_EQ(Ids(waits.TakeAllCommIds()), (std::vector<WaitId>{2, 4}));
  EXPECT_EQ(waits.size(), 0u);
}

TEST(PendingWaitsTest, AWorldOfJoins_EachOperationLogarithmic) {
  // 2^16 Joins, a staleness check (nothing due) after each 64, then the round completes: what
  // the indexes must keep right at a size where a scan per operation would show.
  constexpr int kWorld = 1 << 16;
  PendingWaits waits;
  for (int r = 0; r < kWorld; ++r) {
    waits.AddJoin(Join(r + 1, r, kT0 + absl::Seconds(60) + absl::Milliseconds(r)));
    if (r % 64 == 0) EXPECT_TRUE(waits.TakeExpiredJoins(kT0 + absl::Seconds(59)).empty());
  }
  EXPECT_EQ(waits.TakeJoinOfRank(kWorld / 2)->id, static_cast<WaitId>(kWorld / 2 + 1));
  EXPECT_EQ(waits.TakeRoundJoins().size(), static_cast<size_t>(kWorld - 1));
  EXPECT_EQ(waits.size(), 0u);
}

}  // namespace
}  // namespace modelavg::server
