// A thin wrapper over the generated Coordinator stub: a deadline on every call, the bearer token
// as metadata, TLS credentials, and grpc::Status turned into absl::Status. No logic of its own.
#ifndef MODELAVG_CLIENT_RPC_COORDINATOR_CLIENT_H_
#define MODELAVG_CLIENT_RPC_COORDINATOR_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_callback.h"
#include "modelavg/client/cancel_token.h"
#include "modelavg/client/connection.h"
#include "modelavg/v1/coordinator.grpc.pb.h"

namespace modelavg::client {

// One beat stream call, HeartbeatStream or HostHeartbeatStream (gRPC callback API: nothing here
// blocks but Finish). The owner writes beats with Write and ends the call with Finish; replies
// and the end of the stream are reported through the callbacks given at the start, which run on
// gRPC threads and must not block.
template <typename Request, typename Response>
class BeatStreamCall final : public grpc::ClientBidiReactor<Request, Response> {
 public:
  using ReplyCallback = std::function<void(const Response&)>;
  using EndCallback = std::function<void()>;
  // How the call ended, with the coordinator's trailers (for failover); on a gRPC thread.
  using DoneCallback =
      std::function<void(const grpc::Status&, const grpc::ClientContext& context)>;
  // Starts the RPC on the stub (`stub->async()->HeartbeatStream(context, reactor)`).
  using StartRpc =
      std::function<void(grpc::ClientContext*, grpc::ClientBidiReactor<Request, Response>*)>;

  // Use CoordinatorClient::StartHeartbeatStream / StartHostHeartbeatStream. `rpc` names the
  // stream in errors.
  BeatStreamCall(const StartRpc& start, const char* rpc, const std::string& authorization,
                 ReplyCallback on_reply, EndCallback on_end, DoneCallback on_done = nullptr);
  // Finishes the call if the owner has not.
  ~BeatStreamCall() override;

  // Sends one request. False when it was not sent: the previous write is still in flight, or
  // the stream has ended (on_end has been or is about to be called). Only the owner's thread
  // calls Write and Finish.
  bool Write(const Request& request);
  // Cancels the call (a no-op if it has ended), waits for gRPC to release it and returns its
  // status: OK or CANCELLED when ended here, the coordinator's error otherwise (UNIMPLEMENTED
  // from a coordinator without the RPC, UNAVAILABLE when unreachable, ...). With `closing` (a
  // request whose beats set HeartbeatRequest.closing), the stream is first ended on purpose:
  // that request is written last and the coordinator's end awaited, each for at most `wait`,
  // so that the coordinator does not take the end for a lost connection.
  absl::Status Finish(const Request* closing = nullptr,
                      absl::Duration wait = absl::Milliseconds(200));

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  bool WriteIdle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_ || ended_; }

  const char* const rpc_;
  grpc::ClientContext context_;
  Request request_;  // the write in flight
  Response reply_;   // the read in flight
  const ReplyCallback on_reply_;
  const EndCallback on_end_;
  const DoneCallback on_done_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ = false;  // the owner's thread only
  grpc::Status status_;    // set by OnDone, read after done_
  absl::Notification done_;
};

using HeartbeatStreamCall = BeatStreamCall<v1::HeartbeatRequest, v1::HeartbeatResponse>;
using HostHeartbeatStreamCall =
    BeatStreamCall<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>;
extern template class BeatStreamCall<v1::HeartbeatRequest, v1::HeartbeatResponse>;
extern template class BeatStreamCall<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>;

// Thread-safe (the stub is).
class CoordinatorOutage;

