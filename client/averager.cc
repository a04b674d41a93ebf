#include "client/averager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/communicator_cache.h"
#include "client/error_kind.h"
#include "client/gloo_communicator.h"
#if MODELAVG_HAVE_CUDA
#include "client/nccl_communicator.h"
#endif
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// All host, or all CUDA on one device. INVALID_ARGUMENT naming the first odd tensor otherwise.
absl::StatusOr<Device> CommonDevice(absl::Span<const TensorView> params) {
  if (params.empty()) return Device::Host();
  const Device first = params[0].device;
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorView& t = params[i];
    if (t.device != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " is on ", t.device.ToString(), " but tensor 0 is on ", first.ToString(),
          ": every parameter of one AverageParameters call must be on the same device"));
    }
    if (absl::Status s = ValidateTensorView(i, t); !s.ok()) return s;
  }
  return first;
}

}  // namespace

ModelAverager::ModelAverager(Client* client) : client_(client) {
  // A replacement starts at its admission step (the first call receives the parameters).
  if (client_->admission_step() > 0) step_ = client_->admission_step();
}
ModelAverager::~ModelAverager() = default;

int64_t ModelAverager::step() const {
  absl::MutexLock l(&mu_);
  return step_;
}

void ModelAverager::set_step(int64_t step) {
  if (step < 0) {
    spdlog::warn("set_step({}): steps count from 0; restoring step 0 instead", step);
    step = 0;
  }
  absl::MutexLock l(&mu_);
  step_ = step;
  client_->ReportStep(step_);
}

absl::StatusOr<Decision> ModelAverager::AverageParameters(absl::Span<const TensorView> params) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Decision> result = AverageStep(params);
  // A failed round (not a call refused for its arguments) makes this worker's eventual Leave a
  // failure, which the coordinator counts as a death rather than an orderly departure.
  if (!result.ok() && (!absl::IsInvalidArgument(result.status()) ||
                       ErrorKindOf(result.status()) == ErrorKind::kLayoutMismatch)) {
    client_->RecordFailure(result.status());
  }
  return result;
}

