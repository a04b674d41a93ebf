// Sharded replicas in the schedule (ScheduleSpec::replica_size, docs/sharded.md): rank r holds
// shard r % S of replica r / S and, at a level of group size g, averages with the ranks of its
// block that hold its shard. Checked against a naive restatement of that rule over random
// specs, against the worked example of the docs, and, for S = 1, against today's blocks.
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"

namespace modelavg {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

Schedule Make(const ScheduleSpec& spec) {
  absl::StatusOr<Schedule> s = Schedule::Create(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

// The rule, restated naively: { g * (r / g) + i * S + r % S : 0 <= i < g / S }.
std::vector<int32_t> NaiveGroup(int32_t rank, int32_t g, int32_t s) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < g / s; ++i) out.push_back(g * (rank / g) + i * s + rank % s);
  return out;
}

// Today's rule (no replicas): the block of consecutive ranks [g * (r / g), g * (r / g) + g).
std::vector<int32_t> Block(int32_t rank, int32_t g) {
  std::vector<int32_t> out;
  for (int32_t r = rank / g * g; r < rank / g * g + g; ++r) out.push_back(r);
  return out;
}

ScheduleSpec WorkedExample() {
  // docs/sharded.md: 8 ranks, S = 2, levels (2, 4) and (5, 8).
  ScheduleSpec spec{8, 0, AveragingMode::kHierarchical, {{2, 4}, {5, 8}}};
  spec.replica_size = 2;
  return spec;
}

TEST(ScheduleReplicasTest, WorkedExample_GroupsHoldOneShardOfTheirBlock) {
  const Schedule s = Make(WorkedExample());
  // Level 0 (groups of 4): the pairs of same-shard ranks in each block of 4.
  EXPECT_THAT(s.SubgroupOf(0, 0).Ranks(), ElementsAre(0, 2));
  EXPECT_THAT(s.SubgroupOf(0, 1).Ranks(), ElementsAre(1, 3));
  EXPECT_THAT(s.SubgroupOf(0, 6).Ranks(), ElementsAre(4, 6));
  EXPECT_THAT(s.SubgroupOf(0, 7).Ranks(), ElementsAre(5, 7));
  // Subgroup index = block * S + shard.
  EXPECT_EQ(s.SubgroupOf(0, 0).index, 0);
  EXPECT_EQ(s.SubgroupOf(0, 3).index, 1);
  EXPECT_EQ(s.SubgroupOf(0, 4).index, 2);
  EXPECT_EQ(s.SubgroupOf(0, 5).index, 3);
  EXPECT_EQ(s.NumSubgroups(0), 4);
  // Level 1 (the world): one group per shard.
  EXPECT_THAT(s.SubgroupOf(1, 4).Ranks(), ElementsAre(0, 2, 4, 6));
  EXPECT_THAT(s.SubgroupOf(1, 3).Ranks(), ElementsAre(1, 3, 5, 7));
  EXPECT_EQ(s.NumSubgroups(1), 2);
  // Step 10: level 1 (5 divides it, the walk goes from the last level); step 4: level 0.
  const Decision d = s.DecisionFor(10, 5);
  EXPECT_EQ(d.level, 1);
  EXPECT_THAT(d.Members(), ElementsAre(1, 3, 5, 7));
  EXPECT_EQ(s.DecisionFor(4, 5).level, 0);
  EXPECT_THAT(s.DecisionFor(4, 5).Members(), ElementsAre(5, 7));
  EXPECT_FALSE(s.DecisionFor(3, 5).average);
  EXPECT_EQ(s.ReplicaOf(5), 2);
  EXPECT_EQ(s.ShardOf(5), 1);
  EXPECT_EQ(s.num_replicas(), 4);
}

TEST(ScheduleReplicasTest, GroupOfOneReplica_EachRankAveragesAlone) {
  // g = S: every group has one rank (it averages nothing).
  ScheduleSpec spec{8, 0, AveragingMode::kHierarchical, {{2, 4}, {4, 8}}};
  spec.replica_size = 4;
  const Schedule s = Make(spec);
  for (int32_t r = 0; r < 8; ++r) {
    EXPECT_THAT(s.SubgroupOf(0, r).Ranks(), ElementsAre(r));
    EXPECT_EQ(s.SubgroupOf(0, r).index, r);
    EXPECT_THAT(s.SubgroupOf(1, r).Ranks(), ElementsAre(r % 4, r % 4 + 4));
  }
}

TEST(ScheduleReplicasTest, SubgroupRange_StridedMembership) {
  const SubgroupRange g{3, 5, 3, 4};  // ranks 5, 9, 13
  EXPECT_THAT(g.Ranks(), ElementsAre(5, 9, 13));
  EXPECT_TRUE(g.Contains(9));
  EXPECT_FALSE(g.Contains(6));
  EXPECT_FALSE(g.Contains(17));
  EXPECT_FALSE(g.Contains(1));
  EXPECT_EQ(g.IndexOf(13), 2);
  EXPECT_EQ(g.LastRank(), 13);
  EXPECT_EQ(g.Describe(), "5,9,13");
  EXPECT_EQ((SubgroupRange{1, 4, 4, 1}).Describe(), "4..7");
}

struct BadReplicaSize {
  ScheduleSpec spec;
  std::string message;
};

TEST(ScheduleReplicasTest, BadReplicaSize_InvalidArgumentNamingFieldAndValues) {
  auto spec = [](int32_t world, std::vector<ScheduleLevel> levels, int32_t s) {
    ScheduleSpec out{world, 0, AveragingMode::kHierarchical, std::move(levels)};
    out.replica_size = s;
    return out;
  };
  const std::vector<BadReplicaSize> cases = {
      {spec(8, {{2, 8}}, 0), "replica_size must be >= 1"},
      {spec(8, {{2, 8}}, -2), "got -2"},
      {spec(8, {{2, 8}}, 3), "replica_size 3 does not divide world_size 8"},
      {spec(12, {{2, 6}, {4, 12}}, 4), "replica_size 4 does not divide levels[0].group_size 6"},
      {spec(8, {{2, 2}, {4, 8}}, 4), "replica_size 4 does not divide levels[0].group_size 2"},
  };
  for (const BadReplicaSize& c : cases) {
    const absl::Status s = ValidateScheduleSpec(c.spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
}

// Random valid specs with a replica size: a world of R replicas of S ranks, group sizes that
// are multiples of S dividing the world.
ScheduleSpec RandomShardedSpec(std::mt19937_64& rng) {
  static const int32_t kReplicaSizes[] = {1, 2, 3, 4, 8};
  const int32_t s = kReplicaSizes[rng() % std::size(kReplicaSizes)];
  const int32_t replicas = 1 + static_cast<int32_t>(rng() % 6);
  const int32_t world = s * replicas;
  std::vector<int32_t> groups;  // multiples of S that divide the world
  for (int32_t g = s; g <= world; g += s) {
    if (world % g == 0) groups.push_back(g);
  }
  ScheduleSpec spec;
  spec.world_size = world;
  spec.replica_size = s;
  spec.warmup_steps = static_cast<int64_t>(rng() % 10);
  const bool periodic = rng() % 3 == 0;
  spec.mode = periodic ? AveragingMode::kPeriodic : AveragingMode::kHierarchical;
  const int n = periodic ? 1 : 1 + static_cast<int>(rng() % 3);
  std::set<int64_t> used;
  for (int i = 0; i < n; ++i) {
    int64_t period;
    do {
      period = 1 + static_cast<int64_t>(rng() % 9);
    } while (!used.insert(period).second);
    spec.levels.push_back({period, i == n - 1 ? world : groups[rng() % groups.size()]});
  }
  return spec;
}

TEST(ScheduleReplicasTest, RandomSpecs_EveryRankInOneGroupPerLevel_EachGroupOneShard) {
  std::mt19937_64 rng(34);
  int sharded = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const ScheduleSpec spec = RandomShardedSpec(rng);
    ASSERT_TRUE(ValidateScheduleSpec(spec).ok()) << ValidateScheduleSpec(spec);
    const Schedule s = Make(spec);
    const int32_t S = spec.replica_size;
    sharded += S > 1 ? 1 : 0;
    for (int level = 0; level < s.num_levels(); ++level) {
      const int32_t g = spec.levels[level].group_size;
      std::vector<int> seen(spec.world_size, 0);
      const std::vector<SubgroupRange> all = s.SubgroupsAt(level);
      ASSERT_EQ(static_cast<int32_t>(all.size()), s.NumSubgroups(level));
      ASSERT_EQ(s.NumSubgroups(level), spec.world_size / g * S);
      for (size_t i = 0; i < all.size(); ++i) {
        const SubgroupRange& group = all[i];
        ASSERT_EQ(group.index, static_cast<int32_t>(i));
        ASSERT_EQ(s.Subgroup(level, group.index), group);
        ASSERT_EQ(group.size, g / S) << "trial " << trial;
        const std::vector<int32_t> ranks = group.Ranks();
        for (int32_t r : ranks) {
          ++seen[r];
          // One shard, one block.
          ASSERT_EQ(r % S, ranks[0] % S) << "trial " << trial << " level " << level;
          ASSERT_EQ(r / g, ranks[0] / g) << "trial " << trial << " level " << level;
        }
      }
      // Each rank in exactly one group of the level.
      for (int32_t r = 0; r < spec.world_size; ++r) ASSERT_EQ(seen[r], 1) << "rank " << r;
      for (int32_t r = 0; r < spec.world_size; ++r) {
        const SubgroupRange mine = s.SubgroupOf(level, r);
        ASSERT_THAT(mine.Ranks(), ElementsAreArray(NaiveGroup(r, g, S)))
            << "trial " << trial << " level " << level << " rank " << r;
        ASSERT_EQ(mine.index, r / g * S + r % S);
        ASSERT_TRUE(mine.Contains(r));
        ASSERT_EQ(mine.RankAt(mine.IndexOf(r)), r);
        for (int32_t other = 0; other < spec.world_size; ++other) {
          const std::vector<int32_t> naive = NaiveGroup(r, g, S);
          const bool in = std::find(naive.begin(), naive.end(), other) != naive.end();
          ASSERT_EQ(mine.Contains(other), in) << "rank " << r << " other " << other;
        }
      }
    }
    // Every member of a group sees the same decision, each step.
    for (int64_t step = 0; step < 30; ++step) {
      for (int32_t r = 0; r < spec.world_size; ++r) {
        const Decision d = s.DecisionFor(step, r);
        if (!d.average) continue;
        ASSERT_THAT(d.Members(),
                    ElementsAreArray(NaiveGroup(r, spec.levels[d.level].group_size, S)));
        for (int32_t m : d.Members()) ASSERT_EQ(s.DecisionFor(step, m), d);
      }
    }
  }
  EXPECT_GT(sharded, 200);
}

TEST(ScheduleReplicasTest, ReplicaSizeOne_IdenticalToConsecutiveBlocks) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    ScheduleSpec spec = RandomShardedSpec(rng);
    // The same levels over the same world, without replicas.
    spec.replica_size = 1;
    const Schedule s = Make(spec);
    for (int level = 0; level < s.num_levels(); ++level) {
      const int32_t g = spec.levels[level].group_size;
      ASSERT_EQ(s.NumSubgroups(level), spec.world_size / g);
      for (int32_t r = 0; r < spec.world_size; ++r) {
        const SubgroupRange mine = s.SubgroupOf(level, r);
        ASSERT_EQ(mine.index, r / g);
        ASSERT_EQ(mine.first_rank, r / g * g);
        ASSERT_EQ(mine.size, g);
        ASSERT_EQ(mine.stride, 1);
        ASSERT_THAT(mine.Ranks(), ElementsAreArray(Block(r, g)));
      }
    }
    // A sharded job's decisions keep the step and the level of the unsharded one.
    ScheduleSpec sharded = spec;
    sharded.replica_size = spec.levels[0].group_size;
    for (const ScheduleLevel& l : spec.levels) {
      sharded.replica_size = std::min(sharded.replica_size, l.group_size);
    }
    bool divides = true;
    for (const ScheduleLevel& l : spec.levels) {
      divides = divides && l.group_size % sharded.replica_size == 0;
    }
    if (!divides) continue;
    const Schedule t = Make(sharded);
    for (int64_t step = 0; step < 40; ++step) {
      ASSERT_EQ(t.LevelAt(step), s.LevelAt(step));
      ASSERT_EQ(t.DecisionFor(step, 0).average, s.DecisionFor(step, 0).average);
    }
  }
}

}  // namespace
}  // namespace modelavg
