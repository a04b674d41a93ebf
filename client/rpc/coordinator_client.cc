#include "client/rpc/coordinator_client.h"

#include <chrono>
#include <utility>

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/rpc/connection.h"
#include "client/rpc/coordinator_outage.h"
#include "common/file_util.h"
#include "common/status_util.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/status_conversion.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// With `cancel`, its Cancel() cancels the call of `ctx` until the returned guard goes (`ctx`
// outlives it).
auto WatchCancel(CancelToken* cancel, grpc::ClientContext* ctx) {
  const uint64_t id = cancel != nullptr ? cancel->Register([ctx] { ctx->TryCancel(); }) : 0;
  return absl::Cleanup([cancel, id] {
    if (cancel != nullptr) cancel->Unregister(id);
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(
    const ConnectionOptions& options) {
  MODELAVG_ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                            ParseAddresses(options.coordinator));
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout must be positive");
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = ChannelCredentialsFor(options);
  if (!creds.ok()) return Annotate(creds.status(), "ClientOptions");
  // The token is read once, here: options() then carries it, not the file.
  absl::StatusOr<std::string> token = AuthTokenOf(options);
  if (!token.ok()) return Annotate(token.status(), "ClientOptions");
  ConnectionOptions resolved = options;
  resolved.auth_token = *std::move(token);
  resolved.auth_token_file.clear();
  auto client = std::unique_ptr<CoordinatorClient>(
      new CoordinatorClient(std::move(resolved), *std::move(creds)));
  absl::MutexLock lock(&client->targets_mu_);
  for (const std::string& address : addresses) client->TargetFor(address);
  return client;
}

absl::StatusOr<std::vector<std::string>> CoordinatorClient::ParseAddresses(
    const std::string& list) {
  std::vector<std::string> addresses;
  for (absl::string_view a : absl::StrSplit(list, ',')) {
    a = absl::StripAsciiWhitespace(a);
    if (a.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "coordinator address \"", list, "\" is empty or has an empty entry: set it to the "
          "coordinator's host:port (several, comma-separated, for coordinators on etcd)"));
    }
    if (std::find(addresses.begin(), addresses.end(), a) == addresses.end()) {
      addresses.emplace_back(a);
    }
  }
  return addresses;
}

CoordinatorClient::CoordinatorClient(ConnectionOptions options,
                                     std::shared_ptr<grpc::ChannelCredentials> creds)
    : options_(std::move(options)), creds_(std::move(creds)) {}

size_t CoordinatorClient::TargetFor(const std::string& address) {
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (targets_[i]->address == address) return i;
  }
  grpc::ChannelArguments args;
  // Fail fast when the coordinator is gone rather than waiting out long reconnect back-offs.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC takes this as the time one connection attempt may take (TCP and the HTTP/2 handshake
  // up to the server's SETTINGS frame), not as a back-off. At 100 ms a busy coordinator (many
  // workers re-attaching at once, a loaded or sanitizer-slowed machine) failed calls with
  // "connection attempt timed out before receiving SETTINGS frame"; a refused connection (the
  // coordinator gone) fails at once either way.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
  // A restarted coordinator may answer at a new address under the same name (a container gets a
  // new IP when it restarts): look the name up again within a second of losing the connection,
  // not after gRPC's default 30 s, so that the workers re-attach within the recovery grace.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 1000);
  auto target = std::make_unique<Target>();
  target->address = address;
  target->channel = grpc::CreateCustomChannel(address, creds_, args);
  target->stub = v1::Coordinator::NewStub(target->channel);
  targets_.push_back(std::move(target));
  return targets_.size() - 1;
}

std::pair<v1::Coordinator::Stub*, size_t> CoordinatorClient::Current() const {
  absl::ReaderMutexLock lock(&targets_mu_);
  return {targets_[current_]->stub.get(), current_};
}

std::string CoordinatorClient::current_address() const {
  absl::ReaderMutexLock lock(&targets_mu_);
  return targets_[current_]->address;
}

void CoordinatorClient::Failover(size_t index, const grpc::Status& status,
                                 const grpc::ClientContext& context) {
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return;
  std::string leader;
  const auto& trailers = context.GetServerTrailingMetadata();
  if (auto it = trailers.find("modelavg-leader"); it != trailers.end()) {
    leader.assign(it->second.data(), it->second.size());
  }
  absl::MutexLock lock(&targets_mu_);
  // Another call has moved on already.
  if (index != current_) return;
  // A single address stays where it is (a restarted coordinator comes back there).
  if (targets_.size() == 1 && leader.empty()) return;
  const std::string from = targets_[current_]->address;
  current_ = !leader.empty() ? TargetFor(leader) : (current_ + 1) % targets_.size();
  if (targets_[current_]->address != from) {
    spdlog::info("coordinator {} is unavailable ({}); trying {}{}", from, status.error_message(),
                 targets_[current_]->address, leader.empty() ? "" : " (it names the leader)");
  }
}

