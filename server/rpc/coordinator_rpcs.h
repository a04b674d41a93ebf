// The Coordinator's RPCs, one line each. The service's routing and role table
// (coordinator_service.cc) and the RPC metrics' method names (rpc_metrics.h) all come from this
// list, so a new RPC is: its messages in the proto, its handler, one line here, its client call.
//
//   RPC(name, request, response, role, largest request, handler)
//
// * name: the method's name in the proto; the route is "/modelavg.v1.Coordinator/<name>" and the
//   label of its metrics (modelavg_rpcs_total{method}) is the name.
// * role: the least role that may call it (service_auth.h): Role::kWorker or Role::kOperator.
// * largest request: its bound in bytes (coordinator_service.h), capped by the server's; a raw
//   stream's reactor checks each of its messages against it.
// * handler, by the shape of its signature:
//     a method of Job (server/job/job.h) for an RPC about one job (the request's job_id):
//       absl::Status (const Request&, Response*)   answered when it returns;
//       absl::Status (const Request&)              the same, with an empty response;
//       void (const Request&, absl::Time deadline, WaitId, callback)
//                                                  a wait: answered by the callback, cancelled
//                                                  with the call, at most until the call's
//                                                  deadline;
//       void (const Request&, callback)            answered by the callback;
//     a method of CoordinatorService, for a call on the registry or the service's own state;
//     kRawStream: a stream served by a reactor of its own (the typed service's method).
//   A response with a coordinator_incarnation field gets the coordinator's.
//
// Expanded where its parts are known: only the name where the others are not needed.
#ifndef MODELAVG_SERVER_RPC_COORDINATOR_RPCS_H_
#define MODELAVG_SERVER_RPC_COORDINATOR_RPCS_H_

namespace modelavg::server {

// The handler of a stream served by a reactor of its own.
struct RawStream {};
inline constexpr RawStream kRawStream{};

}  // namespace modelavg::server

// clang-format off
#define MODELAVG_COORDINATOR_RPCS(RPC)                                                             \
  RPC(CreateJob, v1::CreateJobRequest, v1::Job, Role::kOperator, kSmallRequestBytes,               \
      &CoordinatorService::DoCreateJob)                                                            \
  RPC(GetJob, v1::GetJobRequest, v1::Job, Role::kWorker, kSmallRequestBytes,                       \
      &CoordinatorService::DoGetJob)                                                               \
  RPC(ListJobs, v1::ListJobsRequest, v1::ListJobsResponse, Role::kWorker, kSmallRequestBytes,      \
      &CoordinatorService::DoListJobs)                                                             \
  RPC(DeleteJob, v1::DeleteJobRequest, v1::DeleteJobResponse, Role::kOperator,                     \
      kSmallRequestBytes, &CoordinatorService::DoDeleteJob)                                        \
  RPC(Join, v1::JoinRequest, v1::JoinResponse, Role::kWorker, kSmallRequestBytes, &Job::Join)      \
  RPC(Heartbeat, v1::HeartbeatRequest, v1::HeartbeatResponse, Role::kWorker, kSmallRequestBytes,   \
      &Job::Heartbeat)                                                                             \
  RPC(Step, v1::StepRequest, v1::StepDecision, Role::kWorker, kSmallRequestBytes, &Job::Step)      \
  RPC(GetSchedule, v1::GetScheduleRequest, v1::GetScheduleResponse, Role::kWorker,                 \
      kSmallRequestBytes, &CoordinatorService::DoGetSchedule)                                      \
  RPC(PublishCommId, v1::PublishCommIdRequest, v1::PublishCommIdResponse, Role::kWorker,           \
      kSmallRequestBytes, &Job::PublishCommId)                                                     \
  RPC(GetCommId, v1::GetCommIdRequest, v1::GetCommIdResponse, Role::kWorker, kSmallRequestBytes,   \
      &Job::GetCommId)                                                                             \
  RPC(Leave, v1::LeaveRequest, v1::LeaveResponse, Role::kWorker, kSmallRequestBytes, &Job::Leave)  \
  RPC(WatchJob, v1::WatchJobRequest, v1::JobEvent, Role::kWorker, kSmallRequestBytes,              \
      &CoordinatorService::ServeWatchJob)                                                          \
  RPC(Ping, v1::PingRequest, v1::PingResponse, Role::kWorker, kSmallRequestBytes,                  \
      &CoordinatorService::DoPing)                                                                 \
  RPC(HeartbeatStream, v1::HeartbeatRequest, v1::HeartbeatResponse, Role::kWorker,                 \
      kSmallRequestBytes, kRawStream)                                                              \
  RPC(ReportPeerFailure, v1::ReportPeerFailureRequest, v1::ReportPeerFailureResponse,              \
      Role::kWorker, kPeerReportRequestBytes, &Job::ReportPeerFailure)                             \
  RPC(HostHeartbeatStream, v1::HostHeartbeatRequest, v1::HostHeartbeatResponse, Role::kWorker,     \
      kDefaultMaxRequestBytes, kRawStream)                                                         \
  RPC(ReportNonFinite, v1::ReportNonFiniteRequest, v1::ReportNonFiniteResponse, Role::kWorker,     \
      kSmallRequestBytes, &Job::ReportNonFinite)                                                   \
  RPC(UpdateJob, v1::UpdateJobRequest, v1::UpdateJobResponse, Role::kOperator,                     \
      kSmallRequestBytes, &Job::UpdateJob)
// clang-format on

#endif  // MODELAVG_SERVER_RPC_COORDINATOR_RPCS_H_
