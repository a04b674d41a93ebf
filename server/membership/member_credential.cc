#include "server/membership/member_credential.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <cstdlib>

#include "absl/strings/escaping.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {

std::string NewMemberCredential() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    // No randomness: handing out guessable credentials would be worse than stopping.
    spdlog::critical("the system's random number generator failed; cannot issue credentials");
    std::abort();
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

std::string CredentialDigest(absl::string_view credential) {
  if (credential.empty()) return "";
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(credential.data()), credential.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

bool CredentialMatches(absl::string_view credential, absl::string_view digest) {
  if (credential.empty() || digest.empty()) return false;
  const std::string got = CredentialDigest(credential);
  return got.size() == digest.size() && CRYPTO_memcmp(got.data(), digest.data(), got.size()) == 0;
}

}  // namespace modelavg::server
