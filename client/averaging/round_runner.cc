#include "client/averaging/round_runner.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/base/error_kind.h"
#include "client/rpc/coordinator_client.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// A round lost to a failure is retried in the next generation, at most this many times (each
// retry needs the job to have moved on: a death, a departure or an admission).
constexpr int kMaxElasticAttempts = 16;

std::string ElasticWhere(const Decision& d) {
  return absl::StrCat("averaging at step ", d.step, " (level ", d.level, ", subgroup ",
                      d.subgroup.index, ", generation ", d.generation, ")");
}

}  // namespace

ModelAverager::LevelTraffic& Traffic::At(int level) {
  if (levels_.size() <= static_cast<size_t>(level)) levels_.resize(level + 1);
  return levels_[level];
}

void Traffic::AddBytes(int level, int64_t bytes) {
  if (level < 0) return;
  At(level).bytes_sent += bytes;
}

void Traffic::AddWaited(int level, absl::Duration waited) {
  if (level < 0) return;
  At(level).waited += waited;
}

std::vector<ModelAverager::LevelTraffic> Traffic::PerLevel(size_t levels) const {
  std::vector<ModelAverager::LevelTraffic> out = levels_;
  out.resize(levels);
  return out;
}

RoundRunner::RoundRunner(Client* client, Traffic* traffic, OuterDevice* device, Hooks hooks)
    : client_(client), traffic_(traffic), device_(device), hooks_(std::move(hooks)) {}

absl::Duration RoundRunner::CauseWait() const {
  return client_->heartbeat_timeout() + 2 * client_->options().heartbeat_interval +
         absl::Milliseconds(500);
}

absl::Duration RoundRunner::RetryWait() const {
  return 2 * client_->heartbeat_timeout() + 2 * client_->options().heartbeat_interval +
         absl::Seconds(2);
}

absl::StatusOr<Decision> RoundRunner::Run(const Decision& decision, const Device& device,
                                          absl::Span<const TensorView> tensors, RoundWire wire) {
  if (client_->elastic()) return RunElastic(decision, device, tensors, wire);
  const std::string where = absl::StrCat("averaging at step ", decision.step, " (level ",
                                         decision.level, ", subgroup ", decision.subgroup.index,
                                         ")");
  // A paced round weighs this member's contribution on a copy (round_weights.h); nothing
  // changes for a decision without weights.
  WeightedInput weighted(device_);
  absl::StatusOr<absl::Span<const TensorView>> weighed =
      weighted.For(decision, client_->rank(), tensors, wire.weigh);
  if (!weighed.ok()) return Annotate(weighed.status(), where);
  const absl::Span<const TensorView> round_tensors = *weighed;
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision.subgroup), where));
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
  RoundOptions plain;
  plain.payload = wire.payload;
  plain.topk = wire.topk;
  plain.layout_signature = wire.layout_signature;
  plain.step = decision.step;
  plain.round = decision.round;
  plain.check_finite = client_->options().check_finite;
  const int64_t sent_before = comm.ok() ? (*comm)->bytes_sent() : 0;
  absl::Status s =
      comm.ok() ? (*comm)->AllReduceAverage(round_tensors, plain, nullptr) : comm.status();
  if (comm.ok()) traffic_->AddBytes(decision.level, (*comm)->bytes_sent() - sent_before);
  if (s.ok()) {
    MODELAVG_RETURN_IF_ERROR(Annotate(weighted.Finish(tensors), where));
    return decision;
  }
  // Every member's call fails; nobody's parameters changed (a strict job keeps its generation).
  if (ErrorKindOf(s) == ErrorKind::kNonFinite) {
    return Annotate(OnNonFinite(decision, wire, std::move(s)), where);
  }
  if (s.code() == absl::StatusCode::kInvalidArgument) return Annotate(s, where);
  ReportUnreachablePeersOf(decision, comm.ok() ? *comm : nullptr, s);
  // A transport failure usually means a peer died: give the coordinator up to a heartbeat
  // timeout to say so, so the error names the cause rather than a broken socket.
  absl::Status why = client_->AwaitCannotAverage(decision.subgroup, CauseWait());
  // The collective was aborted for the reason the client gives: say it once.
  if (!why.ok() && ErrorKindOf(s) == ErrorKind::kGenerationMoved) return Annotate(why, where);
  if (!why.ok()) {
    // The kind and the blamed rank of the client's reason (error_kind.h) go with it.
    return Restate(why, absl::StrCat(where, " failed: ", why.message(),
                                     " (transport error: ", s.message(), ")"));
  }
  return Annotate(s, where);
}

