// Error feedback in an elastic job (Level.error_feedback, docs/streaming.md "Error feedback"):
// 4 modelavg-trace-worker ranks over Gloo, one outer level of the world (period 4 in 2
// fragments, lr 0.7, momentum 0.9, nesterov) with the INT4 payload, 8 tensors of 100 elements
// (a fragment is 400 elements: one block), min_world_size 2. A round fails and is retried, or a
// member loses the confirmation of a round its peers completed; a member dies; a worker started
// without --rank replaces it. Every value of every rank at every step is compared with a naive
// restatement of the rule with the members each sync really had, in which each member's
// residual E changes once per committed round (U = beta E + D, C = decode(encode(U)),
// E := U - C) and the replacement's E starts at 0; and each member's residual after the last
// step (its state_dict(), saved by --save_state) is the reference's. The reference is not
// blind: a residual updated twice by a retried round or left stale by a lost commit gives other
// values, and a replacement handed its donor's residual ends with another residual.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/elastic_workers_fixture.h"
#include "tests/reference/naive_outer_sgd.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

constexpr int kWorld = 4;
constexpr int kTensors = 8;
constexpr int kPer = kTensors / 2;  // tensors of a fragment
constexpr int kVictim = 3;
constexpr int64_t kSteps = 56;
constexpr int64_t kNumel = 800;
constexpr absl::Duration kRunDeadline = absl::Seconds(90);

v1::JobSpec FeedbackElasticSpec(const std::string& id, double beta) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::PERIODIC, {{4, kWorld}}, 0,
                              /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  v1::Level* level = spec.mutable_levels(0);
  level->mutable_outer()->set_lr(0.7);
  level->mutable_outer()->set_momentum(0.9);
  level->mutable_outer()->set_nesterov(true);
  level->set_fragments(2);
  level->set_payload(v1::INT4);
  level->set_error_feedback(beta);
  return spec;
}

// Who called AverageParameters at which step, and the faults the reference restates (the
// correct rule has none of the `wrong_*`).
struct Membership {
  int64_t victim_last = -1;  // the victim's last line
  int64_t admitted = -1;     // the replacement's first line (its admission)
  // Wrong rules, for the reference's own check: the survivors' residual updated twice by the
  // round of this step (once by the failed attempt, once by the retry); rank `stale_rank`'s
  // residual left as it was by the round of `stale_at`; the replacement given its donor's
  // residual.
  int64_t wrong_twice_at = -1;
  int wrong_stale_rank = -1;
  int64_t wrong_stale_at = -1;
  bool wrong_donor_residual = false;
  bool Present(int r, int64_t s) const {
    return r != kVictim || s <= victim_last || (admitted >= 0 && s >= admitted);
  }
};

// The rule restated: x_r,t starts at r (the replacement at kVictim when it starts) and gets
// (t + 1)(r + 1)(s + 1)/2 before the call of step s. Fragment f = tensors [4f, 4f + 4) syncs at
// the steps with s mod 4 == 2f, among the ranks present then; the contributors are those but
// a replacement admitted at s, which first receives the contributors' mean of every tensor and
// their anchors and momenta (its residual stays 0). The fragment's first sync: A := mean of x.
// Later: each contributor m sends U_m = beta E_m + (A - x_m) (per element; the trace worker's
// tensors hold one value each), C_m = the documented INT4 round trip of U_m over the fragment's
// block, E_m := U_m - C_m; D = INT4 round trip of (sum of C_m) / contributors; A := SGD(A, D).
// Every present member's fragment becomes A.
struct Expected {
  std::vector<std::vector<std::vector<double>>> values;  // [s][r][t], empty where r is absent
  std::vector<std::vector<double>> residual;             // [r][t] after the last step
};

