// The trace checker (trace_check.h) on synthetic traces: it passes what the averaging rule
// produces, with a death and a replacement, and catches each kind of wrong trace.
#include "tests/integration/trace_check.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 8;
const std::vector<int32_t> kGroups = {2, 4, 8};

// Level averaging at `step` (-1: none): pairs every 2 steps, quads every 4, all every 8.
int LevelAt(int64_t step) {
  if (step % 8 == 7) return 2;
  if (step % 4 == 3) return 1;
  if (step % 2 == 1) return 0;
  return -1;
}

std::string Line(int64_t step, int rank, float value, int level, std::vector<int32_t> members,
                 std::vector<int32_t> joining, bool admitted) {
  std::string s = absl::StrFormat(
      "{\"step\": %d, \"rank\": %d, \"value\": %.9g, \"action\": \"%s\", \"level\": %d, "
      "\"generation\": 1, \"members\": [%s], \"joining\": [%s]",
      step, rank, value, level >= 0 ? "AVERAGE" : "SKIP", level, absl::StrJoin(members, ", "),
      absl::StrJoin(joining, ", "));
  if (admitted) absl::StrAppend(&s, ", \"admitted\": true");
  return s + "}\n";
}

// What the trace workers print (each process's stdout) for 8 ranks and `steps` steps, rank
// `dead` dying during the call of step `dies_at` and a replacement for it admitted at
// `admitted_at` (-1: none).
std::vector<std::string> Simulate(int64_t steps, int dead, int64_t dies_at, int64_t admitted_at) {
  std::vector<float> v(kWorld);
  for (int r = 0; r < kWorld; ++r) v[r] = static_cast<float>(r);
  std::vector<std::string> out(kWorld + (admitted_at >= 0 ? 1 : 0));
  for (int64_t s = 0; s < steps; ++s) {
    // The value of the replacement before its admission does not matter; after it, it is live.
    auto live = [&](int r) {
      if (r != dead) return true;
      return s < dies_at || (admitted_at >= 0 && s >= admitted_at);
    };
    std::vector<float> before = v;
    for (int r = 0; r < kWorld; ++r) before[r] = v[r] + TraceDelta(r, s);
    std::vector<float> after = before;
    const int level = LevelAt(s);
    for (int r = 0; r < kWorld; ++r) {
      if (!live(r)) continue;
      std::vector<int32_t> members, joining;
      if (level >= 0) {
        const int g = kGroups[level];
        double sum = 0;
        int n = 0;
        for (int m = r / g * g; m < r / g * g + g; ++m) {
          if (!live(m)) continue;
          members.push_back(m);
          if (m == dead && s == admitted_at) {
            joining.push_back(m);
            continue;
          }
          sum += before[m];
          ++n;
        }
        after[r] = static_cast<float>(sum / n);
      }
      const bool replacement = r == dead && admitted_at >= 0 && s >= admitted_at;
      out[replacement ? kWorld : r] +=
          Line(s, r, after[r], level, members, joining, replacement && s == admitted_at);
    }
    v = after;
  }
  return out;
}

std::vector<Trace> Parse(const std::vector<std::string>& outs) {
  std::vector<Trace> traces;
  for (size_t i = 0; i < outs.size(); ++i) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("process ", i), outs[i]);
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) traces.push_back(*std::move(t));
  }
  return traces;
}

// Replaces the first occurrence of `from` after the start of line `line` of process `p`.
void Doctor(std::vector<std::string>& outs, int p, int line, const std::string& from,
            const std::string& to) {
  size_t at = 0;
  for (int i = 0; i < line; ++i) at = outs[p].find('\n', at) + 1;
  at = outs[p].find(from, at);
  ASSERT_NE(at, std::string::npos) << from;
  outs[p].replace(at, from.size(), to);
}

TEST(TraceCheckTest, RealRuleWithDeathAndReplacement_Passes) {
  std::vector<std::string> outs = Simulate(24, 5, 10, 15);
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  EXPECT_TRUE(r.ok()) << r.Report();
  EXPECT_EQ(r.admissions, 1);
  // 12 averaging and 12 skipping steps of 8 ranks, less rank 5's 11, 13 and 10, 12, 14.
  EXPECT_EQ(r.averages, 12 * 8 - 2);
  EXPECT_EQ(r.skips, 12 * 8 - 3);
  // Rank 5's original stops after step 9; its replacement starts at 15 with "admitted".
  EXPECT_THAT(outs[5], HasSubstr("\"step\": 9,"));
  EXPECT_THAT(outs[5], ::testing::Not(HasSubstr("\"step\": 10,")));
  EXPECT_THAT(outs[8], ::testing::StartsWith("{\"step\": 15, \"rank\": 5,"));
}

