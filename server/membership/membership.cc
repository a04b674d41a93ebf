#include "server/membership/membership.h"

#include <openssl/crypto.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/membership/member_credential.h"

namespace modelavg::server {
namespace {

Schedule EveryStepOverTheWorld(int32_t world_size) {
  ScheduleSpec spec;
  spec.world_size = world_size;
  spec.mode = AveragingMode::kPeriodic;
  spec.levels.push_back(ScheduleLevel{1, world_size});
  return *Schedule::Create(std::move(spec));
}

}  // namespace

Membership::Membership(Schedule schedule, int32_t min_world_size, MembershipWriter write)
    : schedule_(std::move(schedule)),
      min_world_size_(min_world_size > 0 && min_world_size < schedule_.world_size()
                          ? min_world_size
                          : schedule_.world_size()),
      write_(std::move(write)),
      members_(schedule_.world_size()) {
  for (int32_t r = 0; r < world_size(); ++r) members_[r].rank = r;
}

Membership::Membership(int32_t world_size, int32_t min_world_size, MembershipWriter write)
    : Membership(EveryStepOverTheWorld(world_size), min_world_size, std::move(write)) {}

namespace {

MembershipChange& ChangeOf(Membership::JoinResult& r) { return r.change; }
MembershipChange& ChangeOf(Membership::LeaveResult& r) { return r.change; }
MembershipChange& ChangeOf(MembershipChange& c) { return c; }

}  // namespace

template <typename Op>
auto Membership::Transact(Op op) -> decltype(op()) {
  Begin();
  auto result = op();
  if (!result.ok()) {
    Rollback();
    return result;
  }
  if (absl::Status s = WriteAndKeep(&ChangeOf(*result)); !s.ok()) return s;
  return result;
}

std::shared_ptr<const MemberSteps> Membership::DecisionMembers() const {
  if (decision_members_ != nullptr) return decision_members_;
  auto view = std::make_shared<MemberSteps>();
  view->from_step.assign(members_.size(), -1);
  view->until_step.assign(members_.size(), kNotMember);
  if (state_ == v1::RUNNING) {
    for (int32_t r = 0; r < world_size(); ++r) {
      const LiveMember& m = members_[r];
      if (Lingering(m)) {
        // A replica mate of a rank that left in order: a member until its retired_at_step.
        view->from_step[r] = m.admitted_step >= 0 ? m.admitted_step : -1;
        view->until_step[r] = m.retired_at_step;
        view->all_from_start = false;
      } else if (!InRound(m)) {
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

void Membership::Restore(const MembershipHeader& header, const std::vector<Member>& members,
                         absl::Time now) {
  state_ = header.state;
  generation_ = header.generation;
  last_change_ = header.last_change;
  round_size_ = 0;
  for (const Member& s : members) {
    if (s.rank < 0 || s.rank >= world_size()) continue;
    // A rank of a round that was still assembling (stored by an older coordinator; such ranks are
    // not stored any more): its Join was never answered, so it is nobody's.
    if (header.state == v1::PENDING && s.state == v1::ALIVE && s.generation == header.generation) {
      continue;
    }
    LiveMember& m = members_[s.rank];
    const std::string old_worker_id = m.worker_id;
    static_cast<Member&>(m) = s;
    Reindex(s.rank, old_worker_id);
    if (m.joined_generation <= 0) m.joined_generation = m.generation;
    m.last_step = -1;
    m.last_heartbeat = now;
    if (InRound(m)) ++round_size_;
  }
  unwritten_.clear();
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  ++out_of_round_epoch_;
  ResetProgress();
  pace_unknown_since_restore_ = true;
}

absl::StatusOr<Membership::JoinResult> Membership::Join(const std::string& worker_id,
                                                        const std::string& host,
                                                        std::optional<int32_t> requested,
                                                        absl::Time now,
                                                        const std::string& job_id,
                                                        const std::string& credential,
                                                        const std::string& new_digest,
                                                        const std::string& nonce) {
  const Joiner joiner{worker_id, host, requested, credential, new_digest, nonce};
  absl::StatusOr<JoinResult> joined =
      Transact([&] { return JoinInMemory(joiner, now, job_id); });
  // Soft state: heartbeat times count only while RUNNING, from the round's completion.
  if (joined.ok() && joined->change.world_complete) {
    for (LiveMember& each : members_) each.last_heartbeat = now;
  }
  return joined;
}

absl::StatusOr<Membership::JoinResult> Membership::JoinInMemory(const Joiner& joiner,
                                                                absl::Time now,
                                                                const std::string& job_id) {
  const int32_t world = world_size();
  if (state_ == v1::FINISHED) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is FINISHED (every member left); create a new job to train again"));
  }
  if (state_ == v1::RUNNING && elastic()) {
    return replica_size() > 1 ? AdmitToReplica(joiner, now, job_id) : Admit(joiner, now, job_id);
  }
  absl::StatusOr<int32_t> rank = ChooseRank(joiner, job_id);
  if (!rank.ok()) return rank.status();
  JoinResult result;
  if (state_ == v1::RUNNING) {
    // A re-join of the running round: a new generation, which every worker joins again.
    result.change = Bump(*rank, absl::StrCat("rank ", *rank, " re-joined"), now);
    ResetProgress();
  }
  result.rank = *rank;
  result.was_in_round = InRound(members_[*rank]);
  if (!result.was_in_round) ++round_size_;
  Seat(*rank, joiner.worker_id, joiner.host, now, joiner.new_digest, /*admitted_step=*/-1,
       CredentialDigest(joiner.nonce));
  if (round_size_ == world) {
    state_ = v1::RUNNING;
    MarkHeader();
    // The round's members were left out of the changes while it assembled: all are written now.
    for (int32_t r = 0; r < world; ++r) {
      if (InRound(members_[r])) tx_->ranks.push_back(r);
    }
    result.change.world_complete = true;
  }
  return result;
}

absl::StatusOr<int32_t> Membership::ChooseRank(const Joiner& joiner,
                                               const std::string& job_id) const {
  const int32_t world = world_size();
  int32_t rank = -1;
  if (state_ == v1::RUNNING) {
    if (joiner.rank.has_value()) {
      rank = *joiner.rank;
    } else {
      // Only the holder (its credential) finds its rank back.
      for (int32_t r = 0; r < world; ++r) {
        if (InRound(members_[r]) &&
            CredentialMatches(joiner.credential, members_[r].credential_digest)) {
          rank = r;
        }
      }
    }
    if (rank >= 0 && InRound(members_[rank]) &&
        !CredentialMatches(joiner.credential, members_[rank].credential_digest)) {
      return HeldByOther(rank, job_id);
    }
    if (rank < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is RUNNING with all ", world, " ranks joined in generation ",
          generation_, "; a worker restarting after a crash re-joins by naming its rank"));
    }
  } else if (joiner.rank.has_value()) {
    rank = *joiner.rank;
    const LiveMember& m = members_[rank];
    // The same Join again in an assembling round is a retry (its reply, and so its credential,
    // may never have arrived).
    if (InRound(m) && !RetriedJoin(m, joiner) &&
        !CredentialMatches(joiner.credential, m.credential_digest)) {
      return HeldByOther(rank, job_id);
    }
  } else {
    // The same Join again keeps its rank; a survivor of an earlier generation gets its old rank
    // back if free; anyone else the lowest free rank.
    // (Both only among the ranks whose member has this worker id, lowest first.)
    if (auto it = ranks_by_worker_.find(joiner.worker_id); it != ranks_by_worker_.end()) {
      for (int32_t r : it->second) {
        const LiveMember& m = members_[r];
        if (InRound(m) ? RetriedJoin(m, joiner)
                       : m.present() && m.worker_id == joiner.worker_id) {
          rank = r;
          break;
        }
      }
    }
    if (rank < 0) {
      // From the lowest free rank found last, while every rank below it is still in the round.
      const bool valid = free_from_generation_ == generation_ &&
                         free_from_epoch_ == out_of_round_epoch_;
      int32_t r = valid ? free_from_ : 0;
      while (r < world && InRound(members_[r])) ++r;
      free_from_ = r;
      free_from_generation_ = generation_;
      free_from_epoch_ = out_of_round_epoch_;
      if (r < world) rank = r;
    }
  }
  return rank;
}

absl::Status Membership::HeldByOther(int32_t rank, const std::string& job_id) const {
  const LiveMember& m = members_[rank];
  return absl::AlreadyExistsError(absl::StrCat(
      "rank ", rank, " of job ", job_id, " is held by worker \"", m.worker_id, "\" (host ",
      m.host.empty() ? "unknown" : m.host, "), alive in generation ", generation_,
      "; a rank is re-taken once its holder is dead or has left, or by its holder with its "
      "credential; ask for another rank or leave rank unset"));
}

absl::StatusOr<Membership::Vacancy> Membership::FindVacancy(const Joiner& joiner,
                                                            const std::string& job_id) const {
  const int32_t world = world_size();
  // A live member whose place this Join takes: its holder re-joining (a restart, proven by the
  // credential), or the same Join retried after its reply was lost (the replacement has not been
  // heard from since), proven by the Join's nonce: the worker id alone is public (WatchJob's
  // MEMBER_ADMITTED names it) and took the rank from the real replacement.
  const auto replaces = [&](int32_t r) {
    const LiveMember& m = members_[r];
    return InRound(m) &&
           (CredentialMatches(joiner.credential, m.credential_digest) ||
            (m.worker_id == joiner.worker_id && m.admitted_step >= 0 && m.last_step < 0 &&
             CredentialMatches(joiner.nonce, m.join_nonce_digest)));
  };
  int32_t rank = -1;
  bool replaced = false;
  if (joiner.rank.has_value()) {
    rank = *joiner.rank;
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
      if (absl::Status s = FullButABrokenStream(job_id); !s.ok()) return s;
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is full: an elastic job RUNNING in generation ", generation_,
          " with all ", world, " ranks alive; a replacement is admitted only into a vacant rank "
          "(one whose member died or left)"));
    }
  }
  return Vacancy{rank, replaced};
}

