// Sharded replicas (JobSpec.replica_size, docs/sharded.md) with real processes: whole jobs of
// modelavg-trace-worker ranks over Gloo on loopback, every rank's every line against the rule
// restated naively (trace_check.h's CheckTracesFollowRule: the decision, the members, the mean
// of the members' values): worlds of 8 and 12 ranks, replicas of 2, 3 and 4, hierarchical and
// periodic, with warm-up. Then an elastic job of replicas of 2 with DiLoCo levels: one rank of a
// replica killed with SIGKILL, its replica mate ends with the replica-lost error within the
// heartbeat timeout plus a second, the survivors finish with exact values (outer_trace_check.h),
// and a replacement replica is admitted whole, each rank receiving the outer state of its own
// shard of a live replica.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/elastic_workers_fixture.h"
#include "tests/integration/outer_trace_check.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Sharded(const std::string& id, int world, int replica_size, v1::Mode mode,
                    const std::vector<std::pair<int64_t, int32_t>>& levels, int64_t warmup) {
  v1::JobSpec spec = MakeSpec(id, world, mode, levels, warmup);
  spec.set_replica_size(replica_size);
  return spec;
}

class ClientShardedTest : public TraceJobTest {
 protected:
  ClientShardedTest() : TraceJobTest("sharded") {}

  // Runs `spec` for `steps` steps and checks every rank's every line against the naive rule.
  void RunAndCheck(const v1::JobSpec& spec, int64_t steps) {
    const std::vector<Trace> traces = RunJob(spec, steps, /*numel=*/3);
    ASSERT_EQ(traces.size(), static_cast<size_t>(spec.world_size()));
    for (const Trace& t : traces) ASSERT_EQ(t.lines.size(), static_cast<size_t>(steps)) << t.who;
    const TraceCheckResult r = CheckTracesFollowRule(traces, spec);
    EXPECT_TRUE(r.ok()) << r.Report();
    EXPECT_EQ(r.averages + r.skips, steps * spec.world_size());
    EXPECT_GT(r.averages, 0);
    // The groups hold one shard: the lines of one averaging step name world / (g / S) groups.
    std::printf("%s: %lld averaging and %lld skipping lines follow the rule\n",
                spec.job_id().c_str(), static_cast<long long>(r.averages),
                static_cast<long long>(r.skips));
  }
};

// docs/sharded.md's worked example: 8 ranks in replicas of 2, levels (2, 4) and (5, 8).
TEST_F(ClientShardedTest, World8_ReplicasOf2_Hierarchical_WithWarmup_FollowsRule) {
  RunAndCheck(Sharded("w8s2", 8, 2, v1::HIERARCHICAL, {{2, 4}, {5, 8}}, 3), 12);
}

TEST_F(ClientShardedTest, World8_ReplicasOf4_Periodic_WithWarmup_FollowsRule) {
  RunAndCheck(Sharded("w8s4", 8, 4, v1::PERIODIC, {{2, 8}}, 3), 10);
}

TEST_F(ClientShardedTest, World12_ReplicasOf3_Hierarchical_WithWarmup_FollowsRule) {
  RunAndCheck(Sharded("w12s3", 12, 3, v1::HIERARCHICAL, {{2, 6}, {3, 12}}, 2), 10);
}

// Groups of one replica (g = S) average nothing; the world level averages each shard.
TEST_F(ClientShardedTest, World12_ReplicasOf4_GroupOfOneReplica_FollowsRule) {
  RunAndCheck(Sharded("w12s4", 12, 4, v1::HIERARCHICAL, {{2, 4}, {3, 12}}, 1), 8);
}

TEST_F(ClientShardedTest, World12_ReplicasOf2_ThreeLevels_FollowsRule) {
  RunAndCheck(Sharded("w12s2", 12, 2, v1::HIERARCHICAL, {{2, 4}, {3, 6}, {4, 12}}, 1), 10);
}

// --- Elastic: the replica is the unit of failure.

constexpr int kWorld = 8;
constexpr int64_t kHeartbeatMs = 2000;
constexpr absl::Duration kRunDeadline = absl::Seconds(90);

// 4 replicas of 2; DiLoCo groups of 4 (two replicas) every 2 steps, the world every 4.
v1::JobSpec ElasticShardedSpec(const std::string& id) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::HIERARCHICAL, {{2, 4}, {4, 8}}, 0, kHeartbeatMs);
  spec.set_replica_size(2);
  spec.set_min_world_size(4);
  SetOuter(&spec, 0, 0.8, 0.9, false);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  return spec;
}

class ClientShardedElasticTest : public ElasticWorkersTest {
 protected:
  ClientShardedElasticTest() : ElasticWorkersTest("sharded-elastic", kWorld) {}