CommunicatorSetup RoundRunner::Setup(const Decision& decision) const {
  CommunicatorSetup setup;
  setup.coordinator = client_->coordinator();
  setup.job_id = client_->job_id();
  setup.generation = decision.generation > 0 ? decision.generation : client_->generation();
  setup.plan = decision.plan;
  setup.level = decision.level;
  setup.subgroup = decision.subgroup;
  setup.members = decision.members;
  setup.rank = client_->rank();
  setup.credential = client_->credential();
  setup.timeout = client_->options().collective_timeout;
  // A committed round needs its backup (ClientOptions::gloo_in_place is for strict jobs).
  setup.gloo_in_place = client_->options().gloo_in_place && !client_->elastic();
  setup.gloo_scatter_max_bytes = client_->options().gloo_scatter_max_bytes;
  Client* client = client_;
  const SubgroupRange group = decision.subgroup;
  setup.check_alive = [client, group] { return client->CheckCanAverage(group); };
  setup.request_new_generation = [client](const absl::Status& why) { client->FailOut(why); };
  return setup;
}

// After a failed round: probes the round's peers over the data network and, when some do not
// answer, reports them to the coordinator (a gray failure: they still beat to it, so only their
// peers can tell). The coordinator evicts nobody on one report alone (docs/cluster.md, "Gray
// failures"); when the reports agree it declares the unreachable dead and the job moves on,
// which the caller's wait for a newer generation then sees.
void RoundRunner::ReportUnreachablePeersOf(const Decision& decision, Communicator* comm,
                                           const absl::Status& failure) const {
  const int64_t generation =
      decision.generation > 0 ? decision.generation : client_->generation();
  if (comm == nullptr || ErrorKindOf(failure) == ErrorKind::kGenerationMoved ||
      client_->latest_generation() != generation) {
    return;  // aborted for a generation change: nothing to report
  }
  // A quarter of the collective timeout, at most 1 s: a host answers a connect in a round trip.
  const absl::Duration timeout = std::clamp(client_->options().collective_timeout / 4,
                                            absl::Milliseconds(100), absl::Seconds(1));
  absl::StatusOr<std::vector<PeerReach>> reach = comm->ProbePeers(timeout);
  if (!reach.ok()) {
    spdlog::debug("not probing the peers of the failed round: {}", reach.status().ToString());
    return;
  }
  const std::vector<int32_t> members = decision.Members();
  v1::ReportPeerFailureRequest req;
  std::vector<std::string> notes;
  for (const PeerReach& p : *reach) {
    if (p.member < 0 || p.member >= static_cast<int>(members.size())) continue;
    const int32_t rank = members[p.member];
    if (p.reachable) {
      req.add_reachable_ranks(rank);
    } else {
      req.add_unreachable_ranks(rank);
      notes.push_back(absl::StrCat("rank ", rank, ": ", p.detail));
    }
  }
  if (req.unreachable_ranks().empty()) return;  // every host answers: not a gray failure
  req.set_job_id(client_->job_id());
  req.set_rank(client_->rank());
  req.set_generation(generation);
  req.set_credential(client_->credential());
  req.set_step(decision.step);
  req.set_level(decision.level);
  req.set_reason(std::string(failure.message().substr(0, 256)));
  spdlog::warn("averaging at step {} (level {}) failed and peers do not answer on the data "
               "network ({}); reporting them to the coordinator",
               decision.step, decision.level, absl::StrJoin(notes, "; "));
  absl::StatusOr<v1::ReportPeerFailureResponse> reply =
      client_->coordinator()->ReportPeerFailure(req);
  if (!reply.ok()) {
    spdlog::warn("the coordinator took no peer failure report{}: {}",
                 absl::IsUnimplemented(reply.status()) ? " (it predates them)" : "",
                 reply.status().ToString());
  } else if (!reply->declared_dead().empty()) {
    spdlog::warn("the coordinator confirmed the report: ranks {} declared dead, generation {}",
                 absl::StrJoin(reply->declared_dead(), ","), reply->generation());
  }
}

