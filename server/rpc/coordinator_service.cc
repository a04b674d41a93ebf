#include "server/rpc/coordinator_service.h"

#include <chrono>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "proto/status_conversion.h"
#include "server/core/heartbeat_replies.h"
#include "server/core/host_heartbeats.h"
#include "server/rpc/stream_writes.h"
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

// The request of a call as bytes, parsed here so that bytes that are no such message get
// INVALID_ARGUMENT saying so (gRPC's own parse failure is UNIMPLEMENTED with no message).
absl::Status Parse(const grpc::ByteBuffer& raw, google::protobuf::Message* message,
                   const char* rpc) {
  grpc::ByteBuffer copy(raw);  // shares the slices; Deserialize consumes its buffer
  message->Clear();
  if (grpc::SerializationTraits<google::protobuf::Message>::Deserialize(&copy, message).ok()) {
    return absl::OkStatus();
  }
  message->Clear();
  return absl::InvalidArgumentError(absl::StrCat(
      "could not parse the request: ", rpc, " takes a ", message->GetDescriptor()->full_name(),
      " (protobuf), and these ", raw.Length(), " bytes are not one"));
}

void Serialize(const google::protobuf::Message& message, grpc::ByteBuffer* out) {
  bool own = false;
  out->Clear();
  (void)grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, out, &own);
}

}  // namespace

// One unary call: its parsed request, its typed response, and the raw reply that the response is
// serialized into when the call succeeds. Reply() finishes it exactly once; a call that waits in
// the core (Join, GetCommId) sets what its cancellation does.
template <typename Request, typename Response>
class CoordinatorService::Call final : public grpc::ServerUnaryReactor {
 public:
  Call(grpc::ByteBuffer* reply, RpcMetrics* metrics, RpcMethod method)
      : reply_(reply), metrics_(metrics), method_(method) {}

  Request request;
  Response response;

  void Reply(const absl::Status& status) {
    if (metrics_ != nullptr) metrics_->CountRpc(method_, status.code());
    if (status.ok()) Serialize(response, reply_);
    Finish(ToGrpcStatus(status));
  }
  // Must be set before the handler returns (OnCancel comes only after).
  void SetOnCancel(absl::AnyInvocable<void()> on_cancel) { on_cancel_ = std::move(on_cancel); }

  void OnCancel() override {
    // The wait's completion may finish this call inside on_cancel.
    absl::AnyInvocable<void()> on_cancel = std::move(on_cancel_);
    if (on_cancel) on_cancel();
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer* const reply_;
  RpcMetrics* const metrics_;
  const RpcMethod method_;
  absl::AnyInvocable<void()> on_cancel_;
};

namespace {

// One WatchJob stream. The Job pushes events (in order, never concurrently for one job); they
// are written one at a time, up to kMaxQueuedEvents waiting.
class WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  using Writes = StreamWrites<WatchReactor>;

  // Shared between the Job (as its watcher) and the reactor; outlives whichever ends first.
  class Sink final : public JobWatcher {
   public:
    explicit Sink(WatchReactor* reactor)
        : writes_(reactor, kMaxQueuedEvents, Writes::WhenFull::kRefuse,
                  "the WatchJob stream broke") {}

    void OnEvent(const v1::JobEvent& event) override {
      grpc::ByteBuffer bytes;
      Serialize(event, &bytes);
      if (writes_.Write(std::move(bytes)) == Writes::Queued::kFull) {
        OnClosed(absl::ResourceExhaustedError(
            "the WatchJob reader fell too far behind; watch again"));
      }
    }
    // The events queued before are written first.
    void OnClosed(const absl::Status& status) override { writes_.End(status); }
    bool Done() const override { return writes_.ending(); }

    Writes& writes() { return writes_; }

   private:
    Writes writes_;
  };

  explicit WatchReactor(RpcMetrics* metrics) : sink_(std::make_shared<Sink>(this)), metrics_(metrics) {
    if (metrics_ != nullptr) metrics_->StreamOpened(RpcMethod::kWatchJob);
  }

  // Registers with the job; the snapshot is the first write.
  // Nothing may touch the reactor after this call: a closed job finishes the stream at once.
  void Start(const std::shared_ptr<Job>& job) { job->Watch(sink_); }
  void FinishNow(const absl::Status& status) { sink_->OnClosed(status); }

