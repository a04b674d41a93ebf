// An exclusive lock on a directory, so that two coordinators never share one --state_dir: an
// flock(2) on the directory itself (and on DIR/coordinator.lock, which records the holder's pid
// and host for the error the next one gets), held for the life of the object (the kernel drops
// it when the process dies, kill -9 included). Deleting the lock file does not undo the lock.
// A directory that is removed or replaced while it is held is noticed by Check(): the state
// written after that would be lost, so the holder refuses to write (server/store/sqlite/sqlite_state_store.h).
// flock is advisory and local: every coordinator must use the same machine's view of the
// directory (a node-local disk or a volume mounted by one node at a time).
#ifndef MODELAVG_SERVER_STORE_SQLITE_DIR_LOCK_H_
#define MODELAVG_SERVER_STORE_SQLITE_DIR_LOCK_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace modelavg::server {

class DirLock {
 public:
  // Takes the lock without waiting. FAILED_PRECONDITION naming the holder (pid, host, since)
  // when another process holds it; PERMISSION_DENIED/INTERNAL when the directory or the file
  // cannot be opened.
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& dir);
  ~DirLock();

  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  // OK while the directory's path still names the directory that was locked (same device and
  // inode); UNAVAILABLE saying what happened (removed, replaced, unreadable) otherwise.
  absl::Status Check() const;

  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }

 private:
  DirLock(std::string dir, std::string path, int dir_fd, int fd, dev_t dev, ino_t ino)
      : dir_(std::move(dir)), path_(std::move(path)), dir_fd_(dir_fd), fd_(fd), dev_(dev),
        ino_(ino) {}
  std::string dir_;
  std::string path_;
  int dir_fd_;
  int fd_;
  dev_t dev_;
  ino_t ino_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_SQLITE_DIR_LOCK_H_
