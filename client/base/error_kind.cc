#include "client/base/error_kind.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace modelavg::client {
namespace {

// The payload is "<kind>,<peer>,<rank>" in decimal: tiny, and readable in a debugger.
struct Parsed {
  ErrorKind kind = ErrorKind::kUnknown;
  int32_t peer = -1;
  int32_t rank = -1;
};

Parsed Parse(const absl::Status& status) {
  Parsed p;
  if (status.ok()) return p;
  auto payload = status.GetPayload(kErrorKindPayloadUrl);
  if (!payload.has_value()) return p;
  const std::string text(*payload);
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  int kind = 0;
  if (!absl::SimpleAtoi(parts[0], &kind) || kind < 0 ||
      kind > static_cast<int>(ErrorKind::kNonFinite)) {
    return p;
  }
  p.kind = static_cast<ErrorKind>(kind);
  if (parts.size() > 1 && !absl::SimpleAtoi(parts[1], &p.peer)) p.peer = -1;
  if (parts.size() > 2 && !absl::SimpleAtoi(parts[2], &p.rank)) p.rank = -1;
  return p;
}

}  // namespace

absl::Status SetErrorKind(absl::Status status, ErrorKind kind, int32_t peer, int32_t rank) {
  if (status.ok()) return status;
  status.SetPayload(kErrorKindPayloadUrl,
                    absl::Cord(absl::StrCat(static_cast<int>(kind), ",", peer, ",", rank)));
  return status;
}

ErrorKind ErrorKindOf(const absl::Status& status) { return Parse(status).kind; }

int32_t ErrorPeerOf(const absl::Status& status) { return Parse(status).peer; }

int32_t ErrorRankOf(const absl::Status& status) { return Parse(status).rank; }

absl::string_view ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUnknown:
      return "unknown";
    case ErrorKind::kRoundMismatch:
      return "round mismatch";
    case ErrorKind::kPeerFailure:
      return "peer failure";
    case ErrorKind::kGenerationMoved:
      return "generation moved";
    case ErrorKind::kLayoutMismatch:
      return "layout mismatch";
    case ErrorKind::kStrayConnection:
      return "stray connection";
    case ErrorKind::kTimeout:
      return "timeout";
    case ErrorKind::kReplicaLost:
      return "replica lost";
    case ErrorKind::kNonFinite:
      return "non finite";
  }
  return "unknown";
}

// The payload is "<rank>,<step>,<level>,<tensor>,<value>".
absl::Status SetNonFiniteDetail(absl::Status status, const NonFiniteDetail& detail) {
  if (status.ok()) return status;
  status.SetPayload(kNonFinitePayloadUrl,
                    absl::Cord(absl::StrCat(detail.rank, ",", detail.step, ",", detail.level,
                                            ",", detail.tensor, ",", detail.value)));
  return status;
}

std::optional<NonFiniteDetail> NonFiniteDetailOf(const absl::Status& status) {
  if (status.ok()) return std::nullopt;
  auto payload = status.GetPayload(kNonFinitePayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  std::vector<std::string> parts = absl::StrSplit(std::string(*payload), ',');
  NonFiniteDetail d;
  if (parts.size() != 5 || !absl::SimpleAtoi(parts[0], &d.rank) ||
      !absl::SimpleAtoi(parts[1], &d.step) || !absl::SimpleAtoi(parts[2], &d.level) ||
      !absl::SimpleAtoi(parts[3], &d.tensor)) {
    return std::nullopt;
  }
  d.value = parts[4];
  return d;
}

}  // namespace modelavg::client
