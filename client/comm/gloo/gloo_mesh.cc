#include "client/comm/gloo/gloo_mesh.h"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <thread>
#include <typeinfo>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
#include "client/comm/gloo/pair_proof.h"
#include "common/status_util.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/context.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/address.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "spdlog/spdlog.h"

// Gloo fails a TCP pair from a user thread itself (when a wait on one of its buffers times out)
// with gloo::transport::tcp::Pair::signalExceptionExternal: under the pair's lock it wakes every
// pending send and receive with an error and closes the socket, so that the peers' collectives
// on the mesh fail as well. That member is protected, and Debian's libgloo-dev lacks
// gloo/common/memory.h, which gloo/transport/tcp/pair.h includes, so the class cannot even be
// declared here: the exported function is called by its symbol. On x86-64 (Itanium C++ ABI) a
// member function returning a class by value takes the return slot, then `this`, then its
// arguments, which is this declaration's signature; tcp::Pair's primary base is
// transport::Pair, so the two pointers are equal. GlooAbortTest (client_gloo_abort_test.cc)
// proves it on every build.
#if defined(__x86_64__) && defined(__GLIBCXX__)
#define MODELAVG_GLOO_PAIR_ABORT 1
std::exception_ptr ModelavgGlooTcpPairSignalExceptionExternal(gloo::transport::Pair* pair,
                                                             const std::string& msg)
    __asm__("_ZN4gloo9transport3tcp4Pair23signalExceptionExternalERKNSt7__cxx1112basic_"
            "stringIcSt11char_traitsIcESaIcEEE");
#else
#define MODELAVG_GLOO_PAIR_ABORT 0
#endif

namespace modelavg::client {
namespace {

// A gloo::Context whose full mesh modelavg connects itself (ConnectMesh) instead of
// gloo::rendezvous::Context::connectFullMesh, which waits for each peer up to five times the
// timeout and cannot be interrupted: a member still connecting the mesh of a generation that is
// over would sit there for minutes.
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}
  void Adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> transport) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

// An unbound buffer of the mesh: Gloo's own (`inner`), registered with the mesh's waits while it
// lives, every call passed on. Gloo's pairs see only the inner buffer (its send and recv hand
// themselves to the pair), so the transport is unchanged.
class TrackedUnboundBuffer final : public gloo::transport::UnboundBuffer {
 public:
  TrackedUnboundBuffer(std::unique_ptr<gloo::transport::UnboundBuffer> inner,
                       std::shared_ptr<MeshWaits> waits)
      : gloo::transport::UnboundBuffer(inner->ptr, inner->size),
        inner_(std::move(inner)),
        waits_(std::move(waits)) {
    waits_->Add(inner_.get());
  }
  ~TrackedUnboundBuffer() override { waits_->Remove(inner_.get()); }

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override {
    return inner_->waitRecv(rank, timeout);
  }
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override {
    return inner_->waitSend(rank, timeout);
  }
  void abortWaitRecv() override { inner_->abortWaitRecv(); }
  void abortWaitSend() override { inner_->abortWaitSend(); }
  void send(int dst_rank, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->send(dst_rank, slot, offset, nbytes);
  }
  void recv(int src_rank, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->recv(src_rank, slot, offset, nbytes);
  }
  void recv(std::vector<int> src_ranks, uint64_t slot, size_t offset, size_t nbytes) override {
    inner_->recv(std::move(src_ranks), slot, offset, nbytes);
  }

 private:
  const std::unique_ptr<gloo::transport::UnboundBuffer> inner_;
  const std::shared_ptr<MeshWaits> waits_;
};

// The mesh's transport: Gloo's TCP context (`inner`), whose unbound buffers it tracks. Pairs
// are the inner context's.
class TrackedTransport final : public gloo::transport::Context {
 public:
  TrackedTransport(std::shared_ptr<gloo::transport::Context> inner,
                   std::shared_ptr<MeshWaits> waits)
      : gloo::transport::Context(inner->rank, inner->size),
        inner_(std::move(inner)),
        waits_(std::move(waits)) {
    setTimeout(inner_->getTimeout());
  }

