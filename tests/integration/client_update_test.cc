// UpdateJob with real processes (docs/plan-updates.md): a coordinator and modelavg-trace-worker
// ranks over Gloo on loopback; the plan changes while the job runs, and every rank's value at
// every step is compared with a naive re-statement of the rule (plan_reference.h: the old plan
// before the switch step E, the new one from E, outer states carried or started afresh), with
// the trace's "plan" at every step: a period changed, a level added, DiLoCo's outer lr decayed
// twice, in a strict and an elastic job; the coordinator killed (-9) between UpdateJob and E and
// restarted on its state: E survives and every member switches at it; and every refused change
// (a clear error and the running job unchanged).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/client_test_processes.h"
#include "tests/reference/plan_reference.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/testing/gloo_link_proxy.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::testing {
namespace {

constexpr absl::Duration kRunDeadline = absl::Seconds(120);

// The highest step `p` has printed (-1: none).
int64_t LastStep(Process& p) {
  int64_t last = -1;
  for (const std::string& line : p.OutLines()) {
    absl::StatusOr<TraceLine> l = ParseTraceLine(line);
    if (l.ok()) last = std::max(last, l->step);
  }
  return last;
}

class ClientUpdateTest : public ::testing::Test {
 protected:
  explicit ClientUpdateTest(std::vector<std::string> coordinator_flags = {})
      : cluster_("update", std::move(coordinator_flags)) {}
  ~ClientUpdateTest() override { workers_.clear(); }

  // Creates `spec` and starts its ranks for `steps` steps, each step at least `delay_ms`;
  // rank r with `rank_flags[r]` too.
  void Start(const v1::JobSpec& spec, int64_t steps, int64_t delay_ms,
             const std::vector<std::vector<std::string>>& rank_flags = {}) {
    ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
    absl::StatusOr<v1::Job> made = cluster_.admin()->CreateJob(spec);
    ASSERT_TRUE(made.ok()) << made.status();
    for (int r = 0; r < spec.world_size(); ++r) {
      std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                       "--coordinator=" + cluster_.coordinator().address(),
                                       "--job=" + spec.job_id(),
                                       absl::StrCat("--rank=", r),
                                       absl::StrCat("--world_size=", spec.world_size()),
                                       absl::StrCat("--steps=", steps),
                                       "--numel=8",
                                       "--backend=gloo",
                                       absl::StrCat("--step_delay_ms=", delay_ms),
                                       "--join_timeout_ms=30000",
                                       "--collective_timeout_ms=30000",
                                       "--log_level=info"};
      if (static_cast<size_t>(r) < rank_flags.size()) {
        argv.insert(argv.end(), rank_flags[r].begin(), rank_flags[r].end());
      }
      workers_.push_back(std::make_unique<Process>(
          argv, absl::StrCat(cluster_.dir(), "/", spec.job_id(), "-rank", r)));
    }
  }

