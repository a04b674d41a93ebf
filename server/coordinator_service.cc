#include "server/coordinator_service.h"

#include <chrono>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

// Events a slow WatchJob reader may fall behind by before its stream is ended.
constexpr size_t kMaxQueuedEvents = 4096;

absl::Time CallDeadline(const grpc::CallbackServerContext* ctx) {
  const auto deadline = ctx->deadline();
  if (deadline >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

// A unary call that waits in the core (Join, GetCommId). The core completes it exactly once via
// Complete(); OnCancel (client gone or deadline) asks the core to cancel the wait, which then
// completes it with CANCELLED.
class WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  WaitReactor(std::shared_ptr<Job> job, WaitId id, RpcMetrics* metrics, RpcMethod method)
      : job_(std::move(job)), id_(id), metrics_(metrics), method_(method) {}

  void Complete(const absl::Status& status) {
    if (metrics_ != nullptr) metrics_->CountRpc(method_, status.code());
    Finish(ToGrpcStatus(status));
  }
  void OnCancel() override {
    // The wait's completion may finish this reactor (and drop job_) inside CancelWait.
    const std::shared_ptr<Job> job = job_;
    job->CancelWait(id_);
  }
  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<Job> job_;
  const WaitId id_;
  RpcMetrics* const metrics_;
  const RpcMethod method_;
};

// One WatchJob stream. The Job pushes events (in order, never concurrently for one job); at most
// one write is in flight; the rest queue here.
class WatchReactor final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  // Shared between the Job (as its watcher) and the reactor; outlives whichever ends first.
  class Sink final : public JobWatcher {
   public:
    explicit Sink(WatchReactor* reactor) : reactor_(reactor) {}

    void OnEvent(const v1::JobEvent& event) override {
      WatchReactor* start = nullptr;
      const v1::JobEvent* first = nullptr;
      bool overflow = false;
      {
        absl::MutexLock lock(&mu_);
        if (finishing_ || reactor_ == nullptr) return;
        if (queue_.size() >= kMaxQueuedEvents) {
          overflow = true;
        } else {
          queue_.push_back(event);
          if (!writing_) {
            writing_ = true;
            start = reactor_;
            first = &queue_.front();
          }
        }
      }
      if (overflow) {
        OnClosed(absl::ResourceExhaustedError(
            "the WatchJob reader fell too far behind; watch again"));
      }
      if (start != nullptr) start->StartWrite(first);
    }

    void OnClosed(const absl::Status& status) override {
      WatchReactor* finish = nullptr;
      {
        absl::MutexLock lock(&mu_);
        if (finishing_ || reactor_ == nullptr) return;
        if (writing_) {
          close_pending_ = true;
          close_status_ = status;
          return;
        }
        finishing_ = true;
        final_code_ = status.code();
        finish = reactor_;
      }
      finish->Finish(ToGrpcStatus(status));
    }

    absl::StatusCode final_code() const {
      absl::MutexLock lock(&mu_);
      return final_code_;
    }

    bool Done() const override {
      absl::MutexLock lock(&mu_);
      return finishing_ || reactor_ == nullptr;
    }

    void WriteDone(bool ok) {
      WatchReactor* reactor = nullptr;
      const v1::JobEvent* next = nullptr;
      absl::Status close;
      bool finish = false;
      {
        absl::MutexLock lock(&mu_);
        queue_.pop_front();
        reactor = reactor_;
        if (!ok) {
          writing_ = false;
          if (finishing_) return;
          finishing_ = true;
          finish = true;
          close = absl::CancelledError("the WatchJob stream broke");
          final_code_ = close.code();
        } else if (!queue_.empty()) {
          next = &queue_.front();
        } else {
          writing_ = false;
          if (close_pending_ && !finishing_) {
            finishing_ = true;
            finish = true;
            close = close_status_;
            final_code_ = close.code();
          }
        }
      }
      if (next != nullptr) {
        reactor->StartWrite(next);
      } else if (finish) {
        reactor->Finish(ToGrpcStatus(close));
      }
    }

    void Detach() {
      absl::MutexLock lock(&mu_);
      reactor_ = nullptr;
    }

   private:
    mutable absl::Mutex mu_;
    WatchReactor* reactor_ ABSL_GUARDED_BY(mu_);
    std::deque<v1::JobEvent> queue_ ABSL_GUARDED_BY(mu_);
    bool writing_ ABSL_GUARDED_BY(mu_) = false;
    bool finishing_ ABSL_GUARDED_BY(mu_) = false;
    bool close_pending_ ABSL_GUARDED_BY(mu_) = false;
    absl::Status close_status_ ABSL_GUARDED_BY(mu_);
    absl::StatusCode final_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  };

  explicit WatchReactor(RpcMetrics* metrics) : sink_(std::make_shared<Sink>(this)), metrics_(metrics) {}

  // Registers with the job; the snapshot is the first write.
  // Nothing may touch the reactor after this call: a closed job finishes the stream at once.
  void Start(const std::shared_ptr<Job>& job) { job->Watch(sink_); }
  void FinishNow(const absl::Status& status) { sink_->OnClosed(status); }

  void OnWriteDone(bool ok) override { sink_->WriteDone(ok); }
  void OnCancel() override { sink_->OnClosed(absl::CancelledError("the watcher went away")); }
  void OnDone() override {
    sink_->Detach();
    if (metrics_ != nullptr) metrics_->CountRpc(RpcMethod::kWatchJob, sink_->final_code());
    delete this;
  }

 private:
  const std::shared_ptr<Sink> sink_;
  RpcMetrics* const metrics_;
};

