// The coordinator cut off from its members: when every member of a running job falls silent at
// once and none of their connections broke, nobody is declared dead (the coordinator's own
// network is the likelier fault); a member that does not come back after the others do is.
// One member silent alone is declared dead as before.
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/store/state_store.h"
#include "tests/unit/running_job_fixture.h"

namespace modelavg::server {
namespace {

class SilentMembersTest : public RunningJobTest {
 protected:
  SilentMembersTest() : RunningJobTest("s") {}
  void Beat(Job& job, int rank) { RunningJobTest::Beat(job, rank, 5); }
};

TEST_F(SilentMembersTest, AllSilentTogether_NobodyDeclaredDead_UntilOneStaysAway) {
  std::shared_ptr<Job> job = RunningJob("");
  ASSERT_EQ(State(*job).state(), v1::RUNNING);
  // Three times the heartbeat timeout without a beat from anyone.
  for (int i = 0; i < 12; ++i) {
    clock_.Advance(absl::Milliseconds(500));
    job->CheckStaleness();
  }
  EXPECT_EQ(State(*job).generation(), 1);
  EXPECT_EQ(State(*job).state(), v1::RUNNING);
  // Three come back; rank 3 does not: once the others beat again it is declared dead.
  for (int i = 0; i < 12; ++i) {
    for (int r = 0; r < 3; ++r) Beat(*job, r);
    clock_.Advance(absl::Milliseconds(500));
    job->CheckStaleness();
  }
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_NE(state.last_change().reason().find("rank 3"), std::string::npos)
      << state.last_change().reason();
}

TEST_F(SilentMembersTest, AllSilentLongerThanTheBound_DeclaredDead) {
  std::shared_ptr<Job> job = RunningJob("");
  // A whole job killed at once (no stream to break) is not ridden through forever: three
  // heartbeat timeouts after the silence was noticed, the silent are declared dead as usual.
  for (int i = 0; i < 24; ++i) {
    clock_.Advance(absl::Milliseconds(500));
    job->CheckStaleness();
  }
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.state(), v1::PENDING);
  EXPECT_NE(state.last_change().reason().find("heartbeat timeout"), std::string::npos)
      << state.last_change().reason();
}

TEST_F(SilentMembersTest, OneSilent_DeclaredDeadAfterTheTimeout) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 3");
  for (int i = 0; i < 6; ++i) {
    for (int r = 0; r < 3; ++r) Beat(*job, r);
    clock_.Advance(absl::Milliseconds(500));
    job->CheckStaleness();
  }
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 3);
}

}  // namespace
}  // namespace modelavg::server
