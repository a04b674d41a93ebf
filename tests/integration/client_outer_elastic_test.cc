// DiLoCo in an elastic job: 4 modelavg-trace-worker ranks over Gloo, both levels with an outer
// optimizer (pairs every 2 steps: lr 0.8, momentum 0.9; the world every 4: lr 0.7, momentum 0.9,
// nesterov), min_world_size 2. A member is killed with SIGKILL between outer steps, or inside
// one (no sleep, 4 MiB of parameters), then a worker started without --rank replaces it. Every
// value of every rank follows the rule as outer_trace_check.h restates it from the lines alone
// (the survivors keep their state through the retried round; the replacement receives every
// outer level's anchor and momentum from a live member of its blocks), and from its admission
// on the replacement prints what its peers print. Then streaming levels in an elastic job: without
// and with sync_delay (a death during a background all-reduce).
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
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

constexpr int kWorld = 4;
constexpr absl::Duration kRunDeadline = absl::Seconds(90);

v1::JobSpec OuterElasticSpec(const std::string& id) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0,
                              /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  v1::OuterOptimizer* pairs = spec.mutable_levels(0)->mutable_outer();
  pairs->set_lr(0.8);
  pairs->set_momentum(0.9);
  v1::OuterOptimizer* world = spec.mutable_levels(1)->mutable_outer();
  world->set_lr(0.7);
  world->set_momentum(0.9);
  world->set_nesterov(true);
  return spec;
}

class ClientOuterElasticTest : public ElasticWorkersTest {
 protected:
  ClientOuterElasticTest() : ElasticWorkersTest("outer-elastic", kWorld) {}

  size_t Start(const std::string& job, int rank, int64_t steps, int64_t delay_ms, int64_t numel,
               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {absl::StrCat("--steps=", steps),
                                      absl::StrCat("--numel=", numel),
                                      absl::StrCat("--step_delay_ms=", delay_ms)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(job, rank, flags);
  }

  // Kills rank `victim` once rank 0 has printed `at_step`, waits for the survivors to average
  // without it, starts a replacement; checks the whole job.
  void KillReplaceAndCheck(const std::string& job, int64_t steps, int64_t delay_ms,
                           int64_t numel, int64_t at_step) {
    ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
    ASSERT_TRUE(cluster_.admin()->CreateJob(OuterElasticSpec(job)).ok());
    const int victim = 3;
    for (int r = 0; r < kWorld; ++r) Start(job, r, steps, delay_ms, numel);
    ASSERT_TRUE(WaitForStep(0, at_step)) << Diagnostics();
    workers_[victim]->Signal(SIGKILL);
    ASSERT_TRUE(workers_[victim]->Wait(absl::Seconds(10)).has_value());
    // Rank 2 averaged alone in its pair: the job went on without rank 3.
    ASSERT_TRUE(WaitFor(kRunDeadline, [&] {
      for (const TraceLine& l : TraceOf(2).lines) {
        if (l.action == "AVERAGE" && l.level == 0 && l.members == std::vector<int32_t>{2}) {
          return true;
        }
      }
      return false;
    })) << Diagnostics();
    const size_t replacement = Start(job, -1, steps, delay_ms, numel);
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, replacement}) {
      std::optional<int> code = workers_[i]->Wait(kRunDeadline);
      ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
      EXPECT_EQ(*code, 0) << "worker " << i << Diagnostics();
    }
    std::vector<Trace> traces;
    for (size_t i = 0; i < workers_.size(); ++i) traces.push_back(TraceOf(i));
    TraceCheckResult structure = CheckTraces(traces, {2, 4}, /*check_values=*/false);
    EXPECT_TRUE(structure.ok()) << structure.Report() << Diagnostics();
    v1::JobSpec spec = OuterElasticSpec(job);
    TraceCheckResult values = CheckOuterTraces(traces, spec);
    EXPECT_TRUE(values.ok()) << values.Report() << Diagnostics();
    EXPECT_EQ(structure.admissions, 1);

