// What the etcd state store (server/store/etcd/etcd_state_store.h) conditions its writes on: the leader
// key and this term's revision of it. LeaderElection (server/store/etcd/leader_election.h) is the one
// implementation in the coordinator; tests hand the store a fixed one.
#ifndef MODELAVG_SERVER_STORE_ETCD_ETCD_FENCE_H_
#define MODELAVG_SERVER_STORE_ETCD_ETCD_FENCE_H_

#include <cstdint>
#include <string>

namespace modelavg::server {

class EtcdFence {
 public:
  virtual ~EtcdFence() = default;
  // The leader key.
  virtual const std::string& key() const = 0;
  // The leader key's create_revision in this term; 0 when not leading.
  virtual int64_t fence() const = 0;
  // etcd refused a write fenced with `fence`, or left its outcome open: the term is over.
  virtual void LostLeadership(int64_t fence, const std::string& why) = 0;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_ETCD_ETCD_FENCE_H_
