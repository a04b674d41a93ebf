#include "server/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

constexpr size_t kMaxWorkerIdLength = 256;
constexpr size_t kMaxHostLength = 256;
constexpr size_t kMaxReasonLength = 256;
// A hostile or buggy client could publish without end; a job's store is bounded.
constexpr size_t kMaxCommIdsPerGeneration = 1 << 16;
// Messages list at most this many missing ranks.
constexpr int kMaxListedRanks = 32;

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

std::string StateName(v1::JobState s) { return v1::JobState_Name(s); }

absl::Duration OrDefault(int64_t ms, absl::Duration fallback) {
  return ms > 0 ? absl::Milliseconds(ms) : fallback;
}

std::string Truncate(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(0, n) + "...";
}

// What the job keeps of a spec: its known fields (unknown ones would cost memory for nothing).
v1::JobSpec Stripped(v1::JobSpec spec) {
  spec.DiscardUnknownFields();
  return spec;
}

// How often GetSchedule polls its cancellation, in steps.
constexpr int64_t kCancelPollSteps = 4096;

}  // namespace

// Collects completions and events under Job::mu_; runs them once mu_ is released (it is declared
// before the MutexLock, so it is destroyed after it). The first event takes delivery_mu_ while
// mu_ is still held, so that events of concurrent calls reach watchers in the order they
// happened.
class Job::Outbox {
 public:
  explicit Outbox(Job* job) : job_(job) {}
  ~Outbox() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) {
      for (auto& [target, event] : events_) {
        if (target != nullptr) {
          target->OnEvent(event);
          continue;
        }
        for (auto& w : watchers_) w->OnEvent(event);
      }
      for (auto& w : closing_) w->OnClosed(close_status_);
      job_->delivery_mu_.Unlock();
    }
    // Last, with no lock of the Job held: a completion may end the RPC that owns the Job.
    for (auto& f : completions_) f();
  }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  void Complete(absl::AnyInvocable<void()> f) { completions_.push_back(std::move(f)); }

  // Requires job_->mu_ held.
  void Event(std::shared_ptr<JobWatcher> target, v1::JobEvent event)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    StartDelivery();
    events_.emplace_back(std::move(target), std::move(event));
  }
  void CloseWatchers(std::vector<std::shared_ptr<JobWatcher>> watchers, absl::Status status) {
    StartDelivery();
    closing_ = std::move(watchers);
    close_status_ = std::move(status);
  }

 private:
  void StartDelivery() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) return;
    job_->delivery_mu_.Lock();
    delivering_ = true;
    for (auto& [id, w] : job_->watchers_) watchers_.push_back(w);
  }

  Job* job_;
  std::vector<absl::AnyInvocable<void()>> completions_;
  bool delivering_ = false;
  std::vector<std::shared_ptr<JobWatcher>> watchers_;
  std::vector<std::pair<std::shared_ptr<JobWatcher>, v1::JobEvent>> events_;
  std::vector<std::shared_ptr<JobWatcher>> closing_;
  absl::Status close_status_;
};

Job::Job(v1::JobSpec spec, Schedule schedule, const JobDefaults& defaults, Clock* clock)
    : spec_(Stripped(std::move(spec))),
      schedule_(std::move(schedule)),
      heartbeat_timeout_(OrDefault(spec_.heartbeat_timeout_ms(), defaults.heartbeat_timeout)),
      join_timeout_(OrDefault(spec_.join_timeout_ms(), defaults.join_timeout)),
      clock_(clock),
      created_unix_ms_(UnixMs(clock->Now())),
      warnings_(ScheduleWarnings(schedule_.spec())) {
  members_.resize(schedule_.world_size());
}

Job::~Job() = default;

