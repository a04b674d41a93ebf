#include "server/store/state_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace modelavg::server {

absl::StatusOr<std::vector<StoredJob>> InMemoryStateStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<StoredJob> jobs;
  jobs.reserve(jobs_.size());
  for (const auto& [id, e] : jobs_) {
    StoredJob job;
    job.spec = e.spec;
    job.created_unix_ms = e.created_unix_ms;
    job.header = e.header;
    for (const auto& [rank, m] : e.members) job.members.push_back(m);
    job.plan_changes = e.plan_changes;
    for (const auto& [round, r] : e.paced_rounds) job.paced_rounds.push_back(r);
    for (const auto& [key, blob] : e.comm_ids) {
      job.comm_ids.push_back(
          StoredCommId{std::get<0>(key), std::get<1>(key), std::get<2>(key), blob});
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

absl::Status InMemoryStateStore::CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) {
  absl::MutexLock lock(&mu_);
  if (!fail_writes_.ok()) return fail_writes_;
  if (jobs_.count(spec.job_id()) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("job ", spec.job_id(), " is already stored"));
  }
  Entry& e = jobs_[spec.job_id()];
  e.spec = spec;
  e.created_unix_ms = created_unix_ms;
  return absl::OkStatus();
}

absl::Status InMemoryStateStore::DeleteJob(absl::string_view job_id) {
  absl::MutexLock lock(&mu_);
  if (!fail_writes_.ok()) return fail_writes_;
  jobs_.erase(std::string(job_id));
  return absl::OkStatus();
}

absl::Status InMemoryStateStore::Apply(absl::string_view job_id, const JobDelta& delta) {
  absl::MutexLock lock(&mu_);
  if (!fail_writes_.ok()) return fail_writes_;
  auto it = jobs_.find(std::string(job_id));
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not stored"));
  }
  Entry& e = it->second;
  if (delta.header.has_value()) e.header = *delta.header;
  for (const Member& m : delta.members) {
    if (m.worker_id.empty()) {
      e.members.erase(m.rank);
    } else {
      e.members[m.rank] = m;
    }
  }
  if (delta.clear_comm_ids) e.comm_ids.clear();
  if (delta.comm_id.has_value()) {
    const StoredCommId& c = *delta.comm_id;
    e.comm_ids[CommKey{c.level, c.subgroup, c.key}] = c.blob;
  }
  if (delta.plan_change.has_value()) {
    e.plan_changes.push_back(*delta.plan_change);
  }
  for (const v1::PacedRound& r : delta.paced_rounds) e.paced_rounds[r.round()] = r;
  // After the writes: a round below the drop is gone even if this delta wrote it.
  e.paced_rounds.erase(e.paced_rounds.begin(),
                       e.paced_rounds.lower_bound(delta.drop_paced_rounds_before));
  ++applied_;
  return absl::OkStatus();
}

std::string InMemoryStateStore::Describe() const {
  return "in memory (nothing survives a restart of the coordinator; use --state_dir to keep it)";
}

void InMemoryStateStore::FailWrites(absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_writes_ = std::move(status);
}

int64_t InMemoryStateStore::applied() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

}  // namespace modelavg::server
