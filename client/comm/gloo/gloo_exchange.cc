#include "client/comm/gloo/gloo_exchange.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"

namespace modelavg::client {
namespace {

// Gloo's slots are (prefix << 56 | tag); Gloo's own collectives use prefixes 1..8.
constexpr uint8_t kExchangeSlotPrefix = 0x4d;

using Clock = std::chrono::steady_clock;

// What is left until `deadline`, at least 1 ms (Gloo treats a wait's timeout as its own).
std::chrono::milliseconds Remaining(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()));
}

// Waits for one more completion on `buf` within the deadline. Gloo throws on a timeout (and
// fails every pair of the context) and on a failed pair; an abort of the wait itself (never
// asked for here) is an error too.
void WaitRecv(gloo::transport::UnboundBuffer& buf, Clock::time_point deadline) {
  if (!buf.waitRecv(nullptr, Remaining(deadline))) {
    throw gloo::IoException("a receive of the direct exchange was aborted");
  }
}
void WaitSend(gloo::transport::UnboundBuffer& buf, Clock::time_point deadline) {
  if (!buf.waitSend(nullptr, Remaining(deadline))) {
    throw gloo::IoException("a send of the direct exchange was aborted");
  }
}

// out = a + b, element-wise (each sum exact IEEE arithmetic, so every member that adds the same
// values in the same order gets the same bits, vectorized or not).
template <typename T>
void Add(const T* a, const T* b, size_t n, T* out) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// out = (a + b) / divisor in one pass, the same operations as Add then DivideInto
// (host_staging.h): a power-of-two divisor multiplies by its exact reciprocal.
template <typename T>
void AddDivide(const T* a, const T* b, size_t n, T divisor, T* out) {
  int exp = 0;
  if (std::frexp(divisor, &exp) == static_cast<T>(0.5)) {
    const T inv = static_cast<T>(1) / divisor;
    for (size_t i = 0; i < n; ++i) out[i] = (a[i] + b[i]) * inv;
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = (a[i] + b[i]) / divisor;
  }
}

// The finite check's sum, divided before it sums (as PyTorch's averagers and the checked ring
// do: the mean of the largest floats is no false Inf): out = a / divisor + b / divisor, and
// out += b / divisor. A power-of-two divisor multiplies by its exact reciprocal (same bits).
template <typename T>
void DivideAdd(const T* a, const T* b, size_t n, T divisor, T* out) {
  int exp = 0;
  if (std::frexp(divisor, &exp) == static_cast<T>(0.5)) {
    const T inv = static_cast<T>(1) / divisor;
    for (size_t i = 0; i < n; ++i) out[i] = a[i] * inv + b[i] * inv;
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = a[i] / divisor + b[i] / divisor;
  }
}
template <typename T>
void AccumulateDivided(const T* b, size_t n, T divisor, T* out) {
  int exp = 0;
  if (std::frexp(divisor, &exp) == static_cast<T>(0.5)) {
    const T inv = static_cast<T>(1) / divisor;
    for (size_t i = 0; i < n; ++i) out[i] += b[i] * inv;
  } else {
    for (size_t i = 0; i < n; ++i) out[i] += b[i] / divisor;
  }
}

// One word to every peer and one from every peer: the commit vote, and the finite check's
// codes.
class Words {
 public:
  Words(gloo::Context& context, uint32_t tag, uint64_t word)
      : context_(context),
        slot_(gloo::Slot::build(kExchangeSlotPrefix, tag)),
        word_(word),
        got_(static_cast<size_t>(context.size), 0) {
    got_[static_cast<size_t>(context.rank)] = word;
    send_ = context_.createUnboundBuffer(&word_, sizeof(word_));
    recv_ = context_.createUnboundBuffer(got_.data(), got_.size() * sizeof(uint64_t));
  }
  // Every peer's word may arrive from now on.
  void PostReceives() {
    for (int p = 0; p < context_.size; ++p) {
      if (p != context_.rank) recv_->recv(p, slot_, p * sizeof(uint64_t), sizeof(uint64_t));
    }
  }
  void Send() {
    for (int p = 0; p < context_.size; ++p) {
      if (p != context_.rank) send_->send(p, slot_, 0, sizeof(uint64_t));
    }
  }
  // Waits for every peer's word and for this member's to be sent.
  void Wait(Clock::time_point deadline) {
    for (int i = 1; i < context_.size; ++i) WaitRecv(*recv_, deadline);
    for (int i = 1; i < context_.size; ++i) WaitSend(*send_, deadline);
  }
  // Every member's word, this member's included, in member order (after Wait).
  const std::vector<uint64_t>& got() const { return got_; }
  // The vote's verdict (after Wait): throws when a peer sent another word.
  void CheckSame() const {
    for (int p = 0; p < context_.size; ++p) {
      if (p != context_.rank && got_[p] != word_) {
        throw gloo::IoException(absl::StrCat("member ", p, " voted ", got_[p], " where ", word_,
                                             " was expected: the members are not in the same "
                                             "round"));
      }
    }
  }

