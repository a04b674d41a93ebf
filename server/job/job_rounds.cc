// Job, membership and rounds: Join (and a replacement's wait for its replica, its admission),
// Heartbeat, a broken heartbeat stream, Leave, the members' reports (peer failures, non-finite
// values), and the deaths and expired Joins the staleness check finds.
#include "server/job/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/printable.h"
#include "server/job/job_internal.h"
#include "server/job/request_checks.h"
#include "server/membership/member_credential.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

constexpr size_t kMaxReasonLength = 256;
// Messages list at most this many missing ranks.
constexpr int kMaxListedRanks = 32;

// A worker's free text (a Leave's or a report's reason), as the coordinator keeps, logs and shows
// it: at most n bytes of it, its control characters escaped.
std::string Truncate(const std::string& s, size_t n) {
  return EscapeControlCharacters(s.size() <= n ? s : s.substr(0, n) + "...");
}

}  // namespace

void Job::Join(const v1::JoinRequest& request, absl::Time call_deadline, WaitId wait_id,
               JoinCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status status) { out.Answer(std::move(done), std::move(status)); };
  if (!closed_.ok()) return fail(closed_);
  if (!halted_.ok()) return fail(halted_);
  const int32_t world = schedule_.world_size();
  if (absl::Status s = CheckJoinRequest(request, world, id()); !s.ok()) return fail(s);
  if (absl::Status s = PacedPlan::CheckTokens(request.tokens_per_step()); !s.ok()) {
    return fail(s);
  }
  const absl::Time now = clock_->Now();
  std::string credential = NewMemberCredential();
  // Written before anything else happens: on a failed write nothing did, and a retry of this
  // Join is a first Join again, not a re-join that would move the generation. (A rank in a
  // round that is still assembling is part of this Join's wait: nothing is written for it.)
  absl::StatusOr<Membership::JoinResult> joined = membership_.Join(
      request.worker_id(), request.host(),
      request.has_rank() ? std::optional<int32_t>(request.rank()) : std::nullopt, now, id(),
      request.credential(), CredentialDigest(credential), request.join_nonce());
  if (!joined.ok()) return fail(joined.status());
  const int32_t rank = joined->rank;
  if (paced_) {
    paced_->NoteTokens(rank, request.tokens_per_step());
  }
  if (joined->waiting_for_replica) {
    return WaitForReplica(rank, joined->was_in_round, std::move(credential),
                          std::min(now + join_timeout_, call_deadline),
                          request.subgroup_ranks_from_spec(), wait_id, std::move(done), &out);
  }
  if (joined->change.admitted) {
    // A replacement in a RUNNING elastic job: answered at once, with the rest of its replica.
    for (int32_t mate : joined->admitted_with) {
      if (std::optional<JoinWait> w = waits_.TakeJoinOfRank(mate)) {
        v1::JoinResponse response;
        FillJoinResponse(mate, !w->ranks_from_spec, &response);
        response.set_credential(std::move(w->credential));
        out.Answer(std::move(w->done), std::move(response));
      }
    }
    return AnswerAdmission(rank, joined->change, std::move(credential),
                           request.subgroup_ranks_from_spec(), std::move(done), &out);
  }
  OnMembershipChange(joined->change, &out);
  if (joined->was_in_round) {
    // The same worker joins again (e.g. it retried after losing the reply): the newer call wins.
    if (std::optional<JoinWait> old = waits_.TakeJoinOfRank(rank)) {
      out.Complete([cb = std::move(old->done)]() mutable {
        cb(absl::AbortedError("superseded by a newer Join from the same worker"));
      });
    }
  }
  const LiveMember& m = membership_.member(rank);
  const int64_t generation = membership_.generation();
  spdlog::info("job {}: worker \"{}\" ({}) joined as rank {} in generation {} ({}/{} joined)",
               id(), m.worker_id, m.host, rank, generation,
               joined->change.world_complete ? world : membership_.round_size(), world);
  AddEvent(v1::JobEvent::MEMBER_JOINED, rank,
           absl::StrCat("worker \"", m.worker_id, "\" joined as rank ", rank), false, &out);
  JoinWait wait{wait_id, rank, std::move(credential),
                std::min(now + join_timeout_, call_deadline), std::move(done)};
  wait.ranks_from_spec = request.subgroup_ranks_from_spec();
  waits_.AddJoin(std::move(wait));
  if (joined->change.world_complete) CompleteRound(&out);
}