// Longest reply_interval_ms a HeartbeatStream may ask for.
constexpr int64_t kMaxReplyIntervalMs = 60000;

// What a heartbeat reply says; two replies that say the same need not both be sent.
bool SameNews(const v1::HeartbeatResponse& a, const v1::HeartbeatResponse& b) {
  if (a.state() != b.state() || a.generation() != b.generation() ||
      a.has_last_change() != b.has_last_change()) {
    return false;
  }
  const v1::GenerationChange& x = a.last_change();
  const v1::GenerationChange& y = b.last_change();
  return x.generation() == y.generation() && x.rank() == y.rank() && x.reason() == y.reason() &&
         x.unix_ms() == y.unix_ms();
}

// HeartbeatStream. The job is looked up once, from the first beat, which also picks the mode:
//  * reply_interval_ms = 0: read a beat, answer it, read the next (one reply per beat);
//  * reply_interval_ms > 0: beats are read back to back and answered only when there is news
//    (the first beat; state, generation or last_change differ from the last reply) or that
//    long has passed since the last reply. At most one write is in flight; a reply due
//    meanwhile waits in pending_ (the newest replaces an older one) and goes out when it
//    completes.
// Reads and writes complete on different threads: the write state is guarded by mu_. Finish is
// called once, when no write is in flight (End defers it otherwise).
class HeartbeatStreamReactor final
    : public grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  HeartbeatStreamReactor(JobRegistry* registry, RpcMetrics* metrics, absl::Status auth)
      : registry_(registry), metrics_(metrics) {
    if (!auth.ok()) {
      End(auth);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return End(absl::OkStatus());  // the client half-closed (or went away)
    // Only the read path touches request_, job_ and reply_interval_ (one read at a time).
    if (job_ == nullptr) {
      const int64_t interval_ms = request_.reply_interval_ms();
      if (interval_ms < 0 || interval_ms > kMaxReplyIntervalMs) {
        return End(absl::InvalidArgumentError(absl::StrCat(
            "reply_interval_ms is ", interval_ms, ": it must be in 0..", kMaxReplyIntervalMs,
            " (0: one reply per beat; otherwise replies on change and at least that often)")));
      }
      reply_interval_ = absl::Milliseconds(interval_ms);
      absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request_.job_id());
      if (!job.ok()) return End(job.status());
      job_ = *std::move(job);
    } else if (request_.job_id() != job_->id()) {
      return End(absl::InvalidArgumentError(absl::StrCat(
          "this HeartbeatStream is for job ", job_->id(), "; open another stream for job ",
          request_.job_id().substr(0, 256))));
    }
    v1::HeartbeatResponse reply;
    if (absl::Status s = job_->Heartbeat(request_, &reply); !s.ok()) return End(s);
    reply.set_coordinator_incarnation(registry_->incarnation());
    const bool per_beat = reply_interval_ == absl::ZeroDuration();
    const absl::Time now = absl::Now();
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      const bool due = per_beat || !replied_ || !SameNews(reply, last_reply_) ||
                       now - last_reply_time_ >= reply_interval_;
      if (due) {
        last_reply_ = reply;
        last_reply_time_ = now;
        replied_ = true;
        if (writing_) {
          pending_ = std::move(reply);
          has_pending_ = true;
        } else {
          out_ = std::move(reply);
          writing_ = true;
          write = true;
        }
      }
    }
    if (write) StartWrite(&out_);
    // One reply per beat: the next read waits for the write (OnWriteDone starts it).
    if (!per_beat || !write) StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    bool write = false;
    bool read = false;
    bool finish = false;
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !finishing_) {
        finishing_ = true;
        finish_status_ = absl::CancelledError("the HeartbeatStream broke");
      }
      if (finishing_) {
        finish = !finished_;
        finished_ = true;
        status = finish_status_;
      } else if (has_pending_) {
        out_ = std::move(pending_);
        has_pending_ = false;
        writing_ = true;
        write = true;
      } else {
        // Streaming mode has a read outstanding already.
        read = reply_interval_ == absl::ZeroDuration();
      }
    }
    if (write) {
      StartWrite(&out_);
    } else if (finish) {
      FinishWith(status);
    } else if (read) {
      StartRead(&request_);
    }
  }

  void OnDone() override { delete this; }

 private:
  // Ends the stream with `status` now, or once the write in flight completes.
  void End(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      finish_status_ = status;
      if (writing_) return;  // OnWriteDone finishes
      finished_ = true;
    }
    FinishWith(status);
  }
  void FinishWith(const absl::Status& status) {
    if (metrics_ != nullptr) metrics_->CountRpc(RpcMethod::kHeartbeatStream, status.code());
    Finish(ToGrpcStatus(status));
  }

  JobRegistry* const registry_;
  RpcMetrics* const metrics_;
  std::shared_ptr<Job> job_;
  v1::HeartbeatRequest request_;
  absl::Duration reply_interval_ = absl::ZeroDuration();

  absl::Mutex mu_;
  // The write in flight; set under mu_, and only while no write is in flight.
  v1::HeartbeatResponse out_;
  v1::HeartbeatResponse pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool replied_ ABSL_GUARDED_BY(mu_) = false;
  v1::HeartbeatResponse last_reply_ ABSL_GUARDED_BY(mu_);
  absl::Time last_reply_time_ ABSL_GUARDED_BY(mu_);
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // End was called (Finish may be deferred)
  bool finished_ ABSL_GUARDED_BY(mu_) = false;   // Finish was called
  absl::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

