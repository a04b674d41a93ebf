#include "client/heartbeat/heartbeat_relay.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/heartbeat_keepalive.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// FNV-1a: names the relay of one coordinator key in the directory, the same in every process.
uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

absl::StatusOr<RelayPaths> RelayPathsFor(const std::string& dir, const std::string& key) {
  if (dir.empty() || dir.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_relay_dir \"", dir, "\" is not an absolute path: give one such as "
        "/run/user/<uid>/modelavg"));
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_relay_dir ", dir,
                                                   ": cannot create it: ", ErrnoText()));
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_relay_dir ", dir, ": ", ErrnoText()));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_relay_dir ", dir, " is not a directory"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_relay_dir ", dir, " belongs to uid ", st.st_uid, ", not to this process's (",
        ::geteuid(), "): give a directory of your own"));
  }
  if ((st.st_mode & 0077) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "heartbeat_relay_dir %s has mode %04o: others could read the ranks' credentials from its "
        "relay; chmod 700 it",
        dir, st.st_mode & 07777));
  }
  // (The host's name too: a directory on a shared file system holds a relay per host.)
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  const std::string base =
      absl::StrFormat("%s/hb-%016x", dir, Fnv1a(absl::StrCat(key, "\n", host)));
  RelayPaths paths{base + ".lock", base + ".sock"};
  if (paths.socket.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_relay_dir ", dir, " is too long for a Unix socket path (",
        paths.socket.size(), " bytes of at most ", sizeof(sockaddr_un{}.sun_path) - 1,
        "): give a shorter one"));
  }
  return paths;
}

absl::StatusOr<int> TryRelayLock(const RelayPaths& paths) {
  const int fd = ::open(paths.lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot open the heartbeat relay's lock ", paths.lock, ": ", ErrnoText()));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) return -1;
    errno = err;
    return absl::UnavailableError(
        absl::StrCat("cannot lock the heartbeat relay's lock ", paths.lock, ": ", ErrnoText()));
  }
  // Who serves, for operators and tests.
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    spdlog::debug("heartbeat relay: cannot write the pid into {}: {}", paths.lock, ErrnoText());
  }
  return fd;
}

// One follower's HostHeartbeatStream. Its fields are the relay's (guarded by its mu_); gRPC's
// calls on it (StartWrite, Finish) are made outside that lock, and only by whoever set
// `writing` or `finished` under it, which keeps the reactor alive until that call is made.
class HeartbeatRelay::Follower final
    : public grpc::ServerBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse> {
 public:
  explicit Follower(HeartbeatRelay* relay) : relay_(relay) {}
  void Begin() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The follower half-closed (its members closed in the last message) or is gone: what it
      // still carried is lost.
      std::vector<Action> due;
      {
        absl::MutexLock l(&relay_->mu_);
        relay_->Lose(this);
        if (!end.has_value()) end = absl::OkStatus();
        Due(&due);
      }
      Run(due);
      return;
    }
    bool woke = false;
    const absl::Status s = relay_->Take(this, request_, &woke);
    if (woke) relay_->wake_();
    if (!s.ok()) {
      End(s);
      return;
    }
    {
      absl::MutexLock l(&relay_->mu_);
      if (end.has_value()) return;
    }
    StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    std::vector<Action> due;
    {
      absl::MutexLock l(&relay_->mu_);
      writing = false;
      if (!ok && !end.has_value()) end = absl::CancelledError("the follower's stream broke");
      Due(&due);
    }
    Run(due);
  }

  void OnDone() override {
    relay_->Forget(this);
    delete this;
  }

  // Ends the stream with `s` once the write in flight is done (the first end stands).
  void End(const absl::Status& s) {
    std::vector<Action> due;
    {
      absl::MutexLock l(&relay_->mu_);
      if (!end.has_value()) end = s;
      Due(&due);
    }
    Run(due);
  }

  // What is due on this stream: the next write, or its Finish.
  struct Action {
    Follower* follower;
    bool write;
    grpc::Status status;
  };
  void Due(std::vector<Action>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(relay_->mu_) {
    if (writing || finished) return;
    if (due && !end.has_value()) {
      out_ = std::move(unsent);
      unsent.Clear();
      due = false;
      writing = true;
      last_write = absl::Now();
      out->push_back({this, true, grpc::Status::OK});
    } else if (end.has_value()) {
      finished = true;
      out->push_back({this, false, ToGrpc(*end)});
    }
  }
  static void Run(const std::vector<Action>& actions) {
    for (const Action& a : actions) {
      if (a.write) {
        a.follower->StartWrite(&a.follower->out_);
      } else {
        a.follower->Finish(a.status);
      }
    }
  }

  // Guarded by the relay's mu_.
  std::set<Key> keys;                   // the members it carries
  v1::HostHeartbeatResponse unsent;     // answers not yet written (newest per member)
  bool due = false;                     // unsent is to be written
  bool writing = false;                 // a write is in flight (out_)
  std::optional<absl::Status> end;      // ending with this
  bool finished = false;                // Finish was called
  absl::Time last_write = absl::Now();  // (for its keep-alive; from the stream's start)
  int64_t reply_interval_ms = kMaxReplyIntervalMs;
  absl::Duration interval = absl::InfiniteDuration();

 private:
  HeartbeatRelay* const relay_;
  v1::HostHeartbeatRequest request_;  // the read path's
  v1::HostHeartbeatResponse out_;     // the write in flight's
};

