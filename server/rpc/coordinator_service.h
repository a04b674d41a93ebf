// The thin gRPC adapter: every Coordinator RPC as a callback-API handler over the JobRegistry.
// Handlers never block: Join and GetCommId return reactors that the core finishes; WatchJob is a
// streaming reactor fed by the Job's events.
#ifndef MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_
#define MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/core/job_registry.h"
#include "server/rpc/rpc_metrics.h"
#include "server/rpc/service_auth.h"

namespace modelavg::server {

// The callback API reads a unary or server-streaming call's request whole before it hands the
// call to a handler, whoever sent it. So only the two heartbeat streams are typed methods here
// (their caller is checked when the stream opens, before any message is read); the constructor
// marks every other method generic, served by CreateReactor, which checks the caller first and
// reads the request only for a caller that may make the call: a refused call costs no more than
// its headers. Every request is taken as bytes and parsed here: bytes that are not the method's
// message get INVALID_ARGUMENT with a message (gRPC's generated handlers answer UNIMPLEMENTED
// with none), on every RPC and stream. Which method is served how, and who may call it: the
// list in server/rpc/coordinator_rpcs.h.
using TypedCoordinatorService =
    v1::Coordinator::WithRawCallbackMethod_HeartbeatStream<
    v1::Coordinator::WithRawCallbackMethod_HostHeartbeatStream<
    v1::Coordinator::Service>>;

// The largest request each method takes, in bytes (serialized): sized to the largest legitimate
// message, each capped by the server's receive limit (ServerOptions::max_request_bytes).
//  * HostHeartbeatStream: 4096 beats of at most ~210 bytes (a 128-character job id, a 32-hex
//    credential, five numbers): ~850 KiB; so the default receive limit is 1 MiB.
//  * ReportPeerFailure: two lists of up to 65536 ranks (3 bytes each): 384 KiB.
//  * every other request (a HeartbeatStream's beats too): a few hundred bytes (a spec of 16
//    levels, a 4096-byte comm id).
inline constexpr size_t kDefaultMaxRequestBytes = 1 << 20;
inline constexpr size_t kSmallRequestBytes = 64 << 10;
inline constexpr size_t kPeerReportRequestBytes = 512 << 10;

class CoordinatorService final : public TypedCoordinatorService,
                                 public grpc::CallbackGenericService {
 public:
  // `metrics` may be null. Both pointers must outlive the service. `max_request_bytes` caps
  // every method's request size (gRPC's own receive limit is set to it as well).
  CoordinatorService(JobRegistry* registry, AuthOptions auth, RpcMetrics* metrics,
                     size_t max_request_bytes = kDefaultMaxRequestBytes);
  ~CoordinatorService() override;

  // Asked before every call and every HeartbeatStream beat (HostHeartbeatStream message), after
  // authorization: a non-OK status is the answer (a standby's UNAVAILABLE naming the leader,
  // server/leader_terms.h). `ctx` is null for a beat. Set once, before serving.
  using Gate = std::function<absl::Status(grpc::CallbackServerContext* ctx)>;
  void set_gate(Gate gate) { gate_ = std::move(gate); }

  // The most bytes of GetSchedule answers that one client address may have in flight (built and
  // not yet sent) at once; an answer past it is refused RESOURCE_EXHAUSTED. Set once, before
  // serving; at least kMaxScheduleReplyBytes, so that one answer always fits.
  void set_schedule_bytes_per_client(int64_t bytes) { schedule_bytes_per_client_ = bytes; }

  // Every method but the two heartbeat streams (and UNIMPLEMENTED for unknown ones).
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* HeartbeatStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* HostHeartbeatStream(
      grpc::CallbackServerContext* ctx) override;

 private:
  template <typename Request, typename Response>
  class Call;
  struct Route;
  // The caller, if it may make a call that needs `need` now (authorized, then the gate); else
  // the call's answer.
  absl::StatusOr<Caller> Admit(grpc::CallbackServerContext* ctx, Role need = Role::kWorker,
                               const char* rpc = "") const;
  // Adds the route of one line of the RPC list (coordinator_rpcs.h).
  template <typename Request, typename Response, typename Fn>
  void AddRoute(RpcMethod method, Role need, const char* name, size_t max_bytes, Fn handler);
  // Authorizes, reads, checks, parses and hands the call to `handler` (a method of the job the
  // request names, or of this service), which replies.
  template <typename Request, typename Response, typename Fn>
  grpc::ServerGenericBidiReactor* Serve(grpc::GenericCallbackServerContext* ctx,
                                        const Route& route, Fn handler);
  // The RPCs the service itself serves (the others are Job's).
  grpc::ServerGenericBidiReactor* ServeWatchJob(grpc::GenericCallbackServerContext* ctx,
                                                const Route& route);
  void DoCreateJob(grpc::CallbackServerContext* ctx, Call<v1::CreateJobRequest, v1::Job>* call);
  void DoGetJob(grpc::CallbackServerContext* ctx, Call<v1::GetJobRequest, v1::Job>* call);
  void DoListJobs(grpc::CallbackServerContext* ctx,
                  Call<v1::ListJobsRequest, v1::ListJobsResponse>* call);
  void DoDeleteJob(grpc::CallbackServerContext* ctx,
                   Call<v1::DeleteJobRequest, v1::DeleteJobResponse>* call);
  void DoGetSchedule(grpc::CallbackServerContext* ctx,
                     Call<v1::GetScheduleRequest, v1::GetScheduleResponse>* call);
  void DoPing(grpc::CallbackServerContext* ctx, Call<v1::PingRequest, v1::PingResponse>* call);

  JobRegistry* const registry_;
  const ServiceAuth auth_;
  RpcMetrics* const metrics_;
  const size_t max_request_bytes_;
  // By full method name ("/modelavg.v1.Coordinator/Join").
  absl::flat_hash_map<std::string, std::unique_ptr<Route>> routes_;
  // The role and the request bound of each stream served by a reactor of its own, from its line
  // of the RPC list (the bound capped by max_request_bytes_).
  struct StreamLimits {
    Role need = Role::kWorker;
    size_t max_request_bytes = kSmallRequestBytes;
  };
  absl::flat_hash_map<std::string, StreamLimits> streams_;
  Gate gate_;
  int64_t schedule_bytes_per_client_ = int64_t{64} << 20;
  // GetSchedule answers in flight, bytes per client address.
  absl::Mutex schedule_mu_;
  absl::flat_hash_map<std::string, int64_t> schedule_in_flight_ ABSL_GUARDED_BY(schedule_mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_COORDINATOR_SERVICE_H_
