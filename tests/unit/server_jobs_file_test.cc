// The --jobs_file parser: JSON and text format, and the errors for bad files.
#include "server/jobs_file.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

TEST(JobsFileTest, ParseJobsFile_JsonList_ParsesEveryJob) {
  auto jobs = ParseJobsFile(R"json({"jobs": [
      {"jobId": "a", "worldSize": 2, "mode": "PERIODIC", "levels": [{"period": 4, "groupSize": 2}]},
      {"job_id": "b", "world_size": 4, "warmup_steps": 10, "mode": "HIERARCHICAL",
       "levels": [{"period": 2, "group_size": 2}, {"period": 8, "group_size": 4}]}]})json",
                            "jobs.json");
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_EQ((*jobs)[1].job_id(), "b");
  EXPECT_EQ((*jobs)[1].levels(1).period(), 8);
}

TEST(JobsFileTest, ParseJobsFile_JsonArrayAndSingleSpec_Accepted) {
  auto array = ParseJobsFile(
      R"([{"job_id": "a", "world_size": 1, "mode": "PERIODIC", "levels": [{"period": 1, "group_size": 1}]}])",
      "f");
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->size(), 1u);
  auto single = ParseJobsFile(
      R"({"job_id": "a", "world_size": 1, "mode": "PERIODIC", "levels": [{"period": 1, "group_size": 1}]})",
      "f");
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ((*single)[0].job_id(), "a");
}

TEST(JobsFileTest, ParseJobsFile_TextFormat_Parses) {
  auto jobs = ParseJobsFile(R"pb(
    # two jobs
    jobs { job_id: "a" world_size: 2 mode: PERIODIC levels { period: 4 group_size: 2 } }
    jobs { job_id: "b" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 } }
  )pb",
                            "jobs.textproto");
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ(jobs->size(), 2u);
}

// A level's outer optimizer (DiLoCo) in both formats; a bad one names the job and the field.
TEST(JobsFileTest, ParseJobsFile_OuterLevel_ParsesAndValidates) {
  auto jobs = ParseJobsFile(R"json({"jobs": [{"job_id": "d", "world_size": 2, "mode": "PERIODIC",
      "levels": [{"period": 8, "group_size": 2,
                  "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": true}}]}]})json",
                            "jobs.json");
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_TRUE((*jobs)[0].levels(0).has_outer());
  EXPECT_EQ((*jobs)[0].levels(0).outer().lr(), 0.7);
  EXPECT_TRUE((*jobs)[0].levels(0).outer().nesterov());
  auto bad = ParseJobsFile(R"pb(
    jobs { job_id: "bad" world_size: 2 mode: PERIODIC
           levels { period: 8 group_size: 2 outer { lr: 0.7 momentum: 1 } } }
  )pb",
                           "jobs.textproto");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("bad"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("levels[0].outer.momentum"));
}

TEST(JobsFileTest, ParseJobsFile_WrongJsonType_InvalidArgumentNamingFile) {
  auto jobs = ParseJobsFile(R"({"jobs": [{"job_id": "a", "world_size": "two"}]})", "jobs.json");
  ASSERT_EQ(jobs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(jobs.status().message()), HasSubstr("jobs.json"));
}

TEST(JobsFileTest, ParseJobsFile_Garbage_InvalidArgument) {
  EXPECT_EQ(ParseJobsFile("jobs { job_id: ", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseJobsFile("{not json", "f").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseJobsFile(R"({"jobs": [], "extra": 1})", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JobsFileTest, ParseJobsFile_InvalidSpecOrDuplicate_InvalidArgumentNamingJob) {
  auto bad = ParseJobsFile(R"pb(jobs { job_id: "a" world_size: 3 mode: PERIODIC
                                       levels { period: 1 group_size: 2 } })pb",
                           "f");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("\"a\""));
  auto dup = ParseJobsFile(R"pb(
    jobs { job_id: "a" world_size: 1 mode: PERIODIC levels { period: 1 group_size: 1 } }
    jobs { job_id: "a" world_size: 1 mode: PERIODIC levels { period: 1 group_size: 1 } })pb",
                           "f");
  ASSERT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dup.status().message()), HasSubstr("twice"));
}

}  // namespace
}  // namespace modelavg::server