  std::unique_ptr<gloo::transport::Pair>& getPair(int rank) override {
    return inner_->getPair(rank);
  }
  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    return inner_->createPair(rank);
  }
  std::unique_ptr<gloo::transport::UnboundBuffer> createUnboundBuffer(void* ptr,
                                                                      size_t size) override {
    return std::make_unique<TrackedUnboundBuffer>(inner_->createUnboundBuffer(ptr, size),
                                                  waits_);
  }

 private:
  const std::shared_ptr<gloo::transport::Context> inner_;
  const std::shared_ptr<MeshWaits> waits_;
};

}  // namespace

void MeshWaits::AbortAll() {
  absl::MutexLock l(&mu_);
  aborted_ = true;
  for (gloo::transport::UnboundBuffer* b : live_) {
    b->abortWaitSend();
    b->abortWaitRecv();
  }
}

bool MeshWaits::aborted() const {
  absl::MutexLock l(&mu_);
  return aborted_;
}

void MeshWaits::Add(gloo::transport::UnboundBuffer* buffer) {
  absl::MutexLock l(&mu_);
  live_.insert(buffer);
  if (aborted_) {
    buffer->abortWaitSend();
    buffer->abortWaitRecv();
  }
}

void MeshWaits::Remove(gloo::transport::UnboundBuffer* buffer) {
  absl::MutexLock l(&mu_);
  live_.erase(buffer);
}

void IgnoreDefaultSigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    std::signal(SIGPIPE, SIG_IGN);
    spdlog::debug("SIGPIPE ignored so that a dead peer surfaces as an averaging error");
  }
}

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> CreateGlooDevice(
    const std::string& hostname) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot create a Gloo TCP device on '", hostname,
                                               "' (set ClientOptions.gloo_hostname to an "
                                               "address of this host): ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat("cannot create a Gloo TCP device on '", hostname,
                                            "': unknown error"));
  }
}

absl::Status FromGlooException(const std::exception& e, absl::string_view what,
                               absl::Time started, absl::Duration timeout) {
  const std::string msg = e.what();
  if (absl::Now() - started >= timeout) {
    return SetErrorKind(
        absl::DeadlineExceededError(absl::StrCat(
            what, " timed out after ", absl::FormatDuration(timeout),
            ": a peer did not take part in time (dead, stuck, or passing a different schedule); "
            "Gloo: ", msg)),
        ErrorKind::kTimeout);
  }
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
    return SetErrorKind(
        absl::UnavailableError(absl::StrCat(
            what, " failed: a peer's connection broke (it probably died); Gloo: ", msg)),
        ErrorKind::kPeerFailure);
  }
  return absl::InternalError(absl::StrCat(what, " failed; Gloo: ", msg));
}

void FailPair(gloo::transport::Pair* pair, int member, const std::string& msg) {
  if (pair == nullptr) return;
#if MODELAVG_GLOO_PAIR_ABORT
  if (std::string(typeid(*pair).name()) != "N4gloo9transport3tcp4PairE") {
    spdlog::warn("Gloo pair to member {} is not a TCP pair ({}): it cannot be aborted; the "
                 "collective ends at its timeout",
                 member, typeid(*pair).name());
    return;
  }
  try {
    ModelavgGlooTcpPairSignalExceptionExternal(pair, msg);
  } catch (const std::exception& e) {
    spdlog::debug("aborting the Gloo pair to member {}: {}", member, e.what());
  }
#else
  (void)member;
  (void)msg;
  spdlog::warn("this platform cannot abort a Gloo collective: it ends at its timeout");
#endif
}