class CoordinatorClient {
 public:
  // INVALID_ARGUMENT for an empty address, unreadable TLS or token files, both auth_token and
  // auth_token_file. Reads the token file now. Does not connect yet.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(
      const ConnectionOptions& options);

  // Each returns the RPC's reply or its status (the coordinator's codes, see coordinator.proto;
  // UNAVAILABLE when unreachable, DEADLINE_EXCEEDED past `timeout` or rpc_timeout).
  absl::StatusOr<v1::Job> CreateJob(const v1::JobSpec& spec);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  // Every job: walks ListJobs' pages (next_page_token stays empty in the result).
  absl::StatusOr<v1::ListJobsResponse> ListJobs();
  absl::Status DeleteJob(const std::string& job_id);
  // A new plan for a running job (docs/plan-updates.md): waits for the members' answers (a few
  // heartbeat intervals, at most about 5 s), so its deadline is at least 15 s.
  absl::StatusOr<v1::UpdateJobResponse> UpdateJob(const v1::JobSpec& spec);
  // With `cancel` (not owned; outlives the call), its Cancel() ends the call with CANCELLED.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request, absl::Duration timeout,
                                        CancelToken* cancel = nullptr);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request) {
    return Unary(&v1::Coordinator::Stub::Heartbeat, request, "Heartbeat");
  }
  absl::StatusOr<v1::StepDecision> Step(const v1::StepRequest& request) {
    return Unary(&v1::Coordinator::Stub::Step, request, "Step");
  }
  absl::StatusOr<v1::GetScheduleResponse> GetSchedule(const v1::GetScheduleRequest& request) {
    return Unary(&v1::Coordinator::Stub::GetSchedule, request, "GetSchedule");
  }
  absl::Status PublishCommId(const v1::PublishCommIdRequest& request);
  // The call's deadline is request.timeout_ms plus rpc_timeout (the server answers
  // DEADLINE_EXCEEDED itself at timeout_ms).
  absl::StatusOr<std::string> GetCommId(const v1::GetCommIdRequest& request);
  // With `cancel`, as for Join.
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request,
                                          CancelToken* cancel = nullptr);
  // UNIMPLEMENTED from a coordinator older than the RPC.
  absl::StatusOr<v1::ReportPeerFailureResponse> ReportPeerFailure(
      const v1::ReportPeerFailureRequest& request) {
    return Unary(&v1::Coordinator::Stub::ReportPeerFailure, request, "ReportPeerFailure");
  }
  // UNIMPLEMENTED from a coordinator older than the RPC.
  absl::StatusOr<v1::ReportNonFiniteResponse> ReportNonFinite(
      const v1::ReportNonFiniteRequest& request) {
    return Unary(&v1::Coordinator::Stub::ReportNonFinite, request, "ReportNonFinite");
  }
  absl::Status Ping();
  // Opens a HeartbeatStream carrying the token, without a deadline (it lasts as long as the
  // membership): see HeartbeatStreamCall. Never fails here; errors end the stream.
  std::unique_ptr<HeartbeatStreamCall> StartHeartbeatStream(HeartbeatStreamCall::ReplyCallback on_reply,
                                                            HeartbeatStreamCall::EndCallback on_end);
  // The same for a HostHeartbeatStream (the beats of several members per message).
  std::unique_ptr<HostHeartbeatStreamCall> StartHostHeartbeatStream(
      HostHeartbeatStreamCall::ReplyCallback on_reply, HostHeartbeatStreamCall::EndCallback on_end);

  // The options it was made with, the token read (auth_token set, auth_token_file empty).
  const ConnectionOptions& options() const { return options_; }
  // The address calls go to now (one of options().coordinator's, or a leader one of them named).
  std::string current_address() const;

  // With an outage tracker (not owned; outlives this object), PublishCommId and GetCommId wait
  // through an unreachable coordinator (CoordinatorOutage::Retry) instead of failing at once,
  // and every reply or failure updates it. Set once, before the calls start.
  void set_outage(CoordinatorOutage* outage) { outage_ = outage; }

  // The addresses of a comma-separated list, in order. INVALID_ARGUMENT for an empty one.
  static absl::StatusOr<std::vector<std::string>> ParseAddresses(const std::string& list);

 private:
  struct Target {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Coordinator::Stub> stub;
  };
  CoordinatorClient(ConnectionOptions options,
                    std::shared_ptr<grpc::ChannelCredentials> creds);
  // Deadline and token on a fresh context.
  void Prepare(grpc::ClientContext* context, absl::Duration timeout) const;
  // "Bearer <token>", empty without a token.
  std::string Authorization() const;
  // Adds a target for `address` (or finds it); its index.
  size_t TargetFor(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(targets_mu_);
  // The stub calls go to now, and its index for Failover.
  std::pair<v1::Coordinator::Stub*, size_t> Current() const;
  // A call to target `index` ended with `status`: an UNAVAILABLE moves the next calls to the
  // leader named in the "modelavg-leader" trailer, or else to the next address.
  void Failover(size_t index, const grpc::Status& status, const grpc::ClientContext& context);
  // Runs `call(stub)` against the current target, then Failover.
  template <typename F>
  grpc::Status Send(grpc::ClientContext* context, F call) {
    auto [stub, index] = Current();
    grpc::Status s = call(stub);
    if (!s.ok()) Failover(index, s, *context);
    return s;
  }
  // One call of unary `method` within rpc_timeout: its reply, or its status named after `rpc`
  // (StatusOf). An RPC's client call that needs nothing more is one line over it, in this file.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Unary(
      grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
      const Request& request, const char* rpc) {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.rpc_timeout);
    Response out;
    const grpc::Status s = Send(
        &ctx, [&](v1::Coordinator::Stub* stub) { return (stub->*method)(&ctx, request, &out); });
    if (!s.ok()) return StatusOf(s, rpc);
    return out;
  }
  // A call's status as the client's: OK, or the coordinator's code and message after
  // "coordinator <rpc>".
  static absl::Status StatusOf(const grpc::Status& status, const char* rpc);

  const ConnectionOptions options_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  mutable absl::Mutex targets_mu_;
  // Only grows (stubs handed out stay valid).
  std::vector<std::unique_ptr<Target>> targets_ ABSL_GUARDED_BY(targets_mu_);
  size_t current_ ABSL_GUARDED_BY(targets_mu_) = 0;
  CoordinatorOutage* outage_ = nullptr;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_RPC_COORDINATOR_CLIENT_H_
