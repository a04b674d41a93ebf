// The communicators of one client membership, keyed by (generation, level, subgroup, device
// kind) and created lazily: the first averaging step of a key bootstraps it through the
// coordinator (Gloo's rendezvous store or the NCCL unique id, both on PublishCommId/GetCommId).
#ifndef MODELAVG_CLIENT_COMM_COMMUNICATOR_CACHE_H_
#define MODELAVG_CLIENT_COMM_COMMUNICATOR_CACHE_H_

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
#include "client/comm/communicator.h"
#include "client/comm/communicator_factory.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

struct CommunicatorKey {
  int64_t generation = 0;
  // The plan of `level` (a level of another plan is another group of ranks).
  int32_t plan = 0;
  int32_t level = 0;
  int32_t subgroup = 0;
  Device::Kind kind = Device::Kind::kHost;
  int device_index = 0;
  // CommunicatorSetup::members (empty: the whole subgroup).
  std::vector<int32_t> members;
  bool operator<(const CommunicatorKey& o) const {
    return std::tie(generation, plan, level, subgroup, kind, device_index, members) <
           std::tie(o.generation, o.plan, o.level, o.subgroup, o.kind, o.device_index,
                    o.members);
  }
};

class CommunicatorCache {
 public:
  // `factory` makes each communicator (not null).
  explicit CommunicatorCache(std::unique_ptr<CommunicatorFactory> factory);
  ~CommunicatorCache();

  // The communicator for `setup`'s subgroup on `device`: cached, or created now (blocking until
  // every member of the subgroup has joined it, at most setup.timeout).
  // Errors: the factory's (CommunicatorFactory::Create), annotated with the communicator's key.
  absl::StatusOr<Communicator*> Get(const CommunicatorSetup& setup, const Device& device);

  // Drops every communicator (e.g. after a generation change). Must not run while another
  // thread averages on one of them (Abort them first and let the call return).
  void Clear();

  // Aborts every communicator of a generation below `generation` (Communicator::Abort with
  // `why`), including one whose creation is under way: its set-up is cancelled at once (every
  // wait in it ends, SetupCanceller) and Get returns `why`. Thread-safe and non-blocking: a
  // collective blocked on a stopped peer is broken from the heartbeat thread.
  void AbortBefore(int64_t generation, const absl::Status& why);

  // Drops the communicators of generations below `generation` (after a round in it
  // succeeded). Like Clear, not while another thread averages on one of them.
  void DropBefore(int64_t generation);

  // Whether a communicator for `key` exists.
  bool Contains(const CommunicatorKey& key) const;

 private:
  const std::unique_ptr<CommunicatorFactory> factory_;
  // Held while creating (one creation at a time: two creations of one key must not race on the
  // coordinator's keys), which may block up to the setup's timeout.
  absl::Mutex create_mu_;
  // Held only briefly (lookups, inserts, aborts).
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(create_mu_);
  std::map<CommunicatorKey, std::unique_ptr<Communicator>> comms_ ABSL_GUARDED_BY(mu_);
  // Generations below abort_before_ are aborted, with abort_why_.
  int64_t abort_before_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status abort_why_ ABSL_GUARDED_BY(mu_);
  // The set-up under way (create_mu_ allows one), cancelled by AbortBefore when its generation
  // is over.
  std::shared_ptr<SetupCanceller> creating_ ABSL_GUARDED_BY(mu_);
  int64_t creating_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Bootstraps per key of a CUDA device (the next attempt's number).
  std::map<CommunicatorKey, int32_t> nccl_attempts_ ABSL_GUARDED_BY(create_mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_COMMUNICATOR_CACHE_H_
