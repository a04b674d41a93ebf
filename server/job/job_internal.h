// What the Job's own files (job.cc and its families: job_rounds.cc, job_plans.cc, job_views.cc)
// share and nothing else includes: the Outbox that runs a call's completions and events once the
// Job's lock is released, and small helpers.
#ifndef MODELAVG_SERVER_JOB_JOB_INTERNAL_H_
#define MODELAVG_SERVER_JOB_JOB_INTERNAL_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/job/job.h"

namespace modelavg::server {

inline int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

// Collects completions and events under Job::mu_; runs them once mu_ is released (it is declared
// before the MutexLock, so it is destroyed after it). The first event takes delivery_mu_ while
// mu_ is still held, so that events of concurrent calls reach watchers in the order they
// happened.
class Job::Outbox {
 public:
  explicit Outbox(Job* job) : job_(job) {}
  ~Outbox() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) {
      for (auto& [target, event] : events_) {
        if (target != nullptr) {
          target->OnEvent(event);
          continue;
        }
        for (auto& w : watchers_) w->OnEvent(event);
      }
      for (auto& w : closing_) w->OnClosed(close_status_);
      job_->delivery_mu_.Unlock();
    }
    // Last, with no lock of the Job held: a completion may end the RPC that owns the Job.
    for (auto& f : completions_) f();
  }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  void Complete(absl::AnyInvocable<void()> f) { completions_.push_back(std::move(f)); }
  // Calls `done(result)` once mu_ is released: a wait's answer, a reply or a failure.
  template <typename Callback, typename Result>
  void Answer(Callback done, Result result) {
    Complete([done = std::move(done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }

  // Requires job_->mu_ held.
  void Event(std::shared_ptr<JobWatcher> target, v1::JobEvent event)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    StartDelivery();
    events_.emplace_back(std::move(target), std::move(event));
  }
  void CloseWatchers(std::vector<std::shared_ptr<JobWatcher>> watchers, absl::Status status) {
    StartDelivery();
    closing_ = std::move(watchers);
    close_status_ = std::move(status);
  }

 private:
  void StartDelivery() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) return;
    job_->delivery_mu_.Lock();
    delivering_ = true;
    for (auto& [id, w] : job_->watchers_) watchers_.push_back(w);
  }

  Job* job_;
  std::vector<absl::AnyInvocable<void()>> completions_;
  bool delivering_ = false;
  std::vector<std::shared_ptr<JobWatcher>> watchers_;
  std::vector<std::pair<std::shared_ptr<JobWatcher>, v1::JobEvent>> events_;
  std::vector<std::shared_ptr<JobWatcher>> closing_;
  absl::Status close_status_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_JOB_INTERNAL_H_
