#include "server/rpc/rpc_metrics.h"

#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace modelavg::server {
namespace {

// Per-job gauges, read from the registry when Prometheus scrapes (no bookkeeping on hot paths).
class JobsCollector final : public prometheus::Collectable {
 public:
  explicit JobsCollector(const JobRegistry* registry) : registry_(registry) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily jobs{"modelavg_jobs", "Jobs by state", prometheus::MetricType::Gauge,
                                  {}};
    prometheus::MetricFamily workers{"modelavg_job_workers",
                                     "Workers joined to the job's current generation",
                                     prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily generation{"modelavg_job_generation", "The job's generation",
                                        prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily lag{"modelavg_job_step_lag",
                                 "Largest minus smallest step reported by the current members",
                                 prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily vacant{"modelavg_job_vacant_ranks",
                                    "Elastic jobs: ranks of the running job no live worker holds",
                                    prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily deaths{"modelavg_job_deaths",
                                    "Members declared dead (heartbeat timeout) since the job "
                                    "was created or the coordinator restarted",
                                    prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily admissions{"modelavg_job_admissions",
                                        "Elastic jobs: replacements admitted into the running "
                                        "job since it was created or the coordinator restarted",
                                        prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily nonfinite{"modelavg_job_nonfinite_reports",
                                       "Members that found non-finite values (NaN, Inf) in "
                                       "their contribution to a round and kept them out of it, "
                                       "since the job was created or the coordinator restarted",
                                       prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily plan_updates{"modelavg_job_plan_updates_total",
                                          "Plans UpdateJob accepted for the job (its plan "
                                          "history less the first plan)",
                                          prometheus::MetricType::Counter, {}};
    prometheus::MetricFamily paced_rounds{"modelavg_job_paced_rounds_total",
                                          "Paced jobs (docs/paced.md): rounds of the paced level "
                                          "planned so far",
                                          prometheus::MetricType::Counter, {}};
    prometheus::MetricFamily idle_saved{"modelavg_job_pacing_idle_saved_ratio",
                                        "Paced jobs: the share of the members' time the last "
                                        "planned round saves from waiting at the round, against "
                                        "the same round step-locked (0 while no pace is known)",
                                        prometheus::MetricType::Gauge, {}};
    prometheus::MetricFamily job_state{"modelavg_job_state",
                                       "1 for the job's current state (label state), 0 for the "
                                       "others", prometheus::MetricType::Gauge, {}};
    std::map<std::string, int> by_state = {{"PENDING", 0}, {"RUNNING", 0}, {"FINISHED", 0}};
    for (const auto& job : registry_->ListJobs()) {
      const Job::Stats stats = job->GetStats();
      ++by_state[v1::JobState_Name(stats.state)];
      auto add = [&](prometheus::MetricFamily& f, double v) {
        prometheus::ClientMetric m;
        m.label.push_back({"job", job->id()});
        m.gauge.value = v;
        f.metric.push_back(std::move(m));
      };
      auto add_counter = [&](prometheus::MetricFamily& f, double v) {
        prometheus::ClientMetric m;
        m.label.push_back({"job", job->id()});
        m.counter.value = v;
        f.metric.push_back(std::move(m));
      };
      add(workers, stats.workers);
      add(generation, static_cast<double>(stats.generation));
      add(lag, static_cast<double>(stats.step_lag));
      add(vacant, stats.vacant_ranks);
      add(deaths, static_cast<double>(stats.deaths));
      add(admissions, static_cast<double>(stats.admissions));
      add(nonfinite, static_cast<double>(stats.nonfinite_reports));
      add_counter(plan_updates, static_cast<double>(stats.plan_updates));
      if (stats.paced) {
        add_counter(paced_rounds, static_cast<double>(stats.paced_rounds));
        add(idle_saved, stats.idle_saved);
      }
      for (const auto& [state, n] : by_state) {
        prometheus::ClientMetric m;
        m.label.push_back({"job", job->id()});
        m.label.push_back({"state", state});
        m.gauge.value = state == v1::JobState_Name(stats.state) ? 1 : 0;
        job_state.metric.push_back(std::move(m));
      }
    }
    for (const auto& [state, n] : by_state) {
      prometheus::ClientMetric m;
      m.label.push_back({"state", state});
      m.gauge.value = n;
      jobs.metric.push_back(std::move(m));
    }
    return {std::move(jobs),   std::move(workers), std::move(generation),
            std::move(lag),    std::move(vacant),  std::move(deaths),
            std::move(admissions), std::move(nonfinite), std::move(plan_updates),
            std::move(paced_rounds), std::move(idle_saved), std::move(job_state)};
  }

 private:
  const JobRegistry* registry_;
};

}  // namespace

const char* RpcMethodName(RpcMethod method) {
  static constexpr const char* kNames[] = {
#define MODELAVG_RPC_NAME(name, ...) #name,
      MODELAVG_COORDINATOR_RPCS(MODELAVG_RPC_NAME)
#undef MODELAVG_RPC_NAME
  };
  return kNames[static_cast<int>(method)];
}

std::unique_ptr<RpcMetrics> RpcMetrics::Create(const JobRegistry* registry) {
  std::unique_ptr<RpcMetrics> m(new RpcMetrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildCounter()
                     .Name("modelavg_rpcs_total")
                     .Help("Coordinator RPCs by method and status code")
                     .Register(*m->registry_);
  for (int method = 0; method < static_cast<int>(RpcMethod::kCount); ++method) {
    for (int code = 0; code < kCodes; ++code) {
      m->counters_[method][code] = &family.Add(
          {{"method", RpcMethodName(static_cast<RpcMethod>(method))},
           {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
    }
  }
  auto& streams = prometheus::BuildGauge()
                      .Name("modelavg_streams_open")
                      .Help("Streams open now, by method (a HostHeartbeatStream carries the "
                            "beats of one host's or process's ranks)")
                      .Register(*m->registry_);
  for (RpcMethod method :
       {RpcMethod::kWatchJob, RpcMethod::kHeartbeatStream, RpcMethod::kHostHeartbeatStream}) {
    m->open_streams_[static_cast<int>(method)] =
        &streams.Add({{"method", RpcMethodName(method)}});
  }
  m->jobs_collector_ = std::make_shared<JobsCollector>(registry);
  // A new value at every start: Prometheus sees a restart as a change of it.
  prometheus::BuildGauge()
      .Name("modelavg_coordinator_start_time_seconds")
      .Help("When this coordinator process started, seconds since the Unix epoch")
      .Register(*m->registry_)
      .Add({})
      .Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  return m;
}

namespace {

// The gRPC port's connections and whether a new one is taken (server/rpc/tcp_listener.h).
std::vector<prometheus::MetricFamily> ListenerFamilies(const TcpListenerStats& stats) {
  auto one = [](const char* name, const char* help, prometheus::MetricType type, double value,
                std::vector<prometheus::ClientMetric::Label> labels = {}) {
    prometheus::MetricFamily family{name, help, type, {}};
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    if (type == prometheus::MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    family.metric.push_back(std::move(m));
    return family;
  };
  std::vector<prometheus::MetricFamily> out;
  out.push_back(one("modelavg_grpc_accepting",
                    "1 while a new connection to the gRPC port is taken (the coordinator's "
                    "self-probe), 0 while one is not",
                    prometheus::MetricType::Gauge, stats.accepting ? 1 : 0));
  out.push_back(one("modelavg_grpc_connections_open", "Connections to the gRPC port open now",
                    prometheus::MetricType::Gauge, static_cast<double>(stats.open)));
  out.push_back(one("modelavg_grpc_connections_max",
                    "The gRPC port's most connections at once (--rpc_max_connections)",
                    prometheus::MetricType::Gauge, static_cast<double>(stats.max_connections)));
  prometheus::MetricFamily refused = one(
      "modelavg_grpc_connections_refused_total",
      "Connections to the gRPC port closed at once: every slot taken (reason all) or the "
      "client address's taken (reason per_client)",
      prometheus::MetricType::Counter, static_cast<double>(stats.refused_all),
      {{"reason", "all"}});
  prometheus::MetricFamily per_client = one("", "", prometheus::MetricType::Counter,
                                            static_cast<double>(stats.refused_per_client),
                                            {{"reason", "per_client"}});
  refused.metric.push_back(std::move(per_client.metric[0]));
  out.push_back(std::move(refused));
  out.push_back(one("modelavg_grpc_accept_errors_total",
                    "accept() on the gRPC port failed for want of a resource (EMFILE, ENFILE, "
                    "ENOBUFS, ENOMEM); the coordinator backs off and accepts again",
                    prometheus::MetricType::Counter, static_cast<double>(stats.accept_errors)));
  return out;
}

}  // namespace

std::string RpcMetrics::TextExposition() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> jobs = jobs_collector_->Collect();
  families.insert(families.end(), std::make_move_iterator(jobs.begin()),
                  std::make_move_iterator(jobs.end()));
  if (listener_ != nullptr) {
    std::vector<prometheus::MetricFamily> grpc = ListenerFamilies(listener_->Stats());
    families.insert(families.end(), std::make_move_iterator(grpc.begin()),
                    std::make_move_iterator(grpc.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

std::string RpcMetrics::CachedTextExposition(absl::Duration max_age) const {
  if (max_age <= absl::ZeroDuration()) return TextExposition();
  absl::MutexLock lock(&cache_mu_);
  const absl::Time now = absl::Now();
  if (now - cached_at_ >= max_age) {
    cached_ = TextExposition();
    cached_at_ = now;
  }
  return cached_;
}

RpcMetrics::~RpcMetrics() = default;

void RpcMetrics::CountRpc(RpcMethod method, absl::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c < 0 || c >= kCodes) return;
  counters_[static_cast<int>(method)][c]->Increment();
}

}  // namespace modelavg::server

namespace modelavg::server {

void RpcMetrics::StreamOpened(RpcMethod method) {
  if (prometheus::Gauge* g = open_streams_[static_cast<int>(method)]; g != nullptr) g->Increment();
}

void RpcMetrics::StreamClosed(RpcMethod method) {
  if (prometheus::Gauge* g = open_streams_[static_cast<int>(method)]; g != nullptr) g->Decrement();
}

}  // namespace modelavg::server
