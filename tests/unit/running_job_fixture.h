// A coordinator core for liveness tests: a JobRegistry on a fake clock (no staleness thread; the
// test advances the clock) and an in-memory store, a running four-member periodic job, and each
// member's credential for the calls it makes as its rank.
#ifndef MODELAVG_TESTS_UNIT_RUNNING_JOB_FIXTURE_H_
#define MODELAVG_TESTS_UNIT_RUNNING_JOB_FIXTURE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/store/state_store.h"

namespace modelavg::server {

// Records every event of a job it watches (Job::Watch), for tests to read back.
class RecordedEvents final : public JobWatcher {
 public:
  void OnEvent(const v1::JobEvent& event) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(event);
  }
  void OnClosed(const absl::Status&) override {}
  std::vector<v1::JobEvent> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::JobEvent> events_;
};

class RunningJobTest : public ::testing::Test {
 protected:
  explicit RunningJobTest(std::string job_id) : job_id_(std::move(job_id)) {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = absl::Seconds(2);
    options.store = &store_;
    registry_ = std::make_unique<JobRegistry>(options);
  }

  // Job job_id_ (world 4, averaging all four every 2 steps, `extra` spec fields), all four joined.
  std::shared_ptr<Job> RunningJob(const std::string& extra) {
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        absl::StrCat("job_id: \"", job_id_, "\" world_size: 4 mode: PERIODIC ",
                     "levels { period: 2 group_size: 4 } ", extra),
        &spec));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry_->Find(job_id_);
    for (int r = 0; r < 4; ++r) {
      v1::JoinRequest request;
      request.set_job_id(job_id_);
      request.set_worker_id(absl::StrCat("w", r));
      request.set_rank(r);
      job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                [this](absl::StatusOr<v1::JoinResponse> resp) {
                  if (resp.ok()) credentials_[resp->rank()] = resp->credential();
                });
    }
    return job;
  }

  // One beat of `rank` at generation 1 and `step`.
  void Beat(Job& job, int rank, int64_t step) { BeatWith(job, rank, step, -1, 0); }

  // The same, saying how far the rank may use its plans (`used_through`, -1: not said), in
  // answer to proposal `answered` (UpdateJob), holding `plans_known` plans; the reply.
  v1::HeartbeatResponse BeatWith(Job& job, int rank, int64_t step, int64_t used_through,
                                 int32_t answered, int32_t plans_known = 1) {
    v1::HeartbeatRequest hb;
    hb.set_job_id(job_id_);
    hb.set_rank(rank);
    hb.set_generation(1);
    hb.set_step(step);
    hb.set_credential(credentials_[rank]);
    hb.set_used_through(used_through);
    hb.set_proposal_answered(answered);
    hb.set_plans_known(plans_known);
    v1::HeartbeatResponse reply;
    EXPECT_TRUE(job.Heartbeat(hb, &reply).ok());
    return reply;
  }

  v1::Job State(const Job& job) {
    v1::Job state;
    job.ToProto(&state);
    return state;
  }

  const std::string job_id_;
  FakeClock clock_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
  std::map<int, std::string> credentials_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_TESTS_UNIT_RUNNING_JOB_FIXTURE_H_