namespace {

// A pair is set up at most this many times (the first connection, then again after a failed
// connect or proof) before the set-up fails naming the peer.
constexpr int kPairAttempts = 4;
// The slots of the proofs' messages, two per attempt. Gloo's slots are (prefix << 56 | tag): the
// proofs' prefix is 0x6d, which neither Gloo's collectives (1..8) nor the direct exchange (0x4d,
// gloo_exchange.cc) use.
constexpr uint64_t kProofSlotBase = 0x6d61766770000000ull;

// How long a pair's proof may take once this member's connections are made: round trips between
// members that are all connecting the same mesh, so a quarter of the transport's timeout (at
// least 2 s, at most 10 s); a stranger that stays silent costs this much per attempt.
absl::Duration ProofLimit(absl::Duration timeout) {
  return std::clamp(timeout / 4, absl::Seconds(2), absl::Seconds(10));
}

std::string AddressString(const sockaddr_storage& ss) {
  if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) return "an unknown address";
  return gloo::transport::tcp::Address(ss).str();
}

bool SameEndpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

// Where the connection a pair accepted on `local` (its listening address) comes from, for the
// log: Gloo keeps the pair's socket to itself, so this process's descriptors are searched for a
// connected one on that address. "an unknown address" when none is found (the pair connected
// out, or the connection is gone). Called only for a pair that failed its proof.
std::string RemoteOfConnectionOn(const sockaddr_storage& local) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return "an unknown address";
  std::string found = "an unknown address";
  while (dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir)) continue;
    sockaddr_storage mine{}, theirs{};
    socklen_t len = sizeof(mine);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) != 0) continue;
    if (!SameEndpoint(mine, local)) continue;
    len = sizeof(theirs);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &len) != 0) continue;
    found = AddressString(theirs);
    break;
  }
  closedir(dir);
  return found;
}

// What member `rank` published for its pair with `other`: the pair's Gloo address, then the
// random key of kPairKeyBytes that makes half of the pair's secret.
struct PairRecord {
  std::vector<char> address;
  std::string key;
};

absl::StatusOr<PairRecord> ParseRecord(const std::vector<char>& record, int owner) {
  if (record.size() <= kPairKeyBytes) {
    return absl::InternalError(absl::StrCat(
        "member ", owner, " published a pair record of ", record.size(),
        " bytes: not a modelavg mesh of this version (every member must run a modelavg client "
        "that proves its pairs; upgrade the older ones)"));
  }
  PairRecord out;
  out.address.assign(record.begin(), record.end() - kPairKeyBytes);
  out.key.assign(record.end() - kPairKeyBytes, record.end());
  return out;
}

