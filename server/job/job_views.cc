// Job, operator calls and views: the job as the API shows it (GetJob, ListJobs, the events'
// snapshots), the watchers and the events they get, the figures for metrics and the status page.
#include "server/job/job.h"

#include <algorithm>
#include <utility>

#include "server/job/job_internal.h"

namespace modelavg::server {

uint64_t Job::Watch(std::shared_ptr<JobWatcher> watcher) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  const uint64_t watcher_id = next_watcher_id_++;
  if (!closed_.ok()) {
    out.CloseWatchers({watcher}, closed_);
    return watcher_id;
  }
  v1::JobEvent snapshot;
  snapshot.set_kind(v1::JobEvent::SNAPSHOT);
  ToProtoLocked(snapshot.mutable_job(), true);
  snapshot.set_rank(-1);
  snapshot.set_unix_ms(UnixMs(clock_->Now()));
  out.Event(watcher, std::move(snapshot));
  watchers_.emplace_back(watcher_id, std::move(watcher));
  return watcher_id;
}

void Job::Unwatch(uint64_t watcher_id) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(std::remove_if(watchers_.begin(), watchers_.end(),
                                 [&](const auto& w) { return w.first == watcher_id; }),
                  watchers_.end());
}

void Job::AddEvent(v1::JobEvent::Kind kind, int32_t rank, const std::string& message,
                   bool with_members, Outbox* out) {
  // The status page's history, whether or not anyone watches.
  history_.AddEvent({kind, rank, message, UnixMs(clock_->Now()), membership_.generation()});
  if (kind == v1::JobEvent::GENERATION_CHANGED && membership_.last_change()) {
    history_.AddGeneration(*membership_.last_change());
  } else if (kind == v1::JobEvent::WORLD_COMPLETE) {
    v1::GenerationChange start;
    start.set_generation(membership_.generation());
    start.set_rank(-1);
    start.set_reason(message);
    start.set_unix_ms(UnixMs(clock_->Now()));
    history_.AddGeneration(std::move(start));
  }
  // Streams whose client went away are dropped here.
  watchers_.erase(std::remove_if(watchers_.begin(), watchers_.end(),
                                 [](const auto& w) { return w.second->Done(); }),
                  watchers_.end());
  if (watchers_.empty()) return;
  v1::JobEvent event;
  event.set_kind(kind);
  ToProtoLocked(event.mutable_job(), with_members);
  event.set_rank(rank);
  event.set_message(message);
  event.set_unix_ms(UnixMs(clock_->Now()));
  out->Event(nullptr, std::move(event));
}

void Job::ToProto(v1::Job* out, int64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  ToProtoLocked(out, true, max_bytes);
}

