// The proof of membership of a Gloo pair (client/comm/gloo/pair_proof.h) on its own: only the
// holder of the pair's secret answers a nonce, and an answer is good for that nonce and that
// direction only.
#include "client/comm/gloo/pair_proof.h"

#include <string>

#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

struct Pair {
  std::string secret, nonce_a, nonce_b;
};

Pair Fresh() {
  Pair p;
  p.secret = PairSecret(0, *SecureRandomBytes(kPairKeyBytes), 1,
                        *SecureRandomBytes(kPairKeyBytes));
  p.nonce_a = *SecureRandomBytes(kPairNonceBytes);
  p.nonce_b = *SecureRandomBytes(kPairNonceBytes);
  return p;
}

TEST(PairProofTest, RightSecretAndNonces_Accepted) {
  const Pair p = Fresh();
  // Member 1 answers member 0's nonce.
  absl::StatusOr<std::string> proof = PairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b);
  ASSERT_TRUE(proof.ok()) << proof.status();
  EXPECT_EQ(proof->size(), kPairProofBytes);
  EXPECT_TRUE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, *proof));
}

TEST(PairProofTest, PairSecret_SameFromBothEnds) {
  const std::string a = *SecureRandomBytes(kPairKeyBytes), b = *SecureRandomBytes(kPairKeyBytes);
  EXPECT_EQ(PairSecret(3, a, 7, b), PairSecret(7, b, 3, a));
  EXPECT_NE(PairSecret(3, a, 7, b), PairSecret(3, b, 7, a));
}

TEST(PairProofTest, WrongSecret_Rejected) {
  const Pair p = Fresh();
  const Pair other = Fresh();
  const std::string forged = *PairProof(other.secret, 1, 0, p.nonce_a, p.nonce_b);
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, forged));
}

TEST(PairProofTest, WrongNonce_Rejected) {
  const Pair p = Fresh();
  const std::string proof = *PairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b);
  std::string changed = p.nonce_a;
  changed[5] ^= 1;
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, changed, p.nonce_b, proof));
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, changed, proof));
}

TEST(PairProofTest, TruncatedOrFlipped_Rejected) {
  const Pair p = Fresh();
  std::string proof = *PairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b);
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, proof.substr(0, 31)));
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, ""));
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, proof + "x"));
  proof[31] ^= 0x80;
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b, proof));
  // A truncated nonce or secret is an error, not a proof.
  EXPECT_FALSE(PairProof(p.secret, 1, 0, p.nonce_a.substr(1), p.nonce_b).ok());
  EXPECT_FALSE(PairProof(p.secret.substr(1), 1, 0, p.nonce_a, p.nonce_b).ok());
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a.substr(1), p.nonce_b, proof));
}

// A recorded answer replayed against a new challenge fails: the verifier's nonce is fresh.
TEST(PairProofTest, ReplayedAgainstAFreshNonce_Rejected) {
  const Pair p = Fresh();
  const std::string recorded = *PairProof(p.secret, 1, 0, p.nonce_a, p.nonce_b);
  const std::string fresh = *SecureRandomBytes(kPairNonceBytes);
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, fresh, p.nonce_b, recorded));
}

// A proof reflected back to its maker fails: the ranks are bound in the prover's order.
TEST(PairProofTest, ReflectedToItsMaker_Rejected) {
  const Pair p = Fresh();
  const std::string mine = *PairProof(p.secret, 0, 1, p.nonce_a, p.nonce_a);
  EXPECT_FALSE(CheckPairProof(p.secret, 1, 0, p.nonce_a, p.nonce_a, mine));
}

}  // namespace
}  // namespace modelavg::client
