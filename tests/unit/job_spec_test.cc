#include "common/job_spec.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/common/payload.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg {
namespace {

using ::modelavg::testing::SpecFromText;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(JobSpecTest, ValidHierarchicalSpec_Converts) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(SpecFromText(R"pb(
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
      SpecFromText(R"pb(job_id: "j" world_size: 2 levels { period: 2 group_size: 2 })pb"));
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
  v1::JobSpec spec = SpecFromText(R"pb(
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

// heartbeat_timeout_ms=1 was accepted: every member of a running job was declared dead within
// 35 ms. Timeouts shorter than a real network meets are refused, saying why.
TEST(JobSpecTest, TimeoutsBelowWhatANetworkMeets_InvalidArgumentWithTheReason) {
  v1::JobSpec spec = SpecFromText(R"pb(
    job_id: "j" world_size: 2 mode: PERIODIC levels { period: 2 group_size: 2 }
  )pb");
  struct Bound {
    const char* field;
    int64_t least;
    void (v1::JobSpec::*set)(int64_t);
  };
  for (const Bound& b : {Bound{"heartbeat_timeout_ms", kMinHeartbeatTimeoutMs,
                               &v1::JobSpec::set_heartbeat_timeout_ms},
                         Bound{"join_timeout_ms", kMinJoinTimeoutMs,
                               &v1::JobSpec::set_join_timeout_ms}}) {
    for (int64_t ms : {int64_t{1}, b.least - 1}) {
      (spec.*b.set)(ms);
      const absl::Status s = ScheduleSpecFromProto(spec).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.field << " " << ms;
      EXPECT_THAT(std::string(s.message()),
                  HasSubstr(absl::StrCat(b.field, " is ", ms, "; it must be at least ", b.least)));
    }
    (spec.*b.set)(b.least);
    EXPECT_TRUE(ScheduleSpecFromProto(spec).ok()) << b.field;
  }
  spec.set_heartbeat_timeout_ms(1);
  EXPECT_THAT(std::string(ScheduleSpecFromProto(spec).status().message()),
              HasSubstr("members beat every 100 ms"));
}

TEST(JobSpecTest, ScheduleErrorsPassThrough) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(SpecFromText(R"pb(
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

TEST(JobSpecTest, OuterLevel_ConvertsBothWays) {
  v1::JobSpec spec = SpecFromText(R"pb(
    job_id: "diloco" world_size: 4 mode: HIERARCHICAL
    levels { period: 2 group_size: 2 }
    levels { period: 8 group_size: 4 outer { lr: 0.7 momentum: 0.9 nesterov: true } }
  )pb");
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->levels[0].outer.has_value());
  ASSERT_TRUE(s->levels[1].outer.has_value());
  EXPECT_EQ(s->levels[1].outer->lr, 0.7);
  EXPECT_EQ(s->levels[1].outer->momentum, 0.9);
  EXPECT_TRUE(s->levels[1].outer->nesterov);
  v1::JobSpec back;
  ScheduleSpecToProto(*s, &back);
  EXPECT_FALSE(back.levels(0).has_outer());
  ASSERT_TRUE(back.levels(1).has_outer());
  EXPECT_EQ(back.levels(1).outer().lr(), 0.7);
  EXPECT_TRUE(back.levels(1).outer().nesterov());
}

// lr 0, NaN, infinite; momentum 1 or negative; nesterov without momentum: each names its field.
TEST(JobSpecTest, BadOuter_InvalidArgumentNamingField) {
  struct Case {
    std::string outer;
    std::string field;
  };
  const Case cases[] = {
      {"lr: 0", "levels[1].outer.lr"},
      {"lr: -0.5", "levels[1].outer.lr"},
      {"lr: nan", "levels[1].outer.lr"},
      {"lr: inf", "levels[1].outer.lr"},
      {"lr: 0.7 momentum: 1", "levels[1].outer.momentum"},
      {"lr: 0.7 momentum: -0.1", "levels[1].outer.momentum"},
      {"lr: 0.7 momentum: nan", "levels[1].outer.momentum"},
      {"lr: 0.7 nesterov: true", "levels[1].outer.nesterov"},
      {"lr: 0.7 momentum: 0 nesterov: true", "levels[1].outer.nesterov"},
      // An empty outer {} has lr 0: refused rather than taken as "no outer".
      {"", "levels[1].outer.lr"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = SpecFromText(R"pb(
      job_id: "j" world_size: 4 mode: HIERARCHICAL levels { period: 2 group_size: 2 }
      levels { period: 4 group_size: 4 outer { )pb" + c.outer + R"pb( } }
    )pb");
    absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
    ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.outer;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.field)) << c.outer;
  }
  v1::JobSpec ok = SpecFromText(R"pb(
    job_id: "j" world_size: 2 mode: PERIODIC
    levels { period: 4 group_size: 2 outer { lr: 1 momentum: 0.5 nesterov: true } }
  )pb");
  EXPECT_TRUE(ScheduleSpecFromProto(ok).ok()) << ScheduleSpecFromProto(ok).status();
}

TEST(JobSpecTest, OuterDecision_SaysSoAndRoundTrips) {
  absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(SpecFromText(R"pb(
    job_id: "j" world_size: 4 warmup_steps: 3 mode: HIERARCHICAL
    levels { period: 2 group_size: 2 outer { lr: 0.7 } } levels { period: 6 group_size: 4 }
  )pb"));
  ASSERT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<Schedule> schedule = Schedule::Create(*spec);
  ASSERT_TRUE(schedule.ok());
  EXPECT_TRUE(schedule->DecisionFor(4, 1).outer);
  EXPECT_FALSE(schedule->DecisionFor(6, 1).outer);  // level 1: plain
  EXPECT_FALSE(schedule->DecisionFor(5, 1).outer);  // SKIP
  EXPECT_EQ(schedule->FirstStepOf(0), 4);           // step 2 is in warm-up
  EXPECT_EQ(schedule->FirstStepOf(1), 6);
  v1::StepDecision proto;
  DecisionToProto(schedule->DecisionFor(4, 1), 3, &proto);
  EXPECT_TRUE(proto.outer());
  EXPECT_TRUE(DecisionFromProto(proto).outer);
  DecisionToProto(schedule->DecisionFor(6, 1), 3, &proto);
  EXPECT_FALSE(proto.outer());
}

// Every streaming field, sync_delay included, is fine in an elastic job as in a strict one.
TEST(JobSpecTest, SyncDelayInElasticJob_Accepted) {
  const std::string base = R"pb(job_id: "e" world_size: 4 mode: PERIODIC )pb";
  auto spec = [&](const std::string& fields, int min_world) {
    std::string text = absl::StrCat(base, "levels { period: 8 group_size: 4 fragments: 2 ",
                                    fields, " outer { lr: 0.7 momentum: 0.9 } }");
    if (min_world > 0) text += absl::StrCat(" min_world_size: ", min_world);
    return SpecFromText(text);
  };
  absl::StatusOr<ScheduleSpec> elastic = ScheduleSpecFromProto(spec("sync_delay: 1", 2));
  ASSERT_TRUE(elastic.ok()) << elastic.status();
  EXPECT_EQ(elastic->levels[0].sync_delay, 1);
  EXPECT_TRUE(ScheduleSpecFromProto(spec("sync_delay: 1", 4)).ok());  // min = world: strict
  EXPECT_TRUE(ScheduleSpecFromProto(spec("sync_delay: 1", 0)).ok());
  EXPECT_TRUE(ScheduleSpecFromProto(spec("payload: INT8 mix: 0.5", 2)).ok());
}

// JobSpec.replica_size: 0 and 1 are the unsharded job, bit for bit; anything else must divide
// world_size, every level's group size and an elastic job's min_world_size.
TEST(JobSpecTest, ReplicaSize_ZeroOrOneIsUnsharded_ConvertsBothWays) {
  v1::JobSpec spec = SpecFromText(R"pb(
    job_id: "s" world_size: 8 mode: HIERARCHICAL
    levels { period: 2 group_size: 4 } levels { period: 5 group_size: 8 }
  )pb");
  for (int s : {0, 1}) {
    spec.set_replica_size(s);
    absl::StatusOr<ScheduleSpec> out = ScheduleSpecFromProto(spec);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->replica_size, 1);
    v1::JobSpec back;
    ScheduleSpecToProto(*out, &back);
    EXPECT_EQ(back.replica_size(), 0);
  }
  spec.set_replica_size(2);
  absl::StatusOr<ScheduleSpec> out = ScheduleSpecFromProto(spec);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->replica_size, 2);
  v1::JobSpec back;
  ScheduleSpecToProto(*out, &back);
  EXPECT_EQ(back.replica_size(), 2);
}

TEST(JobSpecTest, BadReplicaSize_InvalidArgumentNamingFieldAndValues) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::string levels =
      "mode: HIERARCHICAL levels { period: 2 group_size: 4 } levels { period: 5 group_size: 8 }";
  const std::vector<Case> cases = {
      {"world_size: 8 replica_size: -1 " + levels, "replica_size must be >= 0"},
      {"world_size: 8 replica_size: 3 " + levels, "replica_size 3 does not divide world_size 8"},
      {"world_size: 8 replica_size: 8 " + levels,
       "replica_size 8 does not divide levels[0].group_size 4"},
      {"world_size: 8 replica_size: 2 min_world_size: 5 " + levels,
       "replica_size 2 does not divide min_world_size 5"},
      {"world_size: 12 replica_size: 4 mode: PERIODIC levels { period: 2 group_size: 12 } "
       "min_world_size: 6",
       "replica_size 4 does not divide min_world_size 6"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ScheduleSpec> s =
        ScheduleSpecFromProto(SpecFromText("job_id: \"j\" " + c.text));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.message)) << c.text;
  }
  // An elastic job whose min_world_size is a whole number of replicas, and a strict one.
  EXPECT_TRUE(ScheduleSpecFromProto(
                  SpecFromText("job_id: \"j\" world_size: 8 replica_size: 2 min_world_size: 4 " +
                               levels))
                  .ok());
  EXPECT_TRUE(ScheduleSpecFromProto(
                  SpecFromText("job_id: \"j\" world_size: 8 replica_size: 4 " + levels))
                  .ok());
}