CoordinatorService::CoordinatorService(JobRegistry* registry, std::string auth_token,
                                       RpcMetrics* metrics)
    : registry_(registry),
      expected_authorization_(auth_token.empty() ? "" : absl::StrCat("Bearer ", auth_token)),
      metrics_(metrics) {}

absl::Status CoordinatorService::Authorize(const grpc::CallbackServerContext* ctx) const {
  if (expected_authorization_.empty()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "this coordinator needs metadata \"authorization: Bearer <token>\"");
  }
  // Compare in time independent of where the first difference is.
  const grpc::string_ref got = it->second;
  const std::string& want = expected_authorization_;
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got.data()[i] : 0));
  }
  if (diff != 0) return absl::UnauthenticatedError("the authorization token is wrong");
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CoordinatorService::Finish(grpc::CallbackServerContext* ctx,
                                                     RpcMethod method,
                                                     const absl::Status& status) {
  Count(method, status.code());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::CreateJob(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateJobRequest* request,
                                                        v1::Job* response) {
  absl::Status s = Authorize(ctx);
  if (s.ok()) s = registry_->CreateJob(request->spec(), response);
  return Finish(ctx, RpcMethod::kCreateJob, s);
}

grpc::ServerUnaryReactor* CoordinatorService::GetJob(grpc::CallbackServerContext* ctx,
                                                     const v1::GetJobRequest* request,
                                                     v1::Job* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kGetJob, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (job.ok()) (*job)->ToProto(response);
  return Finish(ctx, RpcMethod::kGetJob, job.status());
}

grpc::ServerUnaryReactor* CoordinatorService::ListJobs(grpc::CallbackServerContext* ctx,
                                                       const v1::ListJobsRequest* request,
                                                       v1::ListJobsResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kListJobs, s);
  for (const auto& job : registry_->ListJobs()) job->ToProto(response->add_jobs());
  return Finish(ctx, RpcMethod::kListJobs, absl::OkStatus());
}

grpc::ServerUnaryReactor* CoordinatorService::DeleteJob(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteJobRequest* request,
                                                        v1::DeleteJobResponse* response) {
  absl::Status s = Authorize(ctx);
  if (s.ok()) s = registry_->DeleteJob(request->job_id());
  return Finish(ctx, RpcMethod::kDeleteJob, s);
}

