#include "server/core/pending_waits.h"

#include <algorithm>
#include <utility>

namespace modelavg::server {
namespace {

// Moves the elements matching `pred` out of `v`, keeping the order of both parts.
template <typename T, typename Pred>
std::vector<T> TakeIf(std::vector<T>& v, Pred pred) {
  std::vector<T> taken;
  // The staleness thread asks often; usually nothing is due.
  if (std::none_of(v.begin(), v.end(), pred)) return taken;
  std::vector<T> kept;
  for (T& w : v) {
    if (pred(w)) {
      taken.push_back(std::move(w));
    } else {
      kept.push_back(std::move(w));
    }
  }
  v = std::move(kept);
  return taken;
}

template <typename T, typename Pred>
std::optional<T> TakeFirst(std::vector<T>& v, Pred pred) {
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!pred(*it)) continue;
    T w = std::move(*it);
    v.erase(it);
    return w;
  }
  return std::nullopt;
}

}  // namespace

std::optional<JoinWait> PendingWaits::TakeJoinOfRank(int32_t rank) {
  return TakeFirst(joins_, [&](const JoinWait& w) { return w.rank == rank; });
}

std::vector<JoinWait> PendingWaits::TakeAllJoins() { return std::exchange(joins_, {}); }

std::vector<JoinWait> PendingWaits::TakeRoundJoins() {
  return TakeIf(joins_, [](const JoinWait& w) { return !w.for_replica; });
}

std::vector<CommIdWait> PendingWaits::TakeCommIds(const CommKey& key) {
  return TakeIf(comm_ids_, [&](const CommIdWait& w) { return w.key == key; });
}

std::vector<CommIdWait> PendingWaits::TakeAllCommIds() { return std::exchange(comm_ids_, {}); }

std::optional<JoinWait> PendingWaits::TakeJoin(WaitId id) {
  return TakeFirst(joins_, [&](const JoinWait& w) { return w.id == id; });
}

std::optional<CommIdWait> PendingWaits::TakeCommId(WaitId id) {
  return TakeFirst(comm_ids_, [&](const CommIdWait& w) { return w.id == id; });
}

std::vector<JoinWait> PendingWaits::TakeExpiredJoins(absl::Time now) {
  return TakeIf(joins_, [&](const JoinWait& w) { return w.deadline <= now; });
}

std::vector<CommIdWait> PendingWaits::TakeExpiredCommIds(absl::Time now) {
  return TakeIf(comm_ids_, [&](const CommIdWait& w) { return w.deadline <= now; });
}

}  // namespace modelavg::server