  // Waits until every rank has printed `step`.
  void WaitForStep(int64_t step) {
    const absl::Time deadline = absl::Now() + kRunDeadline;
    for (auto& w : workers_) {
      while (LastStep(*w) < step) {
        ASSERT_LT(absl::Now(), deadline) << "no rank reached step " << step << ": " << w->err();
        ASSERT_FALSE(w->Wait(absl::ZeroDuration()).has_value()) << w->err();
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
  }

  // UpdateJob; the switch step, after checking what the answer says.
  int64_t Update(const v1::JobSpec& spec, int expect_version) {
    int64_t before = -1;
    for (auto& w : workers_) before = std::max(before, LastStep(*w));
    absl::StatusOr<v1::UpdateJobResponse> r = cluster_.admin()->UpdateJob(spec);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return -1;
    EXPECT_EQ(r->plan_version(), expect_version);
    EXPECT_GT(r->switch_step(), before);
    EXPECT_EQ(r->job().pending_plan().version(), expect_version);
    EXPECT_EQ(r->job().pending_plan().switch_step(), r->switch_step());
    // Soon: the members gave back their windows (4096 steps), so the switch lies well within
    // the window they held when the update came.
    EXPECT_LT(r->switch_step(), before + 4096) << "no member gave back its window";
    std::printf("plan version %d switches at step %lld; the ranks had printed up to step %lld\n",
                expect_version, static_cast<long long>(r->switch_step()),
                static_cast<long long>(before));
    return r->switch_step();
  }

  // Every rank exits 0; every line follows the reference.
  void ExpectFollowsReference(const std::vector<std::pair<v1::JobSpec, int64_t>>& plans,
                              int64_t steps) {
    const auto want = PlanReference(plans, steps);
    const int world = plans[0].first.world_size();
    ASSERT_EQ(workers_.size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      std::optional<int> code = workers_[r]->Wait(kRunDeadline);
      ASSERT_EQ(code.value_or(-1), 0) << "rank " << r << ": " << workers_[r]->err();
      absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
      ASSERT_TRUE(t.ok()) << t.status();
      ASSERT_EQ(t->lines.size(), static_cast<size_t>(steps)) << "rank " << r;
      for (int64_t s = 0; s < steps; ++s) {
        const TraceLine& l = t->lines[s];
        const PlanReferenceStep& w = want[s][r];
        const std::string where = absl::StrCat("rank ", r, " step ", s, ": ", l.text);
        ASSERT_EQ(l.step, s) << where;
        EXPECT_EQ(l.plan, w.plan) << where;
        EXPECT_EQ(l.action, w.average ? "AVERAGE" : "SKIP") << where;
        EXPECT_EQ(l.level, w.level) << where;
        EXPECT_EQ(l.outer, w.outer) << where;
        // float32 parameters and state (values grow to ~1e7) against double arithmetic.
        EXPECT_NEAR(l.value, w.value, std::max(1e-3, 1e-5 * std::fabs(w.value)))
            << where << " (reference " << w.value << ")";
      }
    }
  }

  // GetJob's plan history: versions, switch steps.
  void ExpectHistory(const std::string& job, const std::vector<int64_t>& switch_steps) {
    absl::StatusOr<v1::Job> j = cluster_.admin()->GetJob(job);
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_EQ(j->plan_history_size(), static_cast<int>(switch_steps.size()));
    for (int v = 0; v < j->plan_history_size(); ++v) {
      EXPECT_EQ(j->plan_history(v).version(), v);
      EXPECT_EQ(j->plan_history(v).switch_step(), switch_steps[v]);
    }
  }

  Cluster cluster_;
  std::vector<std::unique_ptr<Process>> workers_;
};

v1::JobSpec WithOuter(v1::JobSpec spec, int level, double lr, double momentum, bool nesterov) {
  v1::OuterOptimizer* o = spec.mutable_levels(level)->mutable_outer();
  o->set_lr(lr);
  o->set_momentum(momentum);
  o->set_nesterov(nesterov);
  return spec;
}

TEST_F(ClientUpdateTest, PeriodChangedMidRun_EveryRankEveryStepFollowsTheNewPlanFromE) {
  const v1::JobSpec a = MakeSpec("period", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, 3000);
  const v1::JobSpec b = MakeSpec("period", 4, v1::HIERARCHICAL, {{3, 2}, {8, 4}}, 0, 3000);
  constexpr int64_t kSteps = 700;
  Start(a, kSteps, 2);
  WaitForStep(60);
  const int64_t e = Update(b, 1);
  ASSERT_GT(e, 0);
  ASSERT_LT(e, kSteps) << "the run ended before the switch: make it longer";
  ExpectFollowsReference({{a, 0}, {b, e}}, kSteps);
  ExpectHistory("period", {0, e});
}

TEST_F(ClientUpdateTest, OuterLevelAddedMidRun_ItStartsWithAPlainAverageAfterE) {
  const v1::JobSpec a = MakeSpec("added", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 3000);
  v1::JobSpec b = MakeSpec("added", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}, {16, 4}}, 0, 3000);
  b = WithOuter(b, 2, 0.7, 0.9, true);
  constexpr int64_t kSteps = 700;
  Start(a, kSteps, 2);
  WaitForStep(60);
  const int64_t e = Update(b, 1);
  ASSERT_GT(e, 0);
  ASSERT_LT(e, kSteps);
  ExpectFollowsReference({{a, 0}, {b, e}}, kSteps);
}