  // Starts a worker (rank -1: a replacement, the coordinator picks its rank).
  size_t Start(const std::string& job, int rank, int64_t steps,
               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {absl::StrCat("--steps=", steps), "--numel=256",
                                      "--step_delay_ms=40"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(job, rank, flags);
  }

  std::string Diagnostics() { return ElasticWorkersTest::Diagnostics(1500); }
};

TEST_F(ClientShardedElasticTest, RankKilled_MateEndsClearly_SurvivorsExact_ReplicaReplacedWhole) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  const std::string job = "replicas";
  const v1::JobSpec spec = ElasticShardedSpec(job);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  const int64_t steps = 100;
  for (int r = 0; r < kWorld; ++r) Start(job, r, steps);
  const int victim = 5, mate = 4;
  ASSERT_TRUE(WaitFor([&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= 9;
  })) << Diagnostics();
  const absl::Time killed = absl::Now();
  workers_[victim]->Signal(SIGKILL);
  ASSERT_TRUE(workers_[victim]->Wait(absl::Seconds(10)).has_value());

  // The mate ends with the replica-lost error, within the heartbeat timeout plus a second.
  const std::optional<int> mate_code =
      workers_[mate]->Wait(absl::Milliseconds(kHeartbeatMs) + absl::Seconds(1));
  const absl::Duration took = absl::Now() - killed;
  ASSERT_TRUE(mate_code.has_value()) << "rank " << mate << " still running " << took
                                     << " after the kill" << Diagnostics();
  EXPECT_EQ(*mate_code, 1) << Diagnostics();
  const std::string why = workers_[mate]->err();
  EXPECT_THAT(why, HasSubstr("replica 2 (ranks 4..5)"));
  EXPECT_THAT(why, HasSubstr("was retired because its rank 5 died or failed"));
  std::printf("rank %d ended %lld ms after rank %d was killed\n", mate,
              static_cast<long long>(absl::ToInt64Milliseconds(took)), victim);

  // The coordinator shows the loss as one generation change, the replica retired (the mate
  // has left since, failed).
  absl::StatusOr<v1::Job> state = cluster_.admin()->GetJob(job);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->generation(), 2);
  EXPECT_EQ(state->last_change().rank(), victim);
  EXPECT_THAT(state->last_change().reason(), HasSubstr("replica 2 (ranks 4..5) retired"));
  EXPECT_EQ(state->members(mate).state(), v1::LEFT);
  EXPECT_THAT(state->vacant_ranks(), ::testing::ElementsAre(4, 5));

  // A replacement replica: two workers without a rank, admitted together into ranks 4 and 5.
  const size_t a = Start(job, -1, steps);
  const size_t b = Start(job, -1, steps);
  std::vector<size_t> finishing = {0, 1, 2, 3, 6, 7, a, b};
  for (size_t i : finishing) {
    const std::optional<int> code = workers_[i]->Wait(kRunDeadline);
    ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
    EXPECT_EQ(*code, 0) << "worker " << i << Diagnostics();
  }
  const Trace ta = TraceOf(a), tb = TraceOf(b);
  ASSERT_FALSE(ta.lines.empty());
  ASSERT_FALSE(tb.lines.empty());
  std::vector<int32_t> ranks = {ta.lines[0].rank, tb.lines[0].rank};
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(ta.lines[0].admitted && tb.lines[0].admitted);
  EXPECT_EQ(ta.lines[0].step, tb.lines[0].step) << "the replica is admitted at one step";
  EXPECT_EQ(ta.lines.back().step, steps - 1);

  std::vector<Trace> traces;
  for (size_t i = 0; i < workers_.size(); ++i) traces.push_back(TraceOf(i));
  const TraceCheckResult structure =
      CheckTracesFollowRule(traces, spec, /*every_rank_lived=*/false, /*check_values=*/false);
  EXPECT_TRUE(structure.ok()) << structure.Report() << Diagnostics();
  EXPECT_EQ(structure.admissions, 2);
  // Every value of every rank, the replacements' included (each takes its outer state from the
  // lowest live rank of its own shard in its groups).
  const TraceCheckResult values = CheckOuterTraces(traces, spec);
  EXPECT_TRUE(values.ok()) << values.Report() << Diagnostics();
  // From the admission on, each replacement's outer steps equal its shard's peers': at a world
  // step the ranks of its shard (rank 0 or 1), at a group step its group's other rank (6 or 7).
  for (const Trace* t : {&ta, &tb}) {
    const int32_t rank = t->lines[0].rank;
    const Trace world_peer = TraceOf(static_cast<size_t>(rank % 2));
    const Trace group_peer = TraceOf(static_cast<size_t>(rank + 2));
    int world_steps = 0;
    for (const TraceLine& l : t->lines) {
      if (l.action != "AVERAGE") continue;
      const TraceLine& peer = (l.level == 1 ? world_peer : group_peer).lines[l.step];
      ASSERT_EQ(peer.step, l.step);
      EXPECT_NEAR(l.value, peer.value, std::max(1e-4, 1e-6 * std::fabs(peer.value)))
          << "rank " << rank << " step " << l.step << ": " << l.text << " peer " << peer.text;
      world_steps += l.level == 1;
    }
    EXPECT_GT(world_steps, 2) << "too few world steps after the admission to prove it";
  }
  // The checker is not blind: a value of the replacement's shard-1 rank off by 0.1%.
  const size_t shard1 = ta.lines[0].rank == 5 ? a : b;
  for (size_t k = traces[shard1].lines.size(); k-- > 0;) {
    if (traces[shard1].lines[k].action != "AVERAGE") continue;
    std::vector<Trace> doctored = traces;
    doctored[shard1].lines[k].value *= 1.001;
    EXPECT_FALSE(CheckOuterTraces(doctored, spec).ok()) << "a doctored value passed";
    break;
  }
}