// The proof of membership on each pair of `todo` (pair_proof.h), all at once, before any byte
// of a collective: returns the members whose pair failed it (silent, wrong, cut off, or not a
// Gloo peer at all), each logged. `secrets[i]` is the pair's secret with member i. Every wait
// ends at `limit` from now: a watchdog aborts the waits, so that Gloo's own timeout, which would
// fail every pair of the context, never fires.
std::vector<int> ProvePairs(gloo::transport::Context& transport, int rank,
                            const std::vector<int>& todo, const std::vector<std::string>& secrets,
                            const std::vector<sockaddr_storage>& addresses, uint64_t slot,
                            absl::Duration limit) {
  struct Side {
    int peer = -1;
    std::string my_nonce, peer_nonce = std::string(kPairNonceBytes, '\0');
    std::string my_proof, peer_proof = std::string(kPairProofBytes, '\0');
    std::unique_ptr<gloo::transport::UnboundBuffer> out_nonce, in_nonce, out_proof, in_proof;
    std::string failure;  // empty: proven so far
  };
  if (todo.empty()) return {};
  std::vector<Side> sides(todo.size());
  for (size_t s = 0; s < todo.size(); ++s) {
    Side& side = sides[s];
    side.peer = todo[s];
    absl::StatusOr<std::string> nonce = SecureRandomBytes(kPairNonceBytes);
    if (!nonce.ok()) {
      side.failure = std::string(nonce.status().message());
      side.my_nonce.assign(kPairNonceBytes, '\0');
    } else {
      side.my_nonce = *std::move(nonce);
    }
    side.my_proof.assign(kPairProofBytes, '\0');
    side.out_nonce = transport.createUnboundBuffer(side.my_nonce.data(), kPairNonceBytes);
    side.in_nonce = transport.createUnboundBuffer(side.peer_nonce.data(), kPairNonceBytes);
    side.out_proof = transport.createUnboundBuffer(side.my_proof.data(), kPairProofBytes);
    side.in_proof = transport.createUnboundBuffer(side.peer_proof.data(), kPairProofBytes);
  }
  absl::Mutex mu;
  bool done = false;
  std::thread watchdog([&] {
    absl::MutexLock l(&mu);
    if (mu.AwaitWithTimeout(absl::Condition(&done), limit)) return;
    for (Side& side : sides) {
      for (auto* b : {side.out_nonce.get(), side.in_nonce.get(), side.out_proof.get(),
                      side.in_proof.get()}) {
        b->abortWaitSend();
        b->abortWaitRecv();
      }
    }
  });
  // Longer than `limit`: the watchdog ends the waits first.
  const std::chrono::milliseconds wait(absl::ToInt64Milliseconds(limit + absl::Minutes(1)));
  auto step = [&](Side& side, const char* what, auto&& fn) {
    if (!side.failure.empty()) return;
    try {
      if (!fn()) side.failure = absl::StrCat("no ", what, " within ", absl::FormatDuration(limit));
    } catch (const std::exception& e) {
      side.failure = absl::StrCat("the connection failed waiting for its ", what, ": ", e.what());
    }
  };
  // Each pair on a thread of its own: a silent or broken connection holds up no other pair.
  auto prove = [&](Side& side) {
    step(side, "nonce", [&] {
      side.in_nonce->recv(side.peer, slot, 0, kPairNonceBytes);
      side.out_nonce->send(side.peer, slot, 0, kPairNonceBytes);
      return true;
    });
    step(side, "nonce", [&] { return side.in_nonce->waitRecv(nullptr, wait); });
    step(side, "nonce's delivery", [&] { return side.out_nonce->waitSend(nullptr, wait); });
    if (!side.failure.empty()) return;
    absl::StatusOr<std::string> proof =
        PairProof(secrets[side.peer], rank, side.peer, side.peer_nonce, side.my_nonce);
    if (!proof.ok()) {
      side.failure = std::string(proof.status().message());
      return;
    }
    // Into the bytes the send buffer was made on.
    std::memcpy(side.my_proof.data(), proof->data(), kPairProofBytes);
    step(side, "proof", [&] {
      side.in_proof->recv(side.peer, slot + 1, 0, kPairProofBytes);
      side.out_proof->send(side.peer, slot + 1, 0, kPairProofBytes);
      return true;
    });
    step(side, "proof", [&] { return side.in_proof->waitRecv(nullptr, wait); });
    step(side, "proof's delivery", [&] { return side.out_proof->waitSend(nullptr, wait); });
    if (side.failure.empty() &&
        !CheckPairProof(secrets[side.peer], side.peer, rank, side.my_nonce, side.peer_nonce,
                        side.peer_proof)) {
      side.failure = "a wrong proof (not the member's secret, or a replayed answer)";
    }
  };
  if (sides.size() == 1) {
    prove(sides[0]);
  } else {
    std::vector<std::thread> threads;
    threads.reserve(sides.size());
    for (Side& side : sides) threads.emplace_back([&prove, &side] { prove(side); });
    for (std::thread& t : threads) t.join();
  }
  {
    absl::MutexLock l(&mu);
    done = true;
  }
  watchdog.join();
  std::vector<int> failed;
  for (Side& side : sides) {
    if (side.failure.empty()) continue;
    failed.push_back(side.peer);
    const gloo::transport::tcp::Address own(transport.getPair(side.peer)->address().bytes());
    spdlog::warn("Gloo pair with member {} ({}): the connection from {} on this member's port {} "
                 "did not prove membership of the mesh: {}; closing it and setting the pair up "
                 "again (a connection from something that is not a member: a port scanner, a "
                 "health check, a misdirected or hostile client)",
                 side.peer, AddressString(addresses[side.peer]),
                 RemoteOfConnectionOn(own.getSockaddr()), own.str(), side.failure);
    // Wakes the pair's pending operations on the buffers below and closes the connection, so
    // that nothing more is read from it or sent to it.
    FailPair(transport.getPair(side.peer).get(), side.peer,
             absl::StrCat("modelavg: the connection did not prove membership: ", side.failure));
  }
  return failed;
}

