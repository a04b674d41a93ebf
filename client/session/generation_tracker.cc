#include "client/session/generation_tracker.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/base/error_kind.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

GenerationTracker::GenerationTracker(Options options, int64_t generation,
                                     std::string incarnation)
    : options_(std::move(options)),
      generation_(generation),
      view_(MembershipView::Initial(generation, options_.reader.world_size)),
      latest_generation_(generation),
      incarnation_(std::move(incarnation)) {}

void GenerationTracker::Admit(MembershipView view) {
  generation_ = view.generation;
  latest_generation_ = std::max(latest_generation_, view.generation);
  view_ = std::move(view);
}

std::string GenerationTracker::ChangeReason(const v1::HeartbeatResponse& reply) {
  if (!reply.has_last_change() || reply.last_change().reason().empty()) {
    return "membership changed";
  }
  std::string why = reply.last_change().reason();
  const std::string who = absl::StrCat("rank ", reply.last_change().rank());
  if (reply.last_change().rank() >= 0 && !absl::StrContains(why, who)) {
    absl::StrAppend(&why, " (", who, ")");
  }
  return why;
}

GenerationTracker::Abort GenerationTracker::OnGenerationChange(
    int64_t generation, const std::string& why, int32_t blamed_rank,
    const absl::StatusOr<v1::Job>& job) {
  const std::string& job_id = options_.job_id;
  const int32_t rank = options_.reader.rank;
  const int32_t world_size = options_.reader.world_size;
  if (generation <= latest_generation_ && !broken_.ok()) return {};
  if (options_.elastic && absl::IsUnavailable(job.status())) {
    // The coordinator answered the beat but cannot give the job's record now (a leader that has
    // just lost etcd, a take-over): whether this rank is among the live members is unknown, so
    // nothing is concluded and nothing is noted. The generation stays news (IsNews), and the
    // next reply asks again.
    spdlog::warn("job {} moved to generation {}, but its record cannot be read now ({}); asking "
                 "again at the next heartbeat reply",
                 job_id, generation, std::string(job.status().message()));
    return {};
  }
  latest_generation_ = std::max(latest_generation_, generation);
  change_reason_ = why;
  if (options_.elastic && job.ok()) {
    // An elastic job goes on with its live members: this rank follows it into the new
    // generation if it is one of them. Its collectives of older generations are aborted (a
    // round in flight is retried there, see ModelAverager).
    std::string gone;
    int32_t retired_by = -1;
    std::optional<MembershipView> view = ViewOf(*job, options_.reader, &gone, &retired_by);
    if (view.has_value()) {
      latest_generation_ = std::max(latest_generation_, view->generation);
      const int64_t known = follow_.has_value() ? follow_->generation : generation_;
      if (view->generation <= known) return {};
      std::vector<int32_t> vacant;
      for (int32_t r = 0; r < world_size; ++r) {
        if (!view->live[r]) vacant.push_back(r);
      }
      spdlog::info("job {} moved to generation {} ({}); rank {} goes on with the live members "
                   "(vacant ranks: {})",
                   job_id, view->generation, why, rank,
                   vacant.empty() ? std::string("none") : absl::StrJoin(vacant, ","));
      const absl::Status retried = absl::AbortedError(
          absl::StrCat("job ", job_id, " moved to generation ", view->generation, " (", why,
                       "): a round of an older generation is retried with its live members"));
      Abort abort{view->generation,
                  SetErrorKind(retried, ErrorKind::kGenerationMoved, /*peer=*/-1, blamed_rank)};
      follow_ = *std::move(view);
      return abort;
    }
    if (!broken_.ok()) return {};
    // Sharded replicas: this rank's replica lost a rank and was retired (its own kind, naming
    // the lost rank).
    broken_ = SetErrorKind(
        absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " moved from generation ", generation_, " to ", job->generation(),
            " (", why, "); rank ", rank, " cannot average any more: ", gone)),
        retired_by >= 0 ? ErrorKind::kReplicaLost : ErrorKind::kGenerationMoved, /*peer=*/-1,
        retired_by >= 0 ? retired_by : blamed_rank);
    spdlog::error("{}", std::string(broken_.message()));
    return {job->generation(), broken_};
  }
  // Without the job's record, every communicator counts as broken.
  Departures departures;
  departures.hard = true;
  if (job.ok()) departures = DeparturesOf(*job, generation_, world_size);
  if (departures.hard && broken_.ok()) {
    broken_ = SetErrorKind(
        absl::FailedPreconditionError(absl::StrCat(
            "job ", job_id, " moved from generation ", generation_, " to ", generation,
            " because ", why, "; this rank's communicators are stale: connect a new Client to "
            "re-join (or restart the job)")),
        ErrorKind::kGenerationMoved, /*peer=*/-1, blamed_rank);
    spdlog::error("{}", std::string(broken_.message()));
    return {generation, broken_};
  }
  departed_ = std::move(departures.left);
  spdlog::info("job {} moved to generation {} ({}); ranks that left: {}", job_id, generation, why,
               absl::StrJoin(departed_, ","));
  return {};
}