  void OnWriteDone(bool ok) override { sink_->writes().OnWriteDone(ok); }
  void OnCancel() override { sink_->OnClosed(absl::CancelledError("the watcher went away")); }
  void OnDone() override {
    sink_->writes().Detach();
    if (metrics_ != nullptr) {
      metrics_->StreamClosed(RpcMethod::kWatchJob);
      metrics_->CountRpc(RpcMethod::kWatchJob, sink_->writes().final_code());
    }
    delete this;
  }

 private:
  const std::shared_ptr<Sink> sink_;
  RpcMetrics* const metrics_;
};

// HeartbeatStream. The job is looked up once, from the first beat, which also picks the mode
// (which beats are answered is HeartbeatReplies'):
//  * reply_interval_ms = 0: read a beat, answer it, read the next (one reply per beat);
//  * reply_interval_ms > 0: beats are read back to back and answered only when due. At most
//    one write is in flight; a reply due meanwhile waits (the newest replaces an older one) and
//    goes out when it completes.
// Reads and writes complete on different threads; the writes and the stream's end go through
// writes_, which finishes the stream once no write is in flight.
class HeartbeatStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Writes = StreamWrites<HeartbeatStreamReactor>;

  HeartbeatStreamReactor(JobRegistry* registry, RpcMetrics* metrics, absl::Status auth,
                         const CoordinatorService::Gate* gate)
      : registry_(registry), metrics_(metrics), gate_(gate),
        writes_(this, 1, Writes::WhenFull::kReplaceNewest, "the HeartbeatStream broke") {
    if (metrics_ != nullptr) metrics_->StreamOpened(RpcMethod::kHeartbeatStream);
    if (!auth.ok()) {
      writes_.End(auth);
      return;
    }
    StartRead(&raw_request_);
  }

  void OnReadDone(bool ok) override {
    // The client half-closed (or went away).
    if (!ok) return writes_.End(absl::OkStatus());
    if (absl::Status s = Beat(); !s.ok()) return writes_.End(s);
  }

  void OnWriteDone(bool ok) override {
    // One reply per beat: the next read waits for the write (streaming mode has one
    // outstanding already). (replies_ is set before the first write, and per_beat() is fixed.)
    if (writes_.OnWriteDone(ok) && replies_.has_value() && replies_->per_beat()) {
      StartRead(&raw_request_);
    }
  }

  // The stream was cancelled: the client went away (its process died, its connection dropped)
  // or ended the stream without saying so first (HeartbeatRequest.closing).
  void OnCancel() override {
    std::shared_ptr<Job> job;
    int32_t rank;
    std::string credential;
    {
      absl::MutexLock lock(&mu_);
      if (closing_ || beat_job_ == nullptr) return;
      job = beat_job_;
      rank = beat_rank_;
      credential = beat_credential_;
    }
    job->HeartbeatStreamLost(rank, credential);
  }

  void OnDone() override {
    if (metrics_ != nullptr) {
      metrics_->StreamClosed(RpcMethod::kHeartbeatStream);
      metrics_->CountRpc(RpcMethod::kHeartbeatStream, writes_.final_code());
    }
    delete this;
  }

 private:
  // Records the beat just read, replies if due and reads on. Not OK: the stream's end.
  absl::Status Beat() {
    MODELAVG_RETURN_IF_ERROR(Parse(raw_request_, &request_, "HeartbeatStream"));
    if (*gate_) MODELAVG_RETURN_IF_ERROR((*gate_)(nullptr));
    // Only the read path touches request_, job_ and replies_ (one read at a time).
    if (job_ == nullptr) {
      absl::StatusOr<HeartbeatReplies> replies =
          HeartbeatReplies::Create(request_.reply_interval_ms(), registry_->clock());
      if (!replies.ok()) return replies.status();
      replies_.emplace(*std::move(replies));
      absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(request_.job_id());
      if (!job.ok()) return job.status();
      job_ = *std::move(job);
    } else if (request_.job_id() != job_->id()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "this HeartbeatStream is for job ", job_->id(), "; open another stream for job ",
          request_.job_id().substr(0, 256)));
    }
    v1::HeartbeatResponse reply;
    MODELAVG_RETURN_IF_ERROR(job_->Heartbeat(request_, &reply));
    if (!beat_seen_ || request_.closing()) {
      // Whose stream this is, and whether it ends on purpose, for OnCancel (another thread).
      absl::MutexLock lock(&mu_);
      beat_job_ = job_;
      beat_rank_ = request_.rank();
      beat_credential_ = request_.credential();
      beat_seen_ = true;
      closing_ = closing_ || request_.closing();
    }
    if (writes_.ending()) return absl::OkStatus();  // a failed write ended the stream
    const bool per_beat = replies_->per_beat();
    bool started = false;
    if (replies_->Due(reply)) {
      // (Looked up only for a reply: most streamed beats have none. Due ignores it.)
      reply.set_coordinator_incarnation(registry_->incarnation());
      grpc::ByteBuffer bytes;
      Serialize(reply, &bytes);
      started = writes_.Write(std::move(bytes)) == Writes::Queued::kWriting;
    }
    // One reply per beat: the next read waits for the write (OnWriteDone starts it).
    if (!per_beat || !started) StartRead(&raw_request_);
    return absl::OkStatus();
  }

  JobRegistry* const registry_;
  RpcMetrics* const metrics_;
  const CoordinatorService::Gate* const gate_;
  Writes writes_;
  // The read path's.
  std::shared_ptr<Job> job_;
  grpc::ByteBuffer raw_request_;
  v1::HeartbeatRequest request_;
  std::optional<HeartbeatReplies> replies_;  // from the first beat
  bool beat_seen_ = false;

  // The stream's member (from its first beat) and whether it said it ends on purpose: OnCancel's.
  absl::Mutex mu_;
  std::shared_ptr<Job> beat_job_ ABSL_GUARDED_BY(mu_);
  int32_t beat_rank_ ABSL_GUARDED_BY(mu_) = -1;
  std::string beat_credential_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

