// Level.paced, Level.max_lag and Level.rounds in the job spec (docs/paced.md): each rule with its
// message, the conversion both ways, and JSON.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg {
namespace {

using ::modelavg::testing::SpecFromText;
using ::testing::HasSubstr;
using ::testing::Not;


// Pairs below a paced level of 4 ranks: two groups to pace.
const char* const kPairsUnderPaced = R"pb(
  job_id: "p" world_size: 4 mode: HIERARCHICAL
  levels { period: 4 group_size: 2 } levels { period: 32 group_size: 4 paced: true }
)pb";

std::string MessageOf(const v1::JobSpec& spec) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(s.status().message());
}

TEST(PacedSpecTest, PacedTopLevel_ConvertsBothWays) {
  v1::JobSpec spec = SpecFromText(kPairsUnderPaced);
  spec.set_min_world_size(2);
  spec.mutable_levels(1)->set_max_lag(3);
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->levels[0].paced);
  EXPECT_EQ(s->levels[0].max_lag, 0.0);
  EXPECT_TRUE(s->levels[1].paced);
  EXPECT_EQ(s->levels[1].max_lag, 3.0);
  EXPECT_EQ(PacedGroupSize(*s, 1), 2);
  v1::JobSpec back;
  ScheduleSpecToProto(*s, &back);
  EXPECT_FALSE(back.levels(0).paced());
  EXPECT_TRUE(back.levels(1).paced());
  EXPECT_EQ(back.levels(1).max_lag(), 3.0);
}

// An unpaced spec writes neither field: its bytes are what they were before the fields existed.
TEST(PacedSpecTest, UnpacedSpec_FieldsAbsentOnTheWire) {
  v1::JobSpec spec = SpecFromText(R"pb(
    job_id: "u" world_size: 4 mode: HIERARCHICAL
    levels { period: 4 group_size: 2 } levels { period: 32 group_size: 4 }
  )pb");
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  v1::JobSpec back;
  ScheduleSpecToProto(*s, &back);
  for (const v1::Level& l : back.levels()) {
    v1::Level without = l;
    without.clear_paced();
    without.clear_max_lag();
    EXPECT_EQ(l.SerializeAsString(), without.SerializeAsString());
  }
}

TEST(PacedSpecTest, ValidPacedSpec_Accepted) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(SpecFromText(kPairsUnderPaced));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->levels[1].paced);
}

TEST(PacedSpecTest, MaxLagInAStrictJob_RefusedNamingElastic) {
  v1::JobSpec spec = SpecFromText(kPairsUnderPaced);
  spec.mutable_levels(1)->set_max_lag(2);  // strict job
  EXPECT_THAT(MessageOf(spec), HasSubstr("elastic"));
}

// Level.rounds counts a paced job's length: only on the paced level, never negative.
TEST(PacedSpecTest, Rounds_OnlyOnThePacedLevelAndNotNegative) {
  v1::JobSpec spec = SpecFromText(kPairsUnderPaced);
  spec.mutable_levels(1)->set_rounds(5);
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->levels[1].rounds, 5);
  spec.mutable_levels(1)->set_rounds(-1);
  EXPECT_THAT(MessageOf(spec), HasSubstr("levels[1].rounds must be in [0, "));
  spec.mutable_levels(1)->set_rounds(0);
  spec.mutable_levels(0)->set_rounds(3);
  EXPECT_THAT(MessageOf(spec), HasSubstr("levels[0].rounds 3 needs levels[0].paced"));
}

TEST(PacedSpecTest, OnlyTheLastLevelMayBePaced) {
  v1::JobSpec spec = SpecFromText(kPairsUnderPaced);
  spec.mutable_levels(0)->set_paced(true);
  spec.mutable_levels(1)->set_paced(false);
  const std::string message = MessageOf(spec);
  EXPECT_THAT(message, HasSubstr("levels[0].paced"));
  EXPECT_THAT(message, HasSubstr("only the last level may be paced"));
  // Both paced: the lower one is refused the same way.
  spec.mutable_levels(1)->set_paced(true);
  EXPECT_THAT(MessageOf(spec), HasSubstr("levels[0].paced"));
}

// The paced level needs two groups at least: lower levels or replicas that lock the whole world
// together leave nothing to pace.
TEST(PacedSpecTest, OneGroupToPace_InvalidArgument) {
  const std::vector<std::string> one_group = {
      // A lower level over the whole world.
      R"pb(job_id: "o" world_size: 4 mode: HIERARCHICAL
           levels { period: 4 group_size: 4 } levels { period: 32 group_size: 4 paced: true })pb",
      // Lower groups of 4 and 6 chain all 12 ranks together.
      R"pb(job_id: "o" world_size: 12 mode: HIERARCHICAL
           levels { period: 2 group_size: 4 } levels { period: 3 group_size: 6 }
           levels { period: 12 group_size: 12 paced: true })pb",
      // One replica of the whole world.
      R"pb(job_id: "o" world_size: 4 replica_size: 4 mode: PERIODIC
           levels { period: 8 group_size: 4 paced: true })pb",
      // A world of one.
      R"pb(job_id: "o" world_size: 1 mode: PERIODIC
           levels { period: 8 group_size: 1 paced: true })pb",
  };
  for (const std::string& text : one_group) {
    const std::string message = MessageOf(SpecFromText(text));
    EXPECT_THAT(message, HasSubstr("one group to pace")) << text;
    EXPECT_THAT(message, HasSubstr("at least two")) << text;
  }
}