void Job::Join(const v1::JoinRequest& request, absl::Time call_deadline, WaitId wait_id,
               JoinCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status status) {
    out.Complete([done = std::move(done), status = std::move(status)]() mutable {
      done(std::move(status));
    });
  };
  if (!closed_.ok()) return fail(closed_);
  const int32_t world = schedule_.world_size();
  if (request.worker_id().empty()) {
    return fail(absl::InvalidArgumentError(
        "worker_id must not be empty; use a stable identity such as \"host:pid\""));
  }
  if (request.worker_id().size() > kMaxWorkerIdLength || request.host().size() > kMaxHostLength) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("worker_id and host must be at most ", kMaxWorkerIdLength, " characters")));
  }
  if (request.world_size() != 0 && request.world_size() != world) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "the worker expects world_size ", request.world_size(), " but job ", id(),
        " has world_size ", world, "; start every worker with world_size ", world,
        " or join a job of that size")));
  }
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= world)) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "rank ", request.rank(), " is outside [0, ", world, ") for job ", id(),
        "; ask for a rank below world_size or leave rank unset")));
  }
  if (state_ == v1::FINISHED) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), " is FINISHED (every member left); create a new job to train again")));
  }
  const absl::Time now = clock_->Now();
  int32_t rank = -1;
  if (state_ == v1::RUNNING) {
    if (request.has_rank()) {
      rank = request.rank();
    } else {
      for (int32_t r = 0; r < world; ++r) {
        if (InRound(members_[r]) && members_[r].worker_id == request.worker_id()) rank = r;
      }
    }
    if (rank < 0) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "job ", id(), " is RUNNING with all ", world, " ranks joined in generation ",
          generation_, "; a worker restarting after a crash re-joins by naming its rank")));
    }
    BumpGeneration(rank, absl::StrCat("rank ", rank, " re-joined"), &out);
  } else if (request.has_rank()) {
    rank = request.rank();
    const Member& m = members_[rank];
    if (InRound(m) && m.worker_id != request.worker_id()) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank, " of job ", id(), " is already taken by worker \"", m.worker_id,
          "\" in generation ", generation_, "; ask for another rank or leave rank unset")));
    }
  } else {
    // The same worker again keeps its rank; a survivor of an earlier generation gets its old
    // rank back if free; anyone else the lowest free rank.
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (members_[r].present && members_[r].worker_id == request.worker_id()) rank = r;
    }
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (!InRound(members_[r])) rank = r;
    }
  }

  Member& m = members_[rank];
  if (InRound(m)) {
    // The same worker joins again (e.g. it retried after losing the reply): the newer call wins.
    for (auto it = join_waiters_.begin(); it != join_waiters_.end(); ++it) {
      if (it->rank != rank) continue;
      out.Complete([cb = std::move(it->done)]() mutable {
        cb(absl::AbortedError("superseded by a newer Join from the same worker"));
      });
      join_waiters_.erase(it);
      break;
    }
  } else {
    ++round_size_;
  }
  m.present = true;
  m.worker_id = request.worker_id();
  m.host = request.host();
  m.last_step = -1;
  m.last_heartbeat = now;
  m.state = v1::ALIVE;
  m.generation = generation_;
  spdlog::info("job {}: worker \"{}\" ({}) joined as rank {} in generation {} ({}/{} joined)",
               id(), m.worker_id, m.host, rank, generation_, round_size_, world);
  if (!watchers_.empty()) {
    AddEvent(v1::JobEvent::MEMBER_JOINED, rank,
             absl::StrCat("worker \"", m.worker_id, "\" joined as rank ", rank), false, &out);
  }
  join_waiters_.push_back(JoinWaiter{wait_id, rank, std::min(now + join_timeout_, call_deadline),
                                     std::move(done)});
  if (round_size_ == world) CompleteWorld(&out);
}

void Job::CompleteWorld(Outbox* out) {
  state_ = v1::RUNNING;
  const absl::Time now = clock_->Now();
  for (Member& m : members_) m.last_heartbeat = now;
  for (JoinWaiter& w : join_waiters_) {
    v1::JoinResponse response;
    FillJoinResponse(w.rank, &response);
    out->Complete([cb = std::move(w.done), response = std::move(response)]() mutable {
      cb(std::move(response));
    });
  }
  join_waiters_.clear();
  spdlog::info("job {}: all {} ranks joined; RUNNING in generation {}", id(),
               schedule_.world_size(), generation_);
  if (!watchers_.empty()) {
    AddEvent(v1::JobEvent::WORLD_COMPLETE, -1,
             absl::StrCat("RUNNING in generation ", generation_), true, out);
  }
}