class HeartbeatRelay::Service final : public v1::Coordinator::CallbackService {
 public:
  explicit Service(HeartbeatRelay* relay) : relay_(relay) {}

  grpc::ServerBidiReactor<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse>*
  HostHeartbeatStream(grpc::CallbackServerContext*) override {
    auto* f = new Follower(relay_);
    std::optional<absl::Status> refuse;
    {
      absl::MutexLock l(&relay_->mu_);
      relay_->followers_.insert(f);
      if (relay_->stopping_) {
        refuse = absl::UnavailableError("the host's heartbeat relay is stopping");
      } else if (!relay_->unsupported_.ok()) {
        refuse = relay_->unsupported_;
      }
    }
    if (refuse.has_value()) {
      f->End(*refuse);
    } else {
      f->Begin();
    }
    return f;
  }

 private:
  HeartbeatRelay* const relay_;
};

HeartbeatRelay::HeartbeatRelay(RelayPaths paths, int lock_fd, std::function<void()> wake)
    : paths_(std::move(paths)), lock_fd_(lock_fd), wake_(std::move(wake)) {}

absl::StatusOr<std::unique_ptr<HeartbeatRelay>> HeartbeatRelay::Start(
    const RelayPaths& paths, int lock_fd, std::function<void()> wake) {
  // A socket left by a relay that died: the lock says nobody serves on it.
  ::unlink(paths.socket.c_str());
  std::unique_ptr<HeartbeatRelay> relay(new HeartbeatRelay(paths, lock_fd, std::move(wake)));
  relay->service_ = std::make_unique<Service>(relay.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + paths.socket, grpc::InsecureServerCredentials());
  builder.RegisterService(relay->service_.get());
  relay->server_ = builder.BuildAndStart();
  if (relay->server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve the host's heartbeat relay on ", paths.socket));
  }
  ::chmod(paths.socket.c_str(), 0600);
  spdlog::info("heartbeat relay: this process carries the host's beats (socket {})",
               paths.socket);
  return relay;
}

HeartbeatRelay::~HeartbeatRelay() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (server_ != nullptr) {
    EndAll(absl::UnavailableError(
        "the host's heartbeat relay stopped (its process has no rank left, or exits); the next "
        "process to try its lock takes over"));
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
    absl::MutexLock l(&mu_);
    auto gone = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return followers_.empty(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&gone), absl::Seconds(5))) {
      spdlog::warn("heartbeat relay: {} follower streams still open after 5 s", followers_.size());
    }
  }
  // The socket goes before the lock: a process that then finds no socket takes the lock.
  ::unlink(paths_.socket.c_str());
  ::close(lock_fd_);
}

absl::Status HeartbeatRelay::Take(Follower* from, const v1::HostHeartbeatRequest& request,
                                  bool* woke) {
  if (static_cast<size_t>(request.beats_size()) > kMaxHostBeatsPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a HostHeartbeatRequest carries at most ", kMaxHostBeatsPerRequest, " beats, this one ",
        request.beats_size()));
  }
  if (request.reply_interval_ms() < 1 || request.reply_interval_ms() > kMaxReplyIntervalMs) {
    return absl::InvalidArgumentError(absl::StrCat("reply_interval_ms is ",
                                                   request.reply_interval_ms(), ": must be in 1..",
                                                   kMaxReplyIntervalMs));
  }
  absl::MutexLock l(&mu_);
  if (stopping_) return absl::UnavailableError("the host's heartbeat relay is stopping");
  from->reply_interval_ms = request.reply_interval_ms();
  from->interval = request.beat_interval_ms() > 0
                       ? absl::Milliseconds(request.beat_interval_ms())
                       : absl::InfiniteDuration();
  for (const v1::HeartbeatRequest& beat : request.beats()) {
    if (beat.lost()) {
      return absl::InvalidArgumentError(
          "a beat sent to the host's heartbeat relay has `lost` set: only the relay sets it");
    }
    Key key(beat.job_id(), beat.rank());
    auto it = remotes_.find(key);
    if (it == remotes_.end()) {
      if (beat.closing()) continue;  // never carried here: nothing to close
      if (remotes_.size() >= kMaxMembers) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the host's heartbeat relay carries at most ", kMaxMembers,
            " members; rank ", beat.rank(), " of job ", beat.job_id().substr(0, 256),
            " is one too many"));
      }
      it = remotes_.emplace(key, Remote{}).first;
      *woke = true;
    }
    Remote& r = it->second;
    if (r.owner != from) {
      // (A process that took the rank over from another: the newest carrier answers for it.)
      if (r.owner != nullptr) r.owner->keys.erase(key);
      r.owner = from;
      from->keys.insert(key);
    }
    r.beat = beat;
    r.seq = next_seq_++;
    r.pending = true;
    if (beat.closing()) {
      // Sent once more (closing), then gone.
      from->keys.erase(key);
      r.owner = nullptr;
    }
  }
  return absl::OkStatus();
}

