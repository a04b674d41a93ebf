// The communicator bootstrap ids of one job's current generation, keyed by (level, subgroup,
// key). A plain value class: no lock, no waits, no storage; Job (server/job/job.h) owns one under
// its mutex, clears it when the generation changes and writes what it adds to its StateStore.
#ifndef MODELAVG_SERVER_JOB_COMM_ID_STORE_H_
#define MODELAVG_SERVER_JOB_COMM_ID_STORE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace modelavg::server {

// (level, subgroup, key).
using CommKey = std::tuple<int32_t, int32_t, std::string>;

// A hostile or buggy client could publish without end; a generation's ids are bounded, in
// number and in bytes (keys and blobs together; every id is also written to the state store).
// A 65,536-rank job's legitimate ids (one round note per rank, one bootstrap id per subgroup
// and level) take a few MiB.
inline constexpr size_t kMaxCommIdsPerGeneration = 1 << 16;
inline constexpr size_t kMaxCommIdBytesPerJob = size_t{32} << 20;

class CommIdStore {
 public:
  // Checks that `blob` may be stored under `key`: true if it is new, false if the identical
  // bytes are there already (a retried publish). ALREADY_EXISTS for other bytes under the key,
  // RESOURCE_EXHAUSTED past kMaxCommIdsPerGeneration ids or kMaxCommIdBytesPerJob bytes.
  // `job_id` and `generation` only name the job in errors. Stores nothing (see Put).
  absl::StatusOr<bool> CheckPublish(const CommKey& key, const std::string& blob,
                                    const std::string& job_id, int64_t generation) const;
  void Put(const CommKey& key, std::string blob);

  // The blob under `key`, or null.
  const std::string* Find(const CommKey& key) const;

  void Clear() {
    ids_.clear();
    bytes_ = 0;
  }
  size_t size() const { return ids_.size(); }
  // Bytes of the keys and blobs held.
  size_t bytes() const { return bytes_; }

 private:
  absl::flat_hash_map<CommKey, std::string> ids_;
  size_t bytes_ = 0;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_COMM_ID_STORE_H_