absl::StatusOr<Decision> ModelAverager::AverageStep(absl::Span<const TensorView> params) {
  const int64_t step = step_;
  // Decide, then increment — whatever happens next, like PyTorch.
  ++step_;
  if (client_->elastic()) {
    // Into the generation the job moved to (a shrink, an admission), if any, before deciding.
    absl::Status usable = client_->AdvanceGeneration();
    if (!usable.ok()) {
      client_->ReportStep(step_);
      return Annotate(usable, absl::StrCat("averaging at step ", step));
    }
  }
  absl::StatusOr<Decision> decision = client_->DecisionAt(step);
  client_->ReportStep(step_);
  if (!decision.ok()) return decision.status();
  MODELAVG_ASSIGN_OR_RETURN(Device device, CommonDevice(params));
  if (!decision->average) return *decision;
  if (client_->elastic()) return AverageElastic(*decision, device, params);

  const std::string where = absl::StrCat("averaging at step ", step, " (level ", decision->level,
                                         ", subgroup ", decision->subgroup.index, ")");
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision->subgroup), where));
  CommunicatorSetup setup = Setup(*decision);
  const SubgroupRange group = decision->subgroup;
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(setup, device);
  absl::Status s = comm.ok() ? (*comm)->AllReduceAverage(params) : comm.status();
  if (s.ok()) return *decision;
  if (s.code() == absl::StatusCode::kInvalidArgument) return Annotate(s, where);
  // A transport failure usually means a peer died: give the coordinator up to a heartbeat
  // timeout to say so, so the error names the cause rather than a broken socket.
  const absl::Time until = absl::Now() + client_->heartbeat_timeout() +
                           2 * client_->options().heartbeat_interval + absl::Milliseconds(500);
  while (absl::Now() < until) {
    absl::Status why = client_->CheckCanAverage(group);
    // The collective was aborted for the reason the client gives: say it once.
    if (!why.ok() && ErrorKindOf(s) == ErrorKind::kGenerationMoved) return Annotate(why, where);
    if (!why.ok()) {
      return absl::Status(why.code(), absl::StrCat(where, " failed: ", why.message(),
                                                   " (transport error: ", s.message(), ")"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return Annotate(s, where);
}

absl::Duration ModelAverager::RetryWait() const {
  return 2 * client_->heartbeat_timeout() + 2 * client_->options().heartbeat_interval +
         absl::Seconds(2);
}

CommunicatorSetup ModelAverager::Setup(const Decision& decision) const {
  CommunicatorSetup setup;
  setup.coordinator = client_->coordinator();
  setup.job_id = client_->job_id();
  setup.generation = decision.generation > 0 ? decision.generation : client_->generation();
  setup.level = decision.level;
  setup.subgroup = decision.subgroup;
  setup.members = decision.members;
  setup.rank = client_->rank();
  setup.credential = client_->credential();
  setup.timeout = client_->options().collective_timeout;
  // A committed round needs its backup (ClientOptions::gloo_in_place is for strict jobs).
  setup.gloo_in_place = client_->options().gloo_in_place && !client_->elastic();
  Client* client = client_;
  const SubgroupRange group = decision.subgroup;
  setup.check_alive = [client, group] { return client->CheckCanAverage(group); };
  return setup;
}

absl::StatusOr<Decision> ModelAverager::AverageElastic(Decision decision, const Device& device,
                                                       absl::Span<const TensorView> params) {
  const int64_t step = decision.step;
  const auto where = [&](const Decision& d) {
    return absl::StrCat("averaging at step ", step, " (level ", d.level, ", subgroup ",
                        d.subgroup.index, ", generation ", d.generation, ")");
  };
  // A round lost to a failure is retried in the next generation, at most this many times (each
  // retry needs the job to have moved on: a death, a departure or an admission).
  constexpr int kMaxAttempts = 16;
  // Waits for the job to move on past `generation`, moves this client there and decides `step`
  // in it. The wait ends as soon as this rank hears of the change; its bound only matters when
  // the job does not move on (a transport failure with every member alive).
  const auto move_on = [&](int64_t generation) -> absl::StatusOr<Decision> {
    MODELAVG_RETURN_IF_ERROR(
        client_->AwaitNewerGeneration(generation, absl::Now() + RetryWait()));
    MODELAVG_RETURN_IF_ERROR(client_->AdvanceGeneration());
    return client_->DecisionAt(step);
  };
  for (int attempt = 1;; ++attempt) {
    const std::vector<int32_t> members = decision.Members();
    if (!std::binary_search(members.begin(), members.end(), client_->rank())) {
      return absl::InternalError(absl::StrCat(where(decision), ": rank ", client_->rank(),
                                              " is not among the round's members"));
    }
    const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                            client_->rank());
    RoundOptions options;
    options.step = step;
    options.contribute = !joining;
    options.contributors = static_cast<int>(members.size() - decision.joining.size());
    // Every round is committed (retried exactly), on Gloo and NCCL alike.
    options.commit = true;
    if (options.contributors == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          where(decision), ": rank ", client_->rank(),
          " is admitted at this step but no live member of its subgroup can give it the "
          "parameters; start the replacement again"));
    }
    RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
    absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
    if (comm.ok() && client_->TakeCommitFailureForTesting(step)) {
      spdlog::warn("{}: injecting a lost commit on this rank (test)", where(decision));
      if (auto* gloo = dynamic_cast<GlooCommunicator*>(*comm)) {
        gloo->InjectCommitFailureForTesting();
      }
#if MODELAVG_HAVE_CUDA
      if (auto* nccl = dynamic_cast<NcclCommunicator*>(*comm)) {
        nccl->InjectCommitFailureForTesting();
      }
#endif
    }
    absl::Status s =
        comm.ok() ? (*comm)->AllReduceAverage(params, options, &outcome) : comm.status();
    client_->RecordRound(decision.level, step, decision.generation, outcome);
    if (s.ok()) {
      if (attempt > 1 || joining) {
        spdlog::info("{}: averaged with ranks {}{}", where(decision), absl::StrJoin(members, ","),
                     joining ? " (admitted: received the parameters)" : "");
      }
      // Older generations' communicators are of no use any more.
      client_->communicators()->DropBefore(decision.generation);
      return decision;
    }
    if (s.code() == absl::StatusCode::kInvalidArgument ||
        ErrorKindOf(s) == ErrorKind::kRoundMismatch) {
      return Annotate(s, where(decision));
    }
    // The round failed: wait for the job to move on without the failed member (its death is
    // declared within the heartbeat timeout), then settle the round in the new generation. If
    // the job does not move on in time, the call fails with the round's error.
    absl::StatusOr<Decision> next = move_on(decision.generation);
    if (!next.ok()) {
      if (absl::IsDeadlineExceeded(next.status())) return Annotate(s, where(decision));
      return absl::Status(next.status().code(),
                          absl::StrCat(where(decision), " failed: ", next.status().message(),
                                       " (round: ", s.message(), ")"));
    }
    // If any live member completed the round, every member holds its result (the commit
    // phase): keep it. Otherwise nobody kept it: retry with the live members.
    absl::StatusOr<bool> completed = client_->PeerCompletedRound(*next, decision.generation);
    // ABORTED: the job moved on while a note was awaited; FAILED_PRECONDITION: before (a stale
    // generation). Either way: read the notes again in the newer generation.
    while (!completed.ok() &&
           (absl::IsAborted(completed.status()) ||
            absl::IsFailedPrecondition(completed.status())) &&
           attempt < kMaxAttempts) {
      ++attempt;
      const int64_t read_in = next->generation;
      next = move_on(read_in);
      if (!next.ok()) {
        return Annotate(next.status(), absl::StrCat(where(decision), " (round notes of generation ",
                                                    read_in, ")"));
      }
      completed = client_->PeerCompletedRound(*next, decision.generation);
    }
    if (!completed.ok()) return Annotate(completed.status(), where(*next));
    if (*completed) {
      if (outcome != RoundOutcome::kFailedHoldingResult || !comm.ok()) {
        return absl::InternalError(absl::StrCat(
            where(decision), ": a peer completed the round but this rank holds no result (",
            s.message(), "); restore a checkpoint"));
      }
      MODELAVG_RETURN_IF_ERROR(Annotate((*comm)->AdoptPendingResult(params), where(decision)));
      client_->RecordRound(decision.level, step, decision.generation, RoundOutcome::kCompleted);
      spdlog::info("{}: the round completed on a peer before the failure ({}); its result is "
                   "kept",
                   where(decision), std::string(s.message()));
      return decision;
    }
    if (attempt >= kMaxAttempts) {
      return Annotate(s, absl::StrCat(where(decision), " (", attempt, " attempts)"));
    }
    spdlog::warn("{} failed ({}); retrying in generation {} with ranks {}", where(decision),
                 std::string(s.message()), next->generation, absl::StrJoin(next->Members(), ","));
    decision = *std::move(next);
  }
}

absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> PeriodicModelAverager::Create(
    Client* client) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kPeriodic) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is HIERARCHICAL: use HierarchicalModelAverager (or create the job with mode "
        "PERIODIC)"));
  }
  return std::unique_ptr<PeriodicModelAverager>(new PeriodicModelAverager(client));
}

absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> HierarchicalModelAverager::Create(
    Client* client) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kHierarchical) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is PERIODIC: use PeriodicModelAverager (or create the job with mode HIERARCHICAL)"));
  }
  return std::unique_ptr<HierarchicalModelAverager>(new HierarchicalModelAverager(client));
}

}  // namespace modelavg::client
