// An exclusive lock on a directory, so that two coordinators never share one --state_dir: an
// flock(2) on DIR/coordinator.lock, held for the life of the object (the kernel drops it when
// the process dies, kill -9 included). The file records the holder's pid and host for the error
// the next one gets. flock is advisory and local: every coordinator must use the same machine's
// view of the directory (a node-local disk or a volume mounted by one node at a time).
#ifndef MODELAVG_SERVER_DIR_LOCK_H_
#define MODELAVG_SERVER_DIR_LOCK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace modelavg::server {

class DirLock {
 public:
  // Takes the lock without waiting. FAILED_PRECONDITION naming the holder (pid, host, since)
  // when another process holds it; PERMISSION_DENIED/INTERNAL when the file cannot be made.
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& dir);
  ~DirLock();

  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  DirLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_DIR_LOCK_H_
