// The thin gRPC adapter: every Coordinator RPC as a callback-API handler over the JobRegistry.
// Handlers never block: Join and GetCommId return reactors that the core finishes; WatchJob is a
// server-streaming reactor fed by the Job's events.
#ifndef MODELAVG_SERVER_COORDINATOR_SERVICE_H_
#define MODELAVG_SERVER_COORDINATOR_SERVICE_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/job_registry.h"
#include "server/rpc_metrics.h"

namespace modelavg::server {

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `auth_token` empty: no auth. Otherwise every RPC needs "authorization: Bearer <token>"
  // metadata (UNAUTHENTICATED without it). `metrics` may be null. Both pointers must outlive
  // the service.
  CoordinatorService(JobRegistry* registry, std::string auth_token, RpcMetrics* metrics);

  grpc::ServerUnaryReactor* CreateJob(grpc::CallbackServerContext* ctx,
                                      const v1::CreateJobRequest* request,
                                      v1::Job* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* ctx,
                                      const v1::DeleteJobRequest* request,
                                      v1::DeleteJobResponse* response) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>* HeartbeatStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* ctx,
                                 const v1::StepRequest* request,
                                 v1::StepDecision* response) override;
  grpc::ServerUnaryReactor* GetSchedule(grpc::CallbackServerContext* ctx,
                                        const v1::GetScheduleRequest* request,
                                        v1::GetScheduleResponse* response) override;
  grpc::ServerUnaryReactor* PublishCommId(grpc::CallbackServerContext* ctx,
                                          const v1::PublishCommIdRequest* request,
                                          v1::PublishCommIdResponse* response) override;
  grpc::ServerUnaryReactor* GetCommId(grpc::CallbackServerContext* ctx,
                                      const v1::GetCommIdRequest* request,
                                      v1::GetCommIdResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx,
                                                   const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* ctx, const v1::PingRequest* request,
                                 v1::PingResponse* response) override;

 private:
  // UNAUTHENTICATED unless the call carries the token (always OK without auth).
  absl::Status Authorize(const grpc::CallbackServerContext* ctx) const;
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, RpcMethod method,
                                   const absl::Status& status);
  void Count(RpcMethod method, absl::StatusCode code) {
    if (metrics_ != nullptr) metrics_->CountRpc(method, code);
  }

  JobRegistry* const registry_;
  const std::string expected_authorization_;  // "Bearer <token>", empty: no auth
  RpcMetrics* const metrics_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_COORDINATOR_SERVICE_H_
