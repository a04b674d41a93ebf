// The proof of membership that the two ends of a Gloo pair exchange before any byte of a
// collective (ConnectMesh, gloo_mesh.h). Gloo's TCP transport accepts the first connection that
// reaches a pair's port, whoever made it; the proof decides whether the pair is used.
//
// Each member publishes, with its address for each pair, a fresh random key (kPairKeyBytes)
// through the rendezvous store, which the coordinator hands only to the credentialed members of
// that (job, generation, level, subgroup, plan). The pair's secret is the two keys, the lower
// rank's first (PairSecret). Each end sends a fresh nonce, then an HMAC-SHA256 under the secret
// over a label, both ranks in the prover's role order and both nonces, the verifier's first
// (PairProof): a proof answers one challenge only (a replay fails on the nonce) and one
// direction only (a proof reflected back to its maker fails on the ranks' order).
#ifndef MODELAVG_CLIENT_COMM_GLOO_PAIR_PROOF_H_
#define MODELAVG_CLIENT_COMM_GLOO_PAIR_PROOF_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace modelavg::client {

inline constexpr size_t kPairKeyBytes = 32;
inline constexpr size_t kPairNonceBytes = 32;
inline constexpr size_t kPairProofBytes = 32;  // HMAC-SHA256

// `n` bytes from OpenSSL's CSPRNG; INTERNAL when it cannot supply them.
absl::StatusOr<std::string> SecureRandomBytes(size_t n);

// The secret of the pair of members `a` and `b` from the keys each published for it.
std::string PairSecret(int a, absl::string_view key_a, int b, absl::string_view key_b);

// What member `prover` sends member `verifier` to answer the nonce `verifier_nonce`, having sent
// `prover_nonce` itself. INVALID_ARGUMENT when a nonce or the secret has the wrong length.
absl::StatusOr<std::string> PairProof(absl::string_view secret, int prover, int verifier,
                                      absl::string_view verifier_nonce,
                                      absl::string_view prover_nonce);

// Whether `proof` is PairProof(secret, prover, verifier, verifier_nonce, prover_nonce), compared
// in constant time; false for a proof of the wrong length.
bool CheckPairProof(absl::string_view secret, int prover, int verifier,
                    absl::string_view verifier_nonce, absl::string_view prover_nonce,
                    absl::string_view proof);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_PAIR_PROOF_H_
