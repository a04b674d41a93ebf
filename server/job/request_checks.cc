#include "server/job/request_checks.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/printable.h"

namespace modelavg::server {
namespace {

constexpr size_t kMaxWorkerIdLength = 256;
constexpr size_t kMaxHostLength = 256;

}  // namespace

absl::Status CheckRank(int32_t rank, int32_t world_size, const std::string& job_id) {
  if (rank >= 0 && rank < world_size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", rank, " is outside [0, ", world_size, ") for job ", job_id));
}

absl::Status CheckStep(int64_t step) {
  if (step >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("step must be >= 0, got ", step));
}

absl::Status CheckJoinRequest(const v1::JoinRequest& request, int32_t world_size,
                              const std::string& job_id) {
  if (request.worker_id().empty()) {
    return absl::InvalidArgumentError(
        "worker_id must not be empty; use a stable identity such as \"host:pid\"");
  }
  if (request.worker_id().size() > kMaxWorkerIdLength || request.host().size() > kMaxHostLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id and host must be at most ", kMaxWorkerIdLength, " characters"));
  }
  constexpr size_t kMaxJoinNonceLength = 128;
  if (request.join_nonce().size() > kMaxJoinNonceLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join_nonce must be at most ", kMaxJoinNonceLength, " characters; got ",
        request.join_nonce().size(), " (a random value of 16 bytes, in hex, is plenty)"));
  }
  // Both are shown to operators (the modelavg CLI's tables, the logs): a control character
  // there could drive their terminal.
  for (const auto& [field, value] : {std::pair<const char*, const std::string&>{
                                         "worker_id", request.worker_id()},
                                     {"host", request.host()}}) {
    if (const size_t at = FindControlCharacter(value); at != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " \"", EscapeControlCharacters(value),
          "\" has a control character or a bidirectional formatting character (byte ", at,
          "); use printable characters only, such as \"host:pid\""));
    }
  }
  if (request.world_size() != 0 && request.world_size() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the worker expects world_size ", request.world_size(), " but job ", job_id,
        " has world_size ", world_size, "; start every worker with world_size ", world_size,
        " or join a job of that size"));
  }
  if (request.has_rank()) {
    if (absl::Status s = CheckRank(request.rank(), world_size, job_id); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.message(), "; ask for a rank below world_size or leave rank unset"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCommRequest(const Schedule& schedule, int32_t level, int32_t subgroup,
                              int32_t rank, const std::string& key, const std::string& job_id) {
  if (level < 0 || level >= schedule.num_levels()) {
    return absl::InvalidArgumentError(absl::StrCat("level ", level, " is outside [0, ",
                                                   schedule.num_levels(), ") for job ", job_id));
  }
  const int32_t groups = schedule.NumSubgroups(level);
  if (subgroup < 0 || subgroup >= groups) {
    return absl::InvalidArgumentError(absl::StrCat("subgroup ", subgroup, " is outside [0, ",
                                                   groups, ") at level ", level, " of job ",
                                                   job_id));
  }
  if (absl::Status s = CheckRank(rank, schedule.world_size(), job_id); !s.ok()) return s;
  if (key.size() > kMaxCommIdKeyLength) {
    return absl::InvalidArgumentError(absl::StrCat("key is ", key.size(),
                                                   " characters; at most ", kMaxCommIdKeyLength,
                                                   " are allowed"));
  }
  return absl::OkStatus();
}

absl::Status CheckCommIdBlob(const std::string& unique_id) {
  if (unique_id.empty()) return absl::InvalidArgumentError("unique_id must not be empty");
  if (unique_id.size() > kMaxCommIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("unique_id is ", unique_id.size(),
                                                   " bytes; at most ", kMaxCommIdBytes,
                                                   " are allowed"));
  }
  return absl::OkStatus();
}

absl::Status CheckPeerReport(const v1::ReportPeerFailureRequest& request, int32_t world_size,
                             const std::string& job_id) {
  if (absl::Status s = CheckRank(request.rank(), world_size, job_id); !s.ok()) return s;
  for (const auto* list : {&request.unreachable_ranks(), &request.reachable_ranks()}) {
    if (list->size() > world_size) {
      return absl::InvalidArgumentError(absl::StrCat("a peer failure report names ",
                                                     list->size(), " ranks; job ", job_id,
                                                     " has ", world_size));
    }
    for (int32_t r : *list) {
      if (r < 0 || r >= world_size) {
        return absl::InvalidArgumentError(absl::StrCat("the peer failure report names rank ", r,
                                                       ", outside [0, ", world_size,
                                                       ") for job ", job_id));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNonFiniteReport(const v1::ReportNonFiniteRequest& request,
                                  const Schedule& schedule, const std::string& job_id) {
  if (absl::Status s = CheckRank(request.rank(), schedule.world_size(), job_id); !s.ok()) {
    return s;
  }
  const int levels = static_cast<int>(schedule.spec().levels.size());
  if (request.step() < 0 || request.level() < 0 || request.level() >= levels ||
      request.tensor() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a non-finite report needs step >= 0, level in [0, ", levels, ") and tensor >= 0; got "
        "step ", request.step(), ", level ", request.level(), ", tensor ", request.tensor(),
        " for job ", job_id));
  }
  if (request.value() != "NaN" && request.value() != "+Inf" && request.value() != "-Inf") {
    return absl::InvalidArgumentError(absl::StrCat(
        "a non-finite report's value is \"NaN\", \"+Inf\" or \"-Inf\"; got \"",
        EscapeControlCharacters(request.value().substr(0, 16)), "\""));
  }
  if (request.payload().size() > kMaxNonFinitePayloadLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a non-finite report's payload is at most ", kMaxNonFinitePayloadLength,
        " characters; got ", request.payload().size()));
  }
  return absl::OkStatus();
}

}  // namespace modelavg::server