void Job::FillJoinResponse(int32_t rank, v1::JoinResponse* out) const {
  out->set_rank(rank);
  out->set_world_size(schedule_.world_size());
  out->set_generation(generation_);
  *out->mutable_spec() = spec_;
  out->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout_));
  for (int level = 0; level < schedule_.num_levels(); ++level) {
    const SubgroupRange g = schedule_.SubgroupOf(level, rank);
    v1::Subgroup* s = out->add_subgroups();
    s->set_level(level);
    s->set_period(schedule_.spec().levels[level].period);
    s->set_subgroup(g.index);
    for (int32_t i = 0; i < g.size; ++i) s->add_ranks(g.first_rank + i);
  }
}

void Job::BumpGeneration(int32_t rank, const std::string& reason, Outbox* out) {
  const int64_t old = generation_;
  ++generation_;
  last_change_.set_generation(generation_);
  last_change_.set_rank(rank);
  last_change_.set_reason(reason);
  last_change_.set_unix_ms(UnixMs(clock_->Now()));
  has_last_change_ = true;
  state_ = v1::PENDING;
  round_size_ = 0;
  const std::string why = absl::StrCat("job ", id(), " moved from generation ", old, " to ",
                                       generation_, " because ", reason, "; re-join");
  FailAllWaits(absl::AbortedError(why), out);
  comm_ids_.clear();
  spdlog::warn("job {}: generation {} -> {}: {}", id(), old, generation_, reason);
  if (!watchers_.empty()) AddEvent(v1::JobEvent::GENERATION_CHANGED, rank, reason, true, out);
}

void Job::FailAllWaits(const absl::Status& status, Outbox* out) {
  for (JoinWaiter& w : join_waiters_) {
    out->Complete([cb = std::move(w.done), status]() mutable { cb(status); });
  }
  join_waiters_.clear();
  for (CommWaiter& w : comm_waiters_) {
    out->Complete([cb = std::move(w.done), status]() mutable { cb(status); });
  }
  comm_waiters_.clear();
}

void Job::MaybeFinish(Outbox* out) {
  bool any = false;
  for (const Member& m : members_) {
    if (!m.present) continue;
    any = true;
    if (m.state != v1::LEFT) return;
  }
  if (!any) return;
  state_ = v1::FINISHED;
  const std::string why = absl::StrCat("job ", id(), " finished: every member left");
  FailAllWaits(absl::AbortedError(why), out);
  comm_ids_.clear();
  round_size_ = 0;
  spdlog::info("job {}: FINISHED in generation {} (every member left)", id(), generation_);
  if (!watchers_.empty()) AddEvent(v1::JobEvent::JOB_FINISHED, -1, "every member left", true, out);
}

std::string Job::MissingRanks() const {
  std::vector<int32_t> missing;
  int total = 0;
  for (int32_t r = 0; r < schedule_.world_size(); ++r) {
    if (InRound(members_[r])) continue;
    ++total;
    if (missing.size() < kMaxListedRanks) missing.push_back(r);
  }
  std::string s = absl::StrJoin(missing, ", ");
  if (total > static_cast<int>(missing.size())) {
    absl::StrAppend(&s, " and ", total - missing.size(), " more");
  }
  return s;
}

std::string Job::StaleMessage(int64_t generation) const {
  if (generation > generation_) {
    return absl::StrCat("generation ", generation, " does not exist yet; job ", id(),
                        " is at generation ", generation_, "; use the generation from Join");
  }
  std::string s = absl::StrCat("generation ", generation, " is stale; job ", id(),
                               " is at generation ", generation_);
  if (has_last_change_) absl::StrAppend(&s, " since ", last_change_.reason());
  absl::StrAppend(&s, "; re-join");
  return s;
}

