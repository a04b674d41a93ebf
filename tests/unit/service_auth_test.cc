// The worker token file (--worker_token_file) and what a token limited to some jobs may name.
#include "server/rpc/service_auth.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(WorkerTokenFileTest, OldFileOfOneToken_EveryJob) {
  absl::StatusOr<std::vector<WorkerToken>> tokens = ParseWorkerTokenFile("s3cret\n", "w");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 1u);
  EXPECT_EQ((*tokens)[0].token, "s3cret");
  EXPECT_THAT((*tokens)[0].jobs, IsEmpty());
}

TEST(WorkerTokenFileTest, TokensWithJobs_CommentsAndBlankLinesSkipped) {
  absl::StatusOr<std::vector<WorkerToken>> tokens = ParseWorkerTokenFile(
      "# trainers\n\n  tok-a   job-a\ntok-b\tjob-b, team-*,job.c\ntok-all\n", "w");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 3u);
  EXPECT_EQ((*tokens)[0].token, "tok-a");
  EXPECT_THAT((*tokens)[0].jobs, ElementsAre("job-a"));
  EXPECT_THAT((*tokens)[1].jobs, ElementsAre("job-b", "team-*", "job.c"));
  EXPECT_THAT((*tokens)[2].jobs, IsEmpty());
}

TEST(WorkerTokenFileTest, Malformed_InvalidArgumentNamingFileAndLine) {
  struct Case {
    std::string text, message;
  };
  for (const Case& c : std::vector<Case>{
           {"", "holds no token"},
           {"# only a comment\n", "holds no token"},
           {"a job-a\nb job/x\n", "w line 2: \"job/x\" is neither a job id"},
           {"a job-a\nb *\n", "w line 2: \"*\" is not a job pattern"},
           {"a ,\n", "w line 1: no job after the token"},
           {"a job-a\na job-b\n", "w line 2: this token is on an earlier line too"},
       }) {
    absl::StatusOr<std::vector<WorkerToken>> tokens = ParseWorkerTokenFile(c.text, "w");
    ASSERT_FALSE(tokens.ok()) << c.text;
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(tokens.status().message()), HasSubstr(c.message)) << c.text;
  }
}

TEST(CallerTest, LimitedToken_MayUseItsJobsAndPrefixesOnly) {
  const WorkerToken limited{"t", {"job-a", "team-*"}};
  const Caller caller(Role::kWorker, &limited);
  EXPECT_TRUE(caller.MayUse("job-a"));
  EXPECT_TRUE(caller.MayUse("team-x"));
  EXPECT_TRUE(caller.MayUse("team-"));
  EXPECT_FALSE(caller.MayUse("job-ab"));
  EXPECT_FALSE(caller.MayUse("job-b"));
  EXPECT_FALSE(caller.MayUse("tea"));
  const absl::Status s = caller.CheckJob("job-b", "Join");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("Join of job job-b"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("limited to job(s) job-a, team-*"));
  const WorkerToken every{"u", {}};
  EXPECT_TRUE(Caller(Role::kWorker, &every).MayUse("job-b"));
  EXPECT_TRUE(Caller(Role::kOperator, nullptr).MayUse("job-b"));
}

}  // namespace
}  // namespace modelavg::server