Expected Reference(const v1::JobSpec& spec, const Membership& run) {
  const v1::Level& l = spec.levels(0);
  const double beta = l.error_feedback();
  std::vector<std::vector<double>> x(kWorld, std::vector<double>(kTensors));
  std::vector<std::vector<double>> e(kWorld, std::vector<double>(kTensors, 0.0));
  std::vector<std::optional<double>> anchor(kTensors), momentum(kTensors);
  for (int r = 0; r < kWorld; ++r) std::fill(x[r].begin(), x[r].end(), r);
  Expected out;
  std::vector<std::vector<std::vector<double>>>& want = out.values;
  want.resize(kSteps);
  for (int64_t s = 0; s < kSteps; ++s) {
    if (s == run.admitted) {
      x[kVictim].assign(kTensors, kVictim);  // a fresh worker
      e[kVictim].assign(kTensors, 0.0);
    }
    for (int r = 0; r < kWorld; ++r) {
      if (!run.Present(r, s)) continue;
      for (int t = 0; t < kTensors; ++t) x[r][t] += (t + 1) * (r + 1) * (s + 1) * 0.5;
    }
    if (s % 2 == 0) {
      const int f = static_cast<int>((s / 2) % 2);
      std::vector<int> present, contributors;
      for (int r = 0; r < kWorld; ++r) {
        if (!run.Present(r, s)) continue;
        present.push_back(r);
        if (!(r == kVictim && s == run.admitted)) contributors.push_back(r);
      }
      const double n = static_cast<double>(contributors.size());
      if (s == run.admitted) {
        for (int t = 0; t < kTensors; ++t) {
          double mean = 0;
          for (int c : contributors) mean += x[c][t] / n;
          x[kVictim][t] = mean;
        }
        if (run.wrong_donor_residual) e[kVictim] = e[contributors[0]];
      }
      if (!anchor[f * kPer].has_value()) {
        for (int t = f * kPer; t < (f + 1) * kPer; ++t) {
          double mean = 0;
          for (int c : contributors) mean += x[c][t] / n;
          anchor[t] = mean;
        }
      } else {
        std::vector<double> sum(kPer, 0.0);
        for (int c : contributors) {
          const int times = s == run.wrong_twice_at ? 2 : 1;
          std::vector<double> sent;
          for (int k = 0; k < times; ++k) {
            std::vector<double> u(kPer);
            for (int i = 0; i < kPer; ++i) {
              const int t = f * kPer + i;
              u[i] = beta * e[c][t] + (*anchor[t] - x[c][t]);
            }
            sent = NaiveBlockRoundTrip(u, 7.0f);
            if (c == run.wrong_stale_rank && s == run.wrong_stale_at) continue;
            for (int i = 0; i < kPer; ++i) e[c][f * kPer + i] = u[i] - sent[i];
          }
          for (int i = 0; i < kPer; ++i) sum[i] += sent[i];
        }
        for (double& v : sum) v /= n;
        const std::vector<double> d = NaiveBlockRoundTrip(sum, 7.0f);
        for (int i = 0; i < kPer; ++i) {
          const int t = f * kPer + i;
          anchor[t] = NaiveOuterSgd(l.outer(), d[i], &momentum[t], *anchor[t]);
        }
      }
      for (int r : present) {
        for (int t = f * kPer; t < (f + 1) * kPer; ++t) x[r][t] = *anchor[t];
      }
    }
    want[s].resize(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      if (run.Present(r, s)) want[s][r] = x[r];
    }
  }
  out.residual = e;
  return out;
}

// The residual of every tensor (one value: the trace worker's tensors are uniform) from a
// --save_state file: its "fresidual <level> <fragment> <i> <n> <hex floats>" lines.
std::vector<double> SavedResidual(const std::string& path) {
  std::vector<double> out(kTensors, std::nan(""));
  absl::StatusOr<std::string> text = ReadFileToString(path);
  EXPECT_TRUE(text.ok()) << text.status();
  if (!text.ok()) return out;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    const std::vector<std::string> f = absl::StrSplit(line, ' ');
    int fragment = 0, i = 0;
    if (f.size() < 6 || f[0] != "fresidual" || !absl::SimpleAtoi(f[2], &fragment) ||
        !absl::SimpleAtoi(f[3], &i) || fragment * kPer + i >= kTensors) {
      continue;
    }
    out[fragment * kPer + i] = std::strtod(f[5].c_str(), nullptr);
    for (size_t k = 6; k < f.size(); ++k) {
      EXPECT_EQ(std::strtod(f[k].c_str(), nullptr), out[fragment * kPer + i])
          << "tensor " << fragment * kPer + i << " of " << path << " is not uniform";
    }
  }
  return out;
}

class ClientFeedbackElasticTest : public ElasticWorkersTest {
 protected:
  ClientFeedbackElasticTest() : ElasticWorkersTest("feedback-elastic", kWorld) {}

  size_t Start(const std::string& job, int rank, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {absl::StrCat("--steps=", kSteps),
                                      absl::StrCat("--numel=", kNumel),
                                      absl::StrCat("--tensors=", kTensors),
                                      "--step_delay_ms=100",
                                      absl::StrCat("--save_state=", StatePath(workers_.size()))};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(job, rank, flags);
  }

  // Where worker i writes its parameters and state_dict() after its last step.
  std::string StatePath(size_t i) { return absl::StrCat(cluster_.dir(), "/state-worker", i); }