std::string CoordinatorClient::Authorization() const {
  return options_.auth_token.empty() ? "" : absl::StrCat("Bearer ", options_.auth_token);
}

void CoordinatorClient::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  if (!options_.auth_token.empty()) context->AddMetadata("authorization", Authorization());
}

namespace {
absl::Status Wrap(const grpc::Status& s, const char* rpc) {
  if (s.ok()) return absl::OkStatus();
  return Annotate(FromGrpcStatus(s), absl::StrCat("coordinator ", rpc));
}
}  // namespace

absl::Status CoordinatorClient::StatusOf(const grpc::Status& status, const char* rpc) {
  return Wrap(status, rpc);
}

absl::StatusOr<v1::Job> CoordinatorClient::CreateJob(const v1::JobSpec& spec) {
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.rpc_timeout);
  v1::CreateJobRequest req;
  *req.mutable_spec() = spec;
  v1::Job out;
  MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->CreateJob(&ctx, req, &out); }), "CreateJob"));
  return out;
}

absl::StatusOr<v1::Job> CoordinatorClient::GetJob(const std::string& job_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.rpc_timeout);
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  v1::Job out;
  MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->GetJob(&ctx, req, &out); }), "GetJob"));
  return out;
}

absl::StatusOr<v1::ListJobsResponse> CoordinatorClient::ListJobs() {
  // Every page, in job_id order (the coordinator answers at most 1000 jobs, and 4 MiB, a call).
  v1::ListJobsRequest req;
  req.set_page_size(1000);
  v1::ListJobsResponse all;
  do {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.rpc_timeout);
    v1::ListJobsResponse page;
    MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->ListJobs(&ctx, req, &page); }), "ListJobs"));
    for (v1::Job& job : *page.mutable_jobs()) *all.add_jobs() = std::move(job);
    req.set_page_token(page.next_page_token());
  } while (!req.page_token().empty());
  return all;
}

absl::Status CoordinatorClient::DeleteJob(const std::string& job_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.rpc_timeout);
  v1::DeleteJobRequest req;
  req.set_job_id(job_id);
  v1::DeleteJobResponse out;
  return Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->DeleteJob(&ctx, req, &out); }), "DeleteJob");
}

absl::StatusOr<v1::UpdateJobResponse> CoordinatorClient::UpdateJob(const v1::JobSpec& spec) {
  grpc::ClientContext ctx;
  Prepare(&ctx, std::max(options_.rpc_timeout, absl::Seconds(15)));
  v1::UpdateJobRequest req;
  req.set_job_id(spec.job_id());
  *req.mutable_spec() = spec;
  v1::UpdateJobResponse out;
  MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->UpdateJob(&ctx, req, &out); }), "UpdateJob"));
  return out;
}

absl::StatusOr<v1::JoinResponse> CoordinatorClient::Join(const v1::JoinRequest& request,
                                                         absl::Duration timeout,
                                                         CancelToken* cancel) {
  grpc::ClientContext ctx;
  Prepare(&ctx, timeout);
  auto watch = WatchCancel(cancel, &ctx);
  v1::JoinResponse out;
  MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->Join(&ctx, request, &out); }), "Join"));
  return out;
}

absl::Status CoordinatorClient::PublishCommId(const v1::PublishCommIdRequest& request) {
  auto call = [&]() -> absl::Status {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.rpc_timeout);
    v1::PublishCommIdResponse out;
    return Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->PublishCommId(&ctx, request, &out); }), "PublishCommId");
  };
  if (outage_ == nullptr) return call();
  return outage_->Retry(
      absl::StrCat("publishing the bootstrap id of level ", request.level(), " subgroup ",
                   request.subgroup(), " (generation ", request.generation(), ")"),
      call);
}

absl::StatusOr<std::string> CoordinatorClient::GetCommId(const v1::GetCommIdRequest& request) {
  // Retried through an outage, each attempt waits the request's full timeout_ms again.
  auto call = [&]() -> absl::StatusOr<std::string> {
    grpc::ClientContext ctx;
    Prepare(&ctx, absl::Milliseconds(request.timeout_ms()) + options_.rpc_timeout);
    v1::GetCommIdResponse out;
    MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->GetCommId(&ctx, request, &out); }), "GetCommId"));
    return std::move(*out.mutable_unique_id());
  };
  if (outage_ == nullptr) return call();
  return outage_->Retry(
      absl::StrCat("fetching the bootstrap id of level ", request.level(), " subgroup ",
                   request.subgroup(), " (generation ", request.generation(), ")"),
      call);
}