    const Trace mine = TraceOf(replacement);
    ASSERT_FALSE(mine.lines.empty());
    EXPECT_EQ(mine.lines.front().rank, victim);
    EXPECT_TRUE(mine.lines.front().admitted) << mine.lines.front().text;
    EXPECT_EQ(mine.lines.back().step, steps - 1);
    // From its admission on, its outer steps equal its peers': rank 2 in its pair, everyone in
    // the world (the same values, to float32 rounding of the all-reduce order).
    const Trace pair = TraceOf(2), first = TraceOf(0);
    int world_steps = 0;
    for (const TraceLine& l : mine.lines) {
      if (l.action != "AVERAGE") continue;
      ASSERT_TRUE(l.outer) << l.text;
      const TraceLine& peer = (l.level == 0 ? pair : first).lines[l.step];
      ASSERT_EQ(peer.step, l.step);
      EXPECT_NEAR(l.value, peer.value, std::max(1e-4, 1e-6 * std::fabs(peer.value)))
          << "step " << l.step << ": replacement " << l.text << " peer " << peer.text;
      world_steps += l.level == 1;
    }
    EXPECT_GT(world_steps, 2) << "too few world outer steps after the admission to prove it";
    // The checker is not blind: the replacement's last outer value, off by 0.1% (far above
    // its tolerance of 1e-5 relative).
    for (size_t k = mine.lines.size(); k-- > 0;) {
      if (mine.lines[k].action != "AVERAGE") continue;
      std::vector<Trace> doctored = traces;
      doctored[replacement].lines[k].value *= 1.001;
      TraceCheckResult r = CheckOuterTraces(doctored, spec);
      EXPECT_FALSE(r.ok()) << "a doctored value passed";
      EXPECT_THAT(r.Report(), ::testing::HasSubstr(
                                  absl::StrCat("rank ", victim, " step ", mine.lines[k].step)));
      break;
    }
    std::printf("outer trace check: %lld averaging lines; replacement admitted at step %lld\n",
                static_cast<long long>(values.averages),
                static_cast<long long>(mine.lines.front().step));
  }

};

TEST_F(ClientOuterElasticTest, KilledBetweenOuterSteps_ReplacementReceivesOuterState) {
  KillReplaceAndCheck("between", /*steps=*/70, /*delay_ms=*/100, /*numel=*/1000, /*at_step=*/9);
}

TEST_F(ClientOuterElasticTest, KilledInsideOuterStep_ReplacementReceivesOuterState) {
  KillReplaceAndCheck("inside", /*steps=*/400, /*delay_ms=*/0, /*numel=*/1 << 20,
                      /*at_step=*/10);
}

// Streaming sync in an elastic job (docs/streaming.md): one outer level of the world, period 4 in
// 2 fragments (every even step syncs one), nesterov, optionally INT8 or INT4 with error
// feedback. Rank 3 is killed with
// SIGKILL; a worker started without --rank replaces it at a step of that level. The replacement
// receives each fragment's anchor and momentum and its block's mean parameters, so from its
// admission on every synced fragment is the same on every member: its outer steps are its
// peers' (they differ if any anchor or momentum differed).
// One outer level of the world in 2 fragments (lr 0.7, momentum 0.9, nesterov), elastic.
v1::JobSpec StreamingElasticSpec(const std::string& id, int64_t period) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::PERIODIC, {{period, kWorld}}, 0,
                              /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  v1::Level* level = spec.mutable_levels(0);
  level->mutable_outer()->set_lr(0.7);
  level->mutable_outer()->set_momentum(0.9);
  level->mutable_outer()->set_nesterov(true);
  level->set_fragments(2);
  return spec;
}