TEST_F(ClientUpdateTest, DiLoCoOuterLrDecayedTwice_AnchorsAndMomentaCarryAcross) {
  v1::JobSpec a = MakeSpec("decay", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 3000);
  a = WithOuter(a, 1, 0.7, 0.9, true);
  const v1::JobSpec b = WithOuter(a, 1, 0.35, 0.9, true);
  const v1::JobSpec c = WithOuter(a, 1, 0.175, 0.9, true);
  constexpr int64_t kSteps = 1000;
  Start(a, kSteps, 2);
  WaitForStep(60);
  const int64_t e1 = Update(b, 1);
  ASSERT_GT(e1, 0);
  WaitForStep(e1 + 20);
  const int64_t e2 = Update(c, 2);
  ASSERT_GT(e2, e1);
  ASSERT_LT(e2, kSteps);
  ExpectFollowsReference({{a, 0}, {b, e1}, {c, e2}}, kSteps);
  ExpectHistory("decay", {0, e1, e2});
}

TEST_F(ClientUpdateTest, ElasticJob_GroupSizeOfAnOuterLevelChanged_ItStartsAfresh) {
  v1::JobSpec a = MakeSpec("elastic", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 3000);
  a.set_min_world_size(2);
  a = WithOuter(a, 0, 0.8, 0.5, false);
  v1::JobSpec b = MakeSpec("elastic", 4, v1::HIERARCHICAL, {{4, 4}, {8, 4}}, 0, 3000);
  b.set_min_world_size(3);
  b = WithOuter(b, 0, 0.8, 0.5, false);
  constexpr int64_t kSteps = 700;
  Start(a, kSteps, 2);
  WaitForStep(60);
  const int64_t e = Update(b, 1);
  ASSERT_GT(e, 0);
  ASSERT_LT(e, kSteps);
  ExpectFollowsReference({{a, 0}, {b, e}}, kSteps);
  absl::StatusOr<v1::Job> j = cluster_.admin()->GetJob("elastic");
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->spec().min_world_size(), 3);
}

// A member cut off from the coordinator while UpdateJob runs (its connection silent, as a
// dropped route leaves it): it cannot answer, so it holds the switch step back to the end of the
// decisions it was handed (its window of 400 steps), never further; once the link is back it
// learns the switch step, and every member switches there.
TEST_F(ClientUpdateTest, MemberCutOffFromTheCoordinator_HoldsTheSwitchToTheEndOfItsWindow) {
  ASSERT_TRUE(cluster_.ok());
  const std::string& address = cluster_.coordinator().address();
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  target.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
  const int listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(at);
  ASSERT_EQ(bind(listen_fd, reinterpret_cast<sockaddr*>(&at), len), 0);
  ASSERT_EQ(getsockname(listen_fd, reinterpret_cast<sockaddr*>(&at), &len), 0);
  ASSERT_EQ(listen(listen_fd, 16), 0);
  LinkProxy proxy(listen_fd, target);
  const std::string through = absl::StrCat("127.0.0.1:", ntohs(at.sin_port));

  // A heartbeat timeout long enough that the silent member is not declared dead meanwhile.
  const v1::JobSpec a = MakeSpec("cutoff", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 30000);
  const v1::JobSpec b = MakeSpec("cutoff", 4, v1::HIERARCHICAL, {{4, 2}, {16, 4}}, 0, 30000);
  constexpr int64_t kWindow = 400;
  constexpr int64_t kSteps = 900;
  std::vector<std::vector<std::string>> flags(4, {absl::StrCat("--schedule_window=", kWindow)});
  flags[3].push_back("--coordinator=" + through);  // the later flag wins
  Start(a, kSteps, 2, flags);
  WaitForStep(40);
  ASSERT_LT(LastStep(*workers_[3]), kWindow - 100) << "rank 3 is past its first window already";
  proxy.StallAfter(0);
  const int64_t e = Update(b, 1);
  // Rank 3 said nothing: the switch lies past its window [0, 400), not at the others' answers.
  EXPECT_EQ(e, kWindow);
  proxy.Resume();
  ExpectFollowsReference({{a, 0}, {b, e}}, kSteps);
}

