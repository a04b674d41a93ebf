// The rounds of an elastic job (docs/elastic.md): every round committed, a failed one retried
// with the live members of the next generation, a lost confirmation settled from the round notes
// (a live peer that completed the round means this rank keeps the result it holds). The steps of
// ModelAverager::AverageElastic, in the order a round takes them.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator_cache.h"
#include "common/status_util.h"
#include "modelavg/client/averager.h"
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

absl::Duration ModelAverager::RetryWait() const {
  return 2 * client_->heartbeat_timeout() + 2 * client_->options().heartbeat_interval +
         absl::Seconds(2);
}

// What one attempt of an elastic round left: its failure (OK once committed), how far it got
// on this rank, and its communicator (null when none could be set up).
struct ModelAverager::ElasticAttempt {
  absl::Status status;
  RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
  Communicator* comm = nullptr;
};

absl::StatusOr<Decision> ModelAverager::AverageElastic(Decision decision, const Device& device,
                                                       absl::Span<const TensorView> params,
                                                       bool transfer) {
  for (int attempt = 1;; ++attempt) {
    MODELAVG_ASSIGN_OR_RETURN(ElasticAttempt tried,
                              RunElasticAttempt(decision, device, params, transfer));
    if (tried.status.ok()) return CommitElasticRound(decision, attempt);
    if (tried.status.code() == absl::StatusCode::kInvalidArgument ||
        ErrorKindOf(tried.status) == ErrorKind::kRoundMismatch) {
      return Annotate(tried.status, ElasticWhere(decision));
    }
    ReportUnreachablePeersOf(decision, tried.comm, tried.status);
    MODELAVG_ASSIGN_OR_RETURN(Decision next, MoveOnAfterFailure(decision, tried.status));
    MODELAVG_ASSIGN_OR_RETURN(bool completed, PeerCompletedAttempt(decision, &next, &attempt));
    if (completed) {
      MODELAVG_RETURN_IF_ERROR(AdoptLostCommit(decision, tried, params));
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

absl::StatusOr<RoundOptions> ModelAverager::ElasticRoundOptions(const Decision& decision) const {
  const std::vector<int32_t> members = decision.Members();
  if (!std::binary_search(members.begin(), members.end(), client_->rank())) {
    return absl::InternalError(absl::StrCat(ElasticWhere(decision), ": rank ", client_->rank(),
                                            " is not among the round's members"));
  }
  RoundOptions options;
  options.step = decision.step;
  options.contribute =
      !std::binary_search(decision.joining.begin(), decision.joining.end(), client_->rank());
  options.contributors = static_cast<int>(members.size() - decision.joining.size());
  // Every round is committed (retried exactly), on Gloo and NCCL alike.
  options.commit = true;
  options.payload = round_payload_;
  options.layout_signature = round_signature_;
  if (options.contributors == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        ElasticWhere(decision), ": rank ", client_->rank(),
        " is admitted at this step but no live member of its subgroup can give it the "
        "parameters; start the replacement again"));
  }
  return options;
}

absl::StatusOr<ModelAverager::ElasticAttempt> ModelAverager::RunElasticAttempt(
    const Decision& decision, const Device& device, absl::Span<const TensorView> params,
    bool transfer) {
  MODELAVG_ASSIGN_OR_RETURN(RoundOptions options, ElasticRoundOptions(decision));
  ElasticAttempt tried;
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
  if (!comm.ok()) {
    tried.status = comm.status();
    client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
    return tried;
  }
  tried.comm = *comm;
  // An admission hands the replacements the outer state first (their part of this step's
  // round needs it); a failure there is a failure of the round, retried the same way.
  if (transfer) tried.status = TransferOuterState(decision, tried.comm, params);
  const int64_t sent_before = tried.comm->bytes_sent();
  if (tried.status.ok()) {
    tried.status = tried.comm->AllReduceAverage(params, options, &tried.outcome);
  }
  CountBytes(decision.level, tried.comm->bytes_sent() - sent_before);
  client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
  return tried;
}

Decision ModelAverager::CommitElasticRound(const Decision& decision, int attempt) {
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

absl::StatusOr<Decision> ModelAverager::MoveOn(int64_t generation, int64_t step) {
  // The wait ends as soon as this rank hears of the change; its bound only matters when the
  // job does not move on (a transport failure with every member alive).
  MODELAVG_RETURN_IF_ERROR(client_->AwaitNewerGeneration(generation, absl::Now() + RetryWait()));
  MODELAVG_RETURN_IF_ERROR(EnterNewerGeneration());
  return client_->DecisionAt(step);
}

absl::StatusOr<Decision> ModelAverager::MoveOnAfterFailure(const Decision& failed,
                                                           const absl::Status& why) {
  // Wait for the job to move on without the failed member (its death is declared within the
  // heartbeat timeout). If it does not move on in time, the call fails with the round's error.
  absl::StatusOr<Decision> next = MoveOn(failed.generation, failed.step);
  if (next.ok()) return next;
  if (absl::IsDeadlineExceeded(next.status())) return Annotate(why, ElasticWhere(failed));
  return Restate(next.status(),
                 absl::StrCat(ElasticWhere(failed), " failed: ", next.status().message(),
                              " (round: ", why.message(), ")"));
}

absl::StatusOr<bool> ModelAverager::PeerCompletedAttempt(const Decision& failed, Decision* next,
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

absl::Status ModelAverager::AdoptLostCommit(const Decision& decision, const ElasticAttempt& tried,
                                            absl::Span<const TensorView> params) {
  if (tried.outcome != RoundOutcome::kFailedHoldingResult || tried.comm == nullptr) {
    return absl::InternalError(absl::StrCat(
        ElasticWhere(decision), ": a peer completed the round but this rank holds no result (",
        tried.status.message(), "); restore a checkpoint"));
  }
  MODELAVG_RETURN_IF_ERROR(
      Annotate(tried.comm->AdoptPendingResult(params), ElasticWhere(decision)));
  client_->RecordRound(decision.level, decision.step, decision.generation,
                       RoundOutcome::kCompleted);
  spdlog::info("{}: the round completed on a peer before the failure ({}); its result is kept",
               ElasticWhere(decision), std::string(tried.status.message()));
  return absl::OkStatus();
}

}  // namespace modelavg::client
