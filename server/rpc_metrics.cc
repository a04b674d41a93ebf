#include "server/rpc_metrics.h"

#include <exception>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"

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
      add(workers, stats.workers);
      add(generation, static_cast<double>(stats.generation));
      add(lag, static_cast<double>(stats.step_lag));
      add(vacant, stats.vacant_ranks);
      add(deaths, static_cast<double>(stats.deaths));
      add(admissions, static_cast<double>(stats.admissions));
    }
    for (const auto& [state, n] : by_state) {
      prometheus::ClientMetric m;
      m.label.push_back({"state", state});
      m.gauge.value = n;
      jobs.metric.push_back(std::move(m));
    }
    return {std::move(jobs),  std::move(workers), std::move(generation), std::move(lag),
            std::move(vacant), std::move(deaths), std::move(admissions)};
  }

 private:
  const JobRegistry* registry_;
};

}  // namespace

const char* RpcMethodName(RpcMethod method) {
  static constexpr const char* kNames[] = {
      "CreateJob", "GetJob",        "ListJobs",  "DeleteJob", "Join",     "Heartbeat", "Step",
      "GetSchedule", "PublishCommId", "GetCommId", "Leave",     "WatchJob", "Ping", "HeartbeatStream"};
  return kNames[static_cast<int>(method)];
}

absl::StatusOr<std::unique_ptr<RpcMetrics>> RpcMetrics::Start(const std::string& listen,
                                                               const JobRegistry* registry) {
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
  m->jobs_collector_ = std::make_shared<JobsCollector>(registry);
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  m->exposer_->RegisterCollectable(m->jobs_collector_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  const std::string host = std::string(listen.substr(0, listen.rfind(':')));
  m->address_ = absl::StrCat(host, ":", ports.empty() ? 0 : ports[0]);
  return m;
}

RpcMetrics::~RpcMetrics() = default;

void RpcMetrics::CountRpc(RpcMethod method, absl::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c < 0 || c >= kCodes) return;
  counters_[static_cast<int>(method)][c]->Increment();
}

}  // namespace modelavg::server
