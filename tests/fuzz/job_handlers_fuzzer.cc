// libFuzzer target: the coordinator core's request handlers. The input is decoded into a few
// jobs and a sequence of requests (Join, Heartbeat, Step, GetSchedule, PublishCommId, GetCommId,
// Leave, Watch, CancelWait, DeleteJob, ListJobs, time passing) against one JobRegistry with a
// fake clock, as many hostile or confused workers would send them. Properties: nothing crashes
// or trips a sanitizer; every wait completes exactly once (at the latest when the registry
// stops); counts and ranks stay inside the world; every error says what is wrong.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "common/clock.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckError(const absl::Status& s) { Check(s.ok() || !s.message().empty()); }

// Counts completions of one wait; a second completion is a bug.
struct Waits {
  std::vector<std::shared_ptr<int>> counts;
  std::shared_ptr<int> New() {
    counts.push_back(std::make_shared<int>(0));
    return counts.back();
  }
  static void Done(const std::shared_ptr<int>& count) {
    Check(*count == 0);
    ++*count;
  }
};

class Watcher final : public JobWatcher {
 public:
  void OnEvent(const v1::JobEvent& event) override {
    Check(!closed_);
    Check(events_ > 0 || event.kind() == v1::JobEvent::SNAPSHOT);
    ++events_;
  }
  void OnClosed(const absl::Status& status) override {
    Check(!closed_ && !status.ok());
    closed_ = true;
  }
  bool Done() const override { return gone_; }
  bool gone_ = false;

 private:
  int events_ = 0;
  bool closed_ = false;
};

v1::JobSpec SpecFrom(FuzzedDataProvider& in, int index) {
  v1::JobSpec spec;
  spec.set_job_id(index == 0 ? "a" : index == 1 ? "b" : in.ConsumeRandomLengthString(8));
  static constexpr int32_t kWorlds[] = {1, 2, 3, 4, 6, 8, 16};
  const int32_t world = kWorlds[in.ConsumeIntegralInRange<size_t>(0, 6)];
  spec.set_world_size(in.ConsumeBool() ? world : in.ConsumeIntegral<int32_t>());
  spec.set_warmup_steps(in.ConsumeIntegralInRange<int64_t>(-1, 20));
  spec.set_mode(in.ConsumeBool() ? v1::HIERARCHICAL : v1::PERIODIC);
  const int levels = in.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < levels; ++i) {
    v1::Level* l = spec.add_levels();
    l->set_period(in.ConsumeIntegralInRange<int64_t>(-1, 12));
    l->set_group_size(in.ConsumeBool() ? world : in.ConsumeIntegralInRange<int32_t>(-1, 17));
  }
  if (levels > 0 && in.ConsumeBool()) spec.mutable_levels(levels - 1)->set_group_size(world);
  spec.set_heartbeat_timeout_ms(in.ConsumeIntegralInRange<int64_t>(0, 5000));
  spec.set_join_timeout_ms(in.ConsumeIntegralInRange<int64_t>(0, 20000));
  return spec;
}

