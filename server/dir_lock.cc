#include "server/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace modelavg::server {
namespace {

std::string Errno() { return std::strerror(errno); }

std::string HostName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "unknown host";
  return host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirLock>> DirLock::Acquire(const std::string& dir) {
  std::string path = absl::StrCat(dir, "/coordinator.lock");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    return absl::Status(err == EACCES ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kInternal,
                        absl::StrCat("cannot open the lock file ", path, ": ", Errno()));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    char buf[512] = {};
    const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    if (n > 0) holder = std::string(absl::StripAsciiWhitespace(std::string(buf, n)));
    close(fd);
    if (err != EWOULDBLOCK) {
      return absl::InternalError(absl::StrCat("cannot lock ", path, ": ", std::strerror(err)));
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
  return std::unique_ptr<DirLock>(new DirLock(std::move(path), fd));
}

DirLock::~DirLock() {
  // Closing drops the flock. The file stays: removing it would race with the next holder.
  close(fd_);
}

}  // namespace modelavg::server