// Streaming sync (docs/streaming.md) with replicas of 2: one outer level of the world in 2
// fragments. Rank 3 (replica 1) is killed; its mate ends; a replacement replica takes ranks 2
// and 3, each receiving every fragment's anchor and momentum of its own shard: from its admission
// on every fragment it syncs equals its shard's peers' (ranks 0, 4, 6 or 1, 5, 7).
TEST_F(ClientShardedElasticTest, StreamingLevel_ReplicaReplaced_EachRankReceivesItsShardsState) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  const std::string job = "streaming-replicas";
  v1::JobSpec spec = MakeSpec(job, kWorld, v1::PERIODIC, {{4, kWorld}}, 0, kHeartbeatMs);
  spec.set_replica_size(2);
  spec.set_min_world_size(4);
  SetOuter(&spec, 0, 0.7, 0.9, true);
  spec.mutable_levels(0)->set_fragments(2);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  constexpr int64_t kSteps = 80;
  constexpr int kTensors = 8;
  const std::vector<std::string> tensors = {absl::StrCat("--tensors=", kTensors)};
  for (int r = 0; r < kWorld; ++r) Start(job, r, kSteps, tensors);
  ASSERT_TRUE(WaitFor([&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= 9;
  })) << Diagnostics();
  workers_[3]->Signal(SIGKILL);
  ASSERT_TRUE(workers_[3]->Wait(absl::Seconds(10)).has_value());
  const std::optional<int> mate = workers_[2]->Wait(absl::Seconds(10));
  ASSERT_TRUE(mate.has_value()) << Diagnostics();
  EXPECT_EQ(*mate, 1);
  EXPECT_THAT(workers_[2]->err(), HasSubstr("replica 1 (ranks 2..3)"));
  const size_t a = Start(job, 2, kSteps, tensors);  // each asks for its rank
  const size_t b = Start(job, 3, kSteps, tensors);
  for (size_t i : {size_t{0}, size_t{1}, size_t{4}, size_t{5}, size_t{6}, size_t{7}, a, b}) {
    const std::optional<int> code = workers_[i]->Wait(kRunDeadline);
    ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
    ASSERT_EQ(*code, 0) << "worker " << i << Diagnostics();
  }
  int compared = 0;
  for (size_t replacement : {a, b}) {
    const Trace mine = TraceOf(replacement);
    ASSERT_FALSE(mine.lines.empty());
    const int32_t rank = mine.lines.front().rank;
    EXPECT_TRUE(mine.lines.front().admitted) << mine.lines.front().text;
    EXPECT_EQ(mine.lines.back().step, kSteps - 1);
    std::vector<Trace> peers;
    for (int32_t p = rank % 2; p < kWorld; p += 2) {
      if (p != 2 && p != 3) peers.push_back(TraceOf(static_cast<size_t>(p)));
    }
    for (const TraceLine& l : mine.lines) {
      if (l.action != "AVERAGE") continue;
      const int fragment = static_cast<int>((l.step / 2) % 2);
      const std::vector<double> got = l.values;
      ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << l.text;
      for (const Trace& peer : peers) {
        const std::vector<double> want = peer.lines[l.step].values;
        ASSERT_EQ(want.size(), static_cast<size_t>(kTensors));
        for (int t = fragment * kTensors / 2; t < (fragment + 1) * kTensors / 2; ++t) {
          EXPECT_NEAR(got[t], want[t], std::max(1e-5, 1e-6 * std::fabs(want[t])))
              << "rank " << rank << " step " << l.step << " tensor " << t << ": " << l.text
              << "\n peer " << peer.lines[l.step].text;
        }
      }
      ++compared;
    }
  }
  EXPECT_GE(compared, 2 * 4) << "too few outer steps after the admission to prove it";
  // The shards differ: had a replacement taken the other shard's state, it would not match.
  const std::vector<double> shard0 = TraceOf(0).lines.back().values;
  const std::vector<double> shard1 = TraceOf(1).lines.back().values;
  EXPECT_NE(shard0, shard1);
}

}  // namespace
}  // namespace modelavg::testing
