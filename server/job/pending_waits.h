// One job's pending waits: Join calls waiting for their round to complete and GetCommId calls
// waiting for a publish. A plain container with no lock and no clock: Job (server/job/job.h) owns
// one under its mutex, takes waits out when their condition is met, their deadline passes or
// the generation changes, and runs their callbacks after releasing its lock.
#ifndef MODELAVG_SERVER_JOB_PENDING_WAITS_H_
#define MODELAVG_SERVER_JOB_PENDING_WAITS_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/job/comm_id_store.h"

namespace modelavg::server {

// Identifies one pending wait (Join, GetCommId) so that its caller can cancel it.
using WaitId = uint64_t;

// Completion of a Join wait. Called exactly once, never under a Job lock.
using JoinCallback = absl::AnyInvocable<void(absl::StatusOr<v1::JoinResponse>)>;
// Completion of a GetCommId wait. Called exactly once, never under a Job lock.
using CommIdCallback = absl::AnyInvocable<void(absl::StatusOr<std::string>)>;

struct JoinWait {
  WaitId id = 0;
  int32_t rank = -1;
  // The credential this Join is given (in its response). Never logged.
  std::string credential;
  absl::Time deadline;
  JoinCallback done;
  // A sharded replacement waiting for the rest of its replica (Membership::Waiting), not for a
  // round: a generation change of the running job does not end it.
  bool for_replica = false;
  // The Join asked for JoinRequest.subgroup_ranks_from_spec: its reply lists no subgroup ranks.
  bool ranks_from_spec = false;
};

struct CommIdWait {
  WaitId id = 0;
  CommKey key;
  absl::Time deadline;
  CommIdCallback done;
};

// Waits of one kind in arrival order, indexed by id, by key (a Join's rank, a GetCommId's
// CommKey) and by deadline: each operation costs O(log n) plus what it takes out, so that a
// world of n ranks joining, or its staleness checks meanwhile, costs O(n log n) in all rather
// than O(n^2). Whatever is taken out comes in arrival order.
template <typename Wait, typename Key>
class WaitList {
 public:
  void Add(Wait wait) {
    const uint64_t seq = next_seq_++;
    ids_.emplace(wait.id, seq);
    keys_.emplace(KeyOf(wait), seq);
    deadlines_.emplace(wait.deadline, seq);
    waits_.emplace(seq, std::move(wait));
  }
  // The earliest wait with `id` / `key`, taken out; nullopt if none.
  std::optional<Wait> TakeFirstWithId(WaitId id) {
    auto it = ids_.lower_bound({id, 0});
    if (it == ids_.end() || it->first != id) return std::nullopt;
    return Take(it->second);
  }
  std::optional<Wait> TakeFirstWithKey(const Key& key) {
    auto it = keys_.lower_bound({key, 0});
    if (it == keys_.end() || it->first != key) return std::nullopt;
    return Take(it->second);
  }
  std::vector<Wait> TakeAllWithKey(const Key& key) {
    std::vector<uint64_t> seqs;
    for (auto it = keys_.lower_bound({key, 0}); it != keys_.end() && it->first == key; ++it) {
      seqs.push_back(it->second);
    }
    return TakeSeqs(std::move(seqs));
  }
  // The waits whose deadline is at or before `now`.
  std::vector<Wait> TakeDue(absl::Time now) {
    std::vector<uint64_t> seqs;
    for (auto it = deadlines_.begin(); it != deadlines_.end() && it->first <= now; ++it) {
      seqs.push_back(it->second);
    }
    return TakeSeqs(std::move(seqs));
  }
  std::vector<Wait> TakeAll() {
    std::vector<Wait> all;
    all.reserve(waits_.size());
    for (auto& [seq, w] : waits_) all.push_back(std::move(w));
    Clear();
    return all;
  }
  // Those matching `pred` (a scan of them all).
  template <typename Pred>
  std::vector<Wait> TakeIf(Pred pred) {
    std::vector<uint64_t> seqs;
    for (const auto& [seq, w] : waits_) {
      if (pred(w)) seqs.push_back(seq);
    }
    if (seqs.size() == waits_.size()) return TakeAll();
    return TakeSeqs(std::move(seqs));
  }
  size_t size() const { return waits_.size(); }

 private:
  static const Key& KeyOf(const Wait& w);
  void Clear() {
    waits_.clear();
    ids_.clear();
    keys_.clear();
    deadlines_.clear();
  }
  Wait Take(uint64_t seq) {
    auto node = waits_.extract(seq);
    Wait& w = node.mapped();
    ids_.erase({w.id, seq});
    keys_.erase({KeyOf(w), seq});
    deadlines_.erase({w.deadline, seq});
    return std::move(w);
  }
  // In arrival order.
  std::vector<Wait> TakeSeqs(std::vector<uint64_t> seqs) {
    std::sort(seqs.begin(), seqs.end());
    std::vector<Wait> taken;
    taken.reserve(seqs.size());
    for (uint64_t seq : seqs) taken.push_back(Take(seq));
    return taken;
  }

  uint64_t next_seq_ = 0;
  // By arrival.
  std::map<uint64_t, Wait> waits_;
  std::set<std::pair<WaitId, uint64_t>> ids_;
  std::set<std::pair<Key, uint64_t>> keys_;
  std::set<std::pair<absl::Time, uint64_t>> deadlines_;
};

template <>
inline const int32_t& WaitList<JoinWait, int32_t>::KeyOf(const JoinWait& w) {
  return w.rank;
}
template <>
inline const CommKey& WaitList<CommIdWait, CommKey>::KeyOf(const CommIdWait& w) {
  return w.key;
}

class PendingWaits {
 public:
  void AddJoin(JoinWait wait) { joins_.Add(std::move(wait)); }
  void AddCommId(CommIdWait wait) { comm_ids_.Add(std::move(wait)); }

  // The pending Join of `rank`, taken out; nullopt if none.
  std::optional<JoinWait> TakeJoinOfRank(int32_t rank) { return joins_.TakeFirstWithKey(rank); }
  // Every pending Join, taken out.
  std::vector<JoinWait> TakeAllJoins() { return joins_.TakeAll(); }
  // Every pending Join but those waiting for their replica, taken out.
  std::vector<JoinWait> TakeRoundJoins() {
    return joins_.TakeIf([](const JoinWait& w) { return !w.for_replica; });
  }
  // The GetCommId waits for `key`, taken out.
  std::vector<CommIdWait> TakeCommIds(const CommKey& key) {
    return comm_ids_.TakeAllWithKey(key);
  }
  // Every GetCommId wait, taken out.
  std::vector<CommIdWait> TakeAllCommIds() { return comm_ids_.TakeAll(); }
  // The wait with `id`, taken out (at most one of the two is set).
  std::optional<JoinWait> TakeJoin(WaitId id) { return joins_.TakeFirstWithId(id); }
  std::optional<CommIdWait> TakeCommId(WaitId id) { return comm_ids_.TakeFirstWithId(id); }
  // The waits whose deadline is at or before `now`, taken out.
  std::vector<JoinWait> TakeExpiredJoins(absl::Time now) { return joins_.TakeDue(now); }
  std::vector<CommIdWait> TakeExpiredCommIds(absl::Time now) { return comm_ids_.TakeDue(now); }

  size_t size() const { return joins_.size() + comm_ids_.size(); }

 private:
  WaitList<JoinWait, int32_t> joins_;
  WaitList<CommIdWait, CommKey> comm_ids_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_PENDING_WAITS_H_