// PERIODIC (each rank, or each replica, a group of its own), sharded replicas under a lower
// level, and warm-up (round 0 step-locked at the level's first step) are all fine.
TEST(PacedSpecTest, PeriodicReplicasAndWarmup_Accepted) {
  const std::vector<std::string> ok = {
      R"pb(job_id: "a" world_size: 4 mode: PERIODIC levels { period: 8 group_size: 4 paced: true })pb",
      R"pb(job_id: "a" world_size: 8 replica_size: 2 mode: PERIODIC
           levels { period: 8 group_size: 8 paced: true })pb",
      R"pb(job_id: "a" world_size: 8 replica_size: 2 mode: HIERARCHICAL
           levels { period: 2 group_size: 4 } levels { period: 16 group_size: 8 paced: true })pb",
      R"pb(job_id: "a" world_size: 4 warmup_steps: 100 mode: HIERARCHICAL
           levels { period: 4 group_size: 2 } levels { period: 32 group_size: 4 paced: true })pb",
      // A streaming DiLoCo level, paced.
      R"pb(job_id: "a" world_size: 4 mode: PERIODIC
           levels { period: 32 group_size: 4 paced: true fragments: 4 sync_delay: 2
                    payload: INT8 error_feedback: 1 outer { lr: 0.7 momentum: 0.9 } })pb",
  };
  for (const std::string& text : ok) {
    absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(SpecFromText(text));
    EXPECT_TRUE(s.ok()) << text << ": " << s.status();
  }
}

TEST(PacedSpecTest, MaxLag_Rules) {
  struct Bad {
    std::string fields;  // of levels[1]
    int32_t min_world_size;
    std::vector<std::string> says;
  };
  const std::vector<Bad> bad = {
      {"paced: true max_lag: 0.5", 2, {"levels[1].max_lag", "[1, 1e+06]", "0.5"}},
      {"paced: true max_lag: -1", 2, {"levels[1].max_lag", "-1"}},
      {"paced: true max_lag: nan", 2, {"levels[1].max_lag", "nan"}},
      {"paced: true max_lag: inf", 2, {"levels[1].max_lag", "inf"}},
      {"paced: true max_lag: 2e6", 2, {"levels[1].max_lag", "2e+06"}},
      {"max_lag: 3", 2, {"levels[1].max_lag 3 needs levels[1].paced"}},
      {"paced: true max_lag: 3", 0, {"levels[1].max_lag 3", "needs an elastic job"}},
      {"paced: true max_lag: 3", 4, {"needs an elastic job"}},  // min = world: strict
  };
  for (const Bad& b : bad) {
    v1::JobSpec spec = SpecFromText(absl::StrCat(
        R"pb(job_id: "m" world_size: 4 mode: HIERARCHICAL levels { period: 4 group_size: 2 }
             levels { period: 32 group_size: 4 )pb",
        b.fields, " }"));
    spec.set_min_world_size(b.min_world_size);
    const std::string message = MessageOf(spec);
    for (const std::string& word : b.says) EXPECT_THAT(message, HasSubstr(word)) << b.fields;
  }
  // On a lower level max_lag is refused for the level not being paced.
  v1::JobSpec lower = SpecFromText(kPairsUnderPaced);
  lower.set_min_world_size(2);
  lower.mutable_levels(0)->set_max_lag(2);
  EXPECT_THAT(MessageOf(lower), HasSubstr("levels[0].max_lag 2 needs levels[0].paced"));
  // 1 and 1e6 are the bounds, both in.
  for (double lag : {1.0, 1e6}) {
    v1::JobSpec spec = SpecFromText(kPairsUnderPaced);
    spec.set_min_world_size(2);
    spec.mutable_levels(1)->set_max_lag(lag);
    EXPECT_TRUE(ScheduleSpecFromProto(spec).ok()) << lag;
  }
}

// The JSON spec (the jobs file, `modelavg create -f`) spells the fields paced and maxLag (or
// max_lag), and the gate refuses it there too.
TEST(PacedSpecTest, Json_ParsesBothFields) {
  for (const std::string lag : {"\"maxLag\": 2.5", "\"max_lag\": 2.5"}) {
    v1::JobSpec spec;
    const std::string json = absl::StrCat(
        R"({"jobId": "j", "worldSize": 4, "mode": "PERIODIC", "minWorldSize": 2,
            "levels": [{"period": 8, "groupSize": 4, "paced": true, )",
        lag, "}]}");
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &spec).ok()) << json;
    EXPECT_TRUE(spec.levels(0).paced());
    EXPECT_EQ(spec.levels(0).max_lag(), 2.5);
    EXPECT_TRUE(ScheduleSpecFromProto(spec).ok());
  }
}

// ValidatePacing on the schedule spec alone (what Schedule::Create checks).
TEST(PacedSpecTest, ScheduleCreate_ChecksThePacingRules) {
  ScheduleSpec spec{4, 0, AveragingMode::kHierarchical, {{4, 2}, {32, 4}}};
  spec.levels[1].paced = true;
  EXPECT_TRUE(Schedule::Create(spec).ok());
  spec.levels[0].paced = true;
  EXPECT_EQ(Schedule::Create(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace modelavg
