// The unit of work of a storm test (coordinator_restart_test, etcd_ha_test): a client thread
// drives one-member jobs through their stages while the coordinator is killed at a random moment,
// recording per job the highest stage it attempted and the highest the coordinator
// acknowledged; after the kill the test checks that every acknowledged change survived and that
// none appeared that nobody attempted.
#ifndef MODELAVG_TESTS_INTEGRATION_STAGED_JOB_STORM_H_
#define MODELAVG_TESTS_INTEGRATION_STAGED_JOB_STORM_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {

// Stages of one job in the storm, in the order they are attempted.
enum Stage { kAbsent = 0, kCreated, kJoined, kLeft, kDeleted };

// What the storm attempted and what the coordinator acknowledged. The storm thread writes under
// `mu`; the test reads once it has joined the thread.
struct StageLedger {
  absl::Mutex mu;
  std::map<std::string, int> attempted;  // job -> highest attempted stage
  std::map<std::string, int> acked;      // job -> highest acknowledged stage
  int64_t acknowledged = 0;              // acknowledged calls, all rounds together
};

// Drives job `id` (world 1, period 1) through created, joined (worker "w-<id>", rank 0), left
// and, with `and_delete`, deleted, recording in `ledger` each stage as attempted before its call
// and as acknowledged once the call succeeded. False at the first call that fails (the later
// stages are not tried).
inline bool DriveJobThroughStages(client::CoordinatorClient& admin, const std::string& id,
                                  bool and_delete, StageLedger* ledger) {
  auto attempt = [&](int stage) {
    absl::MutexLock l(&ledger->mu);
    ledger->attempted[id] = stage;
  };
  auto ack = [&](int stage) {
    absl::MutexLock l(&ledger->mu);
    ledger->acked[id] = stage;
    ++ledger->acknowledged;
  };
  attempt(kCreated);
  if (!admin.CreateJob(MakeSpec(id, 1, v1::PERIODIC, {{1, 1}}, 0)).ok()) return false;
  ack(kCreated);
  v1::JoinRequest join;
  join.set_job_id(id);
  join.set_worker_id("w-" + id);
  join.set_rank(0);
  attempt(kJoined);
  absl::StatusOr<v1::JoinResponse> joined = admin.Join(join, absl::Seconds(5));
  if (!joined.ok()) return false;
  ack(kJoined);
  v1::LeaveRequest leave;
  leave.set_job_id(id);
  leave.set_rank(0);
  leave.set_generation(1);
  leave.set_credential(joined->credential());
  attempt(kLeft);
  if (!admin.Leave(leave).ok()) return false;
  ack(kLeft);
  if (!and_delete) return true;
  attempt(kDeleted);
  if (!admin.DeleteJob(id).ok()) return false;
  ack(kDeleted);
  return true;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_STAGED_JOB_STORM_H_
