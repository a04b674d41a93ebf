#include "client/session/round_notes.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/comm/communicator.h"
#include "client/rpc/coordinator_client.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

constexpr char kRoundNotePrefix[] = "round/";

}  // namespace

RoundNotes::RoundNotes(CoordinatorClient& coordinator, const Clock& clock, std::string job_id,
                       int32_t rank, std::string credential, int32_t num_levels,
                       int32_t world_subgroup)
    : coordinator_(coordinator),
      clock_(clock),
      job_id_(std::move(job_id)),
      rank_(rank),
      credential_(std::move(credential)),
      num_levels_(num_levels),
      world_subgroup_(world_subgroup),
      entries_(num_levels) {}

void RoundNotes::Record(int32_t level, int64_t step, int64_t generation, RoundOutcome outcome) {
  absl::MutexLock l(&mu_);
  if (level < 0 || level >= static_cast<int32_t>(entries_.size())) return;
  std::array<Entry, 2>& e = entries_[level];
  const Entry now{step, generation, static_cast<int>(outcome)};
  if (e[0].step == step) {
    e[0] = now;
  } else if (e[1].step == step) {
    e[1] = now;  // an older round settled late (a background all-reduce)
  } else {
    e[1] = e[0];
    e[0] = now;
  }
}

void RoundNotes::Publish(int64_t generation) {
  // "v1" then "level:step:generation:outcome" per level and recorded round.
  std::string blob = "v1";
  {
    absl::MutexLock l(&mu_);
    for (size_t level = 0; level < entries_.size(); ++level) {
      for (const Entry& e : entries_[level]) {
        if (e.step < 0) continue;
        absl::StrAppend(&blob, ";", level, ":", e.step, ":", e.generation, ":", e.outcome);
      }
    }
  }
  v1::PublishCommIdRequest req;
  req.set_job_id(job_id_);
  req.set_generation(generation);
  // The last level's subgroup: every rank this one averages with (its shard) may read it.
  req.set_level(num_levels_ - 1);
  req.set_subgroup(world_subgroup_);
  req.set_key(absl::StrCat(kRoundNotePrefix, rank_));
  req.set_unique_id(blob);
  req.set_rank(rank_);
  req.set_credential(credential_);
  absl::Status s = coordinator_.PublishCommId(req);
  if (!s.ok()) {
    // A newer generation gets a note of its own; otherwise the members that wait for this one
    // see their wait end in an error.
    spdlog::warn("rank {}: publishing the round note of generation {}: {}", rank_, generation,
                 s.ToString());
  }
}

absl::StatusOr<bool> RoundNotes::PeerCompleted(const Decision& decision,
                                               int64_t attempt_generation,
                                               absl::Time deadline) const {
  const int64_t generation = decision.generation;
  for (int32_t peer : decision.Members()) {
    if (peer == rank_ ||
        std::binary_search(decision.joining.begin(), decision.joining.end(), peer)) {
      continue;
    }
    v1::GetCommIdRequest req;
    req.set_job_id(job_id_);
    req.set_generation(generation);
    req.set_level(num_levels_ - 1);
    req.set_subgroup(world_subgroup_);  // the peers hold this rank's shard
    req.set_key(absl::StrCat(kRoundNotePrefix, peer));
    req.set_rank(rank_);
    req.set_credential(credential_);
    req.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - clock_.Now())));
    absl::StatusOr<std::string> blob = coordinator_.GetCommId(req);
    if (!blob.ok()) {
      return Annotate(blob.status(),
                      absl::StrCat("reading rank ", peer, "'s round note of generation ",
                                   generation));
    }
    for (absl::string_view field : absl::StrSplit(*blob, ';')) {
      std::vector<absl::string_view> parts = absl::StrSplit(field, ':');
      int64_t level, step, gen, outcome;
      if (parts.size() != 4 || !absl::SimpleAtoi(parts[0], &level) ||
          !absl::SimpleAtoi(parts[1], &step) || !absl::SimpleAtoi(parts[2], &gen) ||
          !absl::SimpleAtoi(parts[3], &outcome)) {
        continue;
      }
      if (level != decision.level || step != decision.step ||
          outcome != static_cast<int>(RoundOutcome::kCompleted)) {
        continue;
      }
      if (gen != attempt_generation) {
        return absl::InternalError(absl::StrCat(
            "rank ", peer, " completed the round of step ", step, " at level ", level,
            " in generation ", gen, ", this rank attempted it in generation ",
            attempt_generation, "; the round notes contradict each other"));
      }
      spdlog::info("rank {} completed the round of step {} (level {}) before the failure: rank "
                   "{} keeps that result",
                   peer, step, level, rank_);
      return true;
    }
  }
  return false;
}

}  // namespace modelavg::client
