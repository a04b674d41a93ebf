#include "server/rpc/coordinator_service.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <type_traits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "google/protobuf/descriptor.h"
#include "proto/status_conversion.h"
#include "server/core/heartbeat_replies.h"
#include "server/core/host_heartbeats.h"
#include "server/job/job.h"
#include "server/rpc/coordinator_rpcs.h"
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

// At most `max_bytes`: RESOURCE_EXHAUSTED naming the bound otherwise.
absl::Status CheckRequestSize(const grpc::ByteBuffer& raw, size_t max_bytes, const char* rpc,
                              const google::protobuf::Message& request) {
  if (raw.Length() <= max_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      rpc, " takes a request of at most ", max_bytes, " bytes; this one has ", raw.Length(),
      " (no ", request.GetDescriptor()->full_name(), " of any legitimate call is near that)"));
}

void Serialize(const google::protobuf::Message& message, grpc::ByteBuffer* out) {
  bool own = false;
  out->Clear();
  (void)grpc::SerializationTraits<google::protobuf::Message>::Serialize(message, out, &own);
}

}  // namespace

// One unary call, served through the generic API: the caller is checked before anything is
// read (Serve), then the request is read, bounded, parsed and handed to the method's handler.
// Reply() finishes it exactly once; a call that waits in the core (Join, GetCommId) sets what
// its cancellation does.
template <typename Request, typename Response>
class CoordinatorService::Call final : public grpc::ServerGenericBidiReactor {
 public:
  Call(RpcMetrics* metrics, RpcMethod method) : metrics_(metrics), method_(method) {}

  Request request;
  Response response;
  Caller caller;
  grpc::ByteBuffer raw;  // the request as read (cleared once parsed)

  void Reply(const absl::Status& status) {
    if (metrics_ != nullptr) metrics_->CountRpc(method_, status.code());
    if (!status.ok()) return Finish(ToGrpcStatus(status));
    Serialize(response, &reply_);
    response.Clear();  // the bytes are what is sent: one copy in flight, not two
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }
  // Runs once the call is over (its answer sent, or the call broken).
  void SetOnDone(absl::AnyInvocable<void()> on_done) { on_done_ = std::move(on_done); }
  // Reads the request; `on_read` runs when it is in (false: the call ended without one).
  void Read(absl::AnyInvocable<void(bool)> on_read) {
    on_read_ = std::move(on_read);
    StartRead(&raw);
  }
  // Must be set before the handler returns (OnCancel comes only after).
  void SetOnCancel(absl::AnyInvocable<void()> on_cancel) { on_cancel_ = std::move(on_cancel); }

  void OnReadDone(bool ok) override {
    absl::AnyInvocable<void(bool)> on_read = std::move(on_read_);
    if (on_read) on_read(ok);
  }
  void OnCancel() override {
    // The wait's completion may finish this call inside on_cancel.
    absl::AnyInvocable<void()> on_cancel = std::move(on_cancel_);
    if (on_cancel) on_cancel();
  }
  void OnDone() override {
    if (on_done_) on_done_();
    delete this;
  }

 private:
  grpc::ByteBuffer reply_;
  absl::AnyInvocable<void()> on_done_;
  RpcMetrics* const metrics_;
  const RpcMethod method_;
  absl::AnyInvocable<void(bool)> on_read_;
  absl::AnyInvocable<void()> on_cancel_;
};

// A method of the generic API: who may call it, how big its request may be, and what serves it.
struct CoordinatorService::Route {
  RpcMethod method;
  Role need;
  const char* name;
  size_t max_request_bytes;
  std::function<grpc::ServerGenericBidiReactor*(grpc::GenericCallbackServerContext*,
                                                const Route&)>
      serve;
};

namespace {

// One WatchJob stream (a server stream, served through the generic API: its request is read
// only once the caller is checked). The Job pushes events (in order, never concurrently for one
// job); they are written one at a time, up to kMaxQueuedEvents waiting.
class WatchReactor final : public grpc::ServerGenericBidiReactor {
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

  explicit WatchReactor(RpcMetrics* metrics)
      : sink_(std::make_shared<Sink>(this)), metrics_(metrics, RpcMethod::kWatchJob) {}

  // Reads the request; `on_read` runs when it is in (false: the call ended without one).
  void Read(absl::AnyInvocable<void(bool)> on_read) {
    on_read_ = std::move(on_read);
    StartRead(&raw);
  }
  // Registers with the job; the snapshot is the first write.
  // Nothing may touch the reactor after this call: a closed job finishes the stream at once.
  void Start(const std::shared_ptr<Job>& job) { job->Watch(sink_); }
  void FinishNow(const absl::Status& status) { sink_->OnClosed(status); }