// HostHeartbeatStream: the beats of several members per message (HostHeartbeats decides what is
// recorded and answered). Reads follow one another back to back; at most one reply is being
// written, and the answers due meanwhile are merged into the next one (unsent_), which goes out
// when the write completes.
class HostHeartbeatStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Writes = StreamWrites<HostHeartbeatStreamReactor>;

  HostHeartbeatStreamReactor(JobRegistry* registry, RpcMetrics* metrics, absl::Status auth,
                             const CoordinatorService::Gate* gate)
      : metrics_(metrics), gate_(gate), beats_(registry),
        writes_(this, 0, Writes::WhenFull::kRefuse, "the HostHeartbeatStream broke") {
    if (metrics_ != nullptr) metrics_->StreamOpened(RpcMethod::kHostHeartbeatStream);
    if (!auth.ok()) {
      writes_.End(auth);
      return;
    }
    StartRead(&raw_request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return writes_.End(absl::OkStatus());  // the client half-closed (or went away)
    if (absl::Status s = Beat(); !s.ok()) return writes_.End(s);
    StartRead(&raw_request_);
  }

  void OnWriteDone(bool ok) override {
    if (!writes_.OnWriteDone(ok)) return;
    grpc::ByteBuffer next;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!TakeUnsent(&next)) return;
    }
    (void)writes_.Write(std::move(next));
  }

  // The stream broke: every member still on it is told (an elastic job declares a member that
  // does not beat again within half its heartbeat timeout dead).
  void OnCancel() override {
    for (const HostHeartbeats::Member& m : beats_.Members()) {
      m.job->HeartbeatStreamLost(m.rank, m.credential);
    }
  }

  void OnDone() override {
    if (metrics_ != nullptr) {
      metrics_->StreamClosed(RpcMethod::kHostHeartbeatStream);
      metrics_->CountRpc(RpcMethod::kHostHeartbeatStream, writes_.final_code());
    }
    delete this;
  }

 private:
  absl::Status Beat() {
    MODELAVG_RETURN_IF_ERROR(Parse(raw_request_, &request_, "HostHeartbeatStream"));
    if (*gate_) MODELAVG_RETURN_IF_ERROR((*gate_)(nullptr));
    grpc::ByteBuffer bytes;
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<bool> due = beats_.Beat(request_, &unsent_);
      if (!due.ok()) return due.status();
      due_ = due_ || *due;
      if (!TakeUnsent(&bytes)) return absl::OkStatus();
    }
    (void)writes_.Write(std::move(bytes));
    return absl::OkStatus();
  }

  // Serializes what is due into *bytes and starts counting a write in flight. False when a
  // write is in flight or the stream is ending.
  bool TakeUnsent(grpc::ByteBuffer* bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || !due_ || writes_.ending()) return false;
    Serialize(unsent_, bytes);
    unsent_.Clear();
    due_ = false;
    writing_ = true;
    beats_.Sent();
    return true;
  }

  RpcMetrics* const metrics_;
  const CoordinatorService::Gate* const gate_;
  HostHeartbeats beats_;
  Writes writes_;
  grpc::ByteBuffer raw_request_;  // the read path's
  v1::HostHeartbeatRequest request_;
  absl::Mutex mu_;  // the read path and the write completions
  v1::HostHeartbeatResponse unsent_ ABSL_GUARDED_BY(mu_);
  bool due_ ABSL_GUARDED_BY(mu_) = false;      // unsent_ is to be written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a reply is being written
};

}  // namespace