// A streaming outer level changed mid-run (docs/streaming.md): its payload to INT8 and its lr
// (fragments 2, a sync delay of 1 step both before and after), and a whole-model FP32 outer level
// moved to INT8 with error feedback (one fragment: its state moves to the per-fragment path).
// Both keep their anchors and momenta across E; every tensor of every rank at every step against
// the streaming rule restated with the INT8 encoding (streaming_reference.h).
TEST_F(ClientUpdateTest, PayloadChangedToInt8MidRun_AnchorsCarryEveryTensorFollowsTheRule) {
  // Short, slow steps and no momentum: the reference restates INT8 exactly, and over a long run
  // at large values a float32 rounding that moves one element to the next INT8 level would be
  // amplified past any tolerance that still checks something.
  constexpr int kTensors = 4;
  v1::JobSpec a = MakeSpec("payload", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 3000);
  a = WithOuter(a, 1, 0.7, 0.0, false);
  a.mutable_levels(1)->set_fragments(2);
  a.mutable_levels(1)->set_sync_delay(1);
  a = WithOuter(a, 0, 0.9, 0.0, false);
  v1::JobSpec b = a;
  b.mutable_levels(1)->set_payload(v1::INT8);
  b.mutable_levels(1)->mutable_outer()->set_lr(0.5);
  b.mutable_levels(0)->set_payload(v1::INT8);
  b.mutable_levels(0)->set_error_feedback(1.0);
  constexpr int64_t kSteps = 240;
  Start(a, kSteps, 8, std::vector<std::vector<std::string>>(
                          4, {absl::StrCat("--tensors=", kTensors), "--numel=16"}));
  WaitForStep(20);
  const int64_t e = Update(b, 1);
  ASSERT_GT(e, 0);
  ASSERT_LT(e, kSteps - 60) << "too few steps after the switch: slow the steps down";
  const auto want = StreamingReference({{a, 0}, {b, e}}, kSteps, kTensors, /*model_payload=*/true);
  // Near misses: the old lr kept past E, and the anchors dropped at E (as if the level's group
  // size had changed for a step).
  v1::JobSpec old_lr = b;
  old_lr.mutable_levels(1)->mutable_outer()->set_lr(0.7);
  v1::JobSpec afresh = b;
  afresh.mutable_levels(1)->set_group_size(2);
  const std::vector<std::vector<std::vector<StreamingStep>>> near_misses = {
      StreamingReference({{a, 0}, {old_lr, e}}, kSteps, kTensors, true),
      StreamingReference({{a, 0}, {afresh, e}, {b, e + 1}}, kSteps, kTensors, true)};
  for (int r = 0; r < 4; ++r) {
    std::optional<int> code = workers_[r]->Wait(kRunDeadline);
    ASSERT_EQ(code.value_or(-1), 0) << "rank " << r << ": " << workers_[r]->err();
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->lines.size(), static_cast<size_t>(kSteps));
    // The reference restates INT8 in double precision where the workers compute in float32: an
    // element that the two round to either side of an INT8 level's midpoint moves by one level
    // (M / 127, M the block's largest |A - x|, here up to ~1% of the values), which later outer
    // steps carry on. So past E each value must be within 2% of the rule's and, wherever a near
    // miss differs from the rule by more than 4% (a few such levels), nearer the rule than the
    // near miss.
    int told_apart = 0;
    for (int64_t s = 0; s < kSteps; ++s) {
      const TraceLine& l = t->lines[s];
      const StreamingStep& w = want[s][r];
      const std::string where = absl::StrCat("rank ", r, " step ", s, ": ", l.text);
      EXPECT_EQ(l.plan, s < e ? 0 : 1) << where;
      EXPECT_EQ(l.level, w.level) << where;
      ASSERT_EQ(l.values.size(), static_cast<size_t>(kTensors)) << where;
      for (int k = 0; k < kTensors; ++k) {
        const double got = l.values[k], rule = w.values[k];
        if (s < e) {
          EXPECT_NEAR(got, rule, std::max(1e-3, 1e-5 * std::fabs(rule))) << where << " tensor " << k;
          continue;
        }
        EXPECT_NEAR(got, rule, 2e-2 * std::fabs(rule)) << where << " tensor " << k;
        for (const auto& miss : near_misses) {
          const double other = miss[s][r].values[k];
          if (std::fabs(other - rule) <= 4e-2 * std::fabs(rule)) continue;
          ++told_apart;
          EXPECT_LT(std::fabs(got - rule), std::fabs(got - other))
              << where << " tensor " << k << ": nearer a near miss (" << other << ") than the rule ("
              << rule << ")";
        }
      }
    }
    EXPECT_GT(told_apart, 0) << "no near miss differs from the rule: the run shows nothing";
  }
}

