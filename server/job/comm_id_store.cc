#include "server/job/comm_id_store.h"

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
  const size_t more = std::get<2>(key).size() + blob.size();
  if (bytes_ + more > kMaxCommIdBytesPerJob) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", job_id, " already holds ", bytes_, " bytes of communicator ids in generation ",
        generation, "; ", more, " more would pass the bound of ", kMaxCommIdBytesPerJob,
        " bytes per job (keys and blobs). Only subgroup leaders publish, one id per subgroup "
        "and key: is a worker publishing under ever new keys?"));
  }
  return true;
}

void CommIdStore::Put(const CommKey& key, std::string blob) {
  auto it = ids_.find(key);
  if (it != ids_.end()) {
    bytes_ -= std::get<2>(key).size() + it->second.size();
  }
  bytes_ += std::get<2>(key).size() + blob.size();
  ids_.insert_or_assign(key, std::move(blob));
}

const std::string* CommIdStore::Find(const CommKey& key) const {
  auto it = ids_.find(key);
  return it == ids_.end() ? nullptr : &it->second;
}

}  // namespace modelavg::server