absl::Status RoundRunner::OnNonFinite(const Decision& decision, const RoundWire& wire,
                                      absl::Status failure) const {
  NonFiniteDetail detail = NonFiniteDetailOf(failure).value_or(NonFiniteDetail{});
  const std::vector<int32_t> members = decision.Members();
  const int32_t member = ErrorPeerOf(failure);
  if (member >= 0 && member < static_cast<int32_t>(members.size())) {
    detail.rank = members[member];
  }
  detail.level = decision.level;
  if (detail.step < 0) detail.step = decision.step;
  absl::Status out(failure.code(),
                   absl::StrCat(failure.message(), " (rank ", detail.rank, ", level ",
                                decision.level, ", ", wire.contents, ")"));
  failure.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  out = SetErrorKind(std::move(out), ErrorKind::kNonFinite, member, detail.rank);
  out = SetNonFiniteDetail(std::move(out), detail);
  if (detail.rank != client_->rank()) return out;
  v1::ReportNonFiniteRequest req;
  req.set_job_id(client_->job_id());
  req.set_rank(client_->rank());
  req.set_generation(decision.generation > 0 ? decision.generation : client_->generation());
  req.set_credential(client_->credential());
  req.set_step(detail.step);
  req.set_level(decision.level);
  req.set_tensor(std::max(detail.tensor, 0));
  req.set_value(detail.value);
  req.set_payload(wire.contents.substr(0, 64));
  spdlog::error("averaging at step {} (level {}): this rank's {} hold {} in tensor {}; kept out "
                "of the round and reported to the coordinator",
                detail.step, decision.level, wire.contents, detail.value, detail.tensor);
  absl::StatusOr<v1::ReportNonFiniteResponse> reply =
      client_->coordinator()->ReportNonFinite(req);
  if (!reply.ok()) {
    spdlog::warn("the coordinator took no non-finite report{}: {}",
                 absl::IsUnimplemented(reply.status()) ? " (it predates them)" : "",
                 reply.status().ToString());
  } else if (reply->retired()) {
    spdlog::warn("the coordinator retired this rank: generation {} goes on without it",
                 reply->generation());
  }
  return out;
}

absl::Status RoundRunner::EnterNewerGeneration() {
  return client_->AdvanceGeneration(
      [this](int64_t generation) { hooks_.before_note(generation); });
}

absl::StatusOr<Decision> RoundRunner::RunElastic(Decision decision, const Device& device,
                                                 absl::Span<const TensorView> tensors,
                                                 RoundWire wire, bool hand_over) {
  for (int attempt = 1;; ++attempt) {
    MODELAVG_ASSIGN_OR_RETURN(Attempt tried,
                              RunAttempt(decision, device, tensors, wire, hand_over));
    if (tried.status.ok()) return Commit(decision, attempt);
    if (ErrorKindOf(tried.status) == ErrorKind::kNonFinite) {
      // A donor's NaN in the hand-over (checked like any round): the replacement took nothing.
      RoundWire named = wire;
      if (tried.in_hand_over) named.contents = "values handed to the replacement";
      tried.status = OnNonFinite(decision, named, std::move(tried.status));
      // The member that contributed them fails its call (the coordinator retires it); the
      // others retry without it in the generation that follows, inside this call.
      if (NonFiniteDetailOf(tried.status)->rank == client_->rank()) {
        return Annotate(tried.status, ElasticWhere(decision));
      }
      spdlog::warn("{}: {}; retrying without its member", ElasticWhere(decision),
                   std::string(tried.status.message()));
    } else if (tried.status.code() == absl::StatusCode::kInvalidArgument ||
        ErrorKindOf(tried.status) == ErrorKind::kRoundMismatch) {
      return Annotate(tried.status, ElasticWhere(decision));
    } else {
      ReportUnreachablePeersOf(decision, tried.comm, tried.status);
    }
    MODELAVG_ASSIGN_OR_RETURN(Decision next, MoveOnAfterFailure(decision, tried.status));
    MODELAVG_ASSIGN_OR_RETURN(bool completed, PeerCompletedAttempt(decision, &next, &attempt));
    if (completed) {
      MODELAVG_RETURN_IF_ERROR(AdoptLostCommit(decision, tried, tensors));
      return decision;
    }
    if (attempt >= kMaxElasticAttempts) {
      return Annotate(tried.status,
                      absl::StrCat(ElasticWhere(decision), " (", attempt, " attempts)"));
    }
    spdlog::warn("{} failed ({}); retrying in generation {} with ranks {}", ElasticWhere(decision),
                 std::string(tried.status.message()), next.generation,
                 absl::StrJoin(next.Members(), ","));
    decision = std::move(next);
  }
}

