// The communicators of one client membership, keyed by (generation, level, subgroup, device
// kind) and created lazily: the first averaging step of a key bootstraps it through the
// coordinator (Gloo's rendezvous store or the NCCL unique id, both on PublishCommId/GetCommId).
#ifndef MODELAVG_CLIENT_COMMUNICATOR_CACHE_H_
#define MODELAVG_CLIENT_COMMUNICATOR_CACHE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/communicator.h"
#include "client/tensor.h"
#include "common/schedule.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace modelavg::client {

class CoordinatorClient;

// Everything a communicator needs to bootstrap one subgroup through the coordinator.
struct CommunicatorSetup {
  CoordinatorClient* coordinator = nullptr;
  std::string job_id;
  int64_t generation = 0;
  int32_t level = 0;
  SubgroupRange subgroup;
  // This process's global rank (a member of `subgroup`).
  int32_t rank = 0;
  // That rank's credential (Client::credential()), sent with every comm-id request.
  std::string credential;
  // Bounds the bootstrap and every collective.
  absl::Duration timeout = absl::Seconds(60);
  // Polled while waiting (NCCL): non-OK aborts the wait with that status.
  std::function<absl::Status()> check_alive;
  // Gloo: average one-buffer parameters in place (ClientOptions::gloo_in_place).
  bool gloo_in_place = false;
  // NCCL: which bootstrap of this subgroup in this generation (0, then 1, 2, ... after failed
  // ones): each attempt exchanges a fresh unique id under its own key (NcclUniqueIdKey).
  int32_t bootstrap_attempt = 0;
  // The global ranks that form the communicator, ascending: the subgroup's live (and admitted)
  // members in an elastic job. Empty: the whole subgroup.
  std::vector<int32_t> members;

  // This rank's index among the members, and their number.
  int MemberIndex() const;
  int MemberCount() const;
  // A key prefix that tells this member set from the whole subgroup's (and from other sets of
  // the same subgroup and generation): "" for the whole subgroup, else "m<hash>/".
  std::string MemberScope() const;

  // Scopes a v1::PublishCommIdRequest or v1::GetCommIdRequest to this job, generation, level,
  // subgroup and rank, under `key` (empty: the communicator's unique id).
  template <typename Request>
  void ScopeCommIdRequest(const std::string& key, Request* req) const {
    req->set_job_id(job_id);
    req->set_generation(generation);
    req->set_level(level);
    req->set_subgroup(subgroup.index);
    req->set_rank(rank);
    req->set_key(key);
    req->set_credential(credential);
  }
};

struct CommunicatorKey {
  int64_t generation = 0;
  int32_t level = 0;
  int32_t subgroup = 0;
  Device::Kind kind = Device::Kind::kHost;
  int device_index = 0;
  // CommunicatorSetup::members (empty: the whole subgroup).
  std::vector<int32_t> members;
  bool operator<(const CommunicatorKey& o) const {
    return std::tie(generation, level, subgroup, kind, device_index, members) <
           std::tie(o.generation, o.level, o.subgroup, o.kind, o.device_index, o.members);
  }
};

class CommunicatorCache {
 public:
  // `gloo_hostname`: the address the shared Gloo TCP device binds to.
  explicit CommunicatorCache(std::string gloo_hostname);
  ~CommunicatorCache();

  // The communicator for `setup`'s subgroup on `device`: cached, or created now (blocking until
  // every member of the subgroup has joined it, at most setup.timeout).
  // Errors: those of GlooCommunicator::Create / NcclCommunicator::Create; UNIMPLEMENTED for CUDA
  // tensors in a build without CUDA.
  absl::StatusOr<Communicator*> Get(const CommunicatorSetup& setup, const Device& device);

  // Drops every communicator (e.g. after a generation change). Must not run while another
  // thread averages on one of them (Abort them first and let the call return).
  void Clear();

  // Aborts every communicator of a generation below `generation` (Communicator::Abort with
  // `why`), including one whose creation is under way (it is aborted as soon as it is made, and
  // Get returns `why`). Thread-safe and non-blocking: a collective blocked on a stopped peer
  // is broken from the heartbeat thread.
  void AbortBefore(int64_t generation, const absl::Status& why);

  // Drops the communicators of generations below `generation` (after a round in it
  // succeeded). Like Clear, not while another thread averages on one of them.
  void DropBefore(int64_t generation);

  // Whether a communicator for `key` exists.
  bool Contains(const CommunicatorKey& key) const;

 private:
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> GlooDevice()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);

  const std::string gloo_hostname_;
  // Held while creating (one creation at a time: two creations of one key must not race on the
  // coordinator's keys), which may block up to the setup's timeout.
  absl::Mutex create_mu_;
  std::shared_ptr<gloo::transport::Device> gloo_device_ ABSL_GUARDED_BY(create_mu_);
  // Held only briefly (lookups, inserts, aborts).
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(create_mu_);
  std::map<CommunicatorKey, std::unique_ptr<Communicator>> comms_ ABSL_GUARDED_BY(mu_);
  // Generations below abort_before_ are aborted, with abort_why_.
  int64_t abort_before_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status abort_why_ ABSL_GUARDED_BY(mu_);
  // Failed NCCL bootstraps per key (the next attempt's number).
  std::map<CommunicatorKey, int32_t> nccl_attempts_ ABSL_GUARDED_BY(create_mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMMUNICATOR_CACHE_H_
