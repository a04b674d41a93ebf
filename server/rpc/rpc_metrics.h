// Prometheus metrics of the coordinator: RPCs by method and code, and per-job gauges (workers,
// generation, step lag) computed from the registry at each scrape. The coordinator's HTTP port
// (server/http/http_server.h, --metrics_listen) serves TextExposition() as /metrics.
#ifndef MODELAVG_SERVER_RPC_RPC_METRICS_H_
#define MODELAVG_SERVER_RPC_RPC_METRICS_H_

#include <array>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/job_registry.h"
#include "server/rpc/coordinator_rpcs.h"
#include "server/rpc/tcp_listener.h"

namespace prometheus {
class Collectable;
class Counter;
class Gauge;
class Registry;
}  // namespace prometheus

namespace modelavg::server {

// The coordinator's RPCs, for counting: k<name> for each line of the list.
enum class RpcMethod {
#define MODELAVG_RPC_METHOD(name, ...) k##name,
  MODELAVG_COORDINATOR_RPCS(MODELAVG_RPC_METHOD)
#undef MODELAVG_RPC_METHOD
  kCount  // number of methods
};
const char* RpcMethodName(RpcMethod method);

class RpcMetrics {
 public:
  // `registry` must outlive the returned object.
  static std::unique_ptr<RpcMetrics> Create(const JobRegistry* registry);
  ~RpcMetrics();

  // Thread-safe, lock-free.
  void CountRpc(RpcMethod method, absl::StatusCode code);
  // A stream (WatchJob, HeartbeatStream, HostHeartbeatStream) opened or ended: the gauge
  // modelavg_streams_open{method}. Thread-safe; other methods are ignored.
  void StreamOpened(RpcMethod method);
  void StreamClosed(RpcMethod method);

  // The gRPC port's listener, whose connections and self-probe are read at each scrape
  // (modelavg_grpc_*); must outlive this object's scrapes. Set once, before serving.
  void set_listener(const TcpListener* listener) { listener_ = listener; }

  // Every metric in Prometheus' text format (version 0.0.4), as of now. Thread-safe.
  std::string TextExposition() const;
  // The same, made at most `max_age` ago: scrapes within it share one exposition, so that its
  // cost (which grows with jobs x ranks) is paid once per interval however many clients ask.
  // Thread-safe; one caller makes it while the others wait for it.
  std::string CachedTextExposition(absl::Duration max_age) const ABSL_LOCKS_EXCLUDED(cache_mu_);

 private:
  RpcMetrics() = default;
  static constexpr int kCodes = 17;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> jobs_collector_;
  const TcpListener* listener_ = nullptr;
  mutable absl::Mutex cache_mu_;
  mutable std::string cached_ ABSL_GUARDED_BY(cache_mu_);
  mutable absl::Time cached_at_ ABSL_GUARDED_BY(cache_mu_) = absl::InfinitePast();
  std::array<std::array<prometheus::Counter*, kCodes>, static_cast<int>(RpcMethod::kCount)>
      counters_{};
  std::array<prometheus::Gauge*, static_cast<int>(RpcMethod::kCount)> open_streams_{};
};

// One stream's metrics (WatchJob, HeartbeatStream, HostHeartbeatStream): open from construction
// until Ended, which counts the stream by its final code. `metrics` may be null.
class StreamMetrics {
 public:
  StreamMetrics(RpcMetrics* metrics, RpcMethod method) : metrics_(metrics), method_(method) {
    if (metrics_ != nullptr) metrics_->StreamOpened(method_);
  }
  StreamMetrics(const StreamMetrics&) = delete;
  StreamMetrics& operator=(const StreamMetrics&) = delete;

  void Ended(absl::StatusCode code) {
    if (metrics_ == nullptr) return;
    metrics_->StreamClosed(method_);
    metrics_->CountRpc(method_, code);
  }

 private:
  RpcMetrics* const metrics_;
  const RpcMethod method_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_RPC_METRICS_H_
