// DiLoCo in an elastic job: 4 modelavg-trace-worker ranks over Gloo, both levels with an outer
// optimizer (pairs every 2 steps: lr 0.8, momentum 0.9; the world every 4: lr 0.7, momentum 0.9,
// nesterov), min_world_size 2. A member is killed with SIGKILL between outer steps, or inside
// one (no sleep, 4 MiB of parameters), then a worker started without --rank replaces it. Every
// value of every rank follows the rule as outer_trace_check.h restates it from the lines alone
// (the survivors keep their state through the retried round; the replacement receives every
// outer level's anchor and momentum from a live member of its blocks), and from its admission
// on the replacement prints what its peers print.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/outer_trace_check.h"
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

class ClientOuterElasticTest : public ::testing::Test {
 protected:
  ClientOuterElasticTest() : cluster_("outer-elastic") {}
  ~ClientOuterElasticTest() override { workers_.clear(); }

  size_t Start(const std::string& job, int rank, int64_t steps, int64_t delay_ms, int64_t numel,
               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                     "--coordinator=" + cluster_.coordinator().address(),
                                     "--job=" + job,
                                     absl::StrCat("--world_size=", kWorld),
                                     absl::StrCat("--steps=", steps),
                                     absl::StrCat("--numel=", numel),
                                     absl::StrCat("--step_delay_ms=", delay_ms),
                                     "--backend=gloo",
                                     "--join_timeout_ms=30000",
                                     "--collective_timeout_ms=60000",
                                     "--log_level=info"};
    if (rank >= 0) argv.push_back(absl::StrCat("--rank=", rank));
    argv.insert(argv.end(), extra.begin(), extra.end());
    const size_t i = workers_.size();
    workers_.push_back(std::make_unique<Process>(
        argv, absl::StrCat(cluster_.dir(), "/", job, "-worker", i)));
    return i;
  }

  Trace TraceOf(size_t i) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("worker ", i), workers_[i]->out());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : Trace{};
  }

  bool WaitFor(absl::Duration timeout, const std::function<bool()>& done) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  bool WaitForStep(size_t i, int64_t step) {
    return WaitFor(kRunDeadline, [&] {
      Trace t = TraceOf(i);
      return !t.lines.empty() && t.lines.back().step >= step;
    });
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

  std::string Diagnostics() {
    std::string s = absl::StrCat("\ncoordinator log (tail):\n",
                                 Tail(cluster_.coordinator().process().err()));
    for (size_t i = 0; i < workers_.size(); ++i) {
      absl::StrAppend(&s, "\nworker ", i, " stderr (tail):\n", Tail(workers_[i]->err()));
    }
    return s;
  }
  static std::string Tail(const std::string& s, size_t n = 2000) {
    return s.size() <= n ? s : s.substr(s.size() - n);
  }

  Cluster cluster_;
  std::vector<std::unique_ptr<Process>> workers_;  // after cluster_: stopped before it
};

TEST_F(ClientOuterElasticTest, KilledBetweenOuterSteps_ReplacementReceivesOuterState) {
  KillReplaceAndCheck("between", /*steps=*/70, /*delay_ms=*/100, /*numel=*/1000, /*at_step=*/9);
}

TEST_F(ClientOuterElasticTest, KilledInsideOuterStep_ReplacementReceivesOuterState) {
  KillReplaceAndCheck("inside", /*steps=*/400, /*delay_ms=*/0, /*numel=*/1 << 20,
                      /*at_step=*/10);
}

// Streaming sync in an elastic job (docs/streaming.md): one outer level of the world, period 4 in
// 2 fragments (every even step syncs one), nesterov, optionally INT8. Rank 3 is killed with
// SIGKILL; a worker started without --rank replaces it at a step of that level. The replacement
// receives each fragment's anchor and momentum and its block's mean parameters, so from its
// admission on every synced fragment is the same on every member: its outer steps are its
// peers' (they differ if any anchor or momentum differed).
std::vector<double> Values(const std::string& text) {
  std::vector<double> out;
  const size_t at = text.find("\"values\": [");
  if (at == std::string::npos) return out;
  const size_t from = at + 11;
  for (absl::string_view v :
       absl::StrSplit(text.substr(from, text.find(']', from) - from), ", ")) {
    double d = 0;
    if (absl::SimpleAtod(v, &d)) out.push_back(d);
  }
  return out;
}

TEST_F(ClientOuterElasticTest, StreamingLevel_KilledAndReplaced_ReplacementReceivesFragmentState) {
  for (v1::Payload payload : {v1::FP32, v1::INT8}) {
    SCOPED_TRACE(v1::Payload_Name(payload));
    const std::string job = absl::StrCat("streaming-", v1::Payload_Name(payload));
    v1::JobSpec spec = MakeSpec(job, kWorld, v1::PERIODIC, {{4, kWorld}}, 0,
                                /*heartbeat_ms=*/2000);
    spec.set_min_world_size(2);
    v1::Level* level = spec.mutable_levels(0);
    level->mutable_outer()->set_lr(0.7);
    level->mutable_outer()->set_momentum(0.9);
    level->mutable_outer()->set_nesterov(true);
    level->set_fragments(2);
    level->set_payload(payload);
    ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
    ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
    constexpr int64_t kSteps = 60;
    constexpr int kTensors = 8;
    workers_.clear();
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
    int compared = 0;
    for (const TraceLine& l : mine.lines) {
      if (l.action != "AVERAGE") continue;
      const int fragment = static_cast<int>((l.step / 2) % 2);
      const std::vector<double> got = Values(l.text);
      ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << l.text;
      for (const Trace& peer : peers) {
        const std::vector<double> want = Values(peer.lines[l.step].text);
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

}  // namespace
}  // namespace modelavg::testing