// Each refusal names what is wrong, and the running job keeps its one plan.
TEST_F(ClientUpdateTest, RefusedChanges_ClearErrorsAndTheJobUnchanged) {
  const v1::JobSpec a = MakeSpec("refused", 2, v1::HIERARCHICAL, {{2, 2}}, 50, 3000);
  // Not RUNNING yet: nobody joined.
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.admin()->CreateJob(a).ok());
  absl::StatusOr<v1::UpdateJobResponse> pending = cluster_.admin()->UpdateJob(a);
  EXPECT_TRUE(absl::IsFailedPrecondition(pending.status())) << pending.status();
  EXPECT_TRUE(absl::StrContains(pending.status().message(), "RUNNING")) << pending.status();
  ASSERT_TRUE(cluster_.admin()->DeleteJob("refused").ok());

  Start(a, 4000, 1);
  WaitForStep(60);  // past the warm-up of 50
  struct Case {
    std::string what;
    v1::JobSpec spec;
    absl::StatusCode code;
    std::string names;
  };
  std::vector<Case> cases;
  v1::JobSpec world = MakeSpec("refused", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 50, 3000);
  cases.push_back({"world_size", world, absl::StatusCode::kInvalidArgument, "world_size"});
  v1::JobSpec mode = a;
  mode.set_mode(v1::PERIODIC);
  cases.push_back({"mode", mode, absl::StatusCode::kInvalidArgument, "mode"});
  v1::JobSpec replica = a;
  replica.set_replica_size(2);
  replica.mutable_levels(0)->set_group_size(2);
  cases.push_back({"replica_size", replica, absl::StatusCode::kInvalidArgument, "replica_size"});
  v1::JobSpec elastic = a;
  elastic.set_min_world_size(1);
  cases.push_back({"min_world_size", elastic, absl::StatusCode::kInvalidArgument,
                   "min_world_size"});
  v1::JobSpec warmup = a;
  warmup.set_warmup_steps(10);
  cases.push_back({"warmup_steps", warmup, absl::StatusCode::kFailedPrecondition,
                   "warmup_steps"});
  v1::JobSpec bad = a;
  bad.mutable_levels(0)->set_period(0);
  cases.push_back({"a spec CreateJob refuses", bad, absl::StatusCode::kInvalidArgument,
                   "period"});
  v1::JobSpec other = a;
  other.set_job_id("another");
  for (const Case& c : cases) {
    absl::StatusOr<v1::UpdateJobResponse> r = cluster_.admin()->UpdateJob(c.spec);
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.names)) << c.what << ": "
                                                                   << r.status();
  }
  // Another job's spec names another job: that one does not exist.
  absl::StatusOr<v1::UpdateJobResponse> mismatch = cluster_.admin()->UpdateJob(other);
  EXPECT_TRUE(absl::IsNotFound(mismatch.status())) << mismatch.status();
  absl::StatusOr<v1::Job> j = cluster_.admin()->GetJob("refused");
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->plan_history_size(), 1);
  EXPECT_FALSE(j->has_pending_plan());
  EXPECT_EQ(j->state(), v1::RUNNING);
  for (auto& w : workers_) w->Signal(SIGTERM);
}

