// The thin gRPC adapter: every Coordinator RPC as a callback-API handler over the JobRegistry.
// Handlers never block: Join and GetCommId return reactors that the core finishes; WatchJob is a
// server-streaming reactor fed by the Job's events.
#ifndef MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_
#define MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_

#include <functional>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/core/job_registry.h"
#include "server/rpc/rpc_metrics.h"
#include "server/rpc/service_auth.h"

namespace modelavg::server {

// Every method takes its request as bytes and parses it itself: bytes that are not the
// method's message get INVALID_ARGUMENT with a message (gRPC's generated handlers answer
// UNIMPLEMENTED with none), on every RPC and stream.
using RawCoordinatorService =
    v1::Coordinator::WithRawCallbackMethod_CreateJob<
    v1::Coordinator::WithRawCallbackMethod_GetJob<
    v1::Coordinator::WithRawCallbackMethod_ListJobs<
    v1::Coordinator::WithRawCallbackMethod_DeleteJob<
    v1::Coordinator::WithRawCallbackMethod_Join<
    v1::Coordinator::WithRawCallbackMethod_Heartbeat<
    v1::Coordinator::WithRawCallbackMethod_HeartbeatStream<
    v1::Coordinator::WithRawCallbackMethod_HostHeartbeatStream<
    v1::Coordinator::WithRawCallbackMethod_Step<
    v1::Coordinator::WithRawCallbackMethod_GetSchedule<
    v1::Coordinator::WithRawCallbackMethod_PublishCommId<
    v1::Coordinator::WithRawCallbackMethod_GetCommId<
    v1::Coordinator::WithRawCallbackMethod_Leave<
    v1::Coordinator::WithRawCallbackMethod_WatchJob<
    v1::Coordinator::WithRawCallbackMethod_Ping<
    v1::Coordinator::WithRawCallbackMethod_ReportPeerFailure<
    v1::Coordinator::WithRawCallbackMethod_ReportNonFinite<
    v1::Coordinator::Service>>>>>>>>>>>>>>>>>;

class CoordinatorService final : public RawCoordinatorService {
 public:
  // `metrics` may be null. Both pointers must outlive the service.
  CoordinatorService(JobRegistry* registry, AuthOptions auth, RpcMetrics* metrics);

  // Asked before every call and every HeartbeatStream beat (HostHeartbeatStream message), after authorization: a non-OK
  // status is the answer (a standby's UNAVAILABLE naming the leader, server/leader_terms.h).
  // `ctx` is null for a beat. Set once, before serving.
  using Gate = std::function<absl::Status(grpc::CallbackServerContext* ctx)>;
  void set_gate(Gate gate) { gate_ = std::move(gate); }

#define MODELAVG_RAW_UNARY(Rpc)                                                          \
  grpc::ServerUnaryReactor* Rpc(grpc::CallbackServerContext* ctx,                        \
                                const grpc::ByteBuffer* request, grpc::ByteBuffer* response) \
      override;
  MODELAVG_RAW_UNARY(CreateJob)
  MODELAVG_RAW_UNARY(GetJob)
  MODELAVG_RAW_UNARY(ListJobs)
  MODELAVG_RAW_UNARY(DeleteJob)
  MODELAVG_RAW_UNARY(Join)
  MODELAVG_RAW_UNARY(Heartbeat)
  MODELAVG_RAW_UNARY(Step)
  MODELAVG_RAW_UNARY(GetSchedule)
  MODELAVG_RAW_UNARY(PublishCommId)
  MODELAVG_RAW_UNARY(GetCommId)
  MODELAVG_RAW_UNARY(Leave)
  MODELAVG_RAW_UNARY(Ping)
  MODELAVG_RAW_UNARY(ReportPeerFailure)
  MODELAVG_RAW_UNARY(ReportNonFinite)
#undef MODELAVG_RAW_UNARY
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* HeartbeatStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* HostHeartbeatStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchJob(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request) override;

 private:
  template <typename Request, typename Response>
  class Call;
  // Authorizes, parses and hands the call to `handler`, which replies.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw,
                                  grpc::ByteBuffer* reply, RpcMethod method, Role need,
                                  const char* rpc,
                                  void (CoordinatorService::*handler)(
                                      grpc::CallbackServerContext*, Call<Request, Response>*));
  void DoCreateJob(grpc::CallbackServerContext* ctx, Call<v1::CreateJobRequest, v1::Job>* call);
  void DoGetJob(grpc::CallbackServerContext* ctx, Call<v1::GetJobRequest, v1::Job>* call);
  void DoListJobs(grpc::CallbackServerContext* ctx,
                  Call<v1::ListJobsRequest, v1::ListJobsResponse>* call);
  void DoDeleteJob(grpc::CallbackServerContext* ctx,
                   Call<v1::DeleteJobRequest, v1::DeleteJobResponse>* call);
  void DoJoin(grpc::CallbackServerContext* ctx, Call<v1::JoinRequest, v1::JoinResponse>* call);
  void DoHeartbeat(grpc::CallbackServerContext* ctx,
                   Call<v1::HeartbeatRequest, v1::HeartbeatResponse>* call);
  void DoStep(grpc::CallbackServerContext* ctx, Call<v1::StepRequest, v1::StepDecision>* call);
  void DoGetSchedule(grpc::CallbackServerContext* ctx,
                     Call<v1::GetScheduleRequest, v1::GetScheduleResponse>* call);
  void DoPublishCommId(grpc::CallbackServerContext* ctx,
                       Call<v1::PublishCommIdRequest, v1::PublishCommIdResponse>* call);
  void DoGetCommId(grpc::CallbackServerContext* ctx,
                   Call<v1::GetCommIdRequest, v1::GetCommIdResponse>* call);
  void DoLeave(grpc::CallbackServerContext* ctx, Call<v1::LeaveRequest, v1::LeaveResponse>* call);
  void DoPing(grpc::CallbackServerContext* ctx, Call<v1::PingRequest, v1::PingResponse>* call);
  void DoReportPeerFailure(
      grpc::CallbackServerContext* ctx,
      Call<v1::ReportPeerFailureRequest, v1::ReportPeerFailureResponse>* call);
  void DoReportNonFinite(grpc::CallbackServerContext* ctx,
                         Call<v1::ReportNonFiniteRequest, v1::ReportNonFiniteResponse>* call);

  JobRegistry* const registry_;
  const ServiceAuth auth_;
  RpcMetrics* const metrics_;
  Gate gate_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_
