// Streaming sync with a delay (Level.sync_delay, docs/streaming.md) in an elastic job, with real
// processes: 4 modelavg-trace-worker ranks over Gloo on loopback, one outer level of the world
// (period 8 in 2 fragments, sync_delay 2, mix 0.5, nesterov), min_world_size 2. A member dies
// while the survivors' background all-reduce of step 8 runs; a worker started without --rank
// then replaces it. Every value of every rank (the dead one up to its last line, the
// replacement from its admission) at every step is compared with a naive re-statement of the
// rule with the members each sync really had: a round lost to the death is run again with the
// survivors at its apply step, with the inputs of its sync step; a round that a member completed
// is kept by all.
#include <signal.h>

#include <algorithm>
#include <cmath>
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
#include "tests/integration/streaming_reference.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr int kTensors = 8;
constexpr int kVictim = 3;
constexpr int64_t kSteps = 64;
constexpr absl::Duration kRunDeadline = absl::Seconds(90);

v1::JobSpec DelayedElasticSpec(const std::string& id) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::PERIODIC, {{8, kWorld}}, 0, /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  v1::Level* level = spec.mutable_levels(0);
  level->mutable_outer()->set_lr(0.7);
  level->mutable_outer()->set_momentum(0.9);
  level->mutable_outer()->set_nesterov(true);
  level->set_fragments(2);
  level->set_sync_delay(2);
  level->set_mix(0.5);
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
          const double a = p.first ? p.mean[i] : Sgd(l, p.mean[i], &momentum[r][t], *anchor[r][t]);
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

class ClientStreamingElasticTest : public ::testing::Test {
 protected:
  ClientStreamingElasticTest() : cluster_("streaming-elastic") {}
  ~ClientStreamingElasticTest() override { workers_.clear(); }

  size_t Start(const std::string& job, int rank, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                     "--coordinator=" + cluster_.coordinator().address(),
                                     "--job=" + job,
                                     absl::StrCat("--world_size=", kWorld),
                                     absl::StrCat("--steps=", kSteps),
                                     "--numel=800",
                                     absl::StrCat("--tensors=", kTensors),
                                     "--step_delay_ms=100",
                                     "--backend=gloo",
                                     "--join_timeout_ms=30000",
                                     "--collective_timeout_ms=30000",
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

  bool WaitFor(const std::function<bool()>& done) {
    const absl::Time deadline = absl::Now() + kRunDeadline;
    while (absl::Now() < deadline) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // Once the survivors have averaged without the victim: a replacement, every worker to its
  // end, and every line against the reference.
  void ReplaceAndCheck(const std::string& job, int victim_exit) {
    ASSERT_TRUE(WaitFor([&] {
      for (const TraceLine& l : TraceOf(0).lines) {
        if (l.action == "AVERAGE" && l.members == std::vector<int32_t>{0, 1, 2}) return true;
      }
      return false;
    })) << Diagnostics();
    const size_t replacement = Start(job, -1);
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
        const std::vector<double> got = Values(l.text);
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

  std::string Diagnostics() {
    std::string s = absl::StrCat("\ncoordinator log (tail):\n",
                                 Tail(cluster_.coordinator().process().err()));
    for (size_t i = 0; i < workers_.size(); ++i) {
      absl::StrAppend(&s, "\nworker ", i, " stderr (tail):\n", Tail(workers_[i]->err()));
    }
    return s;
  }
  static std::string Tail(const std::string& s, size_t n = 3000) {
    return s.size() <= n ? s : s.substr(s.size() - n);
  }

  Cluster cluster_;
  std::vector<std::unique_ptr<Process>> workers_;  // after cluster_: stopped before it
};

// Rank 3 sleeps before its call at step 8; ranks 0-2 start fragment 0's sync there, train on,
// and rank 3 gets SIGKILL while their all-reduce waits for it. Nobody can complete that round:
// at step 10 the survivors run it again among themselves with their step-8 inputs.
TEST_F(ClientStreamingElasticTest, KilledDuringBackgroundAllReduce_SurvivorsRunItAgainExactly) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(DelayedElasticSpec("rerun")).ok());
  for (int r = 0; r < kWorld; ++r) {
    Start("rerun", r,
          r == kVictim ? std::vector<std::string>{"--testing_sleep_at_step=8",
                                                  "--testing_sleep_ms=5000"}
                       : std::vector<std::string>{});
  }
  // Rank 0 is past step 8 (its sync is in flight): kill rank 3.
  ASSERT_TRUE(WaitFor([&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= 9;
  })) << Diagnostics();
  workers_[kVictim]->Signal(SIGKILL);
  ReplaceAndCheck("rerun", 128 + SIGKILL);
  EXPECT_THAT(workers_[0]->err(), HasSubstr("running it again in generation"))
      << Diagnostics();
}

// Rank 1 loses the confirmation of step 8's background round, which ranks 0, 2 and 3 complete;
// rank 3 dies after step 9. At step 10 rank 1 learns from its peers' round notes that they
// completed the round and keeps the result it holds: the sync of step 8 is the mean of all four.
TEST_F(ClientStreamingElasticTest, LostCommitOfBackgroundRoundThenADeath_ResultKeptByAll) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(DelayedElasticSpec("adopt")).ok());
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> extra;
    if (r == 1) extra.push_back("--testing_fail_commit_at_step=8");
    if (r == kVictim) extra.push_back("--testing_die_after_step=9");
    Start("adopt", r, extra);
  }
  ReplaceAndCheck("adopt", 9);
  EXPECT_THAT(workers_[1]->err(), HasSubstr("injecting a lost commit")) << Diagnostics();
  EXPECT_THAT(workers_[1]->err(), HasSubstr("its result is kept")) << Diagnostics();
}

}  // namespace
}  // namespace modelavg::testing
