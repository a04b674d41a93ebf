#include "client/comm/gloo/gloo_mesh.h"

#include <netinet/in.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <typeinfo>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
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

absl::StatusOr<std::shared_ptr<gloo::Context>> ConnectMesh(
    gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
    int size, absl::Duration timeout, absl::Time deadline,
    const std::shared_ptr<SetupCanceller>& cancel, std::vector<sockaddr_storage>* peers,
    std::shared_ptr<MeshWaits> waits) {
  peers->assign(static_cast<size_t>(size), sockaddr_storage{});
  std::shared_ptr<gloo::transport::Context> transport = device->createContext(rank, size);
  transport->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  std::vector<char> addresses;
  for (int i = 0; i < size; ++i) {
    if (i == rank) continue;
    std::unique_ptr<gloo::transport::Pair>& pair = transport->createPair(i);
    const std::vector<char> bytes = pair->address().bytes();
    addresses.insert(addresses.end(), bytes.begin(), bytes.end());
  }
  // The pair table is complete and never changes again: a cancel may fail the pairs from any
  // thread from here on. The hook holds the transport weakly: it is torn down by its owner
  // (this thread, or the communicator), never by the thread that cancels.
  cancel->OnCancel([weak = std::weak_ptr<gloo::transport::Context>(transport), rank,
                    size](const absl::Status& why) {
    std::shared_ptr<gloo::transport::Context> transport = weak.lock();
    if (transport == nullptr) return;
    const std::string msg = absl::StrCat("set-up cancelled by modelavg: ", why.message());
    for (int i = 0; i < size; ++i) {
      if (i != rank) FailPair(transport->getPair(i).get(), i, msg);
    }
  });
  store.set(std::to_string(rank), addresses);
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
    // Member i lists the addresses of its pairs in member order, without its own.
    if (all.empty() || all.size() % (size - 1) != 0) {
      return absl::InternalError(absl::StrCat("member ", i, " published ", all.size(),
                                              " bytes of pair addresses: not a modelavg mesh"));
    }
    const size_t each = all.size() / (size - 1);
    const size_t index = static_cast<size_t>(rank > i ? rank - 1 : rank);
    const std::vector<char> address(all.begin() + index * each,
                                    all.begin() + (index + 1) * each);
    if (address.size() == gloo::transport::tcp::Address().bytes().size()) {
      (*peers)[i] = gloo::transport::tcp::Address(address).getSockaddr();
    }
    try {
      transport->getPair(i)->connect(address);
    } catch (const std::exception& e) {
      MODELAVG_RETURN_IF_ERROR(cancel->status());
      return SetErrorKind(
          absl::UnavailableError(absl::StrCat(
              "connecting the Gloo mesh to member ", i, " failed during set-up: its port "
              "refused or dropped this member's connection, which happens when something that "
              "is not a member connected to that port first (a stray connection: a port "
              "scanner, a health check, a misdirected client) or when member ", i,
              " is gone; if the coordinator reports no failure of member ", i,
              ", look for the stray connection on this host's network; Gloo: ", e.what())),
          ErrorKind::kStrayConnection, i);
    }
  }
  auto context = std::make_shared<MeshContext>(rank, size);
  context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  context->Adopt(std::move(device),
                 std::make_shared<TrackedTransport>(std::move(transport), std::move(waits)));
  return context;
}


}  // namespace modelavg::client