CoordinatorService::CoordinatorService(JobRegistry* registry, AuthOptions auth,
                                       RpcMetrics* metrics)
    : registry_(registry), auth_(std::move(auth)), metrics_(metrics) {}

template <typename Request, typename Response>
grpc::ServerUnaryReactor* CoordinatorService::Serve(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw, grpc::ByteBuffer* reply,
    RpcMethod method, Role need, const char* rpc,
    void (CoordinatorService::*handler)(grpc::CallbackServerContext*,
                                        Call<Request, Response>*)) {
  auto* call = new Call<Request, Response>(reply, metrics_, method);
  absl::Status s = auth_.Authorize(*ctx, need, rpc);
  if (s.ok() && gate_) s = gate_(ctx);
  if (s.ok()) s = Parse(*raw, &call->request, rpc);
  if (!s.ok()) {
    call->Reply(s);
  } else {
    // The handler replies, now or (waits) later; nothing may touch `call` after it.
    (this->*handler)(ctx, call);
  }
  return call;
}

#define MODELAVG_SERVE(Rpc, Request, Response, need)                                        \
  grpc::ServerUnaryReactor* CoordinatorService::Rpc(                                        \
      grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,                    \
      grpc::ByteBuffer* response) {                                                         \
    return Serve<Request, Response>(ctx, request, response, RpcMethod::k##Rpc, need, #Rpc,  \
                                    &CoordinatorService::Do##Rpc);                          \
  }
MODELAVG_SERVE(CreateJob, v1::CreateJobRequest, v1::Job, Role::kOperator)
MODELAVG_SERVE(GetJob, v1::GetJobRequest, v1::Job, Role::kWorker)
MODELAVG_SERVE(ListJobs, v1::ListJobsRequest, v1::ListJobsResponse, Role::kWorker)
MODELAVG_SERVE(DeleteJob, v1::DeleteJobRequest, v1::DeleteJobResponse, Role::kOperator)
MODELAVG_SERVE(Join, v1::JoinRequest, v1::JoinResponse, Role::kWorker)
MODELAVG_SERVE(Heartbeat, v1::HeartbeatRequest, v1::HeartbeatResponse, Role::kWorker)
MODELAVG_SERVE(Step, v1::StepRequest, v1::StepDecision, Role::kWorker)
MODELAVG_SERVE(GetSchedule, v1::GetScheduleRequest, v1::GetScheduleResponse, Role::kWorker)
MODELAVG_SERVE(PublishCommId, v1::PublishCommIdRequest, v1::PublishCommIdResponse, Role::kWorker)
MODELAVG_SERVE(GetCommId, v1::GetCommIdRequest, v1::GetCommIdResponse, Role::kWorker)
MODELAVG_SERVE(Leave, v1::LeaveRequest, v1::LeaveResponse, Role::kWorker)
MODELAVG_SERVE(Ping, v1::PingRequest, v1::PingResponse, Role::kWorker)
MODELAVG_SERVE(ReportPeerFailure, v1::ReportPeerFailureRequest, v1::ReportPeerFailureResponse,
               Role::kWorker)
MODELAVG_SERVE(ReportNonFinite, v1::ReportNonFiniteRequest, v1::ReportNonFiniteResponse,
               Role::kWorker)
#undef MODELAVG_SERVE

void CoordinatorService::DoCreateJob(grpc::CallbackServerContext*,
                                     Call<v1::CreateJobRequest, v1::Job>* call) {
  call->Reply(registry_->CreateJob(call->request.spec(), &call->response));
}

void CoordinatorService::DoGetJob(grpc::CallbackServerContext*,
                                  Call<v1::GetJobRequest, v1::Job>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (job.ok()) (*job)->ToProto(&call->response);
  call->Reply(job.status());
}

void CoordinatorService::DoListJobs(grpc::CallbackServerContext*,
                                    Call<v1::ListJobsRequest, v1::ListJobsResponse>* call) {
  call->Reply(registry_->ListJobsPage(call->request, &call->response));
}

void CoordinatorService::DoDeleteJob(grpc::CallbackServerContext*,
                                     Call<v1::DeleteJobRequest, v1::DeleteJobResponse>* call) {
  call->Reply(registry_->DeleteJob(call->request.job_id()));
}

void CoordinatorService::DoJoin(grpc::CallbackServerContext* ctx,
                                Call<v1::JoinRequest, v1::JoinResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  const WaitId id = registry_->NewWaitId();
  call->SetOnCancel([job = *job, id] { job->CancelWait(id); });
  // Nothing may touch `call` after this: the core may finish it at once.
  (*job)->Join(call->request, CallDeadline(ctx), id,
               [call, incarnation = registry_->incarnation()](
                   absl::StatusOr<v1::JoinResponse> result) {
                 if (result.ok()) {
                   call->response = *std::move(result);
                   call->response.set_coordinator_incarnation(incarnation);
                 }
                 call->Reply(result.status());
               });
}

void CoordinatorService::DoHeartbeat(grpc::CallbackServerContext*,
                                     Call<v1::HeartbeatRequest, v1::HeartbeatResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->response.set_coordinator_incarnation(registry_->incarnation());
  call->Reply((*job)->Heartbeat(call->request, &call->response));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* CoordinatorService::HeartbeatStream(
    grpc::CallbackServerContext* ctx) {
  absl::Status s = auth_.Authorize(*ctx);
  if (s.ok() && gate_) s = gate_(ctx);
  return new HeartbeatStreamReactor(registry_, metrics_, std::move(s), &gate_);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
CoordinatorService::HostHeartbeatStream(grpc::CallbackServerContext* ctx) {
  absl::Status s = auth_.Authorize(*ctx);
  if (s.ok() && gate_) s = gate_(ctx);
  return new HostHeartbeatStreamReactor(registry_, metrics_, std::move(s), &gate_);
}

void CoordinatorService::DoStep(grpc::CallbackServerContext*,
                                Call<v1::StepRequest, v1::StepDecision>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->Step(call->request, &call->response));
}

void CoordinatorService::DoGetSchedule(
    grpc::CallbackServerContext* ctx,
    Call<v1::GetScheduleRequest, v1::GetScheduleResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->GetSchedule(call->request, &call->response,
                                  [ctx] { return ctx->IsCancelled(); }));
}

void CoordinatorService::DoPublishCommId(
    grpc::CallbackServerContext*,
    Call<v1::PublishCommIdRequest, v1::PublishCommIdResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->PublishCommId(call->request));
}