  // Once the survivors have averaged without the victim: a replacement, every worker to its
  // end, and every line of every worker against the reference. Returns the run's membership.
  Membership ReplaceAndCheck(const v1::JobSpec& spec, int victim_exit) {
    Membership run;
    const std::string& job = spec.job_id();
    EXPECT_TRUE(WaitFor(kRunDeadline, [&] {
      for (const TraceLine& l : TraceOf(0).lines) {
        if (l.action == "AVERAGE" && l.members == std::vector<int32_t>{0, 1, 2}) return true;
      }
      return false;
    })) << Diagnostics();
    const size_t replacement = Start(job, -1);
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, replacement}) {
      std::optional<int> code = workers_[i]->Wait(kRunDeadline);
      EXPECT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
      if (!code.has_value()) return run;
      EXPECT_EQ(*code, 0) << "worker " << i << Diagnostics();
    }
    std::optional<int> victim = workers_[kVictim]->Wait(absl::Seconds(10));
    EXPECT_TRUE(victim.has_value());
    if (victim.has_value()) EXPECT_EQ(*victim, victim_exit);
    const Trace mine = TraceOf(replacement);
    EXPECT_FALSE(mine.lines.empty());
    if (mine.lines.empty()) return run;
    EXPECT_EQ(mine.lines.front().rank, kVictim);
    EXPECT_TRUE(mine.lines.front().admitted) << mine.lines.front().text;
    EXPECT_EQ(mine.lines.back().step, kSteps - 1);
    const Trace dead = TraceOf(kVictim);
    run.victim_last = dead.lines.empty() ? -1 : dead.lines.back().step;
    run.admitted = mine.lines.front().step;
    // Each fragment syncs at least twice after the admission: the replacement's own residual
    // (0 at first) reaches the common mean.
    EXPECT_LE(run.admitted + 10, kSteps) << "too few steps after the admission to prove it";
    const Expected expected = Reference(spec, run);
    const auto& want = expected.values;
    int compared = 0;
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, size_t{kVictim}, replacement}) {
      const Trace t = TraceOf(i);
      const int r = i == replacement ? kVictim : static_cast<int>(i);
      if (i != replacement && i != kVictim) {
        EXPECT_EQ(t.lines.size(), static_cast<size_t>(kSteps)) << "worker " << i;
      }
      for (const TraceLine& l : t.lines) {
        const std::string where = absl::StrCat("worker ", i, " (rank ", r, ") step ", l.step,
                                               ": ", l.text);
        EXPECT_TRUE(run.Present(r, l.step)) << where;
        if (!run.Present(r, l.step)) return run;
        EXPECT_EQ(l.values.size(), static_cast<size_t>(kTensors)) << where;
        if (l.values.size() != static_cast<size_t>(kTensors)) return run;
        for (int k = 0; k < kTensors; ++k) {
          const double w = want[l.step][r][k];
          EXPECT_NEAR(l.values[k], w, std::max(1e-4, 2e-6 * std::fabs(w)))
              << where << " tensor " << k;
        }
        ++compared;
      }
    }
    EXPECT_GT(compared, 3 * kSteps);
    // Each member's residual after the last step (its state_dict()), the replacement's
    // included: the reference's, from E = 0 at its admission.
    for (size_t i : {size_t{0}, size_t{1}, size_t{2}, replacement}) {
      const int r = i == replacement ? kVictim : static_cast<int>(i);
      const std::vector<double> got = SavedResidual(StatePath(i));
      for (int t = 0; t < kTensors; ++t) {
        const double w = expected.residual[r][t];
        EXPECT_NEAR(got[t], w, 1e-3 + 1e-6 * std::fabs(want[kSteps - 1][r][t]))
            << "worker " << i << " (rank " << r << ") residual of tensor " << t;
      }
    }
    // The reference is not blind: a replacement that started with its donor's residual ends
    // with another one.
    Membership donor = run;
    donor.wrong_donor_residual = true;
    EXPECT_GT(ResidualGap(Reference(spec, donor), expected), 1.0)
        << "a replacement with its donor's residual would pass";
    std::printf("%s: the dead member's last line step %lld, replacement admitted at step %lld, "
                "%d lines compared\n",
                job.c_str(), static_cast<long long>(run.victim_last),
                static_cast<long long>(run.admitted), compared);
    return run;
  }

  // The largest difference of rank 0's values over the run.
  static double LargestGap(const Expected& a, const Expected& b) {
    double gap = 0;
    for (int64_t s = 0; s < kSteps; ++s) {
      for (int t = 0; t < kTensors; ++t) {
        gap = std::max(gap, std::fabs(a.values[s][0][t] - b.values[s][0][t]));
      }
    }
    return gap;
  }
  // The largest difference of the final residuals, every rank.
  static double ResidualGap(const Expected& a, const Expected& b) {
    double gap = 0;
    for (int r = 0; r < kWorld; ++r) {
      for (int t = 0; t < kTensors; ++t) {
        gap = std::max(gap, std::fabs(a.residual[r][t] - b.residual[r][t]));
      }
    }
    return gap;
  }

};

