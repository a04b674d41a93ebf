// A thin wrapper over the generated Coordinator stub: a deadline on every call, the bearer token
// as metadata, TLS credentials, and grpc::Status turned into absl::Status. No logic of its own.
#ifndef MODELAVG_CLIENT_COORDINATOR_CLIENT_H_
#define MODELAVG_CLIENT_COORDINATOR_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "modelavg/v1/coordinator.grpc.pb.h"

namespace modelavg::client {

struct CoordinatorClientOptions {
  // "host:port".
  std::string address;
  std::string auth_token;
  bool tls = false;
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  // Default deadline of a call that does not say otherwise.
  absl::Duration rpc_timeout = absl::Seconds(10);
};

// Thread-safe (the stub is).
class CoordinatorClient {
 public:
  // INVALID_ARGUMENT for an empty address or unreadable TLS files. Does not connect yet.
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(
      const CoordinatorClientOptions& options);

  // Each returns the RPC's reply or its status (the coordinator's codes, see coordinator.proto;
  // UNAVAILABLE when unreachable, DEADLINE_EXCEEDED past `timeout` or rpc_timeout).
  absl::StatusOr<v1::Job> CreateJob(const v1::JobSpec& spec);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id);
  absl::Status DeleteJob(const std::string& job_id);
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request, absl::Duration timeout);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::StatusOr<v1::StepDecision> Step(const v1::StepRequest& request);
  absl::StatusOr<v1::GetScheduleResponse> GetSchedule(const v1::GetScheduleRequest& request);
  absl::Status PublishCommId(const v1::PublishCommIdRequest& request);
  // The call's deadline is request.timeout_ms plus rpc_timeout (the server answers
  // DEADLINE_EXCEEDED itself at timeout_ms).
  absl::StatusOr<std::string> GetCommId(const v1::GetCommIdRequest& request);
  absl::StatusOr<v1::LeaveResponse> Leave(const v1::LeaveRequest& request);
  absl::Status Ping();

  const CoordinatorClientOptions& options() const { return options_; }

 private:
  CoordinatorClient(CoordinatorClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // Deadline and token on a fresh context.
  void Prepare(grpc::ClientContext* context, absl::Duration timeout) const;

  const CoordinatorClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COORDINATOR_CLIENT_H_
