#include "server/membership.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/member_credential.h"

namespace modelavg::server {
namespace {

Schedule EveryStepOverTheWorld(int32_t world_size) {
  ScheduleSpec spec;
  spec.world_size = world_size;
  spec.mode = AveragingMode::kPeriodic;
  spec.levels.push_back(ScheduleLevel{1, world_size});
  return *Schedule::Create(std::move(spec));
}

// The first step >= `step` at which `schedule` averages at some level.
int64_t NextAveragingStep(const Schedule& schedule, int64_t step) {
  const ScheduleSpec& spec = schedule.spec();
  step = std::max(step, spec.warmup_steps);
  if (spec.mode == AveragingMode::kPeriodic) {
    const int64_t p = spec.levels[0].period;
    const int64_t offset = step - spec.warmup_steps;
    return spec.warmup_steps + (offset + p - 1) / p * p;
  }
  int64_t next = std::numeric_limits<int64_t>::max();
  for (const ScheduleLevel& level : spec.levels) {
    next = std::min(next, (step + level.period - 1) / level.period * level.period);
  }
  return next;
}

}  // namespace

bool InsideDelayedSync(const Schedule& schedule, int64_t step) {
  const std::vector<ScheduleLevel>& levels = schedule.spec().levels;
  for (int level = 0; level < static_cast<int>(levels.size()); ++level) {
    for (int64_t d = 1; d < levels[level].sync_delay && d <= step; ++d) {
      if (schedule.LevelAt(step - d) == level) return true;
    }
  }
  return false;
}

absl::StatusOr<int64_t> FindAdmissionStep(const Schedule& schedule, int32_t rank,
                                          const std::vector<int64_t>& from_step, int64_t floor,
                                          const std::string& job_id) {
  // Per level, the earliest step from which a member of rank's block other than rank averages.
  std::vector<int64_t> earliest(schedule.num_levels(), kNotMember);
  bool any = false;
  for (int level = 0; level < schedule.num_levels(); ++level) {
    const SubgroupRange g = schedule.SubgroupOf(level, rank);
    for (int32_t r = g.first_rank; r < g.first_rank + g.size; ++r) {
      if (r != rank) earliest[level] = std::min(earliest[level], from_step[r]);
    }
    any = any || earliest[level] != kNotMember;
  }
  if (!any) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " has no live member other than rank ", rank,
        " to give a replacement its parameters; it cannot be admitted"));
  }
  // Steps far beyond any real run keep the arithmetic below clear of overflow.
  constexpr int64_t kMaxFloor = std::numeric_limits<int64_t>::max() / 4;
  const int64_t start = std::max<int64_t>(floor, 1);
  if (start > kMaxFloor) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, ": the members report step ", floor,
        ", too large to choose an admission step after it"));
  }
  const int64_t end = start + kMaxAdmissionScan;
  for (int64_t s = start;; ++s) {
    s = NextAveragingStep(schedule, s);
    if (s >= end) break;
    const int level = schedule.LevelAt(s);
    if (level >= 0 && earliest[level] < s && !InsideDelayedSync(schedule, s)) return s;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "job ", job_id, ": no averaging step in [", start, ", ", end,
      ") gives rank ", rank, " a live peer in its subgroup (one admitted before that step) to "
      "receive the parameters from; a replacement is admitted at an averaging step of a block "
      "that still has a live member"));
}

Membership::Membership(Schedule schedule, int32_t min_world_size)
    : schedule_(std::move(schedule)),
      min_world_size_(min_world_size > 0 && min_world_size < schedule_.world_size()
                          ? min_world_size
                          : schedule_.world_size()),
      members_(schedule_.world_size()) {}

Membership::Membership(int32_t world_size, int32_t min_world_size)
    : Membership(EveryStepOverTheWorld(world_size), min_world_size) {}

std::shared_ptr<const MemberSteps> Membership::DecisionMembers() const {
  if (decision_members_ != nullptr) return decision_members_;
  auto view = std::make_shared<MemberSteps>();
  view->from_step.assign(members_.size(), -1);
  if (state_ == v1::RUNNING) {
    for (int32_t r = 0; r < world_size(); ++r) {
      const Member& m = members_[r];
      if (!InRound(m)) {
        view->from_step[r] = kNotMember;
        view->all_from_start = false;
      } else if (m.admitted_step >= 0) {
        view->from_step[r] = m.admitted_step;
        view->all_from_start = false;
      }
    }
  }
  decision_members_ = std::move(view);
  return decision_members_;
}