absl::Status Job::Heartbeat(const v1::HeartbeatRequest& request,
                            v1::HeartbeatResponse* response) {
  if (request.rank() < 0 || request.rank() >= schedule_.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank(), " is outside [0, ",
                                                   schedule_.world_size(), ") for job ", id()));
  }
  if (request.step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be >= 0, got ", request.step()));
  }
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;  // deleted while a stream still held it
  Member& m = members_[request.rank()];
  // Only the worker of that generation counts: a straggler of an older one keeps nobody alive.
  if (m.present && m.state == v1::ALIVE && m.generation == request.generation()) {
    m.last_heartbeat = now;
    m.last_step = request.step();
  }
  response->set_state(state_);
  response->set_generation(generation_);
  if (request.generation() != generation_ && has_last_change_) {
    *response->mutable_last_change() = last_change_;
  }
  return absl::OkStatus();
}

absl::Status Job::Step(const v1::StepRequest& request, v1::StepDecision* response) {
  const int32_t rank = request.rank();
  if (rank < 0 || rank >= schedule_.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ",
                                                   schedule_.world_size(), ") for job ", id()));
  }
  if (request.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step must be >= 0, got ", request.step()));
  }
  const absl::Time now = clock_->Now();
  int64_t generation;
  {
    absl::MutexLock lock(&mu_);
    if (request.generation() != generation_) {
      return absl::FailedPreconditionError(StaleMessage(request.generation()));
    }
    if (state_ != v1::RUNNING) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id(), " is ", StateName(state_), " in generation ", generation_,
                       "; Step needs a RUNNING job (wait for Join to complete)"));
    }
    Member& m = members_[rank];
    m.last_heartbeat = now;
    m.last_step = request.step();
    generation = generation_;
  }
  DecisionToProto(schedule_.DecisionFor(request.step(), rank), generation, response);
  return absl::OkStatus();
}

absl::Status Job::GetSchedule(const v1::GetScheduleRequest& request,
                              v1::GetScheduleResponse* response,
                              const std::function<bool()>& cancelled) const {
  const auto gone = [&](int64_t i) {
    return i % kCancelPollSteps == 0 && cancelled != nullptr && cancelled();
  };
  const absl::Status cancelled_status =
      absl::CancelledError("the GetSchedule call was cancelled by its caller");
  if (request.from_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_step must be >= 0, got ", request.from_step()));
  }
  if (request.count() < 1 || request.count() > kMaxScheduleCount) {
    return absl::InvalidArgumentError(absl::StrCat("count must be in [1, ", kMaxScheduleCount,
                                                   "], got ", request.count()));
  }
  if (request.from_step() > INT64_MAX - request.count()) {
    return absl::InvalidArgumentError("from_step + count overflows int64");
  }
  const int32_t world = schedule_.world_size();
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= world)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank(), " is outside [0, ",
                                                   world, ") for job ", id()));
  }
  // A cheap estimate first (20 bytes a decision, 1 a listed rank: a lower bound) so that a huge
  // answer is never built; the exact size is checked once built.
  const std::string too_big = absl::StrCat(
      "the answer for count ", request.count(), " would exceed ", kMaxScheduleReplyBytes,
      " bytes (gRPC's default message limit); ask for a smaller count",
      request.has_rank() ? "" : " or for one rank");
  int64_t bytes = 0;
  for (int64_t s = request.from_step(); s < request.from_step() + request.count(); ++s) {
    if (gone(s - request.from_step())) return cancelled_status;
    const int level = schedule_.LevelAt(s);
    if (level < 0) {
      bytes += 20;
      continue;
    }
    const int64_t g = schedule_.spec().levels[level].group_size;
    bytes += request.has_rank() ? 20 + g : 20 * (world / g) + int64_t{world};
    if (bytes > kMaxScheduleReplyBytes) return absl::InvalidArgumentError(too_big);
  }
  int64_t generation;
  {
    absl::MutexLock lock(&mu_);
    generation = generation_;
  }
  response->set_generation(generation);
  const std::vector<Decision> decisions =
      request.has_rank() ? schedule_.Window(request.from_step(), request.count(), request.rank())
                         : schedule_.WindowAllSubgroups(request.from_step(), request.count());
  response->mutable_decisions()->Reserve(static_cast<int>(decisions.size()));
  for (size_t i = 0; i < decisions.size(); ++i) {
    if (gone(static_cast<int64_t>(i) + 1)) {
      response->Clear();
      return cancelled_status;
    }
    DecisionToProto(decisions[i], generation, response->add_decisions());
  }
  if (static_cast<int64_t>(response->ByteSizeLong()) > kMaxScheduleReplyBytes) {
    response->Clear();
    return absl::InvalidArgumentError(too_big);
  }
  return absl::OkStatus();
}