absl::Status Membership::FullButABrokenStream(const std::string& job_id) const {
  for (int32_t r = 0; r < world_size(); ++r) {
    const LiveMember& m = members_[r];
    if (!InRound(m) || m.stream_lost_at == absl::InfiniteFuture()) continue;
    return absl::UnavailableError(absl::StrCat(
        "job ", job_id, " is full, but rank ", r, "'s heartbeat stream broke (worker \"",
        m.worker_id, "\"): it is declared dead unless it beats again within half the job's "
        "heartbeat timeout, and its rank is then vacant; retry in a second (the modelavg "
        "client retries by itself until its join timeout)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Membership::AdmissionStep> Membership::ChooseAdmissionStep(
    const std::vector<int32_t>& ranks, const std::string& job_id) const {
  const int32_t world = world_size();
  // The floor: past every step a live member may have reached before it hears of the new
  // generation. A member that never reported its step (it just joined, or this coordinator
  // restarted) could be anywhere: the Join waits for its report.
  int64_t max_reported = -1;
  std::vector<int32_t> unreported;
  std::vector<int64_t> from_step(world, kNotMember);
  for (int32_t r = 0; r < world; ++r) {
    const LiveMember& m = members_[r];
    if (!InRound(m) || std::find(ranks.begin(), ranks.end(), r) != ranks.end()) continue;
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
  if (pace_unknown_since_restore_) {
    // Its reports alone do not say how far the members run on before they hear of the admission
    // (at a step a second they may be hundreds of steps past their last beat): the margin needs
    // their pace, measured over kRateSampleInterval of this coordinator's own reports.
    return absl::UnavailableError(absl::StrCat(
        "job ", job_id, ": this coordinator took the job over (a restart or a new leader) and "
        "has not measured its members' pace yet; a replacement is admitted at a step chosen "
        "from it: retry in a second (the modelavg client retries by itself)"));
  }
  if (admission_chooser_) {
    // A paced job: the ranks' group's sync step of a round planned for it (nobody holds its
    // decisions yet), past every step a member of the group may have reached.
    absl::StatusOr<int64_t> step = admission_chooser_(ranks);
    if (!step.ok()) return step.status();
    return AdmissionStep{*step, *step, 0, max_reported};
  }
  int64_t margin = kMinAdmissionMargin;
  if (steps_per_second_ > 0) {
    const double notice = std::ceil(steps_per_second_ * absl::ToDoubleSeconds(kAdmissionNotice));
    margin = static_cast<int64_t>(
        std::min(notice + kMinAdmissionMargin, static_cast<double>(kMaxAdmissionMargin)));
  }
  const int64_t floor = std::max(plan_from_, max_reported > std::numeric_limits<int64_t>::max() -
                                                             margin
                                                 ? std::numeric_limits<int64_t>::max()
                                                 : max_reported + margin);
  absl::StatusOr<int64_t> step = FindAdmissionStep(schedule_, ranks, from_step, floor, job_id);
  if (!step.ok()) return step.status();
  return AdmissionStep{*step, floor, margin, max_reported};
}

absl::StatusOr<Membership::JoinResult> Membership::Admit(const Joiner& joiner, absl::Time now,
                                                         const std::string& job_id) {
  absl::StatusOr<Vacancy> vacancy = FindVacancy(joiner, job_id);
  if (!vacancy.ok()) return vacancy.status();
  const int32_t rank = vacancy->rank;
  absl::StatusOr<AdmissionStep> step = ChooseAdmissionStep({rank}, job_id);
  if (!step.ok()) return step.status();

  const int64_t old_generation = generation_;
  JoinResult result;
  result.rank = rank;
  result.change =
      Bump(rank,
           absl::StrCat("rank ", rank, vacancy->replaced ? " re-joined and was" : " was",
                        " admitted at step ", step->step, " (worker \"", joiner.worker_id, "\")"),
           now);
  result.change.admitted = true;
  result.change.replaced_live_member = vacancy->replaced;
  result.change.admission_step = step->step;
  result.change.admission_floor = step->floor;
  result.change.admission_margin = step->margin;
  result.change.max_reported_step = step->max_reported;
  state_ = v1::RUNNING;
  CarryOver(old_generation, /*except=*/rank);
  Seat(rank, joiner.worker_id, joiner.host, now, joiner.new_digest, step->step,
       CredentialDigest(joiner.nonce));
  ++round_size_;
  return result;
}

std::string Membership::ReplicaName(int32_t replica) const {
  const int32_t s = replica_size();
  return absl::StrCat("replica ", replica, " (ranks ", replica * s, "..", replica * s + s - 1,
                      ")");
}

bool Membership::RetriedJoin(const LiveMember& m, const Joiner& joiner) {
  if (m.worker_id != joiner.worker_id) return false;
  // A seat taken without a nonce (a client older than join_nonce) is retried by its worker id.
  return m.join_nonce_digest.empty() || CredentialMatches(joiner.nonce, m.join_nonce_digest);
}

bool Membership::SameJoin(const WaitingJoiner& w, const Joiner& joiner) {
  return w.worker_id == joiner.worker_id && CredentialMatches(joiner.nonce, w.nonce_digest);
}

std::vector<int32_t> Membership::WaitingRanks() const {
  std::vector<int32_t> out;
  for (const auto& [rank, w] : waiting_) out.push_back(rank);
  return out;
}

absl::StatusOr<int32_t> Membership::FindReplicaVacancy(const Joiner& joiner,
                                                       const std::string& job_id) const {
  const int32_t s = replica_size();
  const auto live = [&](int32_t replica) {
    for (int32_t r = replica * s; r < replica * s + s; ++r) {
      if (InRound(members_[r])) return true;
    }
    return false;
  };
  if (joiner.rank.has_value()) {
    const int32_t rank = *joiner.rank;
    if (auto w = waiting_.find(rank); w != waiting_.end()) {
      if (SameJoin(w->second, joiner)) return rank;  // the same Join, retried
      return absl::AlreadyExistsError(absl::StrCat(
          "rank ", rank, " of job ", job_id, " is taken by worker \"", w->second.worker_id,
          "\", which waits for the rest of ", ReplicaName(rank / s),
          " to join; ask for another rank of that replica or leave rank unset"));
    }
    if (InRound(members_[rank])) {
      if (CredentialMatches(joiner.credential, members_[rank].credential_digest)) {
        return absl::UnavailableError(absl::StrCat(
            "rank ", rank, " of job ", job_id, " is still held by this worker's earlier "
            "membership, alive in ", ReplicaName(rank / s),
            ": a sharded replica is replaced whole, once the coordinator has declared the "
            "earlier membership dead (within its heartbeat timeout) and retired its replica; "
            "retry (the modelavg client retries by itself)"));
      }
      return HeldByOther(rank, job_id);
    }
    if (live(rank / s)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, " of job ", job_id, " belongs to ", ReplicaName(rank / s),
          ", which has live ranks: a replacement replica takes the ranks of a vacant replica "
          "(one whose ranks all died, left or were retired); vacant ranks: ",
          absl::StrJoin(VacantRanks(), ",")));
    }
    return rank;
  }
  for (const auto& [rank, w] : waiting_) {
    if (SameJoin(w, joiner)) return rank;  // the same Join, retried
  }
  for (int32_t replica = 0; replica < world_size() / s; ++replica) {
    if (live(replica)) continue;
    for (int32_t r = replica * s; r < replica * s + s; ++r) {
      if (!Waiting(r)) return r;
    }
  }
  if (absl::Status s = FullButABrokenStream(job_id); !s.ok()) return s;
  return absl::FailedPreconditionError(absl::StrCat(
      "job ", job_id, " is full: an elastic job RUNNING in generation ", generation_,
      " with every replica alive or already being replaced; a replacement replica is "
      "admitted only into a vacant replica (one whose ranks died, left or were retired)"));
}

absl::StatusOr<Membership::JoinResult> Membership::AdmitToReplica(const Joiner& joiner,
                                                                  absl::Time now,
                                                                  const std::string& job_id) {
  absl::StatusOr<int32_t> rank = FindReplicaVacancy(joiner, job_id);
  if (!rank.ok()) return rank.status();
  const int32_t s = replica_size();
  const int32_t replica = *rank / s;
  JoinResult result;
  result.rank = *rank;
  result.was_in_round = Waiting(*rank);
  waiting_[*rank] = WaitingJoiner{joiner.worker_id, joiner.host, joiner.new_digest,
                                  CredentialDigest(joiner.nonce)};
  std::vector<int32_t> ranks;
  std::vector<std::string> workers;
  for (int32_t r = replica * s; r < replica * s + s; ++r) {
    auto w = waiting_.find(r);
    if (w == waiting_.end()) {
      // The rest of the replica has not joined yet: nothing to write until it has.
      result.waiting_for_replica = true;
      return result;
    }
    ranks.push_back(r);
    workers.push_back(w->second.worker_id);
  }
  // The whole replica has joined: admitted together, at one step, in one new generation.
  absl::StatusOr<AdmissionStep> step = ChooseAdmissionStep(ranks, job_id);
  if (!step.ok()) return step.status();
  const int64_t old_generation = generation_;
  result.change = Bump(*rank,
                       absl::StrCat(ReplicaName(replica), " was admitted at step ", step->step,
                                    " (workers \"", absl::StrJoin(workers, "\", \""), "\")"),
                       now);
  result.change.admitted = true;
  result.change.admitted_ranks = ranks;
  result.change.admission_step = step->step;
  result.change.admission_floor = step->floor;
  result.change.admission_margin = step->margin;
  result.change.max_reported_step = step->max_reported;
  state_ = v1::RUNNING;
  CarryOver(old_generation, /*except=*/-1);
  for (int32_t r : ranks) {
    const WaitingJoiner w = waiting_[r];
    waiting_.erase(r);
    Seat(r, w.worker_id, w.host, now, w.digest, step->step, w.nonce_digest);
    ++round_size_;
    if (r != *rank) result.admitted_with.push_back(r);
  }
  return result;
}

void Membership::CarryOver(int64_t old_generation, int32_t except) {
  for (int32_t r = 0; r < world_size(); ++r) {
    const LiveMember& m = members_[r];
    if (r != except && m.present() && m.state == v1::ALIVE && m.generation == old_generation) {
      Mutable(r).generation = generation_;
      ++round_size_;
    }
  }
}

void Membership::Seat(int32_t rank, const std::string& worker_id, const std::string& host,
                      absl::Time now, const std::string& digest, int64_t admitted_step,
                      const std::string& nonce_digest) {
  LiveMember& m = Mutable(rank, /*may_leave_round=*/false);
  m.join_nonce_digest = nonce_digest;
  const std::string old_worker_id = std::exchange(m.worker_id, worker_id);
  Reindex(rank, old_worker_id);
  m.host = host;
  m.last_step = -1;
  m.last_heartbeat = now;
  m.stream_lost_at = absl::InfiniteFuture();
  m.state = v1::ALIVE;
  m.generation = generation_;
  m.credential_digest = digest;
  m.joined_generation = generation_;
  m.admitted_step = admitted_step;
  m.retired_by = -1;
  m.retired_at_step = 0;
}

absl::Status Membership::CheckCredential(int32_t rank, const std::string& credential,
                                         const char* rpc, const std::string& job_id) const {
  const LiveMember& m = members_[rank];
  if (!m.present()) {
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
  if (waiting_.erase(rank) > 0) return;  // it only waited for its replica: nothing of it is kept
  if (InRound(members_[rank])) --round_size_;
  const std::string old_worker_id = members_[rank].worker_id;
  members_[rank] = LiveMember{};
  members_[rank].rank = rank;
  Reindex(rank, old_worker_id);
  ++out_of_round_epoch_;
  unwritten_.push_back(rank);
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
}

absl::StatusOr<Membership::LeaveResult> Membership::Leave(int32_t rank, const std::string& reason,
                                                          absl::Time now,
                                                          const std::string& job_id,
                                                          int64_t next_step) {
  return Transact([&] { return LeaveInMemory(rank, reason, now, job_id, next_step); });
}

absl::StatusOr<Membership::LeaveResult> Membership::LeaveInMemory(int32_t rank,
                                                                  const std::string& reason,
                                                                  absl::Time now,
                                                                  const std::string& job_id,
                                                                  int64_t next_step) {
  const LiveMember& m = members_[rank];
  if (!m.present()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " has not joined job ", job_id));
  }
  LeaveResult result;
  if (m.state == v1::LEFT) return result;
  result.left = true;
  const bool in_round = InRound(m);
  // A lingering replica mate (see Lingering) takes part in decisions: its peers must learn it
  // is gone, as for a member of the round.
  const bool lingering = Lingering(m);
  Mutable(rank).state = v1::LEFT;
  if (in_round && state_ == v1::PENDING) {
    // Leaving a round that is still assembling: free the rank, no bump needed.
    --round_size_;
    result.left_pending_round = true;
  }
  if (MaybeFinish()) {
    result.change.finished = true;
  } else if (state_ == v1::RUNNING && (in_round || lingering)) {
    result.change = Depart({rank}, reason, now, /*orderly=*/true, next_step);
  }
  return result;
}

absl::StatusOr<MembershipChange> Membership::Die(const std::vector<int32_t>& ranks,
                                                 const std::string& reason, absl::Time now) {
  return Transact(
      [&]() -> absl::StatusOr<MembershipChange> { return DieInMemory(ranks, reason, now); });
}

MembershipChange Membership::DieInMemory(const std::vector<int32_t>& ranks,
                                         const std::string& reason, absl::Time now) {
  if (ranks.empty()) return MembershipChange{};
  for (int32_t r : ranks) Mutable(r).state = v1::DEAD;
  return Depart(ranks, reason, now, /*orderly=*/false);
}

MembershipChange Membership::Depart(const std::vector<int32_t>& ranks,
                                    const std::string& reason, absl::Time now, bool orderly,
                                    int64_t next_step) {
  const int32_t rank = ranks[0];
  if (state_ == v1::RUNNING && elastic()) {
    // Sharded replicas: a replica that lost a rank cannot go on (its shards' collectives
    // would wait for it): its live ranks are retired with it.
    const int32_t s = replica_size();
    std::vector<int32_t> replicas;
    std::vector<int32_t> retire;
    if (s > 1) {
      for (int32_t r : ranks) {
        if (std::find(replicas.begin(), replicas.end(), r / s) == replicas.end()) {
          replicas.push_back(r / s);
        }
      }
      std::sort(replicas.begin(), replicas.end());
      for (int32_t replica : replicas) {
        for (int32_t r = replica * s; r < replica * s + s; ++r) {
          if (InRound(members_[r])) retire.push_back(r);
        }
      }
    }
    int32_t live = -static_cast<int32_t>(retire.size());
    int32_t lingering = 0;
    for (const LiveMember& m : members_) {
      live += InRound(m) ? 1 : 0;
      lingering += Lingering(m) ? 1 : 0;
    }
    // An orderly Leave winds the job down (the end of a run, where workers finish at different
    // times) without failing the others — those still averaging their last steps included: only
    // deaths count against min_world_size.
    if (live >= min_world_size_ ||
        (orderly && (live > 0 || lingering > 0 || !retire.empty()))) {
      std::string why = reason;
      for (int32_t r : retire) {
        LiveMember& m = Mutable(r);
        m.state = v1::RETIRED;
        m.retired_by = rank;
        for (int32_t d : ranks) {
          if (d / s == r / s) m.retired_by = d;
        }
        // After an orderly Leave the mates finish the steps the leaver finished.
        m.retired_at_step = orderly ? std::max<int64_t>(0, next_step) : 0;
      }
      for (int32_t replica : replicas) {
        bool any = false;
        for (int32_t r : retire) any = any || r / s == replica;
        if (any) absl::StrAppend(&why, "; ", ReplicaName(replica), " retired");
      }
      MembershipChange change = Shrink(rank, why, now);
      change.retired = std::move(retire);
      return change;
    }
  }
  // The job falls back to PENDING: replacements waiting for their replica wait no more.
  waiting_.clear();
  ResetProgress();
  return Bump(rank, reason, now);
}

MembershipChange Membership::Shrink(int32_t rank, const std::string& reason, absl::Time now) {
  const int64_t old_generation = generation_;
  MembershipChange change = Bump(rank, reason, now);
  change.shrunk = true;
  state_ = v1::RUNNING;
  CarryOver(old_generation, /*except=*/-1);
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
    const LiveMember& m = members_[r];
    if (!InRound(m) && !Lingering(m)) continue;
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
  LiveMember& m = members_[rank];
  if (InRound(m) || Lingering(m)) m.stream_lost_at = std::min(m.stream_lost_at, now);
  stale_not_before_ = absl::InfinitePast();
}

void Membership::Heartbeat(int32_t rank, int64_t generation, int64_t step, absl::Time now) {
  LiveMember& m = members_[rank];
  // Only the worker of that generation counts: a straggler of an older one keeps nobody alive.
  if (m.present() && (m.state == v1::ALIVE || Lingering(m)) &&
      generation >= m.joined_generation && generation <= generation_) {
    m.last_heartbeat = now;
    m.stream_lost_at = absl::InfiniteFuture();
    m.last_step = step;
    NoteProgress(step, now);
  }
}

absl::Status Membership::CheckPlausibleStep(int32_t rank, int64_t step, absl::Time now,
                                            const std::string& job_id) const {
  if (progress_max_ < 0 || step <= progress_max_) return absl::OkStatus();
  const double rate = std::max(steps_per_second_, 0.0);
  const double seconds =
      std::max(1.0, rate_sample_time_ == absl::InfinitePast()
                        ? 1.0
                        : absl::ToDoubleSeconds(now - rate_sample_time_));
  // In double: a pace near 2^63 steps per second must not overflow the bound.
  const double bound = static_cast<double>(progress_max_) + static_cast<double>(kStepLeap) +
                       10.0 * rate * seconds;
  if (static_cast<double>(step) <= bound) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "rank ", rank, " of job ", job_id, " reported step ", step, ", which the job's pace cannot "
      "have reached: its members have reported at most step ", progress_max_, ", at about ",
      static_cast<int64_t>(rate), " steps per second; a step more than ", kStepLeap,
      " plus ten times that pace ahead is refused (is the worker's step counter corrupt?)"));
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
  pace_unknown_since_restore_ = false;
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
  LiveMember& m = members_[rank];
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
  return change;
}