std::vector<int32_t> Membership::VacantRanks() const {
  std::vector<int32_t> vacant;
  if (state_ != v1::RUNNING) return vacant;
  for (int32_t r = 0; r < world_size(); ++r) {
    if (!InRound(members_[r])) vacant.push_back(r);
  }
  return vacant;
}

void Membership::Restore(const StoredJobHeader& header, const std::vector<StoredMember>& members,
                         absl::Time now) {
  state_ = header.state;
  generation_ = header.generation;
  last_change_ = header.last_change;
  round_size_ = 0;
  for (const StoredMember& s : members) {
    if (s.rank < 0 || s.rank >= world_size()) continue;
    // A rank of a round that was still assembling (stored by an older coordinator; such ranks are
    // not stored any more): its Join was never answered, so it is nobody's.
    if (header.state == v1::PENDING && s.state == v1::ALIVE && s.generation == header.generation) {
      continue;
    }
    Member& m = members_[s.rank];
    m.present = true;
    m.worker_id = s.worker_id;
    m.host = s.host;
    m.state = s.state;
    m.generation = s.generation;
    m.credential_digest = s.credential_digest;
    m.joined_generation = s.joined_generation > 0 ? s.joined_generation : s.generation;
    m.admitted_step = s.admitted_step;
    m.last_step = -1;
    m.last_heartbeat = now;
    if (InRound(m)) ++round_size_;
  }
  ClearDelta();
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  ResetProgress();
}

absl::StatusOr<Membership::JoinResult> Membership::Join(const std::string& worker_id,
                                                        const std::string& host,
                                                        std::optional<int32_t> requested,
                                                        absl::Time now,
                                                        const std::string& job_id,
                                                        const std::string& credential,
                                                        const std::string& new_digest) {
  const int32_t world = world_size();
  if (state_ == v1::FINISHED) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is FINISHED (every member left); create a new job to train again"));
  }
  if (state_ == v1::RUNNING && elastic()) {
    return Admit(worker_id, host, requested, now, job_id, credential, new_digest);
  }
  JoinResult result;
  int32_t rank = -1;
  if (state_ == v1::RUNNING) {
    if (requested.has_value()) {
      rank = *requested;
    } else {
      // Only the holder (its credential) finds its rank back.
      for (int32_t r = 0; r < world; ++r) {
        if (InRound(members_[r]) &&
            CredentialMatches(credential, members_[r].credential_digest)) {
          rank = r;
        }
      }
    }
    if (rank >= 0 && InRound(members_[rank]) &&
        !CredentialMatches(credential, members_[rank].credential_digest)) {
      return HeldByOther(rank, job_id);
    }
    if (rank < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is RUNNING with all ", world, " ranks joined in generation ",
          generation_, "; a worker restarting after a crash re-joins by naming its rank"));
    }
    result.change = Bump(rank, absl::StrCat("rank ", rank, " re-joined"), now);
    ResetProgress();
  } else if (requested.has_value()) {
    rank = *requested;
    const Member& m = members_[rank];
    // The same worker id again in an assembling round is a retried Join (its reply, and so
    // its credential, may never have arrived).
    if (InRound(m) && m.worker_id != worker_id &&
        !CredentialMatches(credential, m.credential_digest)) {
      return HeldByOther(rank, job_id);
    }
  } else {
    // The same worker again keeps its rank; a survivor of an earlier generation gets its old
    // rank back if free; anyone else the lowest free rank.
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (members_[r].present && members_[r].worker_id == worker_id) rank = r;
    }
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (!InRound(members_[r])) rank = r;
    }
  }

  result.rank = rank;
  result.was_in_round = InRound(members_[rank]);
  if (!result.was_in_round) ++round_size_;
  Seat(rank, worker_id, host, now, new_digest, /*admitted_step=*/-1);
  if (round_size_ == world) {
    state_ = v1::RUNNING;
    MarkHeader();
    // Soft state, not recorded for Rollback: heartbeat times count only while RUNNING, and a
    // rolled-back completion leaves the round assembling.
    for (Member& each : members_) each.last_heartbeat = now;
    result.change.world_complete = true;
  }
  return result;
}