// DeleteJob about 90 ms after UpdateJob, while the members answer its proposal: every member
// ends within seconds, saying that the job was deleted (a member that had given back its
// decisions used to wait for the switch step for the whole outage timeout, 5 minutes, and then
// fail "coordinator has not answered": that wait is client_session_clock_test's
// DecisionWaitingForASwitch_SessionBroken_FailsAtOnceWithTheReason).
TEST_F(ClientUpdateTest, DeletedWhileAnUpdateIsPending_EveryMemberFailsAtOnceSayingSo) {
  const v1::JobSpec a = MakeSpec("deleted", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, 3000);
  const v1::JobSpec b = MakeSpec("deleted", 4, v1::HIERARCHICAL, {{4, 2}, {8, 4}}, 0, 3000);
  Start(a, 1000000, 2);
  WaitForStep(40);
  absl::StatusOr<v1::UpdateJobResponse> updated;
  std::thread update([&] { updated = cluster_.admin()->UpdateJob(b); });
  absl::SleepFor(absl::Milliseconds(90));
  const absl::Status deleted = cluster_.admin()->DeleteJob("deleted");
  const absl::Time at = absl::Now();
  update.join();
  ASSERT_TRUE(deleted.ok()) << deleted;
  std::printf("UpdateJob answered %s\n", updated.status().ToString().c_str());
  for (int r = 0; r < 4; ++r) {
    const std::optional<int> code = workers_[r]->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still runs 30 s after DeleteJob:\n"
                                  << workers_[r]->err();
    EXPECT_NE(*code, 0) << "rank " << r;
    EXPECT_TRUE(absl::StrContains(workers_[r]->err(), "deleted"))
        << "rank " << r << ": " << workers_[r]->err();
    std::printf("rank %d exited %d, %.2f s after DeleteJob\n", r, *code,
                absl::ToDoubleSeconds(absl::Now() - at));
  }
}

