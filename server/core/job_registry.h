// Every job of the coordinator, and the one staleness thread that expires heartbeats and waits.
// No gRPC in here (the RPC adapter is server/rpc/coordinator_service.h).
#ifndef MODELAVG_SERVER_CORE_JOB_REGISTRY_H_
#define MODELAVG_SERVER_CORE_JOB_REGISTRY_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/job/job.h"
#include "server/store/state_store.h"

namespace modelavg::server {

// Bounds on what clients can make the coordinator hold (each rank costs about 100 bytes).
inline constexpr size_t kMaxJobs = 4096;
inline constexpr int64_t kMaxTotalWorldSize = int64_t{1} << 21;
// ListJobs pages: page_size 0 means kDefaultListPageSize; at most kMaxListPageSize.
inline constexpr int32_t kDefaultListPageSize = 100;
inline constexpr int32_t kMaxListPageSize = 1000;

struct JobRegistryOptions {
  JobDefaults defaults;
  Clock* clock = Clock::Real();
  // How often the staleness thread looks at heartbeats and wait deadlines.
  absl::Duration staleness_interval = absl::Milliseconds(20);
  // Tests drive CheckStaleness() themselves with a FakeClock.
  bool start_staleness_thread = true;
  // Where the jobs' hard state is written (not owned; outlives the registry). Null: an
  // InMemoryStateStore owned by the registry.
  StateStore* store = nullptr;
  // Identifies this run of the coordinator (replies carry it); empty: a random one is made.
  std::string incarnation;
};

class JobRegistry {
 public:
  explicit JobRegistry(JobRegistryOptions options);
  ~JobRegistry();  // Stop()

  JobRegistry(const JobRegistry&) = delete;
  JobRegistry& operator=(const JobRegistry&) = delete;

  // Registers a job, writes it to the store and fills `out` (may be null) with it.
  // INVALID_ARGUMENT (the spec's problem, naming the field), ALREADY_EXISTS (duplicate job_id),
  // RESOURCE_EXHAUSTED (more than kMaxJobs jobs or kMaxTotalWorldSize ranks over all jobs),
  // UNAVAILABLE (stopped, or the store's write failed).
  absl::Status CreateJob(const v1::JobSpec& spec, v1::Job* out);

  // Loads every job the store holds (call once, before serving): each continues its generation
  // numbering, membership and ids. Members of a RUNNING generation get max(`grace`, the job's
  // heartbeat timeout) to send a heartbeat before any is declared dead. Returns how many jobs
  // were loaded; the store's error (DATA_LOSS naming the file, ...) otherwise.
  absl::StatusOr<int> LoadFromStore(absl::Duration grace);

  // Creates the jobs of a --jobs_file, merged with the stored ones: a job not stored is created;
  // a stored job with the same spec is kept as it is (with its generation and members); a
  // stored job whose spec differs is FAILED_PRECONDITION naming the job and the field, and
  // nothing is created. Other errors as CreateJob, naming the job.
  absl::Status MergeJobs(const std::vector<v1::JobSpec>& specs);

  // NOT_FOUND for an unknown job, UNAVAILABLE once stopped.
  absl::StatusOr<std::shared_ptr<Job>> Find(absl::string_view job_id) const;

  // Removes the job (from the store first); its pending waits fail with ABORTED and its
  // watchers get JOB_DELETED. NOT_FOUND, UNAVAILABLE (stopped, or the store's write failed).
  absl::Status DeleteJob(absl::string_view job_id);

  // Every job, in job_id order.
  std::vector<std::shared_ptr<Job>> ListJobs() const;

  // One page of the jobs, in job_id order, after request.page_token; at most page_size jobs and
  // kMaxJobReplyBytes in all (a job too big alone comes without its members). INVALID_ARGUMENT
  // for page_size outside [0, kMaxListPageSize] or a page_token that no reply handed out.
  absl::Status ListJobsPage(const v1::ListJobsRequest& request,
                            v1::ListJobsResponse* response) const;

  // A fresh id for a wait (never 0).
  WaitId NewWaitId() { return next_wait_id_.fetch_add(1, std::memory_order_relaxed); }

  // Runs every job's CheckStaleness (the staleness thread calls this).
  void CheckStaleness();

  // Stops the staleness thread and fails every pending wait with UNAVAILABLE. Idempotent.
  void Stop();

  // Drops every job without touching the store (their waits fail and their watchers end with
  // `why`) and takes a new incarnation: a coordinator that stopped leading (etcd,
  // server/leader_terms.h), whose next term starts with LoadFromStore.
  void Unload(const absl::Status& why);

  Clock* clock() const { return options_.clock; }
  const JobDefaults& defaults() const { return options_.defaults; }
  StateStore* store() const { return store_; }
  // A new value every time the coordinator process starts (and at each Unload).
  std::string incarnation() const;

 private:
  void StalenessLoop();

  const JobRegistryOptions options_;
  // Set when options_.store is null.
  std::unique_ptr<StateStore> owned_store_;
  StateStore* const store_;
  std::atomic<WaitId> next_wait_id_{1};

  mutable absl::Mutex mu_;
  std::string incarnation_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Sum of the world sizes of jobs_.
  int64_t total_world_size_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread staleness_thread_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_CORE_JOB_REGISTRY_H_
