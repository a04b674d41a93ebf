// Gloo's rendezvous Store on the coordinator: set/get/wait become PublishCommId/GetCommId with
// the `key` field, scoped by (job, generation, level, subgroup), so Gloo needs no other service.
// Values larger than one blob (4 KiB) are split over several keys. Gloo's Store interface
// reports failures by throwing; the status of the last failure is kept for the caller.
#ifndef MODELAVG_CLIENT_COMM_GLOO_COORDINATOR_STORE_H_
#define MODELAVG_CLIENT_COMM_GLOO_COORDINATOR_STORE_H_

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "gloo/rendezvous/store.h"

namespace modelavg::client {

class CoordinatorStore : public gloo::rendezvous::Store {
 public:
  // Blob bytes per key (the coordinator's limit).
  static constexpr size_t kMaxBlob = 4096;

  // Keys are prefixed with `prefix` (e.g. "gloo/"). setup.timeout bounds each wait.
  CoordinatorStore(const CommunicatorSetup& setup, std::string prefix);

  // Throw std::runtime_error on failure (Gloo's contract); last_error() has the status.
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The status of the last failed operation; OK if none failed.
  absl::Status last_error() const;

 private:
  // Fetches `key` (all its chunks) into fetched_, waiting until `deadline`.
  absl::Status Fetch(const std::string& key, absl::Time deadline);
  absl::Status Publish(const std::string& key, const std::string& blob);
  absl::StatusOr<std::string> GetBlob(const std::string& key, absl::Time deadline);
  [[noreturn]] void Fail(const absl::Status& status);

  const CommunicatorSetup setup_;
  const std::string prefix_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<char>> fetched_ ABSL_GUARDED_BY(mu_);
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_COORDINATOR_STORE_H_