void Job::WaitForReplica(int32_t rank, bool superseding, std::string credential,
                         absl::Time deadline, bool ranks_from_spec, WaitId wait_id,
                         JoinCallback done, Outbox* out) {
  if (superseding) {
    // The same worker joins again (it retried): the newer call waits, the older one ends.
    if (std::optional<JoinWait> old = waits_.TakeJoinOfRank(rank)) {
      out->Complete([cb = std::move(old->done)]() mutable {
        cb(absl::AbortedError("superseded by a newer Join from the same worker"));
      });
    }
  }
  const int32_t s = membership_.replica_size();
  const int32_t replica = rank / s;
  std::vector<int32_t> missing;
  for (int32_t r = replica * s; r < replica * s + s; ++r) {
    if (!membership_.Waiting(r)) missing.push_back(r);
  }
  spdlog::info("job {}: a replacement joined as rank {} of replica {}; it waits for ranks {} of "
               "its replica to join",
               id(), rank, replica, absl::StrJoin(missing, ", "));
  AddEvent(v1::JobEvent::MEMBER_JOINED, rank,
           absl::StrCat("a replacement joined as rank ", rank, " of replica ", replica,
                        " and waits for ranks ", absl::StrJoin(missing, ", ")),
           false, out);
  JoinWait wait{wait_id, rank, std::move(credential), deadline, std::move(done)};
  wait.for_replica = true;
  wait.ranks_from_spec = ranks_from_spec;
  waits_.AddJoin(std::move(wait));
}

void Job::AnswerAdmission(int32_t rank, const MembershipChange& change, std::string credential,
                          bool ranks_from_spec, JoinCallback done, Outbox* out) {
  const LiveMember& m = membership_.member(rank);
  ++admissions_;
  spdlog::info("job {}: worker \"{}\" ({}) admitted as rank {}{} in generation {} at step {} "
               "(floor {} = largest step reported {} + margin {}; {:.1f} steps/s)",
               id(), m.worker_id, m.host,
               change.admitted_ranks.size() > 1
                   ? absl::StrCat(rank, " with ranks ", absl::StrJoin(change.admitted_ranks, ","),
                                  " of its replica")
                   : absl::StrCat(rank),
               change.replaced_live_member ? " (its earlier membership departed)" : "",
               membership_.generation(), change.admission_step, change.admission_floor,
               change.max_reported_step, change.admission_margin,
               std::max(0.0, membership_.steps_per_second()));
  AddEvent(v1::JobEvent::MEMBER_ADMITTED, rank,
           change.admitted_ranks.size() > 1
               ? absl::StrCat("replica ", rank / membership_.replica_size(), " (ranks ",
                              absl::StrJoin(change.admitted_ranks, ","), ") admitted at step ",
                              change.admission_step)
               : absl::StrCat("worker \"", m.worker_id, "\" admitted as rank ", rank,
                              " at step ", change.admission_step),
           true, out);
  OnMembershipChange(change, out);
  v1::JoinResponse response;
  FillJoinResponse(rank, !ranks_from_spec, &response);
  response.set_credential(std::move(credential));
  out->Answer(std::move(done), std::move(response));
}

void Job::CompleteRound(Outbox* out) {
  const int64_t generation = membership_.generation();
  for (JoinWait& w : waits_.TakeRoundJoins()) {
    v1::JoinResponse response;
    FillJoinResponse(w.rank, !w.ranks_from_spec, &response);
    response.set_credential(std::move(w.credential));
    out->Answer(std::move(w.done), std::move(response));
  }
  spdlog::info("job {}: all {} ranks joined; RUNNING in generation {}", id(),
               schedule_.world_size(), generation);
  AddEvent(v1::JobEvent::WORLD_COMPLETE, -1, absl::StrCat("RUNNING in generation ", generation),
           true, out);
}