absl::StatusOr<RoundOptions> RoundRunner::ElasticOptions(const Decision& decision,
                                                         RoundWire wire) const {
  const std::vector<int32_t> members = decision.Members();
  if (!std::binary_search(members.begin(), members.end(), client_->rank())) {
    return absl::InternalError(absl::StrCat(ElasticWhere(decision), ": rank ", client_->rank(),
                                            " is not among the round's members"));
  }
  RoundOptions options;
  options.step = decision.step;
  options.round = decision.round;
  options.contribute =
      !std::binary_search(decision.joining.begin(), decision.joining.end(), client_->rank());
  options.contributors = static_cast<int>(members.size() - decision.joining.size());
  // Every round is committed (retried exactly), on Gloo and NCCL alike.
  options.commit = true;
  options.payload = wire.payload;
  options.topk = wire.topk;
  options.layout_signature = wire.layout_signature;
  options.check_finite = client_->options().check_finite;
  if (options.contributors == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        ElasticWhere(decision), ": rank ", client_->rank(),
        " is admitted at this step but no live member of its subgroup can give it the "
        "parameters; start the replacement again"));
  }
  return options;
}

absl::StatusOr<RoundRunner::Attempt> RoundRunner::RunAttempt(const Decision& decision,
                                                             const Device& device,
                                                             absl::Span<const TensorView> tensors,
                                                             RoundWire wire, bool hand_over) {
  MODELAVG_ASSIGN_OR_RETURN(RoundOptions options, ElasticOptions(decision, wire));
  // A paced round: this attempt's decision (a retry's members and weights may differ) weighs
  // the unscaled `tensors` into a copy, which the round runs on (round_weights.h).
  WeightedInput weighted(device_);
  absl::StatusOr<absl::Span<const TensorView>> weighed =
      weighted.For(decision, client_->rank(), tensors, wire.weigh);
  if (!weighed.ok()) return Annotate(weighed.status(), ElasticWhere(decision));
  const absl::Span<const TensorView> round_tensors = *weighed;
  Attempt tried;
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
  if (!comm.ok()) {
    tried.status = comm.status();
    client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
    return tried;
  }
  tried.comm = *comm;
  // An admission hands the replacements the outer state first (their part of this step's
  // round needs it); a failure there is a failure of the round, retried the same way.
  if (hand_over && !decision.joining.empty()) {
    tried.status = hooks_.hand_over(decision, tried.comm, tensors);
    tried.in_hand_over = !tried.status.ok();
  }
  const int64_t sent_before = tried.comm->bytes_sent();
  absl::Status finished;
  if (tried.status.ok()) {
    tried.status = tried.comm->AllReduceAverage(round_tensors, options, &tried.outcome);
    // Committed: the weighted mean becomes the caller's. A round kept aside (its confirmation
    // lost) is adopted into `tensors` directly (AdoptLostCommit): the layout is the same.
    if (tried.status.ok()) finished = weighted.Finish(tensors);
  }
  traffic_->AddBytes(decision.level, tried.comm->bytes_sent() - sent_before);
  client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
  // The round committed but its result could not be copied out of the device's copy: a device
  // failure, not a peer's, which no retry of the round would mend.
  if (!finished.ok()) return Annotate(finished, ElasticWhere(decision));
  return tried;
}

