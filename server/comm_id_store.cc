#include "server/comm_id_store.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace modelavg::server {

absl::StatusOr<bool> CommIdStore::CheckPublish(const CommKey& key, const std::string& blob,
                                               const std::string& job_id,
                                               int64_t generation) const {
  auto it = ids_.find(key);
  if (it != ids_.end()) {
    if (it->second == blob) return false;
    const auto& [level, subgroup, name] = key;
    return absl::AlreadyExistsError(absl::StrCat(
        "a different id is already published for level ", level, ", subgroup ", subgroup,
        ", key \"", name, "\" in generation ", generation,
        "; only the subgroup's leader publishes, once per generation"));
  }
  if (ids_.size() >= kMaxCommIdsPerGeneration) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", job_id, " already holds ", ids_.size(), " ids in generation ", generation));
  }
  return true;
}

const std::string* CommIdStore::Find(const CommKey& key) const {
  auto it = ids_.find(key);
  return it == ids_.end() ? nullptr : &it->second;
}

}  // namespace modelavg::server