// Waits for `key` in `store` until `deadline`, in slices, so that a cancel ends it within one.
absl::Status WaitForKey(gloo::rendezvous::Store& store, const std::string& key, absl::Time deadline,
                        const std::shared_ptr<SetupCanceller>& cancel) {
  while (true) {
    MODELAVG_RETURN_IF_ERROR(cancel->status());
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return SetErrorKind(
          absl::DeadlineExceededError(absl::StrCat(
              "setting a Gloo pair up again timed out: the peer did not publish rendezvous key '",
              key, "' (it is gone, or it found the pair proven while this member did not)")),
          ErrorKind::kTimeout);
    }
    const int64_t slice_ms = std::max<int64_t>(
        1, absl::ToInt64Milliseconds(
               absl::Ceil(std::min(left, absl::Milliseconds(500)), absl::Milliseconds(1))));
    try {
      store.wait({key}, std::chrono::milliseconds(slice_ms));
      return absl::OkStatus();
    } catch (const std::exception&) {
      if (absl::Now() >= deadline) throw;
    }
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<gloo::Context>> ConnectMesh(
    gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
    int size, absl::Duration timeout, absl::Time deadline,
    const std::shared_ptr<SetupCanceller>& cancel, std::vector<sockaddr_storage>* peers,
    std::shared_ptr<MeshWaits> waits) {
  peers->assign(static_cast<size_t>(size), sockaddr_storage{});
  std::shared_ptr<gloo::transport::Context> transport = device->createContext(rank, size);
  transport->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  // The pair table changes only when a pair is set up again, under `table`, which the cancel
  // hook takes too.
  auto table = std::make_shared<absl::Mutex>();
  std::vector<std::string> keys(static_cast<size_t>(size));     // this member's, per pair
  std::vector<std::string> secrets(static_cast<size_t>(size));  // the pairs'
  // A fresh pair with member `i`, and what this member publishes for it.
  auto new_pair = [&](int i) -> absl::StatusOr<std::vector<char>> {
    MODELAVG_ASSIGN_OR_RETURN(keys[i], SecureRandomBytes(kPairKeyBytes));
    absl::MutexLock l(table.get());
    std::vector<char> record = transport->createPair(i)->address().bytes();
    record.insert(record.end(), keys[i].begin(), keys[i].end());
    return record;
  };
  std::vector<char> records;
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    MODELAVG_ASSIGN_OR_RETURN(std::vector<char> record, new_pair(i));
    records.insert(records.end(), record.begin(), record.end());
  }
  // A cancel may fail the pairs from any thread from here on. The hook holds the transport
  // weakly: it is torn down by its owner (this thread, or the communicator), never by the thread
  // that cancels.
  cancel->OnCancel([weak = std::weak_ptr<gloo::transport::Context>(transport), table, rank,
                    size](const absl::Status& why) {
    std::shared_ptr<gloo::transport::Context> transport = weak.lock();
    if (transport == nullptr) return;
    const std::string msg = absl::StrCat("set-up cancelled by modelavg: ", why.message());
    absl::MutexLock l(table.get());
    for (int i = 0; i < size; ++i) {
      if (i != rank) FailPair(transport->getPair(i).get(), i, msg);
    }
  });
  // Connects the pair with member `i` to `record` (what i published for it); false when the
  // connect failed (the peer's port refused or dropped it), logged.
  auto connect = [&](int i, const std::vector<char>& published) -> absl::StatusOr<bool> {
    MODELAVG_ASSIGN_OR_RETURN(PairRecord record, ParseRecord(published, i));
    secrets[i] = PairSecret(rank, keys[i], i, record.key);
    if (record.address.size() == gloo::transport::tcp::Address().bytes().size()) {
      (*peers)[i] = gloo::transport::tcp::Address(record.address).getSockaddr();
    }
    try {
      transport->getPair(i)->connect(record.address);
      return true;
    } catch (const std::exception& e) {
      MODELAVG_RETURN_IF_ERROR(cancel->status());
      spdlog::warn("connecting the Gloo pair with member {} ({}) failed: {}; setting it up again "
                   "(its port refused or dropped this member's connection: something that is "
                   "not a member may have connected to it first, or member {} is gone)",
                   i, AddressString((*peers)[i]), e.what(), i);
      return false;
    }
  };
  store.set(std::to_string(rank), records);
  std::vector<int> redo;  // members whose pair is to be set up again
  std::vector<int> made;  // members whose pair connected, to be proven
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    MODELAVG_RETURN_IF_ERROR(cancel->status());
    const std::string key = std::to_string(i);
    // Rounded up: a wait that ends at the deadline is reported as a timeout (FromGlooException).
    store.wait({key}, std::chrono::milliseconds(std::max<int64_t>(
                          1, absl::ToInt64Milliseconds(absl::Ceil(deadline - absl::Now(),
                                                                  absl::Milliseconds(1))) +
                                 1)));
    const std::vector<char> all = store.get(key);
    // Member i lists its pair records in member order, without its own.
    if (all.empty() || all.size() % (size - 1) != 0) {
      return absl::InternalError(absl::StrCat("member ", i, " published ", all.size(),
                                              " bytes of pair addresses: not a modelavg mesh"));
    }
    const size_t each = all.size() / (size - 1);
    const size_t index = static_cast<size_t>(rank > i ? rank - 1 : rank);
    const std::vector<char> record(all.begin() + index * each, all.begin() + (index + 1) * each);
    MODELAVG_ASSIGN_OR_RETURN(bool connected, connect(i, record));
    (connected ? made : redo).push_back(i);
  }
  const absl::Duration limit = ProofLimit(timeout);
  for (int attempt = 0;; ++attempt) {
    MODELAVG_RETURN_IF_ERROR(cancel->status());
    for (int i : ProvePairs(*transport, rank, made, secrets, *peers,
                            kProofSlotBase + 2 * static_cast<uint64_t>(attempt), limit)) {
      redo.push_back(i);
    }
    MODELAVG_RETURN_IF_ERROR(cancel->status());
    if (redo.empty()) break;
    std::sort(redo.begin(), redo.end());
    if (attempt + 1 >= kPairAttempts) {
      return SetErrorKind(
          absl::UnavailableError(absl::StrCat(
              "setting up the Gloo pair with member ", redo[0], " failed ", kPairAttempts,
              " times during set-up: its connection never proved membership of the mesh (a "
              "stray connection took the port each time: a port scanner, a health check, a "
              "misdirected or hostile client) or member ", redo[0],
              " is gone; if the coordinator reports no failure of member ", redo[0],
              ", look for the stray connection on this host's network (the warnings above name "
              "the ports)")),
          ErrorKind::kStrayConnection, redo[0]);
    }
    // Both ends of a failed pair find it failed (the connecting end's connect, or both ends'
    // proofs) and set it up again under keys of this attempt; a pair that proved is kept.
    const int next = attempt + 1;
    for (int i : redo) {
      MODELAVG_ASSIGN_OR_RETURN(std::vector<char> record, new_pair(i));
      store.set(absl::StrCat(rank, "/", i, "/", next), record);
    }
    // Each attempt has the transport's timeout to meet the peer again.
    const absl::Time meet = std::max(deadline, absl::Now() + timeout);
    made.clear();
    std::vector<int> again;
    for (int i : redo) {
      const std::string key = absl::StrCat(i, "/", rank, "/", next);
      MODELAVG_RETURN_IF_ERROR(WaitForKey(store, key, meet, cancel));
      MODELAVG_ASSIGN_OR_RETURN(bool connected, connect(i, store.get(key)));
      (connected ? made : again).push_back(i);
    }
    redo = std::move(again);
  }
  auto context = std::make_shared<MeshContext>(rank, size);
  context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  context->Adopt(std::move(device),
                 std::make_shared<TrackedTransport>(std::move(transport), std::move(waits)));
  return context;
}

}  // namespace modelavg::client