Decision RoundRunner::Commit(const Decision& decision, int attempt) {
  const bool joining =
      std::binary_search(decision.joining.begin(), decision.joining.end(), client_->rank());
  if (attempt > 1 || joining) {
    spdlog::info("{}: averaged with ranks {}{}", ElasticWhere(decision),
                 absl::StrJoin(decision.Members(), ","),
                 joining ? " (admitted: received the parameters)" : "");
  }
  // Older generations' communicators are of no use any more.
  client_->communicators()->DropBefore(decision.generation);
  return decision;
}

absl::StatusOr<Decision> RoundRunner::MoveOn(int64_t generation, int64_t step) {
  // The wait ends as soon as this rank hears of the change; its bound only matters when the
  // job does not move on (a transport failure with every member alive).
  MODELAVG_RETURN_IF_ERROR(client_->AwaitNewerGeneration(generation, RetryWait()));
  MODELAVG_RETURN_IF_ERROR(EnterNewerGeneration());
  return client_->DecisionAt(step);
}

absl::StatusOr<Decision> RoundRunner::MoveOnAfterFailure(const Decision& failed,
                                                         const absl::Status& why) {
  // Wait for the job to move on without the failed member (its death is declared within the
  // heartbeat timeout). If it does not move on in time, the call fails with the round's error.
  absl::StatusOr<Decision> next = MoveOn(failed.generation, failed.step);
  if (next.ok()) return next;
  if (absl::IsDeadlineExceeded(next.status())) return Annotate(why, ElasticWhere(failed));
  // The kind of the reason (a lost replica, a moved generation) goes with it.
  return Restate(next.status(),
                 absl::StrCat(ElasticWhere(failed), " failed: ", next.status().message(),
                              " (round: ", why.message(), ")"));
}

absl::StatusOr<bool> RoundRunner::PeerCompletedAttempt(const Decision& failed, Decision* next,
                                                       int* attempt) {
  // If any live member completed the round, every member holds its result (the commit phase).
  absl::StatusOr<bool> completed = client_->PeerCompletedRound(*next, failed.generation);
  // ABORTED: the job moved on while a note was awaited; FAILED_PRECONDITION: before (a stale
  // generation). Either way: read the notes again in the newer generation.
  while (!completed.ok() &&
         (absl::IsAborted(completed.status()) ||
          absl::IsFailedPrecondition(completed.status())) &&
         *attempt < kMaxElasticAttempts) {
    ++*attempt;
    const int64_t read_in = next->generation;
    absl::StatusOr<Decision> again = MoveOn(read_in, failed.step);
    if (!again.ok()) {
      return Annotate(again.status(), absl::StrCat(ElasticWhere(failed),
                                                   " (round notes of generation ", read_in, ")"));
    }
    *next = *std::move(again);
    completed = client_->PeerCompletedRound(*next, failed.generation);
  }
  if (!completed.ok()) return Annotate(completed.status(), ElasticWhere(*next));
  return *completed;
}

absl::Status RoundRunner::AdoptLostCommit(const Decision& decision, const Attempt& tried,
                                          absl::Span<const TensorView> tensors) {
  if (tried.outcome != RoundOutcome::kFailedHoldingResult || tried.comm == nullptr) {
    return absl::InternalError(absl::StrCat(
        ElasticWhere(decision), ": a peer completed the round but this rank holds no result (",
        tried.status.message(), "); restore a checkpoint"));
  }
  MODELAVG_RETURN_IF_ERROR(
      Annotate(tried.comm->AdoptPendingResult(tensors), ElasticWhere(decision)));
  client_->RecordRound(decision.level, decision.step, decision.generation,
                       RoundOutcome::kCompleted);
  spdlog::info("{}: the round completed on a peer before the failure ({}); its result is kept",
               ElasticWhere(decision), std::string(tried.status.message()));
  return absl::OkStatus();
}

}  // namespace modelavg::client
