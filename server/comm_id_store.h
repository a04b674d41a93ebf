// The communicator bootstrap ids of one job's current generation, keyed by (level, subgroup,
// key). A plain value class: no lock, no waits, no storage; Job (server/job.h) owns one under
// its mutex, clears it when the generation changes and writes what it adds to its StateStore.
#ifndef MODELAVG_SERVER_COMM_ID_STORE_H_
#define MODELAVG_SERVER_COMM_ID_STORE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace modelavg::server {

// (level, subgroup, key).
using CommKey = std::tuple<int32_t, int32_t, std::string>;

// A hostile or buggy client could publish without end; a generation's ids are bounded.
inline constexpr size_t kMaxCommIdsPerGeneration = 1 << 16;

class CommIdStore {
 public:
  // Checks that `blob` may be stored under `key`: true if it is new, false if the identical
  // bytes are there already (a retried publish). ALREADY_EXISTS for other bytes under the key,
  // RESOURCE_EXHAUSTED past kMaxCommIdsPerGeneration. `job_id` and `generation` only name the
  // job in errors. Stores nothing (see Put).
  absl::StatusOr<bool> CheckPublish(const CommKey& key, const std::string& blob,
                                    const std::string& job_id, int64_t generation) const;
  void Put(const CommKey& key, std::string blob) { ids_.insert_or_assign(key, std::move(blob)); }

  // The blob under `key`, or null.
  const std::string* Find(const CommKey& key) const;

  void Clear() { ids_.clear(); }
  size_t size() const { return ids_.size(); }

 private:
  absl::flat_hash_map<CommKey, std::string> ids_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_COMM_ID_STORE_H_
