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

// The sum of the contributions in member order, the last addition divided (with the finite
// check, each contribution divided before it is added): the same additions in the same order on
// every member, so every member that sums the same values gets the same bits.
template <typename T>
void SumInOrder(const DirectPlan& plan, int n, absl::FunctionRef<const T*(int)> contribution,
                size_t len, T* out) {
  const T divisor = static_cast<T>(plan.divisor);
  if (plan.check_finite) {
    DivideAdd(contribution(0), contribution(1), len, divisor, out);
    for (int m = 2; m < n; ++m) AccumulateDivided(contribution(m), len, divisor, out);
  } else if (n == 2) {
    AddDivide(contribution(0), contribution(1), len, divisor, out);
  } else {
    Add(contribution(0), contribution(1), len, out);
    for (int m = 2; m < n - 1; ++m) Add(out, contribution(m), len, out);
    AddDivide(out, contribution(n - 1), len, divisor, out);
  }
}

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
    // The same additions in the same order on every member.
    if (!refused) SumInOrder<T>(plan, n, contribution, len, sum);
    if (k == pieces - 1) {
      // Every contribution is here and the last piece's mean is in `sum`: the vote travels
      // while the last piece is written. A refused round votes too (every member alike), so
      // that every posted receive is answered, but holds no result.
      progress->holding = !refused;
      progress->rest = sum;
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

template <typename T>
void RunScatterGather(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
                      absl::FunctionRef<void(int64_t, int64_t)> prepare,
                      absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
                      DirectProgress* progress) {
  const int me = context.rank;
  const int n = context.size;
  // Contributions to an owner, an owner's mean to every member and the closing word each in
  // slots of their own.
  const uint64_t scatter_slot = gloo::Slot::build(kExchangeSlotPrefix, plan.tag);
  const uint64_t gather_slot = gloo::Slot::build(kExchangeSlotPrefix + 1, plan.tag);
  const uint64_t close_slot = gloo::Slot::build(kExchangeSlotPrefix + 2, plan.tag);
  const auto lo = [&](int m) { return ScatterRangeStart(plan.total, m, n); };
  const auto len_of = [&](int m) { return lo(m + 1) - lo(m); };
  const auto bytes_of = [](int64_t elems) { return static_cast<size_t>(elems) * sizeof(T); };
  const int64_t mine = lo(me), my_len = len_of(me);
  const int64_t max_len = (plan.total + n - 1) / n;
  const size_t range_words = (bytes_of(max_len) + sizeof(double) - 1) / sizeof(double);

  // Everything peer p sends this member lands in one buffer, in the order p sends it: p's
  // contribution to this member's range, the mean of p's range, and p's closing word (its vote in
  // a committed round). One buffer a peer because Gloo fails a broken pair's waits through the
  // operations still pending on a buffer, not through the one being read: while any of the
  // three is awaited, a later one is pending on the same buffer, so a cut link fails the wait
  // at once instead of at the deadline. The completions come in that order (one TCP stream,
  // sends in order), so the k-th completion is the k-th part.
  const size_t at_mean = range_words * sizeof(double);
  const size_t at_word = 2 * at_mean;
  scratch->recv.resize(static_cast<size_t>(n));
  if (plan.source == nullptr) scratch->zeros.assign(range_words, 0.0);
  scratch->sum.resize(range_words);
  T* my_mean = reinterpret_cast<T*>(scratch->sum.data());
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> from(n);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    scratch->recv[p].resize(2 * range_words + 1);
    from[p] = context.createUnboundBuffer(scratch->recv[p].data(),
                                          scratch->recv[p].size() * sizeof(double));
  }
  const auto part_of = [&](int p, size_t at) {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(scratch->recv[p].data()) + at);
  };
  // The source, packed whole before the first send (its ranges go to different members).
  const int64_t piece = static_cast<int64_t>(kDirectPieceBytes / sizeof(T));
  for (int64_t begin = 0; begin < plan.total; begin += piece) {
    prepare(begin, std::min(piece, plan.total - begin));
  }
  auto source = context.createUnboundBuffer(
      plan.source != nullptr ? const_cast<void*>(plan.source) : scratch->zeros.data(),
      plan.source != nullptr ? bytes_of(plan.total) : range_words * sizeof(double));
  auto mean_out = context.createUnboundBuffer(my_mean, range_words * sizeof(double));
  // The closing word: the vote (sent once this member holds every mean), or, in a plain round,
  // the tag (sent right after the mean).
  uint64_t word = plan.vote != 0 ? plan.vote : (static_cast<uint64_t>(plan.tag) << 1);
  auto word_out = context.createUnboundBuffer(&word, sizeof(word));
  std::unique_ptr<Words> codes;
  if (plan.check_finite) {
    codes = std::make_unique<Words>(context, plan.tag + 2, static_cast<uint64_t>(plan.finite_code));
    codes->PostReceives();
  }
  // Sends first (see RunDirect), then every receive.
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    source->send(p, scatter_slot, plan.source != nullptr ? bytes_of(lo(p)) : 0,
                 bytes_of(len_of(p)));
  }
  if (codes != nullptr) codes->Send();
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    from[p]->recv(p, scatter_slot, 0, bytes_of(my_len));
    from[p]->recv(p, gather_slot, at_mean, bytes_of(len_of(p)));
    from[p]->recv(p, close_slot, at_word, sizeof(uint64_t));
  }
  for (int p = 0; p < n; ++p) {
    if (p != me) WaitRecv(*from[p], plan.deadline);
  }
  bool refused = false;
  if (codes != nullptr) {
    codes->Wait(plan.deadline);
    progress->codes.assign(codes->got().begin(), codes->got().end());
    for (int64_t c : progress->codes) refused = refused || c != 0;
  }
  // This member's range: the additions every member would make, in the same order, so the
  // mean it sends is the one DirectAverage computes. A refused round sends it unreduced (every
  // member refuses alike; nothing is written).
  if (!refused) {
    SumInOrder<T>(plan, n, [&](int m) -> const T* {
      if (m != me) return part_of(m, 0);
      if (plan.source == nullptr) return reinterpret_cast<const T*>(scratch->zeros.data());
      return static_cast<const T*>(plan.source) + mine;
    }, static_cast<size_t>(my_len), my_mean);
  }
  for (int p = 0; p < n; ++p) {
    if (p != me) mean_out->send(p, gather_slot, 0, bytes_of(my_len));
  }
  const auto send_word = [&] {
    for (int p = 0; p < n; ++p) {
      if (p != me) word_out->send(p, close_slot, 0, sizeof(word));
    }
  };
  if (plan.vote == 0) send_word();
  for (int p = 0; p < n; ++p) {
    if (p != me) WaitRecv(*from[p], plan.deadline);
  }
  // Every mean is here: the vote travels while the result is written.
  progress->holding = !refused;
  const auto range_of = [&](int m) -> const T* { return m == me ? my_mean : part_of(m, at_mean); };
  try {
    if (plan.vote != 0) send_word();
    // The source may change once every owner has its range.
    for (int p = 0; p < n; ++p) {
      if (p != me) WaitSend(*source, plan.deadline);
    }
    if (!refused) {
      // In order, in pieces that do not cross an owner's range.
      for (int m = 0; m < n; ++m) {
        for (int64_t begin = lo(m); begin < lo(m + 1); begin += piece) {
          const int64_t len = std::min(piece, lo(m + 1) - begin);
          write(begin, len, range_of(m) + (begin - lo(m)));
          progress->written = begin + len;
        }
      }
    }
    for (int p = 0; p < n; ++p) {
      if (p != me) WaitSend(*mean_out, plan.deadline);
    }
    for (int p = 0; p < n; ++p) {
      if (p != me) WaitSend(*word_out, plan.deadline);
    }
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      WaitRecv(*from[p], plan.deadline);
      uint64_t got;
      std::memcpy(&got, reinterpret_cast<const char*>(scratch->recv[p].data()) + at_word,
                  sizeof(got));
      // A plain round takes any closing word (it only ends the exchange); a vote must match.
      if (plan.vote != 0 && got != word) {
        throw gloo::IoException(absl::StrCat("member ", p, " closed the exchange with ", got,
                                             " where ", word, " was expected: the members are "
                                             "not in the same round"));
      }
    }
  } catch (...) {
    if (progress->holding && progress->written < plan.total) {
      // What the caller keeps: the unwritten rest of the result, in one piece.
      scratch->gather.resize((bytes_of(plan.total - progress->written) + 7) / 8);
      T* rest = reinterpret_cast<T*>(scratch->gather.data());
      for (int m = 0; m < n; ++m) {
        const int64_t begin = std::max(lo(m), progress->written);
        if (begin >= lo(m + 1)) continue;
        std::memcpy(rest + (begin - progress->written), range_of(m) + (begin - lo(m)),
                    bytes_of(lo(m + 1) - begin));
      }
      progress->rest = rest;
    }
    throw;
  }
}

}  // namespace

void ScatterGatherAverage(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
                          absl::FunctionRef<void(int64_t, int64_t)> prepare,
                          absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
                          DirectProgress* progress) {
  *progress = DirectProgress{};
  if (plan.total < context.size || context.size < 2) {
    throw gloo::InvalidOperationException(
        "a scatter-gather exchange needs two members and an element a member");
  }
  if (plan.dtype == DType::kFloat64) {
    RunScatterGather<double>(context, plan, scratch, prepare, write, progress);
  } else {
    RunScatterGather<float>(context, plan, scratch, prepare, write, progress);
  }
}

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
