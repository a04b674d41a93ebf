#include "client/comm/gloo/pair_proof.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace modelavg::client {
namespace {

constexpr absl::string_view kLabel = "modelavg gloo pair proof v1";

void AppendRank(std::string* out, int rank) {
  const uint32_t r = static_cast<uint32_t>(rank);
  for (int b = 0; b < 4; ++b) out->push_back(static_cast<char>((r >> (8 * b)) & 0xFF));
}

}  // namespace

absl::StatusOr<std::string> SecureRandomBytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    return absl::InternalError(
        "OpenSSL's random generator could not supply the Gloo pair keys and nonces (RAND_bytes "
        "failed: the system's entropy source is unavailable)");
  }
  return out;
}

std::string PairSecret(int a, absl::string_view key_a, int b, absl::string_view key_b) {
  return a < b ? absl::StrCat(key_a, key_b) : absl::StrCat(key_b, key_a);
}

absl::StatusOr<std::string> PairProof(absl::string_view secret, int prover, int verifier,
                                      absl::string_view verifier_nonce,
                                      absl::string_view prover_nonce) {
  if (secret.size() != 2 * kPairKeyBytes || verifier_nonce.size() != kPairNonceBytes ||
      prover_nonce.size() != kPairNonceBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a Gloo pair proof needs a ", 2 * kPairKeyBytes, "-byte secret and ", kPairNonceBytes,
        "-byte nonces; got ", secret.size(), ", ", verifier_nonce.size(), " and ",
        prover_nonce.size(), " bytes"));
  }
  std::string message(kLabel);
  AppendRank(&message, prover);
  AppendRank(&message, verifier);
  message.append(verifier_nonce.data(), verifier_nonce.size());
  message.append(prover_nonce.data(), prover_nonce.size());
  std::string out(EVP_MAX_MD_SIZE, '\0');
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(),
           reinterpret_cast<unsigned char*>(out.data()), &len) == nullptr ||
      len != kPairProofBytes) {
    return absl::InternalError("OpenSSL's HMAC-SHA256 failed computing a Gloo pair proof");
  }
  out.resize(len);
  return out;
}

bool CheckPairProof(absl::string_view secret, int prover, int verifier,
                    absl::string_view verifier_nonce, absl::string_view prover_nonce,
                    absl::string_view proof) {
  absl::StatusOr<std::string> want =
      PairProof(secret, prover, verifier, verifier_nonce, prover_nonce);
  if (!want.ok() || proof.size() != want->size()) return false;
  return CRYPTO_memcmp(want->data(), proof.data(), proof.size()) == 0;
}

}  // namespace modelavg::client
