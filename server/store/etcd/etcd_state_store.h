// The coordinator's hard state in etcd under a prefix (--etcd_endpoints, --etcd_prefix), for
// coordinators that take over from each other (server/store/etcd/leader_election.h). The layout of the
// keys is in server/store/etcd/etcd_records.proto.
//
// * Every write is one etcd transaction conditioned on the leader key's create_revision being
//   this term's fence: a coordinator that has lost its lease cannot write once another has
//   taken over. A refused write is UNAVAILABLE saying so, and ends the term
//   (LeaderElection::LostLeadership); so does a write whose outcome etcd left open (timeout,
//   no quorum), since this coordinator's view and etcd's may then differ: the next term loads
//   the state afresh.
// * A transition is acknowledged by etcd only once a quorum of members has it on disk, so an
//   acknowledged change survives the loss of any minority of etcd members and of every
//   coordinator.
// * The store keeps a copy of what it wrote for each job (the leader is the only writer), so a
//   transition writes only the keys it changes: the job's header, the member buckets (256 ranks
//   each) it touches, one comm id, the paced rounds it planned (one key each) and, for the rounds
//   it drops, one range delete.
#ifndef MODELAVG_SERVER_STORE_ETCD_ETCD_STATE_STORE_H_
#define MODELAVG_SERVER_STORE_ETCD_ETCD_STATE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/store/etcd/etcd_client.h"
#include "server/store/etcd/etcd_fence.h"
#include "server/store/state_store.h"

namespace modelavg::server {

// Ranks per member key.
inline constexpr int32_t kEtcdMemberBucket = 256;

class EtcdStateStore final : public StateStore {
 public:
  // Neither is owned; both outlive the store. Writes use `fence`'s revision of the moment.
  EtcdStateStore(EtcdClient* etcd, EtcdFence* fence, std::string prefix);
  ~EtcdStateStore() override;

  // Reads every job under the prefix (a linearizable read). DATA_LOSS naming the key for a
  // value that does not parse; UNAVAILABLE when etcd cannot answer.
  absl::StatusOr<std::vector<StoredJob>> LoadAll() override;
  absl::Status CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) override;
  absl::Status DeleteJob(absl::string_view job_id) override;
  absl::Status Apply(absl::string_view job_id, const JobDelta& delta) override;
  std::string Describe() const override;

 private:
  struct Mirror;
  std::string JobPrefix(absl::string_view job_id) const;
  // Sends `txn` with the fence compare prepended. OK when it succeeded; `refused` is set when
  // the other compares failed while the fence held (the caller's condition, e.g. the job
  // exists). UNAVAILABLE (ending the term) when the fence failed or the outcome is unknown.
  absl::Status Commit(etcdserverpb::TxnRequest txn, absl::string_view what, bool* refused);

  EtcdClient* const etcd_;
  EtcdFence* const election_;
  const std::string prefix_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Mirror>, std::less<>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_ETCD_ETCD_STATE_STORE_H_
