#include "client/base/error_kind.h"

#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace modelavg::client {
namespace {

// The payload is "<kind>,<peer>" in decimal: tiny, and readable in a debugger.
struct Parsed {
  ErrorKind kind = ErrorKind::kUnknown;
  int32_t peer = -1;
};

Parsed Parse(const absl::Status& status) {
  Parsed p;
  if (status.ok()) return p;
  auto payload = status.GetPayload(kErrorKindPayloadUrl);
  if (!payload.has_value()) return p;
  const std::string text(*payload);
  std::pair<std::string, std::string> parts = absl::StrSplit(text, absl::MaxSplits(',', 1));
  int kind = 0;
  int32_t peer = -1;
  if (!absl::SimpleAtoi(parts.first, &kind) || kind < 0 ||
      kind > static_cast<int>(ErrorKind::kReplicaLost)) {
    return p;
  }
  if (!parts.second.empty() && !absl::SimpleAtoi(parts.second, &peer)) peer = -1;
  p.kind = static_cast<ErrorKind>(kind);
  p.peer = peer;
  return p;
}

}  // namespace

absl::Status SetErrorKind(absl::Status status, ErrorKind kind, int32_t peer) {
  if (status.ok()) return status;
  status.SetPayload(kErrorKindPayloadUrl,
                    absl::Cord(absl::StrCat(static_cast<int>(kind), ",", peer)));
  return status;
}

ErrorKind ErrorKindOf(const absl::Status& status) { return Parse(status).kind; }

int32_t ErrorPeerOf(const absl::Status& status) { return Parse(status).peer; }

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
  }
  return "unknown";
}

}  // namespace modelavg::client