TEST(TraceCheckTest, NoFailures_Passes) {
  TraceCheckResult r = CheckTraces(Parse(Simulate(17, -1, 0, -1)), kGroups);
  EXPECT_TRUE(r.ok()) << r.Report();
  EXPECT_EQ(r.averages + r.skips, 17 * 8);
}

TEST(TraceCheckTest, WrongMean_Fails) {
  std::vector<std::string> outs = Simulate(24, 5, 10, 15);
  // Rank 2's step 11 (a level-1 average) off by 0.1 %: far beyond float32 rounding.
  const std::string line = Parse(outs)[2].lines[11].text;
  absl::StatusOr<TraceLine> l = ParseTraceLine(line);
  ASSERT_TRUE(l.ok());
  Doctor(outs, 2, 11, absl::StrFormat("\"value\": %.9g", l->value),
         absl::StrFormat("\"value\": %.9g", l->value * 1.001));
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("rank 2 step 11: value"));
  EXPECT_THAT(r.Report(), HasSubstr("but the mean of members [0, 1, 2, 3]"));
}

TEST(TraceCheckTest, DeadRankCountedAsMember_Fails) {
  // The survivors of block {4, 5} claim rank 5 averaged at step 13, after it died at 10.
  std::vector<std::string> outs = Simulate(24, 5, 10, 15);
  Doctor(outs, 4, 13, "\"members\": [4]", "\"members\": [4, 5]");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("rank 4 step 13: member 5 has no known value"));
}

TEST(TraceCheckTest, MembersDisagree_Fails) {
  std::vector<std::string> outs = Simulate(24, -1, 0, -1);
  // Rank 1 claims it averaged alone at step 1; rank 0 says {0, 1}.
  Doctor(outs, 1, 1, "\"members\": [0, 1]", "\"members\": [1]");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("but its member rank 1 printed"));
}

TEST(TraceCheckTest, MemberOutsideTheBlock_Fails) {
  std::vector<std::string> outs = Simulate(8, -1, 0, -1);
  Doctor(outs, 0, 1, "\"members\": [0, 1]", "\"members\": [0, 1, 2]");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("member 2 is outside rank 0's block of 2"));
}

TEST(TraceCheckTest, ReplacementReceivedAWrongValue_Fails) {
  std::vector<std::string> outs = Simulate(24, 5, 10, 15);
  absl::StatusOr<TraceLine> l = ParseTraceLine(Parse(outs)[8].lines[0].text);
  ASSERT_TRUE(l.ok());
  Doctor(outs, 8, 0, absl::StrFormat("\"value\": %.9g", l->value), "\"value\": 5");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("rank 5 step 15: value 5 but the mean"));
}

TEST(TraceCheckTest, AdmissionNotListedAsJoining_Fails) {
  std::vector<std::string> outs = Simulate(24, 5, 10, 15);
  Doctor(outs, 8, 0, "\"joining\": [5]", "\"joining\": []");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("must be an AVERAGE that lists rank 5 as joining"));
}

TEST(TraceCheckTest, SkipThatChangedTheValue_Fails) {
  std::vector<std::string> outs = Simulate(8, -1, 0, -1);
  absl::StatusOr<TraceLine> l = ParseTraceLine(Parse(outs)[3].lines[2].text);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->action, "SKIP");
  Doctor(outs, 3, 2, absl::StrFormat("\"value\": %.9g", l->value), "\"value\": 0.25");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("rank 3 step 2: SKIP changed the value"));
}

TEST(TraceCheckTest, MissingStep_Fails) {
  std::vector<std::string> outs = Simulate(8, -1, 0, -1);
  Doctor(outs, 6, 4, "\"step\": 4,", "\"step\": 5,");
  TraceCheckResult r = CheckTraces(Parse(outs), kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("process 6: step 5 follows step 3; expected step 4"));
}