absl::Status Membership::HeldByOther(int32_t rank, const std::string& job_id) const {
  const Member& m = members_[rank];
  return absl::AlreadyExistsError(absl::StrCat(
      "rank ", rank, " of job ", job_id, " is held by worker \"", m.worker_id, "\" (host ",
      m.host.empty() ? "unknown" : m.host, "), alive in generation ", generation_,
      "; a rank is re-taken once its holder is dead or has left, or by its holder with its "
      "credential; ask for another rank or leave rank unset"));
}

absl::StatusOr<Membership::JoinResult> Membership::Admit(const std::string& worker_id,
                                                         const std::string& host,
                                                         std::optional<int32_t> requested,
                                                         absl::Time now,
                                                         const std::string& job_id,
                                                         const std::string& credential,
                                                         const std::string& new_digest) {
  const int32_t world = world_size();
  // A live member whose place this Join takes: its holder re-joining (a restart, proven by the
  // credential), or the same worker retrying a replacement's Join whose reply it never got (it
  // has not been heard from since).
  const auto replaces = [&](int32_t r) {
    const Member& m = members_[r];
    return InRound(m) && (CredentialMatches(credential, m.credential_digest) ||
                          (m.worker_id == worker_id && m.admitted_step >= 0 && m.last_step < 0));
  };
  int32_t rank = -1;
  bool replaced = false;
  if (requested.has_value()) {
    rank = *requested;
    if (InRound(members_[rank])) {
      if (!replaces(rank)) return HeldByOther(rank, job_id);
      replaced = true;
    }
  } else {
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (replaces(r)) {
        rank = r;
        replaced = true;
      }
    }
    for (int32_t r = 0; r < world && rank < 0; ++r) {
      if (!InRound(members_[r])) rank = r;
    }
    if (rank < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is full: an elastic job RUNNING in generation ", generation_,
          " with all ", world, " ranks alive; a replacement is admitted only into a vacant rank "
          "(one whose member died or left)"));
    }
  }

  // The floor: past every step a live member may have reached before it hears of the new
  // generation. A member that never reported its step (it just joined, or this coordinator
  // restarted) could be anywhere: the Join waits for its report.
  int64_t max_reported = -1;
  std::vector<int32_t> unreported;
  std::vector<int64_t> from_step(world, kNotMember);
  for (int32_t r = 0; r < world; ++r) {
    const Member& m = members_[r];
    if (r == rank || !InRound(m)) continue;
    from_step[r] = m.admitted_step;
    if (m.last_step >= 0) {
      max_reported = std::max(max_reported, m.last_step);
    } else if (m.admitted_step >= 0) {
      // A replacement waits at its admission step until it has averaged there.
      max_reported = std::max(max_reported, m.admitted_step);
    } else {
      unreported.push_back(r);
    }
  }
  if (!unreported.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "job ", job_id, ": rank ", unreported[0],
        unreported.size() > 1 ? absl::StrCat(" (and ", unreported.size() - 1, " more)") : "",
        " has not reported its step since it joined or the coordinator restarted; a replacement "
        "is admitted at a step chosen from the members' steps: retry in a second (the modelavg "
        "client retries by itself)"));
  }
  int64_t margin = kMinAdmissionMargin;
  if (steps_per_second_ > 0) {
    const double notice = std::ceil(steps_per_second_ * absl::ToDoubleSeconds(kAdmissionNotice));
    margin = static_cast<int64_t>(
        std::min(notice + kMinAdmissionMargin, static_cast<double>(kMaxAdmissionMargin)));
  }
  const int64_t floor = max_reported > std::numeric_limits<int64_t>::max() - margin
                            ? std::numeric_limits<int64_t>::max()
                            : max_reported + margin;
  absl::StatusOr<int64_t> step = FindAdmissionStep(schedule_, rank, from_step, floor, job_id);
  if (!step.ok()) return step.status();

  const int64_t old_generation = generation_;
  JoinResult result;
  result.rank = rank;
  result.change = Bump(rank,
                       absl::StrCat("rank ", rank, replaced ? " re-joined and was" : " was",
                                    " admitted at step ", *step, " (worker \"", worker_id, "\")"),
                       now);
  result.change.admitted = true;
  result.change.replaced_live_member = replaced;
  result.change.admission_step = *step;
  result.change.admission_floor = floor;
  result.change.admission_margin = margin;
  result.change.max_reported_step = max_reported;
  state_ = v1::RUNNING;
  for (int32_t r = 0; r < world; ++r) {
    const Member& m = members_[r];
    if (r != rank && m.present && m.state == v1::ALIVE && m.generation == old_generation) {
      Mutable(r).generation = generation_;
      ++round_size_;
    }
  }
  Seat(rank, worker_id, host, now, new_digest, *step);
  ++round_size_;
  return result;
}