absl::StatusOr<v1::LeaveResponse> CoordinatorClient::Leave(const v1::LeaveRequest& request,
                                                           CancelToken* cancel) {
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.rpc_timeout);
  auto watch = WatchCancel(cancel, &ctx);
  v1::LeaveResponse out;
  MODELAVG_RETURN_IF_ERROR(Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->Leave(&ctx, request, &out); }), "Leave"));
  return out;
}

absl::Status CoordinatorClient::Ping() {
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.rpc_timeout);
  v1::PingRequest req;
  v1::PingResponse out;
  return Wrap(Send(&ctx, [&](v1::Coordinator::Stub* stub) { return stub->Ping(&ctx, req, &out); }), "Ping");
}

std::unique_ptr<HeartbeatStreamCall> CoordinatorClient::StartHeartbeatStream(
    HeartbeatStreamCall::ReplyCallback on_reply, HeartbeatStreamCall::EndCallback on_end) {
  auto [stub, index] = Current();
  return std::make_unique<HeartbeatStreamCall>(
      [stub = stub](grpc::ClientContext* ctx,
                    grpc::ClientBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* r) {
        stub->async()->HeartbeatStream(ctx, r);
      },
      "HeartbeatStream", Authorization(), std::move(on_reply), std::move(on_end),
      [this, index = index](const grpc::Status& status, const grpc::ClientContext& context) {
        Failover(index, status, context);
      });
}

std::unique_ptr<HostHeartbeatStreamCall> CoordinatorClient::StartHostHeartbeatStream(
    HostHeartbeatStreamCall::ReplyCallback on_reply, HostHeartbeatStreamCall::EndCallback on_end) {
  auto [stub, index] = Current();
  return std::make_unique<HostHeartbeatStreamCall>(
      [stub = stub](
          grpc::ClientContext* ctx,
          grpc::ClientBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>* r) {
        stub->async()->HostHeartbeatStream(ctx, r);
      },
      "HostHeartbeatStream", Authorization(), std::move(on_reply), std::move(on_end),
      [this, index = index](const grpc::Status& status, const grpc::ClientContext& context) {
        Failover(index, status, context);
      });
}

template <typename Request, typename Response>
BeatStreamCall<Request, Response>::BeatStreamCall(const StartRpc& start, const char* rpc,
                                                  const std::string& authorization,
                                                  ReplyCallback on_reply, EndCallback on_end,
                                                  DoneCallback on_done)
    : rpc_(rpc), on_reply_(std::move(on_reply)), on_end_(std::move(on_end)),
      on_done_(std::move(on_done)) {
  if (!authorization.empty()) context_.AddMetadata("authorization", authorization);
  start(&context_, this);
  this->StartRead(&reply_);
  // Held until Finish, so that OnDone cannot come (and the reactor be released) before the
  // owner stops writing.
  this->AddHold();
  this->StartCall();
}

template <typename Request, typename Response>
BeatStreamCall<Request, Response>::~BeatStreamCall() {
  (void)Finish();
}

template <typename Request, typename Response>
bool BeatStreamCall<Request, Response>::Write(const Request& request) {
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || ended_ || finished_) return false;
    writing_ = true;
  }
  request_ = request;
  this->StartWrite(&request_);
  return true;
}

template <typename Request, typename Response>
void BeatStreamCall<Request, Response>::OnWriteDone(bool) {
  absl::MutexLock lock(&mu_);
  writing_ = false;
  // A failed write means the stream is over; the failed read reports it.
}

template <typename Request, typename Response>
void BeatStreamCall<Request, Response>::OnReadDone(bool ok) {
  if (ok) {
    on_reply_(reply_);
    this->StartRead(&reply_);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
  }
  on_end_();
}

template <typename Request, typename Response>
void BeatStreamCall<Request, Response>::OnDone(const grpc::Status& status) {
  status_ = status;
  if (on_done_ && !status.ok()) on_done_(status, context_);
  done_.Notify();
}

template <typename Request, typename Response>
absl::Status BeatStreamCall<Request, Response>::Finish(const Request* closing,
                                                       absl::Duration wait) {
  if (!finished_ && closing != nullptr) {
    const absl::Time deadline = absl::Now() + wait;
    bool send = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(this, &BeatStreamCall::WriteIdle), deadline);
      if (!writing_ && !ended_) {
        writing_ = true;
        send = true;
      }
    }
    if (send) {
      request_ = *closing;
      this->StartWriteLast(&request_, grpc::WriteOptions());
      // The coordinator answers the half-close by ending the call.
      done_.WaitForNotificationWithDeadline(deadline + wait);
    }
  }
  if (!finished_) {
    finished_ = true;
    context_.TryCancel();
    this->RemoveHold();
  }
  // Prompt: the call is cancelled, so every operation in flight completes now.
  done_.WaitForNotification();
  return Wrap(status_, rpc_);
}

template class BeatStreamCall<v1::HeartbeatRequest, v1::HeartbeatResponse>;
template class BeatStreamCall<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>;

}  // namespace modelavg::client