void Run(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  FakeClock clock;
  JobRegistryOptions options;
  options.clock = &clock;
  options.start_staleness_thread = false;
  options.defaults.heartbeat_timeout = absl::Seconds(3);
  options.defaults.join_timeout = absl::Seconds(30);
  auto registry = std::make_unique<JobRegistry>(options);
  Waits waits;
  std::vector<WaitId> wait_ids;
  std::vector<std::shared_ptr<Watcher>> watchers;
  // (job, rank) -> the credential its latest completed Join handed out.
  auto credentials = std::make_shared<std::map<std::pair<std::string, int32_t>, std::string>>();

  const int jobs = in.ConsumeIntegralInRange<int>(1, 3);
  for (int i = 0; i < jobs; ++i) {
    v1::Job out;
    CheckError(registry->CreateJob(SpecFrom(in, i), &out));
  }
  std::vector<std::string> ids = {"a", "b", "nope"};

  while (in.remaining_bytes() > 0) {
    const std::string& job_id = ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)];
    const int op = in.ConsumeIntegralInRange<int>(0, 15);
    const int32_t rank = in.ConsumeIntegralInRange<int32_t>(-1, 16);
    const int64_t generation = in.ConsumeIntegralInRange<int64_t>(0, 6);
    // The rank's own credential, another one, or none.
    const int which = in.ConsumeIntegralInRange<int>(0, 2);
    const std::string credential =
        which == 0 ? (*credentials)[{job_id, rank}]
                   : which == 1 ? (*credentials)[{job_id, (rank + 1) % 4}] : std::string();
    absl::StatusOr<std::shared_ptr<Job>> found = registry->Find(job_id);
    if (op == 12) {
      clock.Advance(absl::Milliseconds(in.ConsumeIntegralInRange<int64_t>(0, 40000)));
      registry->CheckStaleness();
      continue;
    }
    if (op == 13) {
      v1::ListJobsRequest request;
      request.set_page_size(in.ConsumeIntegralInRange<int32_t>(-1, 3));
      request.set_page_token(in.ConsumeBool() ? "a" : in.ConsumeRandomLengthString(4));
      v1::ListJobsResponse response;
      CheckError(registry->ListJobsPage(request, &response));
      continue;
    }
    if (op == 14) {
      CheckError(registry->DeleteJob(job_id));
      continue;
    }
    if (!found.ok()) continue;
    Job& job = **found;
    switch (op) {
      case 0:
      case 1: {
        v1::JoinRequest request;
        request.set_job_id(job_id);
        request.set_worker_id(in.ConsumeBool() ? std::string("w") + std::to_string(rank)
                                               : in.ConsumeRandomLengthString(6));
        request.set_host("h");
        if (op == 0) request.set_rank(rank);
        request.set_world_size(in.ConsumeIntegralInRange<int32_t>(0, 9));
        const WaitId id = registry->NewWaitId();
        wait_ids.push_back(id);
        const int32_t world = job.world_size();
        request.set_credential(credential);
        job.Join(request, clock.Now() + absl::Milliseconds(in.ConsumeIntegral<uint16_t>()), id,
                 [count = waits.New(), world, credentials,
                  job_id](absl::StatusOr<v1::JoinResponse> r) {
                   Waits::Done(count);
                   CheckError(r.status());
                   if (r.ok()) {
                     Check(r->rank() >= 0 && r->rank() < world);
                     Check(r->credential().size() == 32);
                     (*credentials)[{job_id, r->rank()}] = r->credential();
                   }
                 });
        break;
      }
      case 2: {
        v1::HeartbeatRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_rank(rank);
        request.set_generation(generation);
        request.set_step(in.ConsumeIntegralInRange<int64_t>(-1, 100));
        v1::HeartbeatResponse response;
        const absl::Status s = job.Heartbeat(request, &response);
        CheckError(s);
        if (s.ok()) Check(response.generation() >= 1);
        break;
      }
      case 3: {
        v1::StepRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_rank(rank);
        request.set_generation(generation);
        request.set_step(in.ConsumeIntegral<int64_t>());
        v1::StepDecision response;
        CheckError(job.Step(request, &response));
        break;
      }
      case 4: {
        v1::GetScheduleRequest request;
        request.set_job_id(job_id);
        request.set_from_step(in.ConsumeIntegral<int64_t>());
        request.set_count(in.ConsumeIntegralInRange<int64_t>(-1, 300));
        if (in.ConsumeBool()) request.set_rank(rank);
        v1::GetScheduleResponse response;
        const bool cancel = in.ConsumeBool();
        CheckError(job.GetSchedule(request, &response, [cancel] { return cancel; }));
        break;
      }
      case 5: {
        v1::PublishCommIdRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_generation(generation);
        request.set_level(in.ConsumeIntegralInRange<int32_t>(-1, 4));
        request.set_subgroup(in.ConsumeIntegralInRange<int32_t>(-1, 8));
        request.set_rank(rank);
        request.set_key(in.ConsumeRandomLengthString(4));
        request.set_unique_id(in.ConsumeRandomLengthString(16));
        CheckError(job.PublishCommId(request));
        break;
      }
      case 6: {
        v1::GetCommIdRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_generation(generation);
        request.set_level(in.ConsumeIntegralInRange<int32_t>(-1, 4));
        request.set_subgroup(in.ConsumeIntegralInRange<int32_t>(-1, 8));
        request.set_rank(rank);
        request.set_key(in.ConsumeRandomLengthString(4));
        request.set_timeout_ms(in.ConsumeIntegralInRange<int64_t>(-1, 5000));
        const WaitId id = registry->NewWaitId();
        wait_ids.push_back(id);
        job.GetCommId(request, absl::InfiniteFuture(), id,
                      [count = waits.New()](absl::StatusOr<std::string> r) {
                        Waits::Done(count);
                        CheckError(r.status());
                        if (r.ok()) Check(!r->empty());
                      });
        break;
      }
      case 7: {
        v1::LeaveRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_rank(rank);
        request.set_generation(generation);
        request.set_reason(in.ConsumeRandomLengthString(8));
        v1::LeaveResponse response;
        CheckError(job.Leave(request, &response));
        break;
      }
      case 8: {
        auto watcher = std::make_shared<Watcher>();
        watchers.push_back(watcher);
        job.Watch(watcher);
        break;
      }
      case 9:
        if (!watchers.empty()) {
          watchers[in.ConsumeIntegralInRange<size_t>(0, watchers.size() - 1)]->gone_ = true;
        }
        break;
      case 10:
        if (!wait_ids.empty()) {
          job.CancelWait(wait_ids[in.ConsumeIntegralInRange<size_t>(0, wait_ids.size() - 1)]);
        }
        break;
      case 15: {
        v1::ReportNonFiniteRequest request;
        request.set_job_id(job_id);
        request.set_credential(credential);
        request.set_rank(rank);
        request.set_generation(generation);
        request.set_step(in.ConsumeIntegralInRange<int64_t>(-1, 100));
        request.set_level(in.ConsumeIntegralInRange<int32_t>(-1, 3));
        request.set_tensor(in.ConsumeIntegralInRange<int32_t>(-1, 3));
        request.set_value(in.ConsumeBool() ? "NaN" : in.ConsumeRandomLengthString(5));
        request.set_payload(in.ConsumeRandomLengthString(80));
        v1::ReportNonFiniteResponse response;
        CheckError(job.ReportNonFinite(request, &response));
        break;
      }
      case 11: {
        v1::Job proto;
        job.ToProto(&proto);
        Check(proto.members_size() <= job.world_size());
        const Job::Stats stats = job.GetStats();
        Check(stats.workers >= 0 && stats.workers <= job.world_size());
        Check(stats.generation >= 1);
        break;
      }
    }
  }
  registry->Stop();
  for (const auto& count : waits.counts) Check(*count == 1);  // no wait left hanging
  registry.reset();
}

}  // namespace
}  // namespace modelavg::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  modelavg::server::Run(data, size);
  return 0;
}