void GenerationTracker::OnReply(const v1::HeartbeatResponse& reply, absl::Time now) {
  if (reply.recovery_grace_ms() > 0) {
    recovery_until_ =
        std::max(recovery_until_, now + absl::Milliseconds(reply.recovery_grace_ms()));
  }
  const std::string& incarnation = reply.coordinator_incarnation();
  const bool restarted = !incarnation.empty() && incarnation != incarnation_;
  // This rank joined generation_ once it was complete (RUNNING); only a new generation can be
  // PENDING again. The same generation PENDING means the coordinator lost the job's state and
  // has the job afresh (e.g. from its jobs file): it knows nothing of this rank.
  if (reply.generation() == generation_ && reply.state() == v1::PENDING && broken_.ok()) {
    broken_ = absl::FailedPreconditionError(absl::StrCat(
        "the coordinator that now answers at ", options_.coordinator, " (incarnation ",
        incarnation.empty() ? "unknown" : incarnation, ", this rank joined under ",
        incarnation_.empty() ? "unknown" : incarnation_, ") has job ", options_.job_id,
        " afresh, without this rank: it restarted without the job's state (run it with "
        "--state_dir); restart the workers"));
    spdlog::error("{}", std::string(broken_.message()));
  } else if (restarted) {
    spdlog::warn("coordinator {} restarted (incarnation {} -> {}); rank {} re-attached to job {} "
                 "in generation {}",
                 options_.coordinator, incarnation_.empty() ? "unknown" : incarnation_,
                 incarnation, options_.reader.rank, options_.job_id, reply.generation());
  }
  if (restarted) incarnation_ = incarnation;
}

bool GenerationTracker::OnRefusal(const absl::Status& error) {
  if (absl::IsPermissionDenied(error)) {
    // The rank has another member now (this one was declared dead and replaced).
    Break(absl::FailedPreconditionError(absl::StrCat(
        "the coordinator no longer counts this worker as rank ", options_.reader.rank,
        " of job ", options_.job_id, " (", error.message(), "); connect a new Client to re-join")));
    return true;
  }
  if (absl::IsNotFound(error)) {
    // Only a coordinator that answers can say the job is unknown: it lost or never had it.
    Break(absl::FailedPreconditionError(absl::StrCat(
        "job ", options_.job_id, " is unknown to the coordinator that now answers at ",
        options_.coordinator, " (this rank joined under incarnation ",
        incarnation_.empty() ? "unknown" : incarnation_,
        "): it restarted without the job's state (run it with --state_dir) or the job was "
        "deleted; create the job again and restart the workers (",
        error.message(), ")")));
    return true;
  }
  return false;
}

bool GenerationTracker::Break(absl::Status why) {
  if (!broken_.ok()) return false;  // The first reason stands.
  broken_ = std::move(why);
  spdlog::error("{}", std::string(broken_.message()));
  return true;
}

bool GenerationTracker::MarkLeft() {
  if (left_) return false;
  left_ = true;
  if (broken_.ok()) {
    broken_ = absl::FailedPreconditionError(
        absl::StrCat("rank ", options_.reader.rank, " left job ", options_.job_id,
                     "; connect a new Client to take part again"));
  }
  return true;
}