void Membership::Seat(int32_t rank, const std::string& worker_id, const std::string& host,
                      absl::Time now, const std::string& digest, int64_t admitted_step) {
  Member& m = Mutable(rank);
  m.present = true;
  m.worker_id = worker_id;
  m.host = host;
  m.last_step = -1;
  m.last_heartbeat = now;
  m.stream_lost_at = absl::InfiniteFuture();
  m.state = v1::ALIVE;
  m.generation = generation_;
  m.credential_digest = digest;
  m.joined_generation = generation_;
  m.admitted_step = admitted_step;
}

absl::Status Membership::CheckCredential(int32_t rank, const std::string& credential,
                                         const char* rpc, const std::string& job_id) const {
  const Member& m = members_[rank];
  if (!m.present) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " as rank ", rank, " of job ", job_id, ": the rank has no member; Join first"));
  }
  if (credential.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " as rank ", rank, " of job ", job_id,
        " needs the rank's credential (JoinResponse.credential)"));
  }
  // Every beat and Step carries the credential: hash it only when it is not the one already
  // found to match this member's digest.
  const bool known = !m.verified_digest.empty() && m.verified_digest == m.credential_digest &&
                     m.verified_credential.size() == credential.size() &&
                     CRYPTO_memcmp(m.verified_credential.data(), credential.data(),
                                   credential.size()) == 0;
  if (!known && CredentialMatches(credential, m.credential_digest)) {
    m.verified_credential = credential;
    m.verified_digest = m.credential_digest;
  } else if (!known) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " as rank ", rank, " of job ", job_id,
        ": the credential is not that of the rank's current member (worker \"", m.worker_id,
        "\"); a worker whose rank was re-taken re-joins"));
  }
  return absl::OkStatus();
}

void Membership::Withdraw(int32_t rank) {
  if (InRound(members_[rank])) --round_size_;
  Mutable(rank) = Member{};
}

absl::StatusOr<Membership::LeaveResult> Membership::Leave(int32_t rank, const std::string& reason,
                                                          absl::Time now,
                                                          const std::string& job_id) {
  const Member& m = members_[rank];
  if (!m.present) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", job_id));
  }
  LeaveResult result;
  if (m.state == v1::LEFT) return result;
  result.left = true;
  const bool in_round = InRound(m);
  Mutable(rank).state = v1::LEFT;
  if (in_round && state_ == v1::PENDING) {
    // Leaving a round that is still assembling: free the rank, no bump needed.
    --round_size_;
    result.left_pending_round = true;
  }
  if (MaybeFinish()) {
    result.change.finished = true;
  } else if (state_ == v1::RUNNING && in_round) {
    result.change = Depart(rank, reason, now, /*orderly=*/true);
  }
  return result;
}

MembershipChange Membership::Die(const std::vector<int32_t>& ranks, const std::string& reason,
                                 absl::Time now) {
  if (ranks.empty()) return MembershipChange{};
  for (int32_t r : ranks) Mutable(r).state = v1::DEAD;
  return Depart(ranks[0], reason, now, /*orderly=*/false);
}

