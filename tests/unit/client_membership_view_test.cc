// How a rank reads its membership from the coordinator's Job (membership_view.h), with sharded
// replicas: a replica retired by a death is no view but a replica-lost reason naming the replica
// and the lost rank; a mate of a rank that left in order still averages the steps before the
// leaver's next step (its `until`).
#include "modelavg/client/membership_view.h"

#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

v1::Job JobOf(const std::string& text) {
  v1::Job job;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &job)) << text;
  return job;
}

// 4 ranks in replicas of 2, generation 2: replica 1 (ranks 2, 3) lost rank 3.
std::string Members(const std::string& rank2, const std::string& rank3) {
  return "spec { job_id: 'j' world_size: 4 replica_size: 2 min_world_size: 2 } state: RUNNING "
         "generation: 2 "
         "members { rank: 0 worker_id: 'w0' state: ALIVE generation: 2 admitted_step: -1 } "
         "members { rank: 1 worker_id: 'w1' state: ALIVE generation: 2 admitted_step: -1 } "
         "members { rank: 2 worker_id: 'w2' " + rank2 + " } "
         "members { rank: 3 worker_id: 'w3' " + rank3 + " }";
}

ViewReader Reader(int32_t rank) {
  return ViewReader{rank, "w" + std::to_string(rank), 4, absl::Seconds(2), 2};
}

TEST(MembershipViewTest, ReplicaRetiredByADeath_NoViewReasonNamesReplicaAndLostRank) {
  const v1::Job job = JobOf(Members(
      "state: RETIRED generation: 1 admitted_step: -1 retired_by: 3 retired_at_step: 0",
      "state: DEAD generation: 1 admitted_step: -1"));
  std::string why;
  int32_t retired_by = -1;
  EXPECT_FALSE(ViewOf(job, Reader(2), &why, &retired_by).has_value());
  EXPECT_EQ(retired_by, 3);
  EXPECT_THAT(why, HasSubstr("replica 1 (ranks 2..3) of job j was retired because its rank 3 "
                             "died or failed: rank 2 cannot average a partial replica"));
  // The other replica reads a view without ranks 2 and 3.
  std::optional<MembershipView> view = ViewOf(job, Reader(0), &why, &retired_by);
  ASSERT_TRUE(view.has_value()) << why;
  EXPECT_EQ(retired_by, -1);
  EXPECT_TRUE(view->live[1]);
  EXPECT_FALSE(view->live[2]);
  EXPECT_FALSE(view->live[3]);
  EXPECT_EQ(view->until[0], std::numeric_limits<int64_t>::max());
}

TEST(MembershipViewTest, MateOfAnOrderlyLeaver_AveragesUntilTheLeaversNextStep) {
  const v1::Job job = JobOf(Members(
      "state: RETIRED generation: 1 admitted_step: -1 retired_by: 3 retired_at_step: 40",
      "state: LEFT generation: 1 admitted_step: -1"));
  std::string why;
  int32_t retired_by = -1;
  std::optional<MembershipView> mine = ViewOf(job, Reader(2), &why, &retired_by);
  ASSERT_TRUE(mine.has_value()) << why;
  EXPECT_EQ(retired_by, 3);
  EXPECT_TRUE(mine->live[2]);
  EXPECT_EQ(mine->until[2], 40);
  EXPECT_FALSE(mine->live[3]);
  EXPECT_EQ(mine->retired_by, 3);
  EXPECT_THAT(mine->retired_why, HasSubstr("because its rank 3 left"));
  // Its peers count it a member until then too.
  std::optional<MembershipView> peer = ViewOf(job, Reader(0), &why);
  ASSERT_TRUE(peer.has_value()) << why;
  EXPECT_TRUE(peer->live[2]);
  EXPECT_EQ(peer->until[2], 40);
}

}  // namespace
}  // namespace modelavg::client