bool Membership::MaybeFinish() {
  bool any = false;
  for (const LiveMember& m : members_) {
    if (!m.present()) continue;
    any = true;
    if (m.state != v1::LEFT) return false;
  }
  if (!any) return false;
  state_ = v1::FINISHED;
  round_size_ = 0;
  MarkHeader();
  return true;
}

void Membership::Reindex(int32_t rank, const std::string& old_worker_id) {
  const std::string& worker_id = members_[rank].worker_id;
  if (old_worker_id == worker_id) return;
  if (!old_worker_id.empty()) {
    auto it = ranks_by_worker_.find(old_worker_id);
    if (it != ranks_by_worker_.end()) {
      it->second.erase(rank);
      if (it->second.empty()) ranks_by_worker_.erase(it);
    }
  }
  if (!worker_id.empty()) ranks_by_worker_[worker_id].insert(rank);
}

LiveMember& Membership::Mutable(int32_t rank, bool may_leave_round) {
  if (may_leave_round) ++out_of_round_epoch_;
  if (tx_->saved.insert(rank).second) {
    tx_->members.emplace_back(rank, members_[rank]);
    tx_->ranks.push_back(rank);
  }
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  return members_[rank];
}

void Membership::MarkHeader() {
  tx_->header_changed = true;
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
}