MembershipChange Membership::Depart(int32_t rank, const std::string& reason, absl::Time now,
                                    bool orderly) {
  if (state_ == v1::RUNNING && elastic()) {
    int32_t live = 0;
    for (const Member& m : members_) live += InRound(m) ? 1 : 0;
    // An orderly Leave winds the job down (the end of a run, where workers finish at different
    // times) without failing the others: only deaths count against min_world_size.
    if (live >= min_world_size_ || (orderly && live > 0)) return Shrink(rank, reason, now);
  }
  ResetProgress();
  return Bump(rank, reason, now);
}

MembershipChange Membership::Shrink(int32_t rank, const std::string& reason, absl::Time now) {
  const int64_t old_generation = generation_;
  MembershipChange change = Bump(rank, reason, now);
  change.shrunk = true;
  state_ = v1::RUNNING;
  for (int32_t r = 0; r < world_size(); ++r) {
    const Member& m = members_[r];
    if (m.present && m.state == v1::ALIVE && m.generation == old_generation) {
      Mutable(r).generation = generation_;
      ++round_size_;
    }
  }
  return change;
}

std::vector<int32_t> Membership::Stale(absl::Time now, absl::Duration timeout,
                                       absl::Duration lost_grace) const {
  std::vector<int32_t> stale;
  if (state_ != v1::RUNNING) return stale;
  if (now <= stale_not_before_ && timeout == stale_timeout_ && lost_grace == stale_grace_) {
    return stale;
  }
  absl::Time earliest = absl::InfiniteFuture();
  for (int32_t r = 0; r < world_size(); ++r) {
    const Member& m = members_[r];
    if (!InRound(m)) continue;
    if (now - m.last_heartbeat > timeout ||
        (m.stream_lost_at != absl::InfiniteFuture() && now - m.stream_lost_at > lost_grace)) {
      stale.push_back(r);
    }
    earliest = std::min(earliest, m.last_heartbeat + timeout);
    if (m.stream_lost_at != absl::InfiniteFuture()) {
      earliest = std::min(earliest, m.stream_lost_at + lost_grace);
    }
  }
  stale_not_before_ = stale.empty() ? earliest : absl::InfinitePast();
  stale_timeout_ = timeout;
  stale_grace_ = lost_grace;
  return stale;
}

void Membership::StreamLost(int32_t rank, absl::Time now) {
  Member& m = members_[rank];
  if (InRound(m)) m.stream_lost_at = std::min(m.stream_lost_at, now);
  stale_not_before_ = absl::InfinitePast();
}

void Membership::Heartbeat(int32_t rank, int64_t generation, int64_t step, absl::Time now) {
  Member& m = members_[rank];
  // Only the worker of that generation counts: a straggler of an older one keeps nobody alive.
  if (m.present && m.state == v1::ALIVE && generation >= m.joined_generation &&
      generation <= generation_) {
    m.last_heartbeat = now;
    m.stream_lost_at = absl::InfiniteFuture();
    m.last_step = step;
    NoteProgress(step, now);
  }
}

void Membership::NoteProgress(int64_t step, absl::Time now) {
  progress_max_ = std::max(progress_max_, step);
  if (rate_sample_time_ == absl::InfinitePast()) {
    rate_sample_time_ = now;
    rate_sample_step_ = progress_max_;
    return;
  }
  const absl::Duration elapsed = now - rate_sample_time_;
  if (elapsed < kRateSampleInterval) return;
  steps_per_second_ =
      static_cast<double>(progress_max_ - rate_sample_step_) / absl::ToDoubleSeconds(elapsed);
  rate_sample_time_ = now;
  rate_sample_step_ = progress_max_;
}

void Membership::ResetProgress() {
  progress_max_ = -1;
  rate_sample_time_ = absl::InfinitePast();
  rate_sample_step_ = -1;
  steps_per_second_ = -1;
}

void Membership::RecordStep(int32_t rank, int64_t step, absl::Time now) {
  Member& m = members_[rank];
  m.last_heartbeat = now;
  m.stream_lost_at = absl::InfiniteFuture();
  m.last_step = step;
  NoteProgress(step, now);
}