void Job::FillJoinResponse(int32_t rank, bool with_ranks, v1::JoinResponse* out) const {
  out->set_rank(rank);
  out->set_world_size(schedule_.world_size());
  out->set_generation(membership_.generation());
  *out->mutable_spec() = spec_;
  out->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout()));
  out->set_admission_step(membership_.member(rank).admitted_step);
  plans_.AppendAfter(1, out->mutable_plan_changes());
  for (int level = 0; level < schedule_.num_levels(); ++level) {
    const SubgroupRange g = schedule_.SubgroupOf(level, rank);
    v1::Subgroup* s = out->add_subgroups();
    s->set_level(level);
    s->set_period(schedule_.spec().levels[level].period);
    s->set_subgroup(g.index);
    if (!with_ranks) continue;
    s->mutable_ranks()->Reserve(g.size);
    for (int32_t i = 0; i < g.size; ++i) s->add_ranks(g.RankAt(i));
  }
}

absl::Status Job::Heartbeat(const v1::HeartbeatRequest& request,
                            v1::HeartbeatResponse* response) {
  if (absl::Status s = CheckRank(request.rank(), schedule_.world_size(), id()); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckStep(request.step()); !s.ok()) return s;
  const absl::Time now = clock_->Now();
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) {  // deleted (or stopping) while a stream still held it
    return deleted_ ? absl::NotFoundError(closed_.message()) : closed_;
  }
  // A rank without a member is answered (the reply tells a worker whose coordinator lost the
  // job's state that it has the job afresh) and nothing is recorded; a member's rank needs the
  // member's credential.
  if (membership_.member(request.rank()).present()) {
    if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                     "Heartbeat", id());
        !s.ok()) {
      return s;
    }
  }
  if (membership_.member(request.rank()).present()) {
    if (absl::Status s =
            membership_.CheckPlausibleStep(request.rank(), request.step(), now, id());
        !s.ok()) {
      return s;
    }
  }
  membership_.Heartbeat(request.rank(), request.generation(), request.step(), now);
  if (paced_ && membership_.member(request.rank()).present()) {
    paced_->NotePace(request.rank(), request.compute_steps_per_second());
    paced_->NoteStep(request.rank(), request.step(), now);
  }
  // Liveness still counts while halted: the death is written once it can be, of the same ranks.
  if (!halted_.ok()) return halted_;
  if (membership_.member(request.rank()).present() && request.used_through() >= 0) {
    plans_.Reported(request.rank(), request.used_through(), request.proposal_answered());
  }
  plans_.AppendAfter(request.plans_known(), response->mutable_plan_changes());
  response->set_proposed_plan(plans_.proposed());
  if (plans_.proposed() != 0) MaybeFinishProposal(now, &out);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  if (now < grace_until_) {
    response->set_recovery_grace_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(grace_until_ - now)));
  }
  if (request.generation() != membership_.generation() && membership_.last_change()) {
    *response->mutable_last_change() = *membership_.last_change();
  }
  return absl::OkStatus();
}

void Job::HeartbeatStreamLost(int32_t rank, const std::string& credential) {
  if (rank < 0 || rank >= schedule_.world_size()) return;
  absl::MutexLock lock(&mu_);
  if (!closed_.ok() || !membership_.elastic() || !membership_.InRound(rank)) return;
  if (!membership_.CheckCredential(rank, credential, "HeartbeatStream", id()).ok()) return;
  spdlog::info("job {}: rank {}'s heartbeat stream broke; DEAD unless it beats within {} ms",
               id(), rank, absl::ToInt64Milliseconds(StreamLostGrace()));
  membership_.StreamLost(rank, clock_->Now());
}

