// Per-member credentials: Join hands each member a secret for its membership; every call that
// acts as that rank (Heartbeat, HeartbeatStream, PublishCommId, GetCommId, Leave) presents it.
// The coordinator keeps (and stores) only a digest of it, so a copy of its state cannot be used
// to act as a member. Never logged.
#ifndef MODELAVG_SERVER_MEMBERSHIP_MEMBER_CREDENTIAL_H_
#define MODELAVG_SERVER_MEMBERSHIP_MEMBER_CREDENTIAL_H_

#include <string>

#include "absl/strings/string_view.h"

namespace modelavg::server {

// A fresh credential: 32 hex digits (128 bits from the system's CSPRNG).
std::string NewMemberCredential();

// The digest kept of a credential (SHA-256, hex). Empty for an empty credential.
std::string CredentialDigest(absl::string_view credential);

// True when `credential` is the one whose digest is `digest` (compared in constant time).
// False for an empty credential or digest.
bool CredentialMatches(absl::string_view credential, absl::string_view digest);

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_MEMBER_CREDENTIAL_H_
