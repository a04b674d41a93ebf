#include "common/job_spec.h"

#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace modelavg {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::JobSpec Parse(const std::string& text) {
  v1::JobSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

TEST(JobSpecTest, ValidHierarchicalSpec_Converts) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(Parse(R"pb(
    job_id: "llm-7b.run_3" world_size: 8 warmup_steps: 10 mode: HIERARCHICAL
    levels { period: 2 group_size: 4 } levels { period: 8 group_size: 8 }
  )pb"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->world_size, 8);
  EXPECT_EQ(s->warmup_steps, 10);
  EXPECT_EQ(s->mode, AveragingMode::kHierarchical);
  ASSERT_EQ(s->levels.size(), 2u);
  EXPECT_EQ(s->levels[1].period, 8);
}

TEST(JobSpecTest, UnspecifiedMode_InvalidArgument) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(
      Parse(R"pb(job_id: "j" world_size: 2 levels { period: 2 group_size: 2 })pb"));
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("mode must be PERIODIC or HIERARCHICAL, got MODE_UNSPECIFIED"));
}

TEST(JobSpecTest, BadJobIds_InvalidArgument) {
  for (const std::string id : {std::string(""), std::string("has space"), std::string("a/b"),
                               std::string(kMaxJobIdLength + 1, 'x')}) {
    EXPECT_EQ(ValidateJobId(id).code(), absl::StatusCode::kInvalidArgument) << id;
  }
  EXPECT_TRUE(ValidateJobId("ok-id_1.2").ok());
}

TEST(JobSpecTest, BadTimeouts_InvalidArgumentNamingField) {
  v1::JobSpec spec = Parse(R"pb(
    job_id: "j" world_size: 2 mode: PERIODIC levels { period: 2 group_size: 2 }
  )pb");
  spec.set_heartbeat_timeout_ms(-1);
  EXPECT_THAT(std::string(ScheduleSpecFromProto(spec).status().message()),
              HasSubstr("heartbeat_timeout_ms"));
  spec.set_heartbeat_timeout_ms(0);
  spec.set_join_timeout_ms(kMaxJoinTimeoutMs + 1);
  EXPECT_THAT(std::string(ScheduleSpecFromProto(spec).status().message()),
              HasSubstr("join_timeout_ms"));
}

TEST(JobSpecTest, ScheduleErrorsPassThrough) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(Parse(R"pb(
    job_id: "j" world_size: 6 mode: HIERARCHICAL
    levels { period: 2 group_size: 4 } levels { period: 4 group_size: 6 }
  )pb"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("does not divide world_size 6"));
}

TEST(JobSpecTest, DecisionRoundTrip) {
  Decision d;
  d.step = 42;
  d.average = true;
  d.level = 1;
  d.period = 4;
  d.subgroup = SubgroupRange{2, 4, 2};
  v1::StepDecision proto;
  DecisionToProto(d, 7, &proto);
  EXPECT_EQ(proto.action(), v1::AVERAGE);
  EXPECT_EQ(proto.generation(), 7);
  EXPECT_THAT(proto.ranks(), ElementsAre(4, 5));
  EXPECT_EQ(DecisionFromProto(proto), d);

  Decision skip;
  skip.step = 3;
  DecisionToProto(skip, 1, &proto);
  EXPECT_EQ(proto.action(), v1::SKIP);
  EXPECT_TRUE(proto.ranks().empty());
  EXPECT_EQ(DecisionFromProto(proto), skip);
}

}  // namespace
}  // namespace modelavg