absl::Status Job::Leave(const v1::LeaveRequest& request, v1::LeaveResponse* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckRank(rank, schedule_.world_size(), id()); !s.ok()) return s;
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!halted_.ok()) return halted_;
  if (absl::Status s = membership_.CheckCredential(rank, request.credential(), "Leave", id());
      !s.ok()) {
    return s;
  }
  std::string reason = absl::StrCat("rank ", rank, request.failed() ? " failed" : " left");
  if (!request.reason().empty()) {
    absl::StrAppend(&reason, " (", Truncate(request.reason(), kMaxReasonLength), ")");
  }
  // A worker that ends because it failed is no orderly departure: it counts as a death
  // (written first, like every change: on a failed write nothing changed).
  if (const LiveMember& m = membership_.member(rank);
      request.failed() && membership_.state() == v1::RUNNING && m.present() &&
      m.state == v1::ALIVE && m.generation == membership_.generation()) {
    const std::string worker_id = m.worker_id;
    absl::StatusOr<MembershipChange> died = membership_.Die({rank}, reason, clock_->Now());
    if (!died.ok()) return died.status();
    spdlog::warn("job {}: {} (worker \"{}\", generation {}); DEAD", id(), reason, worker_id,
                 request.generation());
    ++deaths_;
    OnMembershipChange(*died, &out);
    response->set_state(membership_.state());
    response->set_generation(membership_.generation());
    return absl::OkStatus();
  }
  absl::StatusOr<Membership::LeaveResult> left =
      membership_.Leave(rank, reason, clock_->Now(), id(), request.next_step());
  if (!left.ok()) return left.status();
  if (left->left) {
    spdlog::info("job {}: {} (worker \"{}\", generation {})", id(), reason,
                 membership_.member(rank).worker_id, request.generation());
    if (left->left_pending_round) {
      if (std::optional<JoinWait> w = waits_.TakeJoinOfRank(rank)) {
        out.Complete([cb = std::move(w->done), reason]() mutable {
          cb(absl::AbortedError(reason));
        });
      }
    }
    OnMembershipChange(left->change, &out);
  }
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

absl::Status Job::ReportPeerFailure(const v1::ReportPeerFailureRequest& request,
                                    v1::ReportPeerFailureResponse* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckPeerReport(request, schedule_.world_size(), id()); !s.ok()) {
    return s;
  }
  PeerReport report;
  report.reporter = rank;
  report.unreachable.assign(request.unreachable_ranks().begin(),
                            request.unreachable_ranks().end());
  report.reachable.assign(request.reachable_ranks().begin(), request.reachable_ranks().end());
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMemberCall(rank, request.credential(), "ReportPeerFailure"); !s.ok()) {
    return s;
  }
  const int64_t generation = membership_.generation();
  response->set_state(membership_.state());
  response->set_generation(generation);
  // The job moved on already (the failure was a death the coordinator saw itself, say).
  if (request.generation() != generation) return absl::OkStatus();
  if (membership_.state() != v1::RUNNING || !membership_.InRound(rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " is not a member of job ", id(), "'s running round (generation ",
        generation, "); a peer failure report is not taken from it"));
  }
  const absl::Time now = clock_->Now();
  report.at = now;
  spdlog::info("job {}: rank {} reports its round at step {} (level {}) failed: could not reach "
               "ranks [{}], reached [{}] ({})",
               id(), rank, request.step(), request.level(),
               absl::StrJoin(report.unreachable, ","), absl::StrJoin(report.reachable, ","),
               Truncate(request.reason(), kMaxReasonLength));
  peer_reports_.Add(generation, std::move(report));
  std::vector<ConfirmedPeer> confirmed = peer_reports_.Confirmed(
      generation, now, [this](int32_t r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return membership_.InRound(r);
      });
  if (confirmed.empty()) return absl::OkStatus();
  std::vector<int32_t> dead;
  for (const ConfirmedPeer& c : confirmed) dead.push_back(c.rank);
  std::string reason = absl::StrCat("rank ", dead[0], " unreachable by its peers");
  if (dead.size() > 1) absl::StrAppend(&reason, " (and ", dead.size() - 1, " more ranks)");
  absl::StatusOr<MembershipChange> died = membership_.Die(dead, reason, now);
  if (!died.ok()) return died.status();
  for (const ConfirmedPeer& c : confirmed) {
    spdlog::warn("job {}: rank {} (worker \"{}\") still beats but its peers cannot reach it: {}; "
                 "DEAD",
                 id(), c.rank, membership_.member(c.rank).worker_id, c.why);
    response->add_declared_dead(c.rank);
  }
  deaths_ += static_cast<int64_t>(dead.size());
  OnMembershipChange(*died, &out);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