  grpc::ByteBuffer raw;  // the request as read

  void OnReadDone(bool ok) override {
    absl::AnyInvocable<void(bool)> on_read = std::move(on_read_);
    if (on_read) on_read(ok);
  }
  void OnWriteDone(bool ok) override { sink_->writes().OnWriteDone(ok); }
  void OnCancel() override { sink_->OnClosed(absl::CancelledError("the watcher went away")); }
  void OnDone() override {
    sink_->writes().Detach();
    metrics_.Ended(sink_->writes().final_code());
    delete this;
  }

 private:
  const std::shared_ptr<Sink> sink_;
  StreamMetrics metrics_;
  absl::AnyInvocable<void(bool)> on_read_;
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

  // `caller`: the stream's caller, or why it may not open one (the stream's end).
  HeartbeatStreamReactor(JobRegistry* registry, RpcMetrics* metrics,
                         absl::StatusOr<Caller> caller, const CoordinatorService::Gate* gate,
                         size_t max_request_bytes)
      : registry_(registry), metrics_(metrics, RpcMethod::kHeartbeatStream), gate_(gate),
        max_request_bytes_(max_request_bytes),
        caller_(caller.ok() ? *caller : Caller()),
        writes_(this, 1, Writes::WhenFull::kReplaceNewest, "the HeartbeatStream broke") {
    if (!caller.ok()) {
      writes_.End(caller.status());
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
    metrics_.Ended(writes_.final_code());
    delete this;
  }

 private:
  // Records the beat just read, replies if due and reads on. Not OK: the stream's end.
  absl::Status Beat() {
    MODELAVG_RETURN_IF_ERROR(
        CheckRequestSize(raw_request_, max_request_bytes_, "HeartbeatStream", request_));
    MODELAVG_RETURN_IF_ERROR(Parse(raw_request_, &request_, "HeartbeatStream"));
    if (*gate_) MODELAVG_RETURN_IF_ERROR((*gate_)(nullptr));
    // Only the read path touches request_, job_ and replies_ (one read at a time).
    if (job_ == nullptr) {
      absl::StatusOr<HeartbeatReplies> replies =
          HeartbeatReplies::Create(request_.reply_interval_ms(), registry_->clock());
      if (!replies.ok()) return replies.status();
      replies_.emplace(*std::move(replies));
      MODELAVG_RETURN_IF_ERROR(caller_.CheckJob(request_.job_id(), "HeartbeatStream"));
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
  StreamMetrics metrics_;
  const CoordinatorService::Gate* const gate_;
  const size_t max_request_bytes_;
  const Caller caller_;
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

  // `caller`: the stream's caller, or why it may not open one (the stream's end). A beat for a
  // job the caller may not use is answered PERMISSION_DENIED (that member's error).
  HostHeartbeatStreamReactor(JobRegistry* registry, RpcMetrics* metrics,
                             absl::StatusOr<Caller> caller, const CoordinatorService::Gate* gate,
                             size_t max_request_bytes)
      : metrics_(metrics, RpcMethod::kHostHeartbeatStream), gate_(gate),
        max_request_bytes_(max_request_bytes),
        beats_(registry,
               [caller = caller.ok() ? *caller : Caller()](absl::string_view job_id) {
                 return caller.CheckJob(job_id, "HostHeartbeatStream");
               }),
        writes_(this, 0, Writes::WhenFull::kRefuse, "the HostHeartbeatStream broke") {
    if (!caller.ok()) {
      writes_.End(caller.status());
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
    metrics_.Ended(writes_.final_code());
    delete this;
  }

 private:
  absl::Status Beat() {
    MODELAVG_RETURN_IF_ERROR(
        CheckRequestSize(raw_request_, max_request_bytes_, "HostHeartbeatStream", request_));
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

  StreamMetrics metrics_;
  const CoordinatorService::Gate* const gate_;
  const size_t max_request_bytes_;
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

namespace {

// Whether a request names one job (every worker request but ListJobs and Ping).
template <typename Request, typename = void>
struct NamesJob : std::false_type {};
template <typename Request>
struct NamesJob<Request, std::void_t<decltype(std::declval<const Request&>().job_id())>>
    : std::true_type {};

// A request read whole (`ok`: it arrived), checked against its method's bound and parsed.
absl::Status ReadRequest(bool ok, const grpc::CallbackServerContext& ctx, grpc::ByteBuffer* raw,
                         size_t max_bytes, const char* rpc, google::protobuf::Message* request) {
  if (!ok) {
    if (ctx.IsCancelled()) return absl::CancelledError("the caller went away");
    return absl::InvalidArgumentError(
        absl::StrCat(rpc, " takes one request message; the call ended without one"));
  }
  MODELAVG_RETURN_IF_ERROR(CheckRequestSize(*raw, max_bytes, rpc, *request));
  MODELAVG_RETURN_IF_ERROR(Parse(*raw, request, rpc));
  raw->Clear();  // a waiting call (Join) keeps nothing of its bytes
  return absl::OkStatus();
}

// Whether a response carries the coordinator's incarnation (Join, Heartbeat, Ping).
template <typename Response, typename = void>
struct CarriesIncarnation : std::false_type {};
template <typename Response>
struct CarriesIncarnation<Response, std::void_t<decltype(std::declval<Response&>()
                                                             .set_coordinator_incarnation(""))>>
    : std::true_type {};

template <typename Response>
void SetIncarnation(Response* response, const std::string& incarnation) {
  if constexpr (CarriesIncarnation<Response>::value) {
    response->set_coordinator_incarnation(incarnation);
  }
}

// A job's answer to a wait, as the call's response.
template <typename Response>
void SetAnswer(Response* response, Response answer) {
  *response = std::move(answer);
}
void SetAnswer(v1::GetCommIdResponse* response, std::string unique_id) {
  response->set_unique_id(std::move(unique_id));
}

// The callback that answers `call` with what the job gives it.
template <typename T, typename CallT>
auto AnswerTo(CallT* call, std::string incarnation) {
  return [call, incarnation = std::move(incarnation)](absl::StatusOr<T> result) {
    if (result.ok()) {
      SetAnswer(&call->response, *std::move(result));
      SetIncarnation(&call->response, incarnation);
    }
    call->Reply(result.status());
  };
}

// The shapes of a Job method that serves an RPC (coordinator_rpcs.h). Each replies to `call`:
// answered when the method returns,
template <typename CallT, typename Request, typename Response>
void ServeJobCall(const std::shared_ptr<Job>& job, absl::Time, JobRegistry* registry,
                  CallT* call, absl::Status (Job::*handler)(const Request&, Response*)) {
  SetIncarnation(&call->response, registry->incarnation());
  call->Reply(((*job).*handler)(call->request, &call->response));
}
template <typename CallT, typename Request>
void ServeJobCall(const std::shared_ptr<Job>& job, absl::Time, JobRegistry*, CallT* call,
                  absl::Status (Job::*handler)(const Request&)) {
  call->Reply(((*job).*handler)(call->request));
}
// a wait that the call's cancellation ends (the job may finish `call` at once: nothing may touch
// it after the method),
template <typename CallT, typename Request, typename T>
void ServeJobCall(const std::shared_ptr<Job>& job, absl::Time deadline, JobRegistry* registry,
                  CallT* call,
                  void (Job::*handler)(const Request&, absl::Time, WaitId,
                                       absl::AnyInvocable<void(absl::StatusOr<T>)>)) {
  const WaitId id = registry->NewWaitId();
  call->SetOnCancel([job, id] { job->CancelWait(id); });
  ((*job).*handler)(call->request, deadline, id, AnswerTo<T>(call, registry->incarnation()));
}
// or answered later by its callback (UpdateJob: once the members answered).
template <typename CallT, typename Request, typename T>
void ServeJobCall(const std::shared_ptr<Job>& job, absl::Time, JobRegistry* registry,
                  CallT* call,
                  void (Job::*handler)(const Request&,
                                       absl::AnyInvocable<void(absl::StatusOr<T>)>)) {
  ((*job).*handler)(call->request, AnswerTo<T>(call, registry->incarnation()));
}

// The answer to a method the coordinator does not have (nothing of the call is read).
class UnknownMethod final : public grpc::ServerGenericBidiReactor {
 public:
  explicit UnknownMethod(const std::string& method) {
    Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("no method ", method.substr(0, 256),
                                     " here; this is a modelavg.v1.Coordinator (server "
                                     "reflection lists its methods)")));
  }
  void OnDone() override { delete this; }
};

}  // namespace

CoordinatorService::CoordinatorService(JobRegistry* registry, AuthOptions auth,
                                       RpcMetrics* metrics, size_t max_request_bytes)
    : registry_(registry), auth_(std::move(auth)), metrics_(metrics),
      max_request_bytes_(max_request_bytes) {
  std::vector<std::string> raw_streams;
#define MODELAVG_ADD_ROUTE(name, Request, Response, need, max_bytes, handler)  \
  AddRoute<Request, Response>(RpcMethod::k##name, need, #name, max_bytes, handler); \
  if (std::is_same_v<std::decay_t<decltype(handler)>, RawStream>) raw_streams.push_back(#name);
  MODELAVG_COORDINATOR_RPCS(MODELAVG_ADD_ROUTE)
#undef MODELAVG_ADD_ROUTE
  // Every method but the typed streams goes to CreateReactor (one missing from the list
  // answers UNIMPLEMENTED there).
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::Coordinator::service_full_name());
  for (int i = 0; i < service->method_count(); ++i) {
    if (std::find(raw_streams.begin(), raw_streams.end(), service->method(i)->name()) ==
        raw_streams.end()) {
      MarkMethodGeneric(i);
    }
  }
}

template <typename Request, typename Response, typename Fn>
void CoordinatorService::AddRoute(RpcMethod method, Role need, const char* name,
                                  size_t max_bytes, Fn handler) {
  if constexpr (!std::is_same_v<Fn, RawStream>) {
    auto route = std::make_unique<Route>();
    route->method = method;
    route->need = need;
    route->name = name;
    route->max_request_bytes = std::min(max_bytes, max_request_bytes_);
    if constexpr (std::is_invocable_v<Fn, CoordinatorService*,
                                      grpc::GenericCallbackServerContext*, const Route&>) {
      route->serve = [this, handler](grpc::GenericCallbackServerContext* ctx,
                                     const Route& route) { return (this->*handler)(ctx, route); };
    } else {
      route->serve = [this, handler](grpc::GenericCallbackServerContext* ctx,
                                     const Route& route) {
        return Serve<Request, Response>(ctx, route, handler);
      };
    }
    routes_[absl::StrCat("/", v1::Coordinator::service_full_name(), "/", name)] =
        std::move(route);
  } else {
    streams_[name] = StreamLimits{need, std::min(max_bytes, max_request_bytes_)};
  }
}

CoordinatorService::~CoordinatorService() = default;

absl::StatusOr<Caller> CoordinatorService::Admit(grpc::CallbackServerContext* ctx, Role need,
                                                 const char* rpc) const {
  absl::StatusOr<Caller> caller = auth_.Authorize(*ctx, need, rpc);
  if (caller.ok() && gate_) {
    if (absl::Status s = gate_(ctx); !s.ok()) return s;
  }
  return caller;
}

grpc::ServerGenericBidiReactor* CoordinatorService::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  auto it = routes_.find(ctx->method());
  if (it == routes_.end()) return new UnknownMethod(ctx->method());
  return it->second->serve(ctx, *it->second);
}

template <typename Request, typename Response, typename Fn>
grpc::ServerGenericBidiReactor* CoordinatorService::Serve(grpc::GenericCallbackServerContext* ctx,
                                                          const Route& route, Fn handler) {
  auto* call = new Call<Request, Response>(metrics_, route.method);
  // Nothing of the request is read until the caller may make this call.
  absl::StatusOr<Caller> caller = Admit(ctx, route.need, route.name);
  if (!caller.ok()) {
    call->Reply(caller.status());
    return call;
  }
  call->caller = *caller;
  call->Read([this, ctx, call, &route, handler](bool ok) {
    absl::Status s = ReadRequest(ok, *ctx, &call->raw, route.max_request_bytes, route.name,
                                 &call->request);
    if constexpr (NamesJob<Request>::value) {
      if (s.ok()) s = call->caller.CheckJob(call->request.job_id(), route.name);
    }
    if (!s.ok()) return call->Reply(s);
    // The handler replies, now or (waits) later; nothing may touch `call` after it.
    if constexpr (std::is_invocable_v<Fn, CoordinatorService*, grpc::CallbackServerContext*,
                                      Call<Request, Response>*>) {
      (this->*handler)(ctx, call);
    } else {
      absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
      if (!job.ok()) return call->Reply(job.status());
      ServeJobCall(*job, CallDeadline(ctx), registry_, call, handler);
    }
  });
  return call;
}

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
  absl::Status s = registry_->ListJobsPage(call->request, &call->response);
  // A worker token limited to some jobs lists only those (a page may come out short).
  auto* jobs = call->response.mutable_jobs();
  jobs->erase(std::remove_if(jobs->begin(), jobs->end(),
                             [call](const v1::Job& j) {
                               return !call->caller.MayUse(j.spec().job_id());
                             }),
              jobs->end());
  call->Reply(s);
}

void CoordinatorService::DoDeleteJob(grpc::CallbackServerContext*,
                                     Call<v1::DeleteJobRequest, v1::DeleteJobResponse>* call) {
  call->Reply(registry_->DeleteJob(call->request.job_id()));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* CoordinatorService::HeartbeatStream(
    grpc::CallbackServerContext* ctx) {
  const StreamLimits& limits = streams_.at("HeartbeatStream");
  return new HeartbeatStreamReactor(registry_, metrics_, Admit(ctx, limits.need, "HeartbeatStream"),
                                    &gate_, limits.max_request_bytes);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
CoordinatorService::HostHeartbeatStream(grpc::CallbackServerContext* ctx) {
  const StreamLimits& limits = streams_.at("HostHeartbeatStream");
  return new HostHeartbeatStreamReactor(registry_, metrics_,
                                        Admit(ctx, limits.need, "HostHeartbeatStream"), &gate_,
                                        limits.max_request_bytes);
}

void CoordinatorService::DoGetSchedule(
    grpc::CallbackServerContext* ctx,
    Call<v1::GetScheduleRequest, v1::GetScheduleResponse>* call) {
  absl::StatusOr<std::shared_ptr<Job>> job = registry_->Find(call->request.job_id());
  if (!job.ok()) return call->Reply(job.status());
  absl::Status built = (*job)->GetSchedule(call->request, &call->response,
                                           [ctx] { return ctx->IsCancelled(); });
  if (!built.ok()) return call->Reply(built);
  // Bytes in flight per client: a hundred largest windows asked at once from one client held
  // 1.7 GB until they were sent. The client is its address (a client's connections share it).
  const int64_t bytes = static_cast<int64_t>(call->response.ByteSizeLong());
  std::string client = ctx->peer();
  client = client.substr(0, client.rfind(':'));
  {
    absl::MutexLock lock(&schedule_mu_);
    int64_t& held = schedule_in_flight_[client];
    if (held > 0 && held + bytes > schedule_bytes_per_client_) {
      const int64_t before = held;
      call->response.Clear();
      return call->Reply(absl::ResourceExhaustedError(absl::StrCat(
          "GetSchedule: this client (", client, ") has ", before, " bytes of schedule windows "
          "in flight already and this answer has ", bytes, "; at most ",
          schedule_bytes_per_client_, " (--rpc_schedule_bytes_per_client): wait for the "
          "answers, or ask for fewer steps or for one rank")));
    }
    held += bytes;
  }
  call->SetOnDone([this, client, bytes] {
    absl::MutexLock lock(&schedule_mu_);
    auto it = schedule_in_flight_.find(client);
    if (it != schedule_in_flight_.end() && (it->second -= bytes) <= 0) {
      schedule_in_flight_.erase(it);
    }
  });
  call->Reply(absl::OkStatus());
}

grpc::ServerGenericBidiReactor* CoordinatorService::ServeWatchJob(
    grpc::GenericCallbackServerContext* ctx, const Route& route) {
  auto* reactor = new WatchReactor(metrics_);
  absl::StatusOr<Caller> caller = Admit(ctx, route.need, route.name);
  if (!caller.ok()) {
    reactor->FinishNow(caller.status());
    return reactor;
  }
  reactor->Read([this, ctx, reactor, &route, caller = *caller](bool ok) {
    v1::WatchJobRequest request;
    absl::Status s =
        ReadRequest(ok, *ctx, &reactor->raw, route.max_request_bytes, route.name, &request);
    if (s.ok()) s = caller.CheckJob(request.job_id(), route.name);
    absl::StatusOr<std::shared_ptr<Job>> job;
    if (s.ok()) {
      job = registry_->Find(request.job_id());
      s = job.status();
    }
    if (!s.ok()) return reactor->FinishNow(s);
    reactor->Start(*job);
  });
  return reactor;
}

void CoordinatorService::DoPing(grpc::CallbackServerContext*,
                                Call<v1::PingRequest, v1::PingResponse>* call) {
  call->response.set_unix_ms(absl::ToUnixMillis(absl::Now()));
  call->response.set_coordinator_incarnation(registry_->incarnation());
  call->Reply(absl::OkStatus());
}

}  // namespace modelavg::server