TEST(TraceCheckTest, Parse_UnfinishedLastLineIgnored_GarbageRejected) {
  absl::StatusOr<Trace> t = ParseTrace("w", Line(0, 0, 0.5f, -1, {}, {}, false) + "{\"step\": 1");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->lines.size(), 1u);
  EXPECT_EQ(t->lines[0].unix_ms, -1);
  absl::StatusOr<Trace> bad = ParseTrace("w", "hello\n");
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("w: not JSON: hello"));
  absl::StatusOr<TraceLine> timed = ParseTraceLine(
      "{\"step\": 3, \"rank\": 1, \"value\": 2, \"action\": \"SKIP\", \"level\": -1, "
      "\"generation\": 2, \"members\": [], \"joining\": [], \"unix_ms\": 1700000000123}");
  ASSERT_TRUE(timed.ok()) << timed.status();
  EXPECT_EQ(timed->unix_ms, 1700000000123);
  EXPECT_EQ(timed->generation, 2);
}

// What trace workers print for `spec` (every rank alive) when the averaging follows `groups`:
// group(spec, step, rank) gives the level and members, or level -1.
std::vector<std::string> SimulateRule(
    const v1::JobSpec& spec, int64_t steps,
    const std::function<NaiveDecision(const v1::JobSpec&, int64_t, int)>& decide) {
  const int world = spec.world_size();
  std::vector<float> v(world);
  for (int r = 0; r < world; ++r) v[r] = static_cast<float>(r);
  std::vector<std::string> out(world);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<float> before = v;
    for (int r = 0; r < world; ++r) before[r] = v[r] + TraceDelta(r, s);
    for (int r = 0; r < world; ++r) {
      const NaiveDecision d = decide(spec, s, r);
      std::vector<int32_t> members;
      double sum = 0;
      for (int m : d.group) {
        members.push_back(m);
        sum += before[m];
      }
      v[r] = d.average ? static_cast<float>(sum / d.group.size()) : before[r];
      out[r] += Line(s, r, v[r], d.average ? d.level : -1, members, {}, false);
    }
  }
  return out;
}

// docs/sharded.md's example: 8 ranks in replicas of 2, levels (2, 4) and (5, 8), warm-up 3.
v1::JobSpec ShardedSpec() {
  v1::JobSpec spec;
  spec.set_job_id("sharded");
  spec.set_world_size(8);
  spec.set_replica_size(2);
  spec.set_mode(v1::HIERARCHICAL);
  spec.set_warmup_steps(3);
  for (auto [p, g] : {std::pair<int64_t, int32_t>{2, 4}, {5, 8}}) {
    v1::Level* l = spec.add_levels();
    l->set_period(p);
    l->set_group_size(g);
  }
  return spec;
}

TEST(TraceCheckTest, ShardedRule_Passes) {
  const v1::JobSpec spec = ShardedSpec();
  const TraceCheckResult r = CheckTracesFollowRule(Parse(SimulateRule(spec, 20, NaiveDecide)),
                                                   spec);
  EXPECT_TRUE(r.ok()) << r.Report();
  EXPECT_GT(r.averages, 0);
  // The naive rule itself, on the worked example: rank 5 at step 4 (level 0) with rank 7; at
  // step 10 (level 1) with ranks 1, 3, 7.
  EXPECT_EQ(NaiveDecide(spec, 4, 5).group, (std::vector<int>{5, 7}));
  EXPECT_EQ(NaiveDecide(spec, 10, 5).group, (std::vector<int>{1, 3, 5, 7}));
}

// Averaging whole blocks (every shard together, the unsharded rule) is caught, although each
// value is the mean of the members it names.
TEST(TraceCheckTest, ShardedJobAveragedWholeBlocks_Fails) {
  v1::JobSpec spec = ShardedSpec();
  const auto whole_blocks = [](const v1::JobSpec& s, int64_t step, int rank) {
    v1::JobSpec unsharded = s;
    unsharded.clear_replica_size();
    return NaiveDecide(unsharded, step, rank);
  };
  const TraceCheckResult r =
      CheckTracesFollowRule(Parse(SimulateRule(spec, 20, whole_blocks)), spec);
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("but the rule's group is [1, 3]"));
}

}  // namespace
}  // namespace modelavg::testing