TEST_F(ClientOuterElasticTest, StreamingLevel_KilledAndReplaced_ReplacementReceivesFragmentState) {
  // INT4 with error feedback: each member keeps its own residual (the replacement starts at 0),
  // and the mean every member applies is still common.
  for (v1::Payload payload : {v1::FP32, v1::INT8, v1::INT4}) {
    SCOPED_TRACE(v1::Payload_Name(payload));
    const std::string job = absl::StrCat("streaming-", v1::Payload_Name(payload));
    v1::JobSpec spec = StreamingElasticSpec(job, /*period=*/4);
    spec.mutable_levels(0)->set_payload(payload);
    if (payload == v1::INT4) spec.mutable_levels(0)->set_error_feedback(1.0);
    ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
    ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
    constexpr int64_t kSteps = 60;
    constexpr int kTensors = 8;
    ClearWorkers();
    const std::vector<std::string> tensors = {absl::StrCat("--tensors=", kTensors)};
    std::vector<size_t> ids;
    for (int r = 0; r < kWorld; ++r) ids.push_back(Start(job, r, kSteps, 100, 800, tensors));
    ASSERT_TRUE(WaitForStep(ids[0], 9)) << Diagnostics();
    workers_[ids[3]]->Signal(SIGKILL);
    ASSERT_TRUE(workers_[ids[3]]->Wait(absl::Seconds(10)).has_value());
    // The survivors averaged without rank 3.
    ASSERT_TRUE(WaitFor(kRunDeadline, [&] {
      for (const TraceLine& l : TraceOf(ids[0]).lines) {
        if (l.action == "AVERAGE" && l.members == std::vector<int32_t>{0, 1, 2}) return true;
      }
      return false;
    })) << Diagnostics();
    const size_t replacement = Start(job, -1, kSteps, 100, 800, tensors);
    for (size_t i : {ids[0], ids[1], ids[2], replacement}) {
      std::optional<int> code = workers_[i]->Wait(kRunDeadline);
      ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
      ASSERT_EQ(*code, 0) << "worker " << i << Diagnostics();
    }
    const Trace mine = TraceOf(replacement);
    ASSERT_FALSE(mine.lines.empty());
    EXPECT_EQ(mine.lines.front().rank, 3);
    EXPECT_TRUE(mine.lines.front().admitted) << mine.lines.front().text;
    EXPECT_EQ(mine.lines.front().action, "AVERAGE") << mine.lines.front().text;
    EXPECT_EQ(mine.lines.back().step, kSteps - 1);
    const std::vector<Trace> peers = {TraceOf(ids[0]), TraceOf(ids[1]), TraceOf(ids[2])};
    // At the admission step the fragment not synced then holds the mean of the peers' values
    // (theirs do not change at that step).
    {
      const TraceLine& first = mine.lines.front();
      const int other = static_cast<int>((first.step / 2 + 1) % 2);
      const std::vector<double> got = first.values;
      ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << first.text;
      for (int t = other * kTensors / 2; t < (other + 1) * kTensors / 2; ++t) {
        double mean = 0;
        for (const Trace& peer : peers) mean += peer.lines[first.step].values[t] / 3;
        EXPECT_NEAR(got[t], mean, std::max(1e-4, 1e-5 * std::fabs(mean)))
            << "tensor " << t << " of the admission line " << first.text;
      }
    }
    int compared = 0;
    for (const TraceLine& l : mine.lines) {
      if (l.action != "AVERAGE") continue;
      const int fragment = static_cast<int>((l.step / 2) % 2);
      const std::vector<double> got = l.values;
      ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << l.text;
      for (const Trace& peer : peers) {
        const std::vector<double> want = peer.lines[l.step].values;
        ASSERT_EQ(want.size(), static_cast<size_t>(kTensors)) << peer.lines[l.step].text;
        for (int t = fragment * kTensors / 2; t < (fragment + 1) * kTensors / 2; ++t) {
          EXPECT_NEAR(got[t], want[t], std::max(1e-5, 1e-6 * std::fabs(want[t])))
              << "step " << l.step << " tensor " << t << ": replacement " << l.text
              << "\n peer " << peer.lines[l.step].text;
        }
      }
      ++compared;
    }
    EXPECT_GT(compared, 8) << "too few outer steps after the admission to prove it";
    std::printf("%s: replacement admitted at step %lld, %d outer steps compared\n",
                job.c_str(), static_cast<long long>(mine.lines.front().step), compared);
  }
}

// Streaming sync with a delay (Level.sync_delay, docs/streaming.md): one outer level of the
// world (period 8 in 2 fragments, sync_delay 2, mix 0.5, nesterov), 8 tensors. A member dies
// while the survivors' background all-reduce of step 8 runs; a worker started without --rank
// then replaces it. Every value of every rank (the dead one up to its last line, the
// replacement from its admission) at every step is compared with a naive re-statement of the
// rule with the members each sync really had: a round lost to the death is run again with the
// survivors at its apply step, with the inputs of its sync step; a round that a member
// completed is kept by all.
constexpr int kTensors = 8;
constexpr int kVictim = 3;
constexpr int64_t kSteps = 64;

v1::JobSpec DelayedElasticSpec(const std::string& id) {
  v1::JobSpec spec = StreamingElasticSpec(id, /*period=*/8);
  spec.mutable_levels(0)->set_sync_delay(2);
  spec.mutable_levels(0)->set_mix(0.5);
  return spec;
}

// Who called AverageParameters at which step: every rank throughout, but the victim up to its
// last line and, in its slot, the replacement from its admission step.
struct Membership {
  int64_t victim_last = -1;
  int64_t admitted = -1;
  bool Present(int r, int64_t s) const {
    return r != kVictim || s <= victim_last || (admitted >= 0 && s >= admitted);
  }
};

