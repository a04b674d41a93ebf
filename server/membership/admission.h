// Admission of replacements into a RUNNING elastic job (Membership::Join): at which step a
// newcomer starts to average, and which ranks take part in decisions from which step. Pure
// functions of the schedule and the members' steps.
#ifndef MODELAVG_SERVER_MEMBERSHIP_ADMISSION_H_
#define MODELAVG_SERVER_MEMBERSHIP_ADMISSION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/common/schedule.h"

namespace modelavg::server {

// The admission step is at least the largest step the live members reported plus this margin:
// kMinAdmissionMargin, plus the steps the job advances in kAdmissionNotice (estimated from the
// reported steps), at most kMaxAdmissionMargin in all.
inline constexpr int64_t kMinAdmissionMargin = 2;
inline constexpr int64_t kMaxAdmissionMargin = 100000;
inline constexpr absl::Duration kAdmissionNotice = absl::Seconds(1);
// The progress rate is re-estimated from two samples of the largest reported step at least
// this far apart.
inline constexpr absl::Duration kRateSampleInterval = absl::Seconds(1);
// The admission step is searched among the next kMaxAdmissionScan steps from the floor.
inline constexpr int64_t kMaxAdmissionScan = 1000000;
// MemberSteps::from_step of a rank no live member holds.
inline constexpr int64_t kNotMember = INT64_MAX;

// Which ranks take part in decisions, step by step: from_step[r] is the first step at which
// rank r is a member of its subgroups' averaging: -1 for a member of the world that started
// the job (and for every rank while the job is not RUNNING), the admission step of a
// replacement, kNotMember for a vacant rank. A decision at step s lists the ranks with
// from_step <= s < until_step as members, and those with from_step == s as joining.
struct MemberSteps {
  std::vector<int64_t> from_step;
  // Per rank, the first step at which it is no longer a member: kNotMember (never) but for the
  // replica mates of a rank that left in order (Member::retired_at_step).
  std::vector<int64_t> until_step;
  // Every rank is a member at every step (no vacancy, no replacement): decisions are the
  // schedule's.
  bool all_from_start = true;
};

// Whether a background all-reduce (Level.sync_delay, docs/streaming.md) started before `step`
// is applied after it: a sync step s of a level with delay tau and s < step < s + tau. The
// members' outer state is then half-way through a sync, so no replacement is admitted there.
bool InsideDelayedSync(const Schedule& schedule, int64_t step);

// The admission step of replacements taking `ranks` (one rank, or the ranks of a replica
// admitted whole): the first step s >= max(floor, 1) at which the schedule averages (at level
// L), no delayed sync is pending (InsideDelayedSync), and each of `ranks` has in its subgroup at
// L a rank outside `ranks` with from_step[r] < s (a live member admitted before s, whose
// parameters it can receive: with sharded replicas, one that holds its shard). `from_step` as
// MemberSteps, with `ranks` themselves ignored. FAILED_PRECONDITION when no such step is among
// the next kMaxAdmissionScan steps (no subgroup of a newcomer has a live member, or the period
// that would give one is too far).
absl::StatusOr<int64_t> FindAdmissionStep(const Schedule& schedule,
                                          const std::vector<int32_t>& ranks,
                                          const std::vector<int64_t>& from_step, int64_t floor,
                                          const std::string& job_id);
// The same for one replacement taking `rank`.
inline absl::StatusOr<int64_t> FindAdmissionStep(const Schedule& schedule, int32_t rank,
                                                 const std::vector<int64_t>& from_step,
                                                 int64_t floor, const std::string& job_id) {
  return FindAdmissionStep(schedule, std::vector<int32_t>{rank}, from_step, floor, job_id);
}

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_ADMISSION_H_