absl::Status Membership::WriteAndKeep(MembershipChange* change) {
  Transaction& tx = *tx_;
  if (tx.header_changed) change->header = MembershipHeader{state_, generation_, last_change_};
  const auto records = [&](std::vector<int32_t> ranks) {
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    change->members.clear();
    for (int32_t r : ranks) {
      if (!Assembling(members_[r])) change->members.push_back(members_[r]);
    }
  };
  records(tx.ranks);
  // A change with nothing to write (a rank seated in an assembling round) writes nothing; one
  // that writes takes the withdrawn ranks' removals along.
  const bool writes = change->changes_hard_state();
  if (writes && !unwritten_.empty()) {
    std::vector<int32_t> ranks = tx.ranks;
    ranks.insert(ranks.end(), unwritten_.begin(), unwritten_.end());
    records(std::move(ranks));
  }
  if (write_ != nullptr && writes) {
    if (absl::Status s = write_(*change); !s.ok()) {
      Rollback();
      return s;
    }
  }
  // Written with this change (a withdrawn rank seated again belongs to the assembling round).
  if (writes) unwritten_.clear();
  tx_.reset();
  return absl::OkStatus();
}

void Membership::Begin() {
  tx_ = Transaction{state_,           generation_,       round_size_,       last_change_,
                    progress_max_,    rate_sample_time_, rate_sample_step_, steps_per_second_};
  tx_->waiting = waiting_;
}

void Membership::Rollback() {
  Transaction& tx = *tx_;
  state_ = tx.state;
  generation_ = tx.generation;
  round_size_ = tx.round_size;
  last_change_ = std::move(tx.last_change);
  progress_max_ = tx.progress_max;
  rate_sample_time_ = tx.rate_sample_time;
  rate_sample_step_ = tx.rate_sample_step;
  steps_per_second_ = tx.steps_per_second;
  for (auto& [rank, m] : tx.members) {
    const std::string old_worker_id = members_[rank].worker_id;
    members_[rank] = std::move(m);
    Reindex(rank, old_worker_id);
  }
  ++out_of_round_epoch_;
  waiting_ = std::move(tx.waiting);
  decision_members_.reset();
  stale_not_before_ = absl::InfinitePast();
  tx_.reset();
}

}  // namespace modelavg::server