TEST(JobSpecTest, ShardedDecision_ListsTheShardsRanksAndRoundTrips) {
  ScheduleSpec spec{8, 0, AveragingMode::kHierarchical, {{2, 4}, {5, 8}}};
  spec.replica_size = 2;
  absl::StatusOr<Schedule> schedule = Schedule::Create(spec);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  const Decision d = schedule->DecisionFor(2, 7);
  v1::StepDecision proto;
  DecisionToProto(d, 4, &proto);
  EXPECT_EQ(proto.subgroup(), 3);
  EXPECT_THAT(proto.ranks(), ElementsAre(5, 7));
  EXPECT_THAT(proto.members(), ElementsAre(5, 7));
  const Decision back = DecisionFromProto(proto);
  EXPECT_EQ(back, d);
  EXPECT_EQ(back.subgroup.stride, 2);
  EXPECT_THAT(back.Members(), ElementsAre(5, 7));
  DecisionToProto(schedule->DecisionFor(5, 2), 4, &proto);
  EXPECT_THAT(proto.ranks(), ElementsAre(0, 2, 4, 6));
  EXPECT_EQ(DecisionFromProto(proto), schedule->DecisionFor(5, 2));
}

// Error feedback and the 4-bit and top-k payloads: accepted where the rule applies, round-trip
// through the proto; INVALID_ARGUMENT naming the field and the value otherwise.
// kPayloads (include/modelavg/common/payload.h) and the proto's enum Payload name the same
// encodings the same way: every proto value has the row of its number and name, and back.
TEST(JobSpecTest, PayloadTable_MatchesTheProtoEnum) {
  const google::protobuf::EnumDescriptor* e = v1::Payload_descriptor();
  ASSERT_EQ(static_cast<size_t>(e->value_count()), kPayloadCount);
  for (int i = 0; i < e->value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor* v = e->value(i);
    const PayloadInfo* info = PayloadInfoOfProto(v->number());
    ASSERT_NE(info, nullptr) << v->name();
    EXPECT_EQ(std::string(info->name), v->name());
  }
  for (const PayloadInfo& info : kPayloads) {
    const google::protobuf::EnumValueDescriptor* v = e->FindValueByNumber(info.proto);
    ASSERT_NE(v, nullptr) << info.name;
    EXPECT_EQ(v->name(), info.name);
  }
}

