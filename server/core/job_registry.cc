#include "server/core/job_registry.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "google/protobuf/util/message_differencer.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

absl::Status Stopped() {
  return absl::UnavailableError("the coordinator is shutting down; retry against a running one");
}

std::string NewIncarnation() {
  std::random_device random;
  const uint64_t bits = (uint64_t{random()} << 32) ^ random() ^
                        static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  return absl::StrFormat("%016x", bits);
}

// The differences between two specs, as "modified: world_size: 4 -> 8; ...", or "" if none.
std::string SpecDifference(const v1::JobSpec& stored, const v1::JobSpec& given) {
  std::string report;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&report);
  if (differencer.Compare(stored, given)) return "";
  std::vector<std::string> lines = absl::StrSplit(report, '\n', absl::SkipEmpty());
  if (lines.size() > 4) {
    const size_t more = lines.size() - 3;
    lines.resize(3);
    lines.push_back(absl::StrCat("and ", more, " more"));
  }
  return absl::StrJoin(lines, "; ");
}

}  // namespace

JobRegistry::JobRegistry(JobRegistryOptions options)
    : options_(std::move(options)),
      owned_store_(options_.store == nullptr ? std::make_unique<InMemoryStateStore>() : nullptr),
      store_(options_.store != nullptr ? options_.store : owned_store_.get()),
      incarnation_(options_.incarnation.empty() ? NewIncarnation() : options_.incarnation) {
  // (incarnation_ is set before any other thread can see the registry.)
  if (options_.start_staleness_thread) {
    staleness_thread_ = std::thread([this] { StalenessLoop(); });
  }
}

JobRegistry::~JobRegistry() { Stop(); }

absl::Status JobRegistry::CreateJob(const v1::JobSpec& request_spec, v1::Job* out) {
  absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(request_spec);
  // What is kept (and stored) of a spec: its known fields; unknown ones would cost memory.
  v1::JobSpec spec = request_spec;
  spec.DiscardUnknownFields();
  if (!schedule_spec.ok()) return schedule_spec.status();
  absl::StatusOr<Schedule> schedule = Schedule::Create(*std::move(schedule_spec));
  if (!schedule.ok()) return schedule.status();
  auto job = std::make_shared<Job>(spec, *std::move(schedule), options_.defaults, options_.clock,
                                   store_, absl::ToUnixMillis(options_.clock->Now()));
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return Stopped();
    if (jobs_.contains(spec.job_id())) {
      return absl::AlreadyExistsError(absl::StrCat(
          "job ", spec.job_id(), " already exists; delete it first or pick another job_id"));
    }
    if (jobs_.size() >= kMaxJobs ||
        total_world_size_ + spec.world_size() > kMaxTotalWorldSize) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the coordinator holds ", jobs_.size(), " jobs with ", total_world_size_,
          " ranks in all (at most ", kMaxJobs, " jobs and ", kMaxTotalWorldSize,
          " ranks); delete finished jobs first"));
    }
    if (absl::Status s = store_->CreateJob(spec, job->created_unix_ms()); !s.ok()) {
      spdlog::error("job {}: could not save the new job: {}", spec.job_id(), s.ToString());
      return absl::UnavailableError(absl::StrCat("the coordinator could not save job ",
                                                 spec.job_id(), ": ", s.message(), "; retry"));
    }
    jobs_.emplace(spec.job_id(), job);
    total_world_size_ += spec.world_size();
  }
  v1::Job proto;
  job->ToProto(&proto);
  spdlog::info("job {}: created ({} mode, world {}, warm-up {}, {} level(s), heartbeat timeout "
               "{} ms, join timeout {} ms)",
               spec.job_id(), v1::Mode_Name(spec.mode()), spec.world_size(), spec.warmup_steps(),
               spec.levels_size(), absl::ToInt64Milliseconds(job->heartbeat_timeout()),
               absl::ToInt64Milliseconds(job->join_timeout()));
  for (const std::string& w : proto.warnings()) {
    spdlog::warn("job {}: {}", spec.job_id(), w);
  }
  if (out != nullptr) *out = std::move(proto);
  return absl::OkStatus();
}

absl::StatusOr<int> JobRegistry::LoadFromStore(absl::Duration grace) {
  absl::StatusOr<std::vector<StoredJob>> stored = store_->LoadAll();
  if (!stored.ok()) return stored.status();
  int loaded = 0;
  for (const StoredJob& sj : *stored) {
    const std::string& id = sj.spec.job_id();
    absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(sj.spec);
    absl::StatusOr<Schedule> schedule =
        schedule_spec.ok() ? Schedule::Create(*std::move(schedule_spec))
                           : absl::StatusOr<Schedule>(schedule_spec.status());
    if (!schedule.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stored job ", id, " has a spec this coordinator rejects (", schedule.status().message(),
          "); delete it with an older coordinator or remove it from ", store_->Describe()));
    }
    auto job = std::make_shared<Job>(sj.spec, *std::move(schedule), options_.defaults,
                                     options_.clock, store_, sj.created_unix_ms);
    job->Restore(sj, grace);
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return Stopped();
      if (!jobs_.emplace(id, job).second) continue;
      total_world_size_ += sj.spec.world_size();
    }
    ++loaded;
    const Job::Stats stats = job->GetStats();
    spdlog::info("job {}: loaded ({} in generation {}, {} of {} ranks in the round{})", id,
                 v1::JobState_Name(stats.state), stats.generation, stats.workers,
                 sj.spec.world_size(),
                 stats.state == v1::RUNNING
                     ? absl::StrCat("; they have ",
                                    absl::ToInt64Milliseconds(
                                        std::max(grace, job->heartbeat_timeout())),
                                    " ms to re-attach")
                     : "");
  }
  return loaded;
}