void Job::ToProtoLocked(v1::Job* out, bool with_members, int64_t max_bytes) const {
  if (with_members) {
    // An upper bound of the members' encoded size: strings plus 9 varints (10 bytes at most)
    // and 3 tags/lengths each.
    int64_t bytes = 0;
    for (int32_t r = 0; r < membership_.world_size(); ++r) {
      const LiveMember& m = membership_.member(r);
      if (m.present()) bytes += static_cast<int64_t>(m.worker_id.size() + m.host.size()) + 112;
    }
    if (bytes > max_bytes - 16 * 1024) {
      with_members = false;
      out->set_members_omitted(true);
    }
  }
  *out->mutable_spec() = spec_;
  out->mutable_spec()->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout()));
  out->mutable_spec()->set_join_timeout_ms(absl::ToInt64Milliseconds(join_timeout_));
  out->set_state(membership_.state());
  const int64_t generation = membership_.generation();
  out->set_generation(generation);
  const absl::Time now = clock_->Now();
  int64_t min_step = -1, max_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    const LiveMember& m = membership_.member(r);
    if (!m.present()) continue;
    if (m.generation == generation && m.last_step >= 0) {
      min_step = min_step < 0 ? m.last_step : std::min(min_step, m.last_step);
      max_step = std::max(max_step, m.last_step);
    }
    if (!with_members) continue;
    v1::Member* p = out->add_members();
    p->set_rank(r);
    p->set_worker_id(m.worker_id);
    p->set_host(m.host);
    p->set_last_step(m.last_step);
    p->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - m.last_heartbeat));
    p->set_state(m.state);
    p->set_generation(m.generation);
    p->set_admitted_step(m.admitted_step);
    p->set_replica(schedule_.ReplicaOf(r));
    p->set_shard(schedule_.ShardOf(r));
    if (m.state == v1::RETIRED) {
      p->set_retired_by(m.retired_by);
      p->set_retired_at_step(m.retired_at_step);
    }
  }
  out->set_min_step(min_step);
  out->set_max_step(max_step);
  if (membership_.last_change()) *out->mutable_last_change() = *membership_.last_change();
  for (const std::string& w : warnings_) out->add_warnings(w);
  if (!halted_.ok()) out->add_warnings(std::string(halted_.message()));
  out->set_created_unix_ms(created_unix_ms_);
  out->set_live_world_size(membership_.round_size());
  for (int32_t r : membership_.VacantRanks()) out->add_vacant_ranks(r);
  for (int32_t r : membership_.WaitingRanks()) out->add_waiting_ranks(r);
  out->set_deaths(deaths_);
  out->set_admissions(admissions_);
  out->set_nonfinite_reports(nonfinite_reports_);
  if (last_nonfinite_) *out->mutable_last_nonfinite() = *last_nonfinite_;
  if (paced_) *out->mutable_pacing() = paced_->Status();
  for (const v1::PlanChange& c : plans_.plans()) *out->add_plan_history() = c;
  // The plan in force at the members' smallest step, and the one still to come.
  const int version = plans_.history()->VersionAt(std::max<int64_t>(min_step, 0));
  out->set_plan_version(version);
  if (version > 0) {
    *out->mutable_spec() = plans_.plans()[version].spec();
    out->mutable_spec()->set_heartbeat_timeout_ms(
        absl::ToInt64Milliseconds(heartbeat_timeout()));
    out->mutable_spec()->set_join_timeout_ms(absl::ToInt64Milliseconds(join_timeout_));
  }
  if (const v1::PlanChange* pending = plans_.Pending(std::max<int64_t>(min_step, 0))) {
    *out->mutable_pending_plan() = *pending;
  }
}

std::vector<LoggedEvent> Job::RecentEvents() const {
  absl::MutexLock lock(&mu_);
  return history_.events();
}

std::vector<v1::GenerationChange> Job::GenerationHistory() const {
  absl::MutexLock lock(&mu_);
  return history_.generations();
}

Job::Stats Job::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats stats;
  stats.workers = membership_.round_size();
  stats.generation = membership_.generation();
  stats.state = membership_.state();
  int64_t min_step = -1, max_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    const LiveMember& m = membership_.member(r);
    if (!membership_.InRound(r) || m.last_step < 0) continue;
    min_step = min_step < 0 ? m.last_step : std::min(min_step, m.last_step);
    max_step = std::max(max_step, m.last_step);
  }
  stats.step_lag = max_step - min_step;
  stats.vacant_ranks = static_cast<int32_t>(membership_.VacantRanks().size());
  stats.deaths = deaths_;
  stats.admissions = admissions_;
  stats.nonfinite_reports = nonfinite_reports_;
  if (paced_) {
    stats.paced = true;
    stats.paced_rounds = paced_->rounds().empty() ? 0 : paced_->rounds().back().round.round + 1;
    stats.idle_saved = paced_->rounds().empty() ? 0 : paced_->IdleSaved(paced_->rounds().back());
  }
  stats.plan_updates = plans_.size() - 1;
  return stats;
}

}  // namespace modelavg::server
