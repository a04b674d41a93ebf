// What kind of failure an error status describes, carried as a payload on the status itself so
// that the code that handles an error branches on its kind, never on its message (the message is
// for people and may change). Set where the error is made; read where it is handled; kept by
// Annotate (common/status_util.h) as the error travels up.
//
//   absl::Status s = SetErrorKind(absl::UnavailableError("..."), ErrorKind::kPeerFailure, 3);
//   if (ErrorKindOf(s) == ErrorKind::kPeerFailure) { int peer = ErrorPeerOf(s); ... }
//
// The Python package raises these as exceptions with the kind and the blamed rank as attributes
// (modelavg.Error.kind, .rank).
#ifndef MODELAVG_CLIENT_BASE_ERROR_KIND_H_
#define MODELAVG_CLIENT_BASE_ERROR_KIND_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace modelavg::client {

enum class ErrorKind : int {
  // No kind attached (an error from elsewhere: the coordinator, the caller's arguments).
  kUnknown = 0,
  // The members of a round were at different steps (a bug in the round agreement).
  kRoundMismatch = 1,
  // A peer's connection broke or the peer stopped answering; ErrorPeerOf names the member
  // index when known.
  kPeerFailure = 2,
  // The job moved to another generation (a death, a re-join, a departure, an admission): the
  // communicator of the old one was aborted.
  kGenerationMoved = 3,
  // The members passed different parameter layouts (element counts or dtypes).
  kLayoutMismatch = 4,
  // Setting up a mesh, a pair's connection was refused, or taken by something that is not a
  // member (a stray connection to a port as it opened) or failed its proof of membership, on
  // every attempt (a single stray only costs the set-up a retry).
  kStrayConnection = 5,
  // A collective or its set-up ran past its deadline.
  kTimeout = 6,
  // Sharded replicas (JobSpec.replica_size): another rank of this rank's replica died, left or
  // failed, so the coordinator retired the whole replica; ErrorRankOf names the lost rank. The
  // replica's workers must restart and re-join together as a replacement replica.
  kReplicaLost = 7,
  // A member's contribution to a round held NaN or Inf (RoundOptions::check_finite): no member
  // kept the round's result. ErrorPeerOf names the member, ErrorRankOf its rank when known, and
  // NonFiniteDetailOf the step, level, tensor and value.
  kNonFinite = 8,
};

// The payload's type URL.
inline constexpr absl::string_view kErrorKindPayloadUrl = "type.modelavg.dev/modelavg.ErrorKind";

// `status` with the kind attached, and the peer (its index among the communicator's members) and
// the rank in the job blamed for it, -1 for none (a generation that moved because rank 3 died:
// kGenerationMoved, rank 3); OK stays OK.
absl::Status SetErrorKind(absl::Status status, ErrorKind kind, int32_t peer = -1,
                          int32_t rank = -1);
// The kind attached to `status`; kUnknown when none is (or it is OK).
ErrorKind ErrorKindOf(const absl::Status& status);
// The peer attached with the kind; -1 when none is.
int32_t ErrorPeerOf(const absl::Status& status);
// The rank attached with the kind; -1 when none is.
int32_t ErrorRankOf(const absl::Status& status);
// "peer failure", "generation moved", ... (for logs).
absl::string_view ErrorKindName(ErrorKind kind);

// Where a kNonFinite error's values were (carried as a payload of its own beside the kind, so
// that the Python package raises it with these as attributes): the rank that contributed them
// (-1: not known yet, e.g. at the communicator, which knows only the member), the round's step
// and level (-1: not known), the first tensor holding a non-finite element (its index in the
// averaging call's list) and what that element held ("NaN", "+Inf", "-Inf").
struct NonFiniteDetail {
  int32_t rank = -1;
  int64_t step = -1;
  int32_t level = -1;
  int32_t tensor = -1;
  std::string value;
};
inline constexpr absl::string_view kNonFinitePayloadUrl = "type.modelavg.dev/modelavg.NonFinite";
// `status` with the detail attached (OK stays OK).
absl::Status SetNonFiniteDetail(absl::Status status, const NonFiniteDetail& detail);
// The detail attached to `status`, if any.
std::optional<NonFiniteDetail> NonFiniteDetailOf(const absl::Status& status);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_BASE_ERROR_KIND_H_