// Rank 3 sleeps before its call at step 10 (fragment 1's third sync: the survivors' residuals
// are not 0); ranks 0-2 enter that blocking round and wait for it; rank 3 gets SIGKILL. The
// round fails and is retried with ranks 0-2 inside the same call: each survivor's residual
// changes once, by the committed round. Then a replacement starts with a residual of 0.
TEST_F(ClientFeedbackElasticTest, RoundRetriedAfterADeath_ResidualChangesOnce_ReplacementAtZero) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  const v1::JobSpec spec = FeedbackElasticSpec("retried", 1.0);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  constexpr int64_t kAt = 10;
  for (int r = 0; r < kWorld; ++r) {
    Start(spec.job_id(), r,
          r == kVictim ? std::vector<std::string>{absl::StrCat("--testing_sleep_at_step=", kAt),
                                                  "--testing_sleep_ms=8000"}
                       : std::vector<std::string>{});
  }
  // Rank 0 has printed step kAt - 1; its call at kAt then waits inside the round for rank 3.
  ASSERT_TRUE(WaitFor(kRunDeadline, [&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= kAt - 1;
  })) << Diagnostics();
  absl::SleepFor(absl::Seconds(1));
  ASSERT_EQ(TraceOf(0).lines.back().step, kAt - 1) << "rank 0 is past the round" << Diagnostics();
  workers_[kVictim]->Signal(SIGKILL);
  const Membership run = ReplaceAndCheck(spec, 128 + SIGKILL);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(run.victim_last, kAt - 1);
  EXPECT_EQ(TraceOf(0).lines[kAt].members, (std::vector<int32_t>{0, 1, 2}));
  // The round failed and was retried inside the call of step kAt.
  bool retried = false;
  for (absl::string_view line : absl::StrSplit(workers_[0]->err(), '\n')) {
    retried |= absl::StrContains(line, absl::StrCat("averaging at step ", kAt, " ")) &&
               absl::StrContains(line, "retrying in generation");
  }
  EXPECT_TRUE(retried) << "no retry of step " << kAt << "'s round" << Diagnostics();
  // Not blind: a residual updated by the failed attempt and again by the retry.
  Membership twice = run;
  twice.wrong_twice_at = kAt;
  EXPECT_GT(LargestGap(Reference(spec, twice), Reference(spec, run)), 1e-2);
}

// Rank 1 loses the confirmation of step 10's round, which ranks 0, 2 and 3 complete; rank 3
// dies right after printing step 10. Rank 1 learns from its peers' round notes that the round
// completed and keeps its result: its residual is the committed round's, as its peers' are.
TEST_F(ClientFeedbackElasticTest, LostCommitKept_ResidualAsCommitted_ReplacementAtZero) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  const v1::JobSpec spec = FeedbackElasticSpec("lostcommit", 0.9);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  constexpr int64_t kAt = 10;
  for (int r = 0; r < kWorld; ++r) {
    std::vector<std::string> extra;
    if (r == 1) extra.push_back(absl::StrCat("--testing_fail_commit_at_step=", kAt));
    if (r == kVictim) extra.push_back(absl::StrCat("--testing_die_after_step=", kAt));
    Start(spec.job_id(), r, extra);
  }
  const Membership run = ReplaceAndCheck(spec, 9);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(run.victim_last, kAt);
  EXPECT_EQ(TraceOf(1).lines[kAt].members, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_THAT(workers_[1]->err(), ::testing::HasSubstr("injecting a lost commit"))
      << Diagnostics();
  EXPECT_THAT(workers_[1]->err(), ::testing::HasSubstr("its result is kept")) << Diagnostics();
  // Not blind: rank 1's residual left as it was before the round it kept.
  Membership stale = run;
  stale.wrong_stale_rank = 1;
  stale.wrong_stale_at = kAt;
  EXPECT_GT(LargestGap(Reference(spec, stale), Reference(spec, run)), 1e-2);
}

}  // namespace
}  // namespace modelavg::testing