absl::Status Job::ValidateCommRequest(int64_t generation, int32_t level, int32_t subgroup,
                                      int32_t rank, const std::string& key) const {
  if (level < 0 || level >= schedule_.num_levels()) {
    return absl::InvalidArgumentError(absl::StrCat("level ", level, " is outside [0, ",
                                                   schedule_.num_levels(), ") for job ", id()));
  }
  const int32_t groups = schedule_.world_size() / schedule_.spec().levels[level].group_size;
  if (subgroup < 0 || subgroup >= groups) {
    return absl::InvalidArgumentError(absl::StrCat("subgroup ", subgroup, " is outside [0, ",
                                                   groups, ") at level ", level, " of job ",
                                                   id()));
  }
  if (rank < 0 || rank >= schedule_.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ",
                                                   schedule_.world_size(), ") for job ", id()));
  }
  if (key.size() > kMaxCommIdKeyLength) {
    return absl::InvalidArgumentError(absl::StrCat("key is ", key.size(),
                                                   " characters; at most ", kMaxCommIdKeyLength,
                                                   " are allowed"));
  }
  if (generation != generation_) return absl::FailedPreconditionError(StaleMessage(generation));
  if (state_ != v1::RUNNING) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id(), " is ", StateName(state_), " in generation ", generation_,
                     "; communicator ids are exchanged once the world is complete"));
  }
  const SubgroupRange g = schedule_.SubgroupOf(level, rank);
  if (g.index != subgroup) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " is in subgroup ", g.index, " at level ", level,
        ", not in subgroup ", subgroup, "; only the subgroup's members may use its ids"));
  }
  return absl::OkStatus();
}

absl::Status Job::PublishCommId(const v1::PublishCommIdRequest& request) {
  if (request.unique_id().empty()) {
    return absl::InvalidArgumentError("unique_id must not be empty");
  }
  if (request.unique_id().size() > kMaxCommIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("unique_id is ", request.unique_id().size(),
                                                   " bytes; at most ", kMaxCommIdBytes,
                                                   " are allowed"));
  }
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (absl::Status s = ValidateCommRequest(request.generation(), request.level(),
                                           request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return s;
  }
  CommKey key{request.level(), request.subgroup(), request.key()};
  auto it = comm_ids_.find(key);
  if (it != comm_ids_.end()) {
    if (it->second == request.unique_id()) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat(
        "a different id is already published for level ", request.level(), ", subgroup ",
        request.subgroup(), ", key \"", request.key(), "\" in generation ", generation_,
        "; only the subgroup's leader publishes, once per generation"));
  }
  if (comm_ids_.size() >= kMaxCommIdsPerGeneration) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", id(), " already holds ", comm_ids_.size(), " ids in generation ", generation_));
  }
  comm_ids_.emplace(key, request.unique_id());
  spdlog::debug("job {}: rank {} published a {}-byte id for level {}, subgroup {}, key \"{}\" "
                "in generation {}",
                id(), request.rank(), request.unique_id().size(), request.level(),
                request.subgroup(), request.key(), generation_);
  for (auto w = comm_waiters_.begin(); w != comm_waiters_.end();) {
    if (w->key != key) {
      ++w;
      continue;
    }
    out.Complete([cb = std::move(w->done), blob = request.unique_id()]() mutable {
      cb(std::move(blob));
    });
    w = comm_waiters_.erase(w);
  }
  return absl::OkStatus();
}