 private:
  gloo::Context& context_;
  const uint64_t slot_;
  uint64_t word_;
  std::vector<uint64_t> got_;
  std::unique_ptr<gloo::transport::UnboundBuffer> send_;
  std::unique_ptr<gloo::transport::UnboundBuffer> recv_;
};

template <typename T>
void RunDirect(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
               absl::FunctionRef<void(int64_t, int64_t)> prepare,
               absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
               DirectProgress* progress) {
  const int me = context.rank;
  const int n = context.size;
  const uint64_t slot = gloo::Slot::build(kExchangeSlotPrefix, plan.tag);
  const int64_t piece = static_cast<int64_t>(kDirectPieceBytes / sizeof(T));
  const int64_t pieces = (plan.total + piece - 1) / piece;
  const auto length = [&](int64_t k) { return std::min(piece, plan.total - k * piece); };
  const size_t piece_words = (kDirectPieceBytes + sizeof(double) - 1) / sizeof(double);

  scratch->recv.resize(static_cast<size_t>(n));
  scratch->sum.resize(piece_words);
  if (plan.source == nullptr) scratch->zeros.assign(piece_words, 0.0);
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends(n), recvs(n);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    std::vector<double>& window = scratch->recv[p];
    window.resize(piece_words * kDirectWindow);
    recvs[p] = context.createUnboundBuffer(window.data(), window.size() * sizeof(double));
    if (plan.source != nullptr) {
      sends[p] = context.createUnboundBuffer(const_cast<void*>(plan.source),
                                             static_cast<size_t>(plan.total) * sizeof(T));
    } else {
      sends[p] = context.createUnboundBuffer(scratch->zeros.data(), kDirectPieceBytes);
    }
  }
  std::unique_ptr<Words> vote;
  if (plan.vote != 0) {
    vote = std::make_unique<Words>(context, plan.tag + 1, plan.vote);
    vote->PostReceives();
  }
  // The finite check: every member's code, one word each way, known before any piece is
  // written (finite_check.h).
  std::unique_ptr<Words> codes;
  if (plan.check_finite) {
    codes = std::make_unique<Words>(context, plan.tag + 2, static_cast<uint64_t>(plan.finite_code));
    codes->PostReceives();
  }

  int64_t recvs_posted = 0, sends_posted = 0;
  const auto post_receives = [&](int64_t upto) {
    for (; recvs_posted < std::min(upto, pieces); ++recvs_posted) {
      const size_t at = static_cast<size_t>(recvs_posted % kDirectWindow) * kDirectPieceBytes;
      const size_t bytes = static_cast<size_t>(length(recvs_posted)) * sizeof(T);
      for (int p = 0; p < n; ++p) {
        if (p != me) recvs[p]->recv(p, slot, at, bytes);
      }
    }
  };
  const auto post_sends = [&](int64_t upto) {
    for (; sends_posted < std::min(upto, pieces); ++sends_posted) {
      const int64_t begin = sends_posted * piece;
      const int64_t len = length(sends_posted);
      prepare(begin, len);
      const size_t at = plan.source != nullptr ? static_cast<size_t>(begin) * sizeof(T) : 0;
      for (int p = 0; p < n; ++p) {
        if (p != me) sends[p]->send(p, slot, at, static_cast<size_t>(len) * sizeof(T));
      }
    }
  };
  // Every send is posted before any receive: a send posted before the peer's receive is
  // written later by Gloo's event loop thread when the peer's receive arrives, not here by this
  // thread while holding the pair's lock — during which the event loop, which only tries that
  // lock, spins on the same socket's pending reads (thousands of empty epoll_wait calls per
  // megabyte on loopback).
  post_sends(pieces);
  if (codes != nullptr) codes->Send();
  post_receives(kDirectWindow);

  // With a non-finite code from any member, every member (all read the same codes) receives
  // the rest of the exchange, so that the mesh stays in step, but reduces and writes nothing.
  bool refused = false;
  T* sum = reinterpret_cast<T*>(scratch->sum.data());
  for (int64_t k = 0; k < pieces; ++k) {
    for (int p = 0; p < n; ++p) {
      if (p != me) WaitRecv(*recvs[p], plan.deadline);
    }
    if (k == 0 && codes != nullptr) {
      // Before anything is written.
      codes->Wait(plan.deadline);
      progress->codes.assign(codes->got().begin(), codes->got().end());
      for (int64_t c : progress->codes) refused = refused || c != 0;
    }
    const int64_t begin = k * piece;
    const size_t len = static_cast<size_t>(length(k));
    const size_t at = static_cast<size_t>(k % kDirectWindow) * (kDirectPieceBytes / sizeof(T));
    const auto contribution = [&](int m) -> const T* {
      if (m != me) return reinterpret_cast<const T*>(scratch->recv[m].data()) + at;
      if (plan.source == nullptr) return reinterpret_cast<const T*>(scratch->zeros.data());
      return static_cast<const T*>(plan.source) + begin;
    };
    // The same additions in the same order on every member, the last one divided (with the
    // finite check, each contribution divided before it is added).
    const T divisor = static_cast<T>(plan.divisor);
    if (refused) {
      // Nothing to reduce.
    } else if (plan.check_finite) {
      DivideAdd(contribution(0), contribution(1), len, divisor, sum);
      for (int m = 2; m < n; ++m) AccumulateDivided(contribution(m), len, divisor, sum);
    } else if (n == 2) {
      AddDivide(contribution(0), contribution(1), len, divisor, sum);
    } else {
      Add(contribution(0), contribution(1), len, sum);
      for (int m = 2; m < n - 1; ++m) Add(sum, contribution(m), len, sum);
      AddDivide(sum, contribution(n - 1), len, divisor, sum);
    }
    if (k == pieces - 1) {
      // Every contribution is here and the last piece's mean is in `sum`: the vote travels
      // while the last piece is written. A refused round votes too (every member alike), so
      // that every posted receive is answered, but holds no result.
      progress->holding = !refused;
      if (vote != nullptr) vote->Send();
    }
    // This piece of the source may change once every peer has it.
    for (int p = 0; p < n; ++p) {
      if (p != me) WaitSend(*sends[p], plan.deadline);
    }
    if (!refused) {
      write(begin, static_cast<int64_t>(len), sum);
      progress->written = begin + static_cast<int64_t>(len);
    }
    post_receives(k + 1 + kDirectWindow);
  }
  if (vote != nullptr) {
    vote->Wait(plan.deadline);
    vote->CheckSame();
  }
}

}  // namespace

void DirectAverage(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
                   absl::FunctionRef<void(int64_t, int64_t)> prepare,
                   absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
                   DirectProgress* progress) {
  *progress = DirectProgress{};
  if (plan.total <= 0 || context.size < 2) {
    throw gloo::InvalidOperationException("a direct exchange needs elements and two members");
  }
  if (plan.dtype == DType::kFloat64) {
    RunDirect<double>(context, plan, scratch, prepare, write, progress);
  } else {
    RunDirect<float>(context, plan, scratch, prepare, write, progress);
  }
}

void ExchangeVote(gloo::Context& context, uint32_t tag, uint64_t word,
                  std::chrono::steady_clock::time_point deadline) {
  Words vote(context, tag, word);
  vote.PostReceives();
  vote.Send();
  vote.Wait(deadline);
  vote.CheckSame();
}

}  // namespace modelavg::client