// The coordinator, killed (-9) between UpdateJob and the switch step and restarted on its state
// directory (same port): the plan and E survive, and every member switches at E.
TEST(ClientUpdateRestartTest, CoordinatorKilledBetweenUpdateAndSwitch_EveryMemberSwitchesAtE) {
  TempDir dir("update_restart");
  ASSERT_FALSE(dir.path().empty());
  const std::string state = dir.path() + "/state";
  int runs = 0;
  auto start = [&](const std::string& listen) {
    const std::string run = absl::StrCat(dir.path(), "/run", runs++);
    std::filesystem::create_directories(run);
    std::vector<std::string> flags = {"--state_dir=" + state, "--log_level=info"};
    if (!listen.empty()) flags.push_back("--listen=" + listen);
    std::unique_ptr<CoordinatorProcess> c;
    // The killed incarnation's port can take a moment to be free again.
    for (int attempt = 0; attempt < 50; ++attempt) {
      c = std::make_unique<CoordinatorProcess>(MODELAVG_COORDINATOR_BIN, run, flags);
      if (!c->address().empty() || listen.empty()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return c;
  };
  std::unique_ptr<CoordinatorProcess> coordinator = start("");
  ASSERT_FALSE(coordinator->address().empty()) << coordinator->process().err();
  const std::string address = coordinator->address();
  client::ConnectionOptions o;
  o.coordinator = address;
  absl::StatusOr<std::unique_ptr<client::CoordinatorClient>> admin =
      client::CoordinatorClient::Create(o);
  ASSERT_TRUE(admin.ok());
  v1::JobSpec a = MakeSpec("restart", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, 3000);
  a = WithOuter(a, 1, 0.7, 0.9, true);
  const v1::JobSpec b = WithOuter(MakeSpec("restart", 4, v1::HIERARCHICAL, {{4, 2}, {16, 4}},
                                           0, 3000),
                                  1, 0.35, 0.9, true);
  ASSERT_TRUE((*admin)->CreateJob(a).ok());
  constexpr int64_t kSteps = 700;
  std::vector<std::unique_ptr<Process>> workers;
  for (int r = 0; r < 4; ++r) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{MODELAVG_TRACE_WORKER_BIN, "--coordinator=" + address,
                                 "--job=restart", absl::StrCat("--rank=", r), "--world_size=4",
                                 absl::StrCat("--steps=", kSteps), "--numel=8", "--backend=gloo",
                                 "--step_delay_ms=2", "--log_level=info"},
        absl::StrCat(dir.path(), "/restart-rank", r)));
  }
  const absl::Time deadline = absl::Now() + kRunDeadline;
  while (LastStep(*workers[0]) < 60) {
    ASSERT_LT(absl::Now(), deadline) << workers[0]->err();
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::StatusOr<v1::UpdateJobResponse> r = (*admin)->UpdateJob(b);
  ASSERT_TRUE(r.ok()) << r.status();
  const int64_t e = r->switch_step();
  coordinator->process().Signal(SIGKILL);
  coordinator->process().Wait(absl::Seconds(10));
  int64_t at_kill = -1;
  for (auto& w : workers) at_kill = std::max(at_kill, LastStep(*w));
  std::printf("killed the coordinator at step %lld; the switch is at step %lld\n",
              static_cast<long long>(at_kill), static_cast<long long>(e));
  coordinator = start(address);
  ASSERT_FALSE(coordinator->address().empty()) << coordinator->process().err();
  // The restarted coordinator has the plan and its switch step.
  {
    absl::StatusOr<std::unique_ptr<client::CoordinatorClient>> again =
        client::CoordinatorClient::Create(o);
    ASSERT_TRUE(again.ok());
    absl::StatusOr<v1::Job> j = (*again)->GetJob("restart");
    for (int attempt = 0; attempt < 100 && !j.ok(); ++attempt) {
      absl::SleepFor(absl::Milliseconds(100));  // the new channel connects
      j = (*again)->GetJob("restart");
    }
    ASSERT_TRUE(j.ok()) << j.status() << "\n" << coordinator->process().err();
    ASSERT_EQ(j->plan_history_size(), 2);
    EXPECT_EQ(j->plan_history(1).switch_step(), e);
  }
  const auto want = PlanReference({{a, 0}, {b, e}}, kSteps);
  for (int rank = 0; rank < 4; ++rank) {
    std::optional<int> code = workers[rank]->Wait(kRunDeadline);
    ASSERT_EQ(code.value_or(-1), 0) << "rank " << rank << ": " << workers[rank]->err();
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", rank), workers[rank]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->lines.size(), static_cast<size_t>(kSteps));
    for (int64_t s = 0; s < kSteps; ++s) {
      const TraceLine& l = t->lines[s];
      const PlanReferenceStep& w = want[s][rank];
      const std::string where = absl::StrCat("rank ", rank, " step ", s, ": ", l.text);
      EXPECT_EQ(l.plan, w.plan) << where;
      EXPECT_EQ(l.level, w.level) << where;
      EXPECT_NEAR(l.value, w.value, std::max(1e-3, 1e-5 * std::fabs(w.value))) << where;
    }
  }
  workers.clear();
  coordinator.reset();
}

}  // namespace
}  // namespace modelavg::testing