void CoordinatorService::DoGetCommId(grpc::CallbackServerContext* ctx,
                                     Call<v1::GetCommIdRequest, v1::GetCommIdResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  const WaitId id = registry_->NewWaitId();
  call->SetOnCancel([job = *job, id] { job->CancelWait(id); });
  (*job)->GetCommId(call->request, CallDeadline(ctx), id,
                    [call](absl::StatusOr<std::string> result) {
                      if (result.ok()) call->response.set_unique_id(*std::move(result));
                      call->Reply(result.status());
                    });
}

void CoordinatorService::DoLeave(grpc::CallbackServerContext*,
                                 Call<v1::LeaveRequest, v1::LeaveResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->Leave(call->request, &call->response));
}

void CoordinatorService::DoReportPeerFailure(
    grpc::CallbackServerContext*,
    Call<v1::ReportPeerFailureRequest, v1::ReportPeerFailureResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->ReportPeerFailure(call->request, &call->response));
}

void CoordinatorService::DoReportNonFinite(
    grpc::CallbackServerContext*,
    Call<v1::ReportNonFiniteRequest, v1::ReportNonFiniteResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  call->Reply((*job)->ReportNonFinite(call->request, &call->response));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* CoordinatorService::WatchJob(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) {
  auto* reactor = new WatchReactor(metrics_);
  v1::WatchJobRequest request;
  absl::Status s = auth_.Authorize(*ctx);
  if (s.ok() && gate_) s = gate_(ctx);
  if (s.ok()) s = Parse(*raw, &request, "WatchJob");
  absl::StatusOr<std::shared_ptr<Job>> job;
  if (s.ok()) {
    job = registry_->Find(request.job_id());
    s = job.status();
  }
  if (!s.ok()) {
    reactor->FinishNow(s);
  } else {
    reactor->Start(*job);
  }
  return reactor;
}

void CoordinatorService::DoPing(grpc::CallbackServerContext*,
                                Call<v1::PingRequest, v1::PingResponse>* call) {
  call->response.set_unix_ms(absl::ToUnixMillis(absl::Now()));
  call->response.set_coordinator_incarnation(registry_->incarnation());
  call->Reply(absl::OkStatus());
}

}  // namespace modelavg::server
