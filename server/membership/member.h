// The hard state of a job's membership, as Membership (server/membership/membership.h) holds it and a
// StateStore (server/store/state_store.h) keeps it: one Member per rank and the job-wide
// MembershipHeader. One type each, so that nothing is copied field by field between the two.
#ifndef MODELAVG_SERVER_MEMBERSHIP_MEMBER_H_
#define MODELAVG_SERVER_MEMBERSHIP_MEMBER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

// Who holds one rank and in which generation.
struct Member {
  int32_t rank = 0;
  // Empty: the rank has no member (a StateStore removes its record).
  std::string worker_id;
  std::string host;
  v1::MemberState state = v1::MEMBER_STATE_UNSPECIFIED;
  // The generation of this member's round: the one it joined, or a later one that an elastic
  // job shrank into with it as a survivor; 0 when not in any round.
  int64_t generation = 0;
  // The generation in which the worker joined (an elastic job's survivors keep theirs while
  // `generation` moves on; its heartbeats count from then on). 0 in a record of an older store:
  // the same as `generation`.
  int64_t joined_generation = 0;
  // Digest of the member's credential (server/membership/member_credential.h); never the credential.
  std::string credential_digest;
  // The step from which it takes part in the averaging: -1 for a member of the world that
  // started the job (or re-formed it after a fall-back to PENDING), its admission step for a
  // replacement admitted into the RUNNING elastic job.
  int64_t admitted_step = -1;
  // RETIRED (sharded replicas, JobSpec.replica_size): the rank whose death, Leave or failure
  // retired this member's replica, and the first step at which this member no longer takes
  // part in the averaging: 0 after a death or a failure (at once); after an orderly Leave, the
  // first step the leaver did not start (its replica mates finish the steps it finished).
  int32_t retired_by = -1;
  int64_t retired_at_step = 0;

  bool present() const { return !worker_id.empty(); }
};

// The job-wide hard state besides its members.
struct MembershipHeader {
  v1::JobState state = v1::PENDING;
  int64_t generation = 1;
  // Set once the generation changed at least once.
  std::optional<v1::GenerationChange> last_change;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_MEMBER_H_