// The rule for the spec above, restated: x_r,t starts at r and gets (t + 1)(r + 1)(s + 1)/2
// before the call of step s; fragment f (tensors [4f, 4f + 4)) syncs at the steps s with
// s mod 8 == 4f. The sync of step s takes the mean, over the ranks present at s (but a
// replacement admitted at s), of x (the fragment's first sync) or A - x, and is applied at
// s + 2 (before that step's decision) by the ranks present then that were present at s:
// A := mean, or SGD on A with that mean; x := (1 - mix) A + mix x. At its admission step the
// replacement gets the others' mean of every tensor and their anchors and momenta, and applies
// the sync of that step like them. Returns want[s][r] (empty where r is absent).
std::vector<std::vector<std::vector<double>>> Reference(const v1::JobSpec& spec,
                                                        const Membership& m) {
  const v1::Level& l = spec.levels(0);
  const int per = kTensors / Fragments(l);
  const int64_t every = l.period() / Fragments(l);
  std::vector<std::vector<double>> x(kWorld, std::vector<double>(kTensors));
  std::vector<std::vector<std::optional<double>>> anchor(
      kWorld, std::vector<std::optional<double>>(kTensors));
  auto momentum = anchor;
  for (int r = 0; r < kWorld; ++r) {
    for (int t = 0; t < kTensors; ++t) x[r][t] = r;
  }
  struct Sync {
    int64_t apply;
    int fragment;
    bool first;
    std::vector<int> to;
    std::vector<double> mean;  // per tensor of the fragment
  };
  std::vector<Sync> pending;
  std::vector<std::vector<std::vector<double>>> want(kSteps);
  for (int64_t s = 0; s < kSteps; ++s) {
    if (s == m.admitted) x[kVictim].assign(kTensors, kVictim);  // a fresh worker
    for (int r = 0; r < kWorld; ++r) {
      if (!m.Present(r, s)) continue;
      for (int t = 0; t < kTensors; ++t) x[r][t] += (t + 1) * (r + 1) * (s + 1) * 0.5;
    }
    for (const Sync& p : pending) {
      if (p.apply != s) continue;
      for (int r : p.to) {
        if (!m.Present(r, s)) continue;
        for (int i = 0; i < per; ++i) {
          const int t = p.fragment * per + i;
          const double a = p.first ? p.mean[i]
                                   : NaiveOuterSgd(l.outer(), p.mean[i], &momentum[r][t],
                                                   *anchor[r][t]);
          anchor[r][t] = a;
          x[r][t] = (1 - l.mix()) * a + l.mix() * x[r][t];
        }
      }
    }
    if (s % every == 0) {
      std::vector<int> members, contributors;
      for (int r = 0; r < kWorld; ++r) {
        if (!m.Present(r, s)) continue;
        members.push_back(r);
        if (!(r == kVictim && s == m.admitted)) contributors.push_back(r);
      }
      const double n = static_cast<double>(contributors.size());
      if (s == m.admitted) {
        for (int t = 0; t < kTensors; ++t) {
          double mean = 0;
          for (int c : contributors) mean += x[c][t] / n;
          x[kVictim][t] = mean;
        }
        anchor[kVictim] = anchor[contributors[0]];
        momentum[kVictim] = momentum[contributors[0]];
      }
      Sync p{s + l.sync_delay(), static_cast<int>((s / every) % Fragments(l)), false, members, {}};
      p.first = !anchor[contributors[0]][p.fragment * per].has_value();
      for (int i = 0; i < per; ++i) {
        const int t = p.fragment * per + i;
        double mean = 0;
        for (int c : contributors) mean += (p.first ? x[c][t] : *anchor[c][t] - x[c][t]) / n;
        p.mean.push_back(mean);
      }
      pending.push_back(std::move(p));
    }
    want[s].resize(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      if (m.Present(r, s)) want[s][r] = x[r];
    }
  }
  return want;
}