void HeartbeatRelay::Lose(Follower* from) {
  for (const Key& key : from->keys) {
    auto it = remotes_.find(key);
    if (it == remotes_.end() || it->second.owner != from) continue;
    Remote& r = it->second;
    r.owner = nullptr;
    r.beat.set_closing(false);
    r.beat.set_lost(true);
    r.seq = next_seq_++;
    r.pending = true;
  }
  from->keys.clear();
}

void HeartbeatRelay::Forget(Follower* from) {
  absl::MutexLock l(&mu_);
  Lose(from);
  followers_.erase(from);
}

std::vector<HeartbeatRelay::Taken> HeartbeatRelay::Collect(size_t room, bool closing_all,
                                                           v1::HostHeartbeatRequest* request) {
  std::vector<Taken> taken;
  absl::MutexLock l(&mu_);
  for (const auto& [key, r] : remotes_) {
    if (taken.size() >= room) break;
    if (!r.pending && !closing_all) continue;
    v1::HeartbeatRequest* beat = request->add_beats();
    *beat = r.beat;
    if (closing_all && !beat->lost()) beat->set_closing(true);
    taken.push_back({key, r.seq});
  }
  return taken;
}

void HeartbeatRelay::Sent(const std::vector<Taken>& taken) {
  absl::MutexLock l(&mu_);
  for (const Taken& t : taken) {
    auto it = remotes_.find(t.key);
    if (it == remotes_.end() || it->second.seq != t.seq) continue;
    it->second.pending = false;
    if (it->second.beat.closing() || it->second.beat.lost()) remotes_.erase(it);
  }
}

bool HeartbeatRelay::has_members() const {
  absl::MutexLock l(&mu_);
  return !remotes_.empty();
}

absl::Duration HeartbeatRelay::Interval() const {
  absl::MutexLock l(&mu_);
  absl::Duration d = absl::InfiniteDuration();
  for (const Follower* f : followers_) d = std::min(d, f->interval);
  return d;
}

int64_t HeartbeatRelay::ReplyIntervalMs() const {
  absl::MutexLock l(&mu_);
  int64_t ms = kMaxReplyIntervalMs;
  for (const Follower* f : followers_) {
    ms = std::min(ms, std::max<int64_t>(1, f->reply_interval_ms / 2));
  }
  return ms;
}

void HeartbeatRelay::Deliver(const v1::HostHeartbeatResponse& reply) {
  std::vector<Follower::Action> due;
  {
    absl::MutexLock l(&mu_);
    for (const v1::MemberHeartbeatReply& m : reply.members()) {
      const Key key(m.job_id(), m.rank());
      auto it = remotes_.find(key);
      if (it == remotes_.end() || it->second.owner == nullptr) continue;
      Follower* f = it->second.owner;
      bool merged = false;
      for (v1::MemberHeartbeatReply& old : *f->unsent.mutable_members()) {
        if (old.rank() == m.rank() && old.job_id() == m.job_id()) {
          old = m;
          merged = true;
          break;
        }
      }
      if (!merged) *f->unsent.add_members() = m;
      f->due = true;
      if (m.error_code() != 0) {
        // The coordinator forgot the member: so does the relay (its next beat is a first one).
        f->keys.erase(key);
        remotes_.erase(it);
      }
    }
    const absl::Time now = absl::Now();
    for (Follower* f : followers_) {
      if (!f->due && now - f->last_write >= absl::Milliseconds(f->reply_interval_ms) / 2) {
        f->due = true;  // an empty reply: the keep-alive
      }
      f->Due(&due);
    }
  }
  Follower::Run(due);
}

void HeartbeatRelay::EndAll(const absl::Status& status, bool unsupported) {
  std::vector<Follower::Action> due;
  {
    absl::MutexLock l(&mu_);
    if (unsupported) unsupported_ = status;
    for (Follower* f : followers_) {
      f->keys.clear();
      if (!f->end.has_value()) f->end = status;
      f->Due(&due);
    }
    // (The coordinator counts every member of the broken stream as lost already.)
    remotes_.clear();
  }
  Follower::Run(due);
}

}  // namespace modelavg::client