absl::Status JobRegistry::MergeJobs(const std::vector<v1::JobSpec>& specs) {
  // Checked first, so that a conflict creates nothing.
  for (const v1::JobSpec& spec : specs) {
    absl::StatusOr<std::shared_ptr<Job>> existing = Find(spec.job_id());
    if (!existing.ok()) continue;
    if (const std::string diff = SpecDifference((*existing)->spec(), spec); !diff.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job \"", spec.job_id(), "\" is stored with a different spec than the jobs file's (",
          diff, "); delete the stored job (DeleteJob) or give the new one another job_id"));
    }
  }
  for (const v1::JobSpec& spec : specs) {
    if (Find(spec.job_id()).ok()) {
      spdlog::info("job {}: in the jobs file and already stored with the same spec; kept",
                   spec.job_id());
      continue;
    }
    if (absl::Status s = CreateJob(spec, nullptr); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("job \"", spec.job_id(), "\": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Job>> JobRegistry::Find(absl::string_view job_id) const {
  absl::ReaderMutexLock lock(&mu_);
  if (stopped_) return Stopped();
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no job \"", job_id.substr(0, 256), "\"; create it first (CreateJob or --jobs_file)"));
  }
  return it->second;
}

absl::Status JobRegistry::DeleteJob(absl::string_view job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return Stopped();
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no job \"", job_id.substr(0, 256), "\""));
    }
    if (absl::Status s = store_->DeleteJob(job_id); !s.ok()) {
      spdlog::error("job {}: could not delete it from the store: {}", std::string(job_id),
                    s.ToString());
      return absl::UnavailableError(absl::StrCat("the coordinator could not delete job ",
                                                 job_id, " from its state: ", s.message(),
                                                 "; retry"));
    }
    job = std::move(it->second);
    jobs_.erase(it);
    total_world_size_ -= job->world_size();
  }
  spdlog::info("job {}: deleted", job->id());
  job->Close(absl::AbortedError(absl::StrCat("job ", job->id(), " was deleted")),
             /*deleted=*/true);
  job.reset();
#ifdef __GLIBC__
  // glibc keeps freed heap pages in its arenas; without this a coordinator that once held many
  // jobs keeps that RSS after they are deleted. DeleteJob is rare, so the trim's cost is too.
  malloc_trim(0);
#endif
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Job>> JobRegistry::ListJobs() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::ReaderMutexLock lock(&mu_);
    jobs.reserve(jobs_.size());
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  std::sort(jobs.begin(), jobs.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return jobs;
}

absl::Status JobRegistry::ListJobsPage(const v1::ListJobsRequest& request,
                                       v1::ListJobsResponse* response) const {
  if (request.page_size() < 0 || request.page_size() > kMaxListPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size must be in [0, ", kMaxListPageSize,
                                                   "] (0: ", kDefaultListPageSize, "), got ",
                                                   request.page_size()));
  }
  // A token is the last job id of the previous page.
  if (!request.page_token().empty() && !ValidateJobId(request.page_token()).ok()) {
    return absl::InvalidArgumentError(
        "page_token is not one this coordinator handed out; pass next_page_token of the previous "
        "reply unchanged, or leave it empty to start from the first job");
  }
  const size_t page_size =
      request.page_size() == 0 ? kDefaultListPageSize : static_cast<size_t>(request.page_size());
  const std::vector<std::shared_ptr<Job>> jobs = ListJobs();
  auto it = std::upper_bound(jobs.begin(), jobs.end(), request.page_token(),
                             [](const std::string& token, const std::shared_ptr<Job>& job) {
                               return token < job->id();
                             });
  int64_t bytes = 0;
  for (; it != jobs.end(); ++it) {
    if (static_cast<size_t>(response->jobs_size()) == page_size) break;
    v1::Job job;
    (*it)->ToProto(&job);
    // 8 bytes of tag and length per entry, and room for the token.
    const int64_t size = static_cast<int64_t>(job.ByteSizeLong()) + 8;
    if (response->jobs_size() > 0 && bytes + size > kMaxJobReplyBytes - 256) break;
    bytes += size;
    response->add_jobs()->Swap(&job);
  }
  if (it != jobs.end() && response->jobs_size() > 0) {
    response->set_next_page_token(response->jobs(response->jobs_size() - 1).spec().job_id());
  }
  return absl::OkStatus();
}

void JobRegistry::CheckStaleness() {
  for (const std::shared_ptr<Job>& job : ListJobs()) job->CheckStaleness();
}

void JobRegistry::StalenessLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopped_) {
    // Wakes up early when Stop() sets stopped_.
    mu_.AwaitWithTimeout(absl::Condition(&stopped_), options_.staleness_interval);
    if (stopped_) break;
    mu_.Unlock();
    CheckStaleness();
    mu_.Lock();
  }
}

std::string JobRegistry::incarnation() const {
  absl::ReaderMutexLock lock(&mu_);
  return incarnation_;
}

void JobRegistry::Unload(const absl::Status& why) {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(std::move(job));
    jobs_.clear();
    total_world_size_ = 0;
    incarnation_ = NewIncarnation();
  }
  for (const std::shared_ptr<Job>& job : jobs) job->Close(why, /*deleted=*/false);
  if (!jobs.empty()) spdlog::info("{} job(s) unloaded: {}", jobs.size(), std::string(why.message()));
}

void JobRegistry::Stop() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  if (staleness_thread_.joinable()) staleness_thread_.join();
  for (const std::shared_ptr<Job>& job : jobs) {
    job->Close(Stopped(), /*deleted=*/false);
  }
  spdlog::info("coordinator core stopped ({} job(s) closed)", jobs.size());
}

}  // namespace modelavg::server
