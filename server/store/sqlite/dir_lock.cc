#include "server/store/sqlite/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"

namespace modelavg::server {
namespace {

std::string HostName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown host";
  return host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirLock>> DirLock::Acquire(const std::string& dir) {
  std::string path = absl::StrCat(dir, "/coordinator.lock");
  const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    const int err = errno;
    return absl::Status(err == EACCES ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInternal,
                        absl::StrCat("cannot open the state directory ", dir, ": ", ErrnoText()));
  }
  struct stat st;
  if (fstat(dir_fd, &st) != 0) {
    const std::string why = ErrnoText();
    close(dir_fd);
    return absl::InternalError(absl::StrCat("cannot stat the state directory ", dir, ": ", why));
  }
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    close(dir_fd);
    return absl::Status(err == EACCES ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInternal,
                        absl::StrCat("cannot open the lock file ", path, ": ", ErrnoText()));
  }
  // The directory first: it cannot be deleted from under the lock while it is in use, as the
  // file can. Then the file, which older coordinators lock.
  int err = 0;
  if (flock(dir_fd, LOCK_EX | LOCK_NB) != 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) err = errno;
  if (err != 0) {
    std::string holder;
    char buf[512] = {};
    const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    if (n > 0) holder = std::string(absl::StripAsciiWhitespace(std::string(buf, n)));
    close(fd);
    close(dir_fd);
    if (err != EWOULDBLOCK) {
      return absl::InternalError(absl::StrCat("cannot lock ", dir, ": ", std::strerror(err)));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "the state directory ", dir, " is in use by another coordinator (",
        holder.empty() ? "holder unknown" : holder, ", per ", path,
        "); stop that one first, or give this one another --state_dir"));
  }
  const std::string me =
      absl::StrCat("pid ", getpid(), " on host ", HostName(), " since ",
                   absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()));
  if (ftruncate(fd, 0) != 0 || pwrite(fd, me.data(), me.size(), 0) < 0) {
    // The lock holds without the note; only the next one's error is less helpful.
  }
  return std::unique_ptr<DirLock>(
      new DirLock(dir, std::move(path), dir_fd, fd, st.st_dev, st.st_ino));
}

absl::Status DirLock::Check() const {
  struct stat st;
  if (stat(dir_.c_str(), &st) != 0) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat(
        "the state directory ", dir_,
        err == ENOENT ? " was removed while the coordinator ran"
                      : absl::StrCat(" cannot be read (", std::strerror(err), ")"),
        "; what it writes now would be lost, so it writes nothing. Restore the directory "
        "(from a backup) and restart the coordinator"));
  }
  if (st.st_dev != dev_ || st.st_ino != ino_) {
    return absl::UnavailableError(absl::StrCat(
        "the state directory ", dir_, " was replaced while the coordinator ran (it is another "
        "directory now: device ", st.st_dev, " inode ", st.st_ino, ", locked were device ", dev_,
        " inode ", ino_, "); what it writes now would be lost, so it writes nothing. Restart "
        "the coordinator on the directory that holds its state"));
  }
  return absl::OkStatus();
}

DirLock::~DirLock() {
  // Closing drops the flocks. The file stays: removing it would race with the next holder.
  close(fd_);
  close(dir_fd_);
}

}  // namespace modelavg::server