absl::Status Job::ReportNonFinite(const v1::ReportNonFiniteRequest& request,
                                  v1::ReportNonFiniteResponse* response) {
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    plans = plans_.history();
  }
  // The level is one of the plan in force at the report's step.
  if (absl::Status s = CheckNonFiniteReport(
          request, plans->At(std::max<int64_t>(request.step(), 0)), id());
      !s.ok()) {
    return s;
  }
  const int32_t rank = request.rank();
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMemberCall(rank, request.credential(), "ReportNonFinite"); !s.ok()) {
    return s;
  }
  // The payload is the member's free text, shown in the log, the status page, the CLI and
  // events: its control and bidirectional formatting characters escaped.
  const std::string payload =
      request.payload().empty() ? "values" : EscapeControlCharacters(request.payload());
  const std::string& value = request.value();  // one of NaN, +Inf, -Inf (checked)
  const std::string reason = absl::StrCat(
      "rank ", rank, " contributed non-finite values (", value, " in tensor ",
      request.tensor(), " of its ", payload, ") at step ", request.step(), ", level ",
      request.level());
  const absl::Time now = clock_->Now();
  v1::NonFiniteReport report;
  report.set_rank(rank);
  report.set_generation(request.generation());
  report.set_step(request.step());
  report.set_level(request.level());
  report.set_tensor(request.tensor());
  report.set_value(value);
  report.set_payload(payload);
  report.set_unix_ms(UnixMs(now));
  // An elastic job goes on without the member, as after a failure: it is declared dead (a
  // member that is in the running round only; a report that comes after the job moved on
  // without it changes nothing).
  const bool retire = membership_.elastic() && membership_.state() == v1::RUNNING &&
                      membership_.InRound(rank);
  std::optional<MembershipChange> died;
  if (retire) {
    absl::StatusOr<MembershipChange> change = membership_.Die({rank}, reason, now);
    if (!change.ok()) return change.status();  // not written: nothing changed, nothing recorded
    died = *std::move(change);
    ++deaths_;
  }
  report.set_retired(retire);
  ++nonfinite_reports_;
  last_nonfinite_ = report;
  spdlog::warn("job {}: {} (worker \"{}\", generation {}); {}", id(), reason,
               membership_.member(rank).worker_id, request.generation(),
               retire ? "retired: DEAD"
               : membership_.elastic()
                   ? "the rank is no longer in the running round"
                   : "a strict job: every member's round fails and nothing changes");
  AddEvent(v1::JobEvent::MEMBER_NON_FINITE, rank,
           retire ? absl::StrCat(reason, "; retired") : reason, /*with_members=*/false, &out);
  if (died) OnMembershipChange(*died, &out);
  response->set_retired(retire);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

void Job::DeclareDead(const std::vector<int32_t>& dead, absl::Time now, Outbox* out,
                      const std::string& straggler) {
  bool all_lost = true;
  for (int32_t r : dead) {
    all_lost = all_lost && membership_.member(r).stream_lost_at != absl::InfiniteFuture();
  }
  std::string reason = absl::StrCat("rank ", dead[0],
                                    !straggler.empty() ? " straggler"
                                    : all_lost         ? " connection lost"
                                                       : " heartbeat timeout");
  if (dead.size() > 1) absl::StrAppend(&reason, " (and ", dead.size() - 1, " more ranks)");
  // Logged before the members change (their times are read here).
  std::vector<std::string> notes;
  for (int32_t r : dead) {
    const LiveMember& m = membership_.member(r);
    if (!straggler.empty()) {
      notes.push_back(absl::StrCat("rank ", r, " (worker \"", m.worker_id, "\") ", straggler));
    } else if (m.stream_lost_at != absl::InfiniteFuture()) {
      notes.push_back(absl::StrCat(
          "rank ", r, " (worker \"", m.worker_id, "\"): its heartbeat stream broke ",
          absl::ToInt64Milliseconds(now - m.stream_lost_at), " ms ago and no beat came since "
          "(the last ", absl::ToInt64Milliseconds(now - m.last_heartbeat), " ms ago)"));
    } else {
      notes.push_back(absl::StrCat("rank ", r, " (worker \"", m.worker_id,
                                   "\") sent no heartbeat for ",
                                   absl::ToInt64Milliseconds(now - m.last_heartbeat), " ms"));
    }
  }
  absl::StatusOr<MembershipChange> died = membership_.Die(dead, reason, now);
  if (!died.ok()) {
    // The death cannot be recorded: going on without it would make a restarted coordinator
    // bring the dead back (and issue the next generation twice). The job stops, loudly, until
    // the write succeeds (tried again at every check).
    if (halted_.ok()) {
      halted_ = absl::UnavailableError(absl::StrCat(
          "job ", id(), " is halted: the death of ", reason, " cannot be recorded (",
          last_save_error_.message(),
          "); the job resumes once the coordinator can write its state again"));
      spdlog::error("{}", std::string(halted_.message()));
      FailAllWaits(halted_, out);
    }
  } else {
    if (!halted_.ok()) {
      spdlog::info("job {}: its state is written again; no longer halted", id());
      halted_ = absl::OkStatus();
    }
    for (const std::string& note : notes) spdlog::warn("job {}: {}; DEAD", id(), note);
    deaths_ += static_cast<int64_t>(dead.size());
    if (paced_) {
      for (int32_t r : dead) paced_->Forget(r);
    }
    OnMembershipChange(*died, out);
  }
}