TEST(JobSpecTest, ErrorFeedbackAndPayloads_ValidatedAndKept) {
  auto spec = [](const std::string& fields, bool outer = true) {
    return SpecFromText(absl::StrCat(
        R"pb(job_id: "f" world_size: 2 mode: PERIODIC levels { period: 4 group_size: 2 )pb",
        fields, outer ? " outer { lr: 1 } }" : " }"));
  };
  for (const char* ok : {"payload: INT4 error_feedback: 1", "payload: INT4 error_feedback: 0.9",
                         "payload: INT8 error_feedback: 0.5", "payload: BF16 error_feedback: 1",
                         "payload: INT4", "payload: TOPK topk_density: 0.02",
                         "payload: TOPK topk_density: 0.02 error_feedback: 1"}) {
    absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec(ok));
    ASSERT_TRUE(s.ok()) << ok << ": " << s.status();
  }
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec("payload: INT4 error_feedback: 0.9"));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->levels[0].payload, Payload::kInt4);
  EXPECT_EQ(s->levels[0].error_feedback, 0.9);
  v1::JobSpec back;
  ScheduleSpecToProto(*s, &back);
  EXPECT_EQ(back.levels(0).payload(), v1::INT4);
  EXPECT_EQ(back.levels(0).error_feedback(), 0.9);

  struct Bad {
    std::string fields;
    bool outer;
    std::vector<std::string> says;
  };
  const std::vector<Bad> bad = {
      {"payload: INT4 error_feedback: 1.5", true, {"levels[0].error_feedback", "[0, 1]", "1.5"}},
      {"payload: INT4 error_feedback: -0.1", true, {"levels[0].error_feedback", "-0.1"}},
      {"payload: INT4 error_feedback: nan", true, {"levels[0].error_feedback", "nan"}},
      {"error_feedback: 1", true, {"levels[0].error_feedback", "FP32"}},
      {"payload: INT4 error_feedback: 1", false, {"levels[0].error_feedback", "outer"}},
      {"payload: TOPK topk_density: 0", true, {"levels[0].topk_density", "(0, 1)"}},
      {"payload: TOPK topk_density: 1", true, {"levels[0].topk_density", "(0, 1)"}},
      {"payload: INT4 topk_density: 0.02", true, {"levels[0].topk_density", "TOPK"}},
      {"payload: INT4", false, {"levels[0].payload INT4", "outer"}},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<ScheduleSpec> got = ScheduleSpecFromProto(spec(b.fields, b.outer));
    ASSERT_FALSE(got.ok()) << b.fields;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << b.fields;
    for (const std::string& word : b.says) {
      EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr(word)) << b.fields;
    }
  }
}

}  // namespace
}  // namespace modelavg
