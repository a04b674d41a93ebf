#include "client/comm/gloo/coordinator_store.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "client/rpc/coordinator_client.h"
#include "common/status_util.h"

namespace modelavg::client {
namespace {

// Chunk i > 0 of a value lives under "<key>#<i>"; the value's first blob starts with the
// chunk count (4 bytes, little endian) and is published last, so a reader that sees it finds
// every other chunk already there.
constexpr size_t kHeader = 4;

std::string ChunkKey(const std::string& key, uint32_t i) { return absl::StrCat(key, "#", i); }

}  // namespace

CoordinatorStore::CoordinatorStore(const CommunicatorSetup& setup, std::string prefix)
    : setup_(setup), prefix_(std::move(prefix)) {}

absl::Status CoordinatorStore::last_error() const {
  absl::MutexLock l(&mu_);
  return last_error_;
}

void CoordinatorStore::Fail(const absl::Status& status) {
  {
    absl::MutexLock l(&mu_);
    last_error_ = status;
  }
  throw std::runtime_error(status.ToString());
}

absl::Status CoordinatorStore::Publish(const std::string& key, const std::string& blob) {
  v1::PublishCommIdRequest req;
  setup_.ScopeCommIdRequest(prefix_ + key, &req);
  req.set_unique_id(blob);
  return setup_.coordinator->PublishCommId(req);
}

absl::StatusOr<std::string> CoordinatorStore::GetBlob(const std::string& key,
                                                     absl::Time deadline) {
  v1::GetCommIdRequest req;
  setup_.ScopeCommIdRequest(prefix_ + key, &req);
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()));
  req.set_timeout_ms(ms);
  return setup_.coordinator->GetCommId(req);
}

void CoordinatorStore::set(const std::string& key, const std::vector<char>& data) {
  const size_t first = kMaxBlob - kHeader;
  const size_t rest = data.size() > first ? data.size() - first : 0;
  const uint32_t chunks = 1 + static_cast<uint32_t>((rest + kMaxBlob - 1) / kMaxBlob);
  for (uint32_t i = 1; i < chunks; ++i) {
    const size_t begin = first + (i - 1) * kMaxBlob;
    const size_t len = std::min(kMaxBlob, data.size() - begin);
    absl::Status s = Publish(ChunkKey(key, i), std::string(data.data() + begin, len));
    if (!s.ok()) Fail(Annotate(s, absl::StrCat("publishing rendezvous key '", key, "'")));
  }
  std::string head(kHeader, '\0');
  for (size_t b = 0; b < kHeader; ++b) head[b] = static_cast<char>((chunks >> (8 * b)) & 0xFF);
  head.append(data.data(), std::min(first, data.size()));
  absl::Status s = Publish(key, head);
  if (!s.ok()) Fail(Annotate(s, absl::StrCat("publishing rendezvous key '", key, "'")));
}

absl::Status CoordinatorStore::Fetch(const std::string& key, absl::Time deadline) {
  {
    absl::MutexLock l(&mu_);
    if (fetched_.count(key)) return absl::OkStatus();
  }
  MODELAVG_ASSIGN_OR_RETURN(std::string head, GetBlob(key, deadline));
  if (head.size() < kHeader) {
    return absl::InternalError(absl::StrCat("rendezvous key '", key, "' holds ", head.size(),
                                            " bytes: not written by a modelavg client"));
  }
  uint32_t chunks = 0;
  for (size_t b = 0; b < kHeader; ++b) {
    chunks |= static_cast<uint32_t>(static_cast<unsigned char>(head[b])) << (8 * b);
  }
  std::vector<char> value(head.begin() + kHeader, head.end());
  for (uint32_t i = 1; i < chunks; ++i) {
    MODELAVG_ASSIGN_OR_RETURN(std::string part, GetBlob(ChunkKey(key, i), deadline));
    value.insert(value.end(), part.begin(), part.end());
  }
  absl::MutexLock l(&mu_);
  fetched_[key] = std::move(value);
  return absl::OkStatus();
}

std::vector<char> CoordinatorStore::get(const std::string& key) {
  absl::Status s = Fetch(key, absl::Now() + setup_.timeout);
  if (!s.ok()) Fail(Annotate(s, absl::StrCat("waiting for rendezvous key '", key, "'")));
  absl::MutexLock l(&mu_);
  return fetched_[key];
}

void CoordinatorStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(setup_.timeout)));
}

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  const absl::Time deadline = absl::Now() + std::min(setup_.timeout, absl::FromChrono(timeout));
  for (const std::string& key : keys) {
    absl::Status s = Fetch(key, deadline);
    if (!s.ok()) Fail(Annotate(s, absl::StrCat("waiting for rendezvous key '", key, "'")));
  }
}

}  // namespace modelavg::client