grpc::ServerUnaryReactor* CoordinatorService::Join(grpc::CallbackServerContext* ctx,
                                                   const v1::JoinRequest* request,
                                                   v1::JoinResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kJoin, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kJoin, job.status());
  const WaitId id = registry_->NewWaitId();
  auto* reactor = new WaitReactor(*job, id, metrics_, RpcMethod::kJoin);
  // Nothing may touch `reactor` after this call: the core may finish it at once.
  (*job)->Join(*request, CallDeadline(ctx), id,
               [reactor, response,
                incarnation = registry_->incarnation()](absl::StatusOr<v1::JoinResponse> result) {
                 if (result.ok()) {
                   *response = *std::move(result);
                   response->set_coordinator_incarnation(incarnation);
                 }
                 reactor->Complete(result.status());
               });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kHeartbeat, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kHeartbeat, job.status());
  response->set_coordinator_incarnation(registry_->incarnation());
  return Finish(ctx, RpcMethod::kHeartbeat, (*job)->Heartbeat(*request, response));
}

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>*
CoordinatorService::HeartbeatStream(grpc::CallbackServerContext* ctx) {
  return new HeartbeatStreamReactor(registry_, metrics_, Authorize(ctx));
}

grpc::ServerUnaryReactor* CoordinatorService::Step(grpc::CallbackServerContext* ctx,
                                                   const v1::StepRequest* request,
                                                   v1::StepDecision* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kStep, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kStep, job.status());
  return Finish(ctx, RpcMethod::kStep, (*job)->Step(*request, response));
}

grpc::ServerUnaryReactor* CoordinatorService::GetSchedule(grpc::CallbackServerContext* ctx,
                                                          const v1::GetScheduleRequest* request,
                                                          v1::GetScheduleResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kGetSchedule, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kGetSchedule, job.status());
  return Finish(ctx, RpcMethod::kGetSchedule, (*job)->GetSchedule(*request, response));
}

grpc::ServerUnaryReactor* CoordinatorService::PublishCommId(
    grpc::CallbackServerContext* ctx, const v1::PublishCommIdRequest* request,
    v1::PublishCommIdResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kPublishCommId, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kPublishCommId, job.status());
  return Finish(ctx, RpcMethod::kPublishCommId, (*job)->PublishCommId(*request));
}

grpc::ServerUnaryReactor* CoordinatorService::GetCommId(grpc::CallbackServerContext* ctx,
                                                        const v1::GetCommIdRequest* request,
                                                        v1::GetCommIdResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kGetCommId, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kGetCommId, job.status());
  const WaitId id = registry_->NewWaitId();
  auto* reactor = new WaitReactor(*job, id, metrics_, RpcMethod::kGetCommId);
  (*job)->GetCommId(*request, CallDeadline(ctx), id,
                    [reactor, response](absl::StatusOr<std::string> result) {
                      if (result.ok()) response->set_unique_id(*std::move(result));
                      reactor->Complete(result.status());
                    });
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(grpc::CallbackServerContext* ctx,
                                                    const v1::LeaveRequest* request,
                                                    v1::LeaveResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kLeave, s);
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request->job_id());
  if (!job.ok()) return Finish(ctx, RpcMethod::kLeave, job.status());
  return Finish(ctx, RpcMethod::kLeave, (*job)->Leave(*request, response));
}

grpc::ServerWriteReactor<v1::JobEvent>* CoordinatorService::WatchJob(
    grpc::CallbackServerContext* ctx, const v1::WatchJobRequest* request) {
  auto* reactor = new WatchReactor(metrics_);
  absl::Status s = Authorize(ctx);
  absl::StatusOr<std::shared_ptr<Job>> job;
  if (s.ok()) {
    job = registry_->Find(request->job_id());
    s = job.status();
  }
  if (!s.ok()) {
    reactor->FinishNow(s);
  } else {
    reactor->Start(*job);
  }
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Ping(grpc::CallbackServerContext* ctx,
                                                   const v1::PingRequest* request,
                                                   v1::PingResponse* response) {
  if (absl::Status s = Authorize(ctx); !s.ok()) return Finish(ctx, RpcMethod::kPing, s);
  response->set_unix_ms(absl::ToUnixMillis(absl::Now()));
  response->set_coordinator_incarnation(registry_->incarnation());
  return Finish(ctx, RpcMethod::kPing, absl::OkStatus());
}

}  // namespace modelavg::server