std::string Membership::MissingRanks(int limit) const {
  std::vector<int32_t> missing;
  int total = 0;
  for (int32_t r = 0; r < world_size(); ++r) {
    if (InRound(members_[r])) continue;
    ++total;
    if (static_cast<int>(missing.size()) < limit) missing.push_back(r);
  }
  std::string s = absl::StrJoin(missing, ", ");
  if (total > static_cast<int>(missing.size())) {
    absl::StrAppend(&s, " and ", total - missing.size(), " more");
  }
  return s;
}

MembershipChange Membership::Bump(int32_t rank, const std::string& reason, absl::Time now) {
  MembershipChange change;
  change.generation_changed = true;
  change.old_generation = generation_;
  change.changed_by_rank = rank;
  change.reason = reason;
  ++generation_;
  v1::GenerationChange last;
  last.set_generation(generation_);
  last.set_rank(rank);
  last.set_reason(reason);
  last.set_unix_ms(absl::ToUnixMillis(now));
  last_change_ = std::move(last);
  state_ = v1::PENDING;
  round_size_ = 0;
  MarkHeader();
  dirty_clear_comm_ids_ = true;
  return change;
}

bool Membership::MaybeFinish() {
  bool any = false;
  for (const Member& m : members_) {
    if (!m.present) continue;
    any = true;
    if (m.state != v1::LEFT) return false;
  }
  if (!any) return false;
  state_ = v1::FINISHED;
  round_size_ = 0;
  MarkHeader();
  dirty_clear_comm_ids_ = true;
  return true;
}

JobDelta Membership::PeekDelta() const {
  JobDelta delta;
  if (dirty_header_) {
    StoredJobHeader header;
    header.state = state_;
    header.generation = generation_;
    header.last_change = last_change_;
    delta.header = std::move(header);
  }
  delta.clear_comm_ids = dirty_clear_comm_ids_;
  std::vector<int32_t> ranks = dirty_members_;
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  for (int32_t r : ranks) {
    const Member& m = members_[r];
    if (Assembling(m)) continue;
    StoredMember s;
    s.rank = r;
    if (m.present) {
      s.worker_id = m.worker_id;
      s.host = m.host;
      s.state = m.state;
      s.generation = m.generation;
      s.credential_digest = m.credential_digest;
      s.joined_generation = m.joined_generation;
      s.admitted_step = m.admitted_step;
    }
    delta.members.push_back(std::move(s));
  }
  return delta;
}

void Membership::ClearDelta() {
  dirty_header_ = false;
  dirty_clear_comm_ids_ = false;
  // What PeekDelta left out stays pending.
  std::vector<int32_t> kept;
  for (int32_t r : dirty_members_) {
    if (Assembling(members_[r])) kept.push_back(r);
  }
  dirty_members_ = std::move(kept);
}

Membership::Member& Membership::Mutable(int32_t rank) {
  if (undo_.has_value() && undo_->saved.insert(rank).second) {
    undo_->members.emplace_back(rank, members_[rank]);
  }
  dirty_members_.push_back(rank);
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  return members_[rank];
}

void Membership::Begin() {
  undo_ = Undo{state_,
               generation_,
               round_size_,
               last_change_,
               progress_max_,
               rate_sample_time_,
               rate_sample_step_,
               steps_per_second_,
               dirty_header_,
               dirty_clear_comm_ids_,
               dirty_members_.size(),
               {},
               {}};
}

void Membership::Commit() { undo_.reset(); }

void Membership::Rollback() {
  if (!undo_.has_value()) return;
  Undo& u = *undo_;
  state_ = u.state;
  generation_ = u.generation;
  round_size_ = u.round_size;
  last_change_ = std::move(u.last_change);
  progress_max_ = u.progress_max;
  rate_sample_time_ = u.rate_sample_time;
  rate_sample_step_ = u.rate_sample_step;
  steps_per_second_ = u.steps_per_second;
  dirty_header_ = u.dirty_header;
  dirty_clear_comm_ids_ = u.dirty_clear_comm_ids;
  // Only appended to within a transaction (ClearDelta comes after Commit).
  dirty_members_.resize(std::min(dirty_members_.size(), u.dirty_members));
  for (auto& [rank, m] : u.members) members_[rank] = std::move(m);
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  undo_.reset();
}

}  // namespace modelavg::server