class DelayedSyncElasticTest : public ClientOuterElasticTest {
 protected:
  size_t StartDelayed(const std::string& job, int rank,
                      const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {absl::StrCat("--tensors=", kTensors)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return Start(job, rank, kSteps, /*delay_ms=*/100, /*numel=*/800, flags);
  }

  // Once the survivors have averaged without the victim: a replacement, every worker to its
  // end, and every line against the reference.
  void ReplaceAndCheck(const std::string& job, int victim_exit) {
    ASSERT_TRUE(WaitFor(kRunDeadline, [&] {
      for (const TraceLine& l : TraceOf(0).lines) {
        if (l.action == "AVERAGE" && l.members == std::vector<int32_t>{0, 1, 2}) return true;
      }
      return false;
    })) << Diagnostics();
    const size_t replacement = StartDelayed(job, -1);
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, replacement}) {
      std::optional<int> code = workers_[i]->Wait(kRunDeadline);
      ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
      ASSERT_EQ(*code, 0) << "worker " << i << Diagnostics();
    }
    std::optional<int> victim = workers_[kVictim]->Wait(absl::Seconds(10));
    ASSERT_TRUE(victim.has_value());
    EXPECT_EQ(*victim, victim_exit);
    const Trace mine = TraceOf(replacement);
    ASSERT_FALSE(mine.lines.empty());
    EXPECT_EQ(mine.lines.front().rank, kVictim);
    EXPECT_TRUE(mine.lines.front().admitted) << mine.lines.front().text;
    EXPECT_EQ(mine.lines.back().step, kSteps - 1);
    Membership m;
    const Trace dead = TraceOf(kVictim);
    m.victim_last = dead.lines.empty() ? -1 : dead.lines.back().step;
    m.admitted = mine.lines.front().step;
    EXPECT_LT(m.admitted + 8, kSteps) << "too few steps after the admission to prove it";
    const auto want = Reference(DelayedElasticSpec(job), m);
    int compared = 0;
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, size_t{kVictim}, replacement}) {
      const Trace t = TraceOf(i);
      const int r = i == replacement ? kVictim : static_cast<int>(i);
      if (i != replacement && i != kVictim) {
        ASSERT_EQ(t.lines.size(), static_cast<size_t>(kSteps)) << "worker " << i;
      }
      for (const TraceLine& l : t.lines) {
        const std::string where = absl::StrCat("worker ", i, " (rank ", r, ") step ", l.step,
                                               ": ", l.text);
        ASSERT_TRUE(m.Present(r, l.step)) << where;
        const std::vector<double> got = l.values;
        ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << where;
        for (int k = 0; k < kTensors; ++k) {
          const double w = want[l.step][r][k];
          ASSERT_NEAR(got[k], w, std::max(1e-4, 2e-6 * std::fabs(w))) << where << " tensor " << k;
        }
        ++compared;
      }
    }
    EXPECT_GT(compared, 3 * kSteps);
    // The reference is not blind: with the dead member in the sync of step 8 or out of it
    // (whichever it was not), the survivors' last values differ.
    Membership wrong = m;
    wrong.victim_last = m.victim_last >= 8 ? 7 : 8;
    EXPECT_NE(Reference(DelayedElasticSpec(job), wrong)[kSteps - 1][0], want[kSteps - 1][0]);
    std::printf("%s: the dead member's last line step %lld, replacement admitted at step %lld, "
                "%d lines compared\n",
                job.c_str(), static_cast<long long>(m.victim_last),
                static_cast<long long>(m.admitted), compared);
  }

};

// Rank 3 sleeps before its call at step 8; ranks 0-2 start fragment 0's sync there, train on,
// and rank 3 gets SIGKILL while their all-reduce waits for it. Nobody can complete that round:
// at step 10 the survivors run it again among themselves with their step-8 inputs.
TEST_F(DelayedSyncElasticTest, KilledDuringBackgroundAllReduce_SurvivorsRunItAgainExactly) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(DelayedElasticSpec("rerun")).ok());
  for (int r = 0; r < kWorld; ++r) {
    StartDelayed("rerun", r,
          r == kVictim ? std::vector<std::string>{"--testing_sleep_at_step=8",
                                                  "--testing_sleep_ms=5000"}
                       : std::vector<std::string>{});
  }
  // Rank 0 is past step 8 (its sync is in flight): kill rank 3.
  ASSERT_TRUE(WaitFor(kRunDeadline, [&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= 9;
  })) << Diagnostics();
  workers_[kVictim]->Signal(SIGKILL);
  ReplaceAndCheck("rerun", 128 + SIGKILL);
  EXPECT_THAT(workers_[0]->err(), ::testing::HasSubstr("running it again in generation"))
      << Diagnostics();
}

// Rank 1 loses the confirmation of step 8's background round, which ranks 0, 2 and 3 complete;
// rank 3 dies after step 9. At step 10 rank 1 learns from its peers' round notes that they
// completed the round and keeps the result it holds: the sync of step 8 is the mean of all four.
TEST_F(DelayedSyncElasticTest, LostCommitOfBackgroundRoundThenADeath_ResultKeptByAll) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(DelayedElasticSpec("adopt")).ok());
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> extra;
    if (r == 1) extra.push_back("--testing_fail_commit_at_step=8");
    if (r == kVictim) extra.push_back("--testing_die_after_step=9");
    StartDelayed("adopt", r, extra);
  }
  ReplaceAndCheck("adopt", 9);
  EXPECT_THAT(workers_[1]->err(), ::testing::HasSubstr("injecting a lost commit")) << Diagnostics();
  EXPECT_THAT(workers_[1]->err(), ::testing::HasSubstr("its result is kept")) << Diagnostics();
}

}  // namespace
}  // namespace modelavg::testing