void Job::GetCommId(const v1::GetCommIdRequest& request, absl::Time call_deadline,
                    WaitId wait_id, CommIdCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto finish = [&](absl::StatusOr<std::string> result) {
    out.Complete([done = std::move(done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  };
  if (!closed_.ok()) return finish(closed_);
  if (request.timeout_ms() < 0) {
    return finish(absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be >= 0 (0: the call's deadline), got ",
                     request.timeout_ms())));
  }
  if (absl::Status s = ValidateCommRequest(request.generation(), request.level(),
                                           request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return finish(s);
  }
  CommKey key{request.level(), request.subgroup(), request.key()};
  auto it = comm_ids_.find(key);
  if (it != comm_ids_.end()) return finish(it->second);
  const absl::Time now = clock_->Now();
  const absl::Duration wait = request.timeout_ms() > 0
                                  ? absl::Milliseconds(request.timeout_ms())
                                  : join_timeout_;
  comm_waiters_.push_back(
      CommWaiter{wait_id, std::move(key), std::min(now + wait, call_deadline), std::move(done)});
}

absl::Status Job::Leave(const v1::LeaveRequest& request, v1::LeaveResponse* response) {
  const int32_t rank = request.rank();
  if (rank < 0 || rank >= schedule_.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ",
                                                   schedule_.world_size(), ") for job ", id()));
  }
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  Member& m = members_[rank];
  if (!m.present) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", id()));
  }
  if (m.state != v1::LEFT) {
    const bool in_round = InRound(m);
    m.state = v1::LEFT;
    std::string reason = absl::StrCat("rank ", rank, " left");
    if (!request.reason().empty()) {
      absl::StrAppend(&reason, " (", Truncate(request.reason(), kMaxReasonLength), ")");
    }
    spdlog::info("job {}: {} (worker \"{}\", generation {})", id(), reason, m.worker_id,
                 request.generation());
    if (in_round && state_ == v1::PENDING) {
      // Leaving a round that is still assembling: free the rank, no bump needed.
      --round_size_;
      for (auto it = join_waiters_.begin(); it != join_waiters_.end(); ++it) {
        if (it->rank != rank) continue;
        out.Complete([cb = std::move(it->done), reason]() mutable {
          cb(absl::AbortedError(reason));
        });
        join_waiters_.erase(it);
        break;
      }
    }
    MaybeFinish(&out);
    if (state_ == v1::RUNNING && in_round) BumpGeneration(rank, reason, &out);
  }
  response->set_state(state_);
  response->set_generation(generation_);
  return absl::OkStatus();
}

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

void Job::RemoveFromRound(int32_t rank) {
  Member& m = members_[rank];
  if (InRound(m)) --round_size_;
  m = Member{};
}

void Job::CancelWait(WaitId wait_id) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  for (auto it = join_waiters_.begin(); it != join_waiters_.end(); ++it) {
    if (it->id != wait_id) continue;
    spdlog::info("job {}: rank {} left the generation {} round (its Join was cancelled)", id(),
                 it->rank, generation_);
    RemoveFromRound(it->rank);
    out.Complete([cb = std::move(it->done)]() mutable {
      cb(absl::CancelledError("the Join call was cancelled"));
    });
    join_waiters_.erase(it);
    return;
  }
  for (auto it = comm_waiters_.begin(); it != comm_waiters_.end(); ++it) {
    if (it->id != wait_id) continue;
    out.Complete([cb = std::move(it->done)]() mutable {
      cb(absl::CancelledError("the GetCommId call was cancelled"));
    });
    comm_waiters_.erase(it);
    return;
  }
}

