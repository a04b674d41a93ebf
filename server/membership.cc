#include "server/membership.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/member_credential.h"

namespace modelavg::server {

Membership::Membership(int32_t world_size, int32_t min_world_size)
    : min_world_size_(min_world_size > 0 && min_world_size < world_size ? min_world_size
                                                                          : world_size),
      members_(world_size) {}

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
    Member& m = members_[s.rank];
    m.present = true;
    m.worker_id = s.worker_id;
    m.host = s.host;
    m.state = s.state;
    m.generation = s.generation;
    m.credential_digest = s.credential_digest;
    m.joined_generation = s.joined_generation > 0 ? s.joined_generation : s.generation;
    m.last_step = -1;
    m.last_heartbeat = now;
    if (InRound(m)) ++round_size_;
  }
  ClearDelta();
}

absl::StatusOr<Membership::JoinResult> Membership::Join(const std::string& worker_id,
                                                        const std::string& host,
                                                        std::optional<int32_t> requested,
                                                        absl::Time now,
                                                        const std::string& job_id,
                                                        const std::string& credential,
                                                        const std::string& new_digest) {
  const int32_t world = world_size();
  const auto held_by_other = [&](int32_t r) {
    const Member& m = members_[r];
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", r, " of job ", job_id, " is held by worker \"", m.worker_id, "\" (host ",
        m.host.empty() ? "unknown" : m.host, "), alive in generation ", generation_,
        "; a rank is re-taken once its holder is dead or has left, or by its holder with its "
        "credential; ask for another rank or leave rank unset"));
  };
  if (state_ == v1::FINISHED) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is FINISHED (every member left); create a new job to train again"));
  }
  JoinResult result;
  int32_t rank = -1;
  if (state_ == v1::RUNNING && elastic()) {
    const std::vector<int32_t> vacant = VacantRanks();
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is an elastic job RUNNING in generation ", generation_, " with ",
        round_size_, " of ", world, " ranks",
        vacant.empty() ? std::string() : absl::StrCat(" (vacant: ", absl::StrJoin(vacant, ", "), ")"),
        "; this coordinator does not admit replacements into a running job: wait until it "
        "finishes or falls below min_world_size (", min_world_size_, ")"));
  }
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
      return held_by_other(rank);
    }
    if (rank < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is RUNNING with all ", world, " ranks joined in generation ",
          generation_, "; a worker restarting after a crash re-joins by naming its rank"));
    }
    result.change = Bump(rank, absl::StrCat("rank ", rank, " re-joined"), now);
  } else if (requested.has_value()) {
    rank = *requested;
    const Member& m = members_[rank];
    // The same worker id again in an assembling round is a retried Join (its reply, and so
    // its credential, may never have arrived).
    if (InRound(m) && m.worker_id != worker_id &&
        !CredentialMatches(credential, m.credential_digest)) {
      return held_by_other(rank);
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

  Member& m = members_[rank];
  result.rank = rank;
  result.was_in_round = InRound(m);
  if (!result.was_in_round) ++round_size_;
  m.present = true;
  m.worker_id = worker_id;
  m.host = host;
  m.last_step = -1;
  m.last_heartbeat = now;
  m.state = v1::ALIVE;
  m.generation = generation_;
  m.credential_digest = new_digest;
  m.joined_generation = generation_;
  MarkMember(rank);
  if (round_size_ == world) {
    state_ = v1::RUNNING;
    dirty_header_ = true;
    for (Member& each : members_) each.last_heartbeat = now;
    result.change.world_complete = true;
  }
  return result;
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
  if (!CredentialMatches(credential, m.credential_digest)) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " as rank ", rank, " of job ", job_id,
        ": the credential is not that of the rank's current member (worker \"", m.worker_id,
        "\"); a worker whose rank was re-taken re-joins"));
  }
  return absl::OkStatus();
}

void Membership::Withdraw(int32_t rank) {
  Member& m = members_[rank];
  if (InRound(m)) --round_size_;
  m = Member{};
  MarkMember(rank);
}

absl::StatusOr<Membership::LeaveResult> Membership::Leave(int32_t rank, const std::string& reason,
                                                          absl::Time now,
                                                          const std::string& job_id) {
  Member& m = members_[rank];
  if (!m.present) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", job_id));
  }
  LeaveResult result;
  if (m.state == v1::LEFT) return result;
  result.left = true;
  const bool in_round = InRound(m);
  m.state = v1::LEFT;
  MarkMember(rank);
  if (in_round && state_ == v1::PENDING) {
    // Leaving a round that is still assembling: free the rank, no bump needed.
    --round_size_;
    result.left_pending_round = true;
  }
  if (MaybeFinish()) {
    result.change.finished = true;
  } else if (state_ == v1::RUNNING && in_round) {
    result.change = Depart(rank, reason, now);
  }
  return result;
}

MembershipChange Membership::Die(const std::vector<int32_t>& ranks, const std::string& reason,
                                 absl::Time now) {
  if (ranks.empty()) return MembershipChange{};
  for (int32_t r : ranks) {
    members_[r].state = v1::DEAD;
    MarkMember(r);
  }
  return Depart(ranks[0], reason, now);
}

MembershipChange Membership::Depart(int32_t rank, const std::string& reason, absl::Time now) {
  if (state_ == v1::RUNNING && elastic()) {
    int32_t live = 0;
    for (const Member& m : members_) live += InRound(m) ? 1 : 0;
    if (live >= min_world_size_) return Shrink(rank, reason, now);
  }
  return Bump(rank, reason, now);
}

MembershipChange Membership::Shrink(int32_t rank, const std::string& reason, absl::Time now) {
  const int64_t old_generation = generation_;
  MembershipChange change = Bump(rank, reason, now);
  change.shrunk = true;
  state_ = v1::RUNNING;
  for (int32_t r = 0; r < world_size(); ++r) {
    Member& m = members_[r];
    if (m.present && m.state == v1::ALIVE && m.generation == old_generation) {
      m.generation = generation_;
      ++round_size_;
      MarkMember(r);
    }
  }
  return change;
}

std::vector<int32_t> Membership::Stale(absl::Time now, absl::Duration timeout) const {
  std::vector<int32_t> stale;
  if (state_ != v1::RUNNING) return stale;
  for (int32_t r = 0; r < world_size(); ++r) {
    const Member& m = members_[r];
    if (InRound(m) && now - m.last_heartbeat > timeout) stale.push_back(r);
  }
  return stale;
}

void Membership::Heartbeat(int32_t rank, int64_t generation, int64_t step, absl::Time now) {
  Member& m = members_[rank];
  // Only the worker of that generation counts: a straggler of an older one keeps nobody alive.
  if (m.present && m.state == v1::ALIVE && generation >= m.joined_generation &&
      generation <= generation_) {
    m.last_heartbeat = now;
    m.last_step = step;
  }
}

void Membership::RecordStep(int32_t rank, int64_t step, absl::Time now) {
  Member& m = members_[rank];
  m.last_heartbeat = now;
  m.last_step = step;
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
  dirty_header_ = true;
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
  dirty_header_ = true;
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
    StoredMember s;
    s.rank = r;
    if (m.present) {
      s.worker_id = m.worker_id;
      s.host = m.host;
      s.state = m.state;
      s.generation = m.generation;
      s.credential_digest = m.credential_digest;
      s.joined_generation = m.joined_generation;
    }
    delta.members.push_back(std::move(s));
  }
  return delta;
}

void Membership::ClearDelta() {
  dirty_header_ = false;
  dirty_clear_comm_ids_ = false;
  dirty_members_.clear();
}

}  // namespace modelavg::server