void Job::ExpireWaits(absl::Time now, Outbox* out) {
  for (JoinWait& w : waits_.TakeExpiredJoins(now)) {
    if (w.for_replica) {
      ExpireReplicaWait(std::move(w), out);
      continue;
    }
    const std::string missing = membership_.MissingRanks(kMaxListedRanks);
    std::string msg = absl::StrCat(
        "join of job ", id(), " (generation ", membership_.generation(), ") timed out: ",
        membership_.round_size(), " of ", schedule_.world_size(),
        " ranks joined; missing ranks: ", missing,
        "; start the missing workers or raise join_timeout_ms");
    spdlog::warn("job {}: rank {} (worker \"{}\") Join timed out; missing ranks: {}", id(),
                 w.rank, membership_.member(w.rank).worker_id, missing);
    membership_.Withdraw(w.rank);  // nothing was written for it (Membership::Withdraw)
    out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
  }
  for (CommIdWait& w : waits_.TakeExpiredCommIds(now)) {
    const auto& [level, subgroup, key] = w.key;
    const int32_t leader = schedule_.Subgroup(level, subgroup).first_rank;
    std::string msg = absl::StrCat(
        "no id was published for level ", level, ", subgroup ", subgroup, ", key \"", key,
        "\" of job ", id(), " in generation ", membership_.generation(),
        " before the deadline; is rank ", leader, " (the subgroup's leader) alive?");
    out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
  }
}

void Job::ExpireReplicaWait(JoinWait w, Outbox* out) {
  const int32_t s = membership_.replica_size();
  const int32_t replica = w.rank / s;
  std::vector<int32_t> joined, missing;
  for (int32_t r = replica * s; r < replica * s + s; ++r) {
    (membership_.Waiting(r) ? joined : missing).push_back(r);
  }
  std::string msg = absl::StrCat(
      "join of job ", id(), " as rank ", w.rank, " timed out: a replacement replica is admitted "
      "whole, and ranks ", absl::StrJoin(missing, ", "), " of replica ", replica,
      " did not join (joined: ", absl::StrJoin(joined, ", "),
      "); start every rank of the replica or raise join_timeout_ms");
  spdlog::warn("job {}: rank {} waited for its replica {} in vain (missing ranks: {})", id(),
               w.rank, replica, absl::StrJoin(missing, ", "));
  membership_.Withdraw(w.rank);  // it only waited: nothing of it was written
  out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
    cb(absl::DeadlineExceededError(msg));
  });
}

absl::Status Job::CheckMemberCall(int32_t rank, const std::string& credential,
                                  const char* rpc) const {
  if (!closed_.ok()) return closed_;
  if (!halted_.ok()) return halted_;
  return membership_.CheckCredential(rank, credential, rpc, id());
}

}  // namespace modelavg::server
