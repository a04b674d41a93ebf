// Prometheus metrics of the coordinator (--metrics_listen): RPCs by method and code, and per-job
// gauges (workers, generation, step lag) computed from the registry at each scrape.
#ifndef MODELAVG_SERVER_RPC_METRICS_H_
#define MODELAVG_SERVER_RPC_METRICS_H_

#include <array>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/job_registry.h"

namespace prometheus {
class Collectable;
class Counter;
class Exposer;
class Registry;
}  // namespace prometheus

namespace modelavg::server {

// The coordinator's RPCs, for counting.
enum class RpcMethod {
  kCreateJob, kGetJob, kListJobs, kDeleteJob, kJoin, kHeartbeat, kStep, kGetSchedule,
  kPublishCommId, kGetCommId, kLeave, kWatchJob, kPing, kHeartbeatStream,
  kCount  // number of methods
};
const char* RpcMethodName(RpcMethod method);

class RpcMetrics {
 public:
  // Serves /metrics on `listen` ("HOST:PORT", port 0 allowed). UNAVAILABLE if it cannot bind.
  // `registry` must outlive the returned object.
  static absl::StatusOr<std::unique_ptr<RpcMetrics>> Start(const std::string& listen,
                                                           const JobRegistry* registry);
  ~RpcMetrics();

  // Thread-safe, lock-free.
  void CountRpc(RpcMethod method, absl::StatusCode code);

  // "HOST:PORT" actually bound.
  const std::string& address() const { return address_; }

 private:
  RpcMetrics() = default;
  static constexpr int kCodes = 17;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> jobs_collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::array<std::array<prometheus::Counter*, kCodes>, static_cast<int>(RpcMethod::kCount)>
      counters_{};
  std::string address_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_METRICS_H_