absl::Status GenerationTracker::CheckRetiredAt(int64_t step) {
  if (!options_.elastic || step < view_.until[options_.reader.rank]) return absl::OkStatus();
  // Sharded replicas: this rank's replica was retired after a mate left (it finished the steps
  // the mate started).
  if (broken_.ok()) {
    broken_ = SetErrorKind(absl::FailedPreconditionError(
                               absl::StrCat("averaging at step ", step, ": ", view_.retired_why)),
                           ErrorKind::kReplicaLost, /*peer=*/-1, view_.retired_by);
  }
  return broken_;
}

Decision GenerationTracker::Decide(Decision d, int64_t step) const {
  d.generation = generation_;
  if (!options_.elastic || !d.average) return d;
  if (d.round >= 0) return DecidePaced(std::move(d));
  // The members of this generation that average at this step: live, admitted by then, and not
  // retired by then (sharded replicas: the mates of a rank that left finish its steps).
  d.members.clear();
  d.joining.clear();
  for (int32_t r : d.subgroup.Ranks()) {
    if (!view_.live[r] || (view_.admitted[r] >= 0 && view_.admitted[r] > step) ||
        step >= view_.until[r]) {
      continue;
    }
    d.members.push_back(r);
    if (view_.admitted[r] == step) d.joining.push_back(r);
  }
  return d;
}

Decision GenerationTracker::DecidePaced(Decision d) const {
  // A paced round's members sync at their own steps (docs/paced.md): the coordinator decided
  // who is a member, and who joins, at each one's own step; this rank's step says nothing of
  // theirs. What this generation changes is who is alive: a member that died since is left out,
  // with its weight (the others' weights, their own steps' work, stay).
  const std::vector<int32_t> members = d.Members();
  const bool weighted = d.weights.size() == members.size();
  std::vector<int32_t> kept, joining;
  std::vector<double> weights;
  for (size_t i = 0; i < members.size(); ++i) {
    const int32_t r = members[i];
    if (r < 0 || r >= static_cast<int32_t>(view_.live.size()) || !view_.live[r]) continue;
    kept.push_back(r);
    if (weighted) weights.push_back(d.weights[i]);
    if (std::binary_search(d.joining.begin(), d.joining.end(), r)) joining.push_back(r);
  }
  d.members = std::move(kept);
  d.joining = std::move(joining);
  if (weighted) d.weights = std::move(weights);
  return d;
}

absl::Status GenerationTracker::CheckUsable() const {
  if (!broken_.ok()) return broken_;
  if (latest_generation_ != generation_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", options_.job_id, " moved from generation ", generation_, " to ",
                     latest_generation_, " (", change_reason_, ")"));
  }
  return absl::OkStatus();
}

absl::Status GenerationTracker::CheckCanAverage(const SubgroupRange& group) const {
  if (!broken_.ok()) return broken_;
  // An elastic job's client follows the generations it is carried into (Advance).
  if (options_.elastic || latest_generation_ == generation_) return absl::OkStatus();
  for (int32_t r : departed_) {
    if (group.Contains(r)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot average with ranks ", group.Describe(), ": rank ", r, " left job ",
          options_.job_id, " (generation ", generation_, " -> ", latest_generation_, ": ",
          change_reason_, "); connect a new Client to re-join"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerationTracker::Move> GenerationTracker::Advance() {
  if (!broken_.ok()) return broken_;
  Move move{generation_, generation_};
  if (!follow_.has_value()) return move;
  move.to = follow_->generation;
  view_ = *std::move(follow_);
  follow_.reset();
  generation_ = move.to;
  return move;
}

bool GenerationTracker::NewerThan(int64_t generation) const {
  return generation_ > generation || (follow_.has_value() && follow_->generation > generation);
}

std::optional<absl::Time> GenerationTracker::ExtendWait(AwaitWindow& wait, absl::Time now,
                                                        absl::Time deadline,
                                                        absl::Duration outage_length) const {
  if (outage_length > absl::ZeroDuration()) {
    wait.outage_seen = true;
    return now + kLookAgain;
  }
  absl::Time next = recovery_until_ + wait.window;
  if (wait.outage_seen) next = std::max(next, now + wait.window);
  wait.outage_seen = false;
  if (next <= deadline) return std::nullopt;
  return next;
}

}  // namespace modelavg::client