void Job::CheckStaleness() {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  const absl::Time now = clock_->Now();
  if (state_ == v1::RUNNING) {
    std::vector<int32_t> dead;
    for (int32_t r = 0; r < schedule_.world_size(); ++r) {
      Member& m = members_[r];
      if (InRound(m) && now - m.last_heartbeat > heartbeat_timeout_) dead.push_back(r);
    }
    if (!dead.empty()) {
      for (int32_t r : dead) {
        members_[r].state = v1::DEAD;
        spdlog::warn("job {}: rank {} (worker \"{}\") sent no heartbeat for {} ms; DEAD", id(), r,
                     members_[r].worker_id,
                     absl::ToInt64Milliseconds(now - members_[r].last_heartbeat));
      }
      std::string reason = absl::StrCat("rank ", dead[0], " heartbeat timeout");
      if (dead.size() > 1) absl::StrAppend(&reason, " (and ", dead.size() - 1, " more ranks)");
      BumpGeneration(dead[0], reason, &out);
    }
  }
  for (auto it = join_waiters_.begin(); it != join_waiters_.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    std::string msg = absl::StrCat(
        "join of job ", id(), " (generation ", generation_, ") timed out: ", round_size_, " of ",
        schedule_.world_size(), " ranks joined; missing ranks: ", MissingRanks(),
        "; start the missing workers or raise join_timeout_ms");
    spdlog::warn("job {}: rank {} (worker \"{}\") Join timed out; missing ranks: {}", id(),
                 it->rank, members_[it->rank].worker_id, MissingRanks());
    RemoveFromRound(it->rank);
    out.Complete([cb = std::move(it->done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
    it = join_waiters_.erase(it);
  }
  for (auto it = comm_waiters_.begin(); it != comm_waiters_.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    const auto& [level, subgroup, key] = it->key;
    const int32_t leader = schedule_.spec().levels[level].group_size * subgroup;
    std::string msg = absl::StrCat(
        "no id was published for level ", level, ", subgroup ", subgroup, ", key \"", key,
        "\" of job ", id(), " in generation ", generation_, " before the deadline; is rank ",
        leader, " (the subgroup's leader) alive?");
    out.Complete([cb = std::move(it->done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
    it = comm_waiters_.erase(it);
  }
}

void Job::ToProto(v1::Job* out, int64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  ToProtoLocked(out, true, max_bytes);
}

void Job::ToProtoLocked(v1::Job* out, bool with_members, int64_t max_bytes) const {
  if (with_members) {
    // An upper bound of the members' encoded size: strings plus 8 varints (10 bytes at most)
    // and 3 tags/lengths each.
    int64_t bytes = 0;
    for (const Member& m : members_) {
      if (m.present) bytes += static_cast<int64_t>(m.worker_id.size() + m.host.size()) + 96;
    }
    if (bytes > max_bytes - 16 * 1024) {
      with_members = false;
      out->set_members_omitted(true);
    }
  }
  *out->mutable_spec() = spec_;
  out->mutable_spec()->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout_));
  out->mutable_spec()->set_join_timeout_ms(absl::ToInt64Milliseconds(join_timeout_));
  out->set_state(state_);
  out->set_generation(generation_);
  const absl::Time now = clock_->Now();
  int64_t min_step = -1, max_step = -1;
  for (int32_t r = 0; r < static_cast<int32_t>(members_.size()); ++r) {
    const Member& m = members_[r];
    if (!m.present) continue;
    if (m.generation == generation_ && m.last_step >= 0) {
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
  }
  out->set_min_step(min_step);
  out->set_max_step(max_step);
  if (has_last_change_) *out->mutable_last_change() = last_change_;
  for (const std::string& w : warnings_) out->add_warnings(w);
  out->set_created_unix_ms(created_unix_ms_);
}

Job::Stats Job::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats stats;
  stats.workers = round_size_;
  stats.generation = generation_;
  stats.state = state_;
  int64_t min_step = -1, max_step = -1;
  for (const Member& m : members_) {
    if (!InRound(m) || m.last_step < 0) continue;
    min_step = min_step < 0 ? m.last_step : std::min(min_step, m.last_step);
    max_step = std::max(max_step, m.last_step);
  }
  stats.step_lag = max_step - min_step;
  return stats;
}

void Job::Close(const absl::Status& status, bool deleted) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  closed_ = status;
  FailAllWaits(status, &out);
  if (deleted) AddEvent(v1::JobEvent::JOB_DELETED, -1, status.ToString(), false, &out);
  std::vector<std::shared_ptr<JobWatcher>> closing;
  for (auto& [wid, w] : watchers_) closing.push_back(std::move(w));
  watchers_.clear();
  if (!closing.empty()) out.CloseWatchers(std::move(closing), status);
}

}  // namespace modelavg::server
