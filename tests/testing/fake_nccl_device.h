// A simulated CUDA device and NCCL for tests of the NCCL path's host logic (NcclCore and what
// is built on it) with members as threads, on a machine without a GPU: FakeOps (a DeviceOps, and
// the outer optimizer's OuterKernels) keeps "device" memory on the host, flags any access outside
// a live allocation (an illegal address on a GPU), and matches the members' collectives through
// a FakeWorld the way NCCL needs them matched, reporting a mismatch (which NCCL would not
// detect: a hang or mixed data) or a member that never arrives (a hang). Its ncclAvg arithmetic
// is NCCL's: inputs are pre-multiplied by 1/n rounded to the reduction dtype (1/d for a round
// divided by d). Work enqueued on a stream runs when the host waits, in stream order, with
// events between streams, in one of two adversarial orders (FakeOps::Policy), so that a missing
// dependency shows. It logs every operation as enqueued and as run, so that a test can count
// what a call costs. A FakeWorld can be aborted, as a generation move aborts the peers'
// collectives. Params is host memory standing in for one member's CUDA tensors; FakeLocalDevice
// opens a FakeOps as the averager's OuterDevice.
#ifndef MODELAVG_TESTS_TESTING_FAKE_NCCL_DEVICE_H_
#define MODELAVG_TESTS_TESTING_FAKE_NCCL_DEVICE_H_

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/finite_check.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_kernels.h"
#include "client/payload/finite_scan.h"
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "common/status_util.h"
#include "gtest/gtest.h"
#include "tests/reference/staging_reference.h"

namespace modelavg::client {

using FakeReduce = DeviceOps::Reduce;

// Rounds to what `code` can hold.
inline double RoundTo(int32_t code, double v) {
  double out = 0;
  char buf[8];
  StoreAs(buf, code, 0, v);
  out = LoadAs(buf, code, 0);
  return out;
}

// What a member posts: an all-reduce (kind kReduce: op, count, code, buffer, divisor) or a byte
// collective of a compressed round (kAllToAll, kAllGather: send, buffer as the receive buffer,
// `bytes` per member).
struct Post {
  enum class Kind { kReduce, kAllToAll, kAllGather };
  FakeReduce op;
  size_t count;
  int32_t code;
  void* buffer;
  int divisor;
  Kind kind = Kind::kReduce;
  const void* send = nullptr;
  size_t bytes = 0;
};

// The members' collectives, matched by sequence number.
class FakeWorld {
 public:
  explicit FakeWorld(int n) : n_(n) {}
  int size() const { return n_; }

  absl::Status Collective(int member, int64_t seq, const Post& p) {
    absl::MutexLock l(&mu_);
    if (!aborted_.ok()) return aborted_;
    std::vector<std::optional<Post>>& posts = posts_[seq];
    posts.resize(n_);
    posts[member] = p;
    if (std::all_of(posts.begin(), posts.end(), [](const auto& x) { return x.has_value(); })) {
      results_[seq] = Reduce_(posts);
    }
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<FakeWorld*, int64_t>* a) {
              return !a->first->aborted_.ok() || a->first->results_.count(a->second) > 0;
            },
            new_pair(seq)),
        absl::Seconds(1));
    if (results_.count(seq) == 0 && !aborted_.ok()) return aborted_;
    if (!done) {
      hang_ = true;
      return absl::DeadlineExceededError(absl::StrCat(
          "member ", member, ": collective #", seq, " never matched (a hang on a GPU)"));
    }
    return results_[seq];
  }

  // What the coordinator and the heartbeat do once a member asked for a new generation: every
  // collective in flight and every later one fails with `why`.
  void Abort(absl::Status why) {
    absl::MutexLock l(&mu_);
    if (aborted_.ok()) aborted_ = std::move(why);
  }

  bool mismatch() const {
    absl::MutexLock l(&mu_);
    return mismatch_;
  }
  bool hang() const {
    absl::MutexLock l(&mu_);
    return hang_;
  }

 private:
  std::pair<FakeWorld*, int64_t>* new_pair(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pairs_.push_back(std::make_unique<std::pair<FakeWorld*, int64_t>>(this, seq));
    return pairs_.back().get();
  }

  absl::Status Reduce_(const std::vector<std::optional<Post>>& posts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Post& a = *posts[0];
    for (const auto& p : posts) {
      if (p->kind != a.kind || p->bytes != a.bytes) {
        mismatch_ = true;
        return absl::InternalError("mismatched collectives (NCCL would hang or mix data)");
      }
    }
    if (a.kind == Post::Kind::kAllToAll) {
      // Member m receives member j's piece m at j * bytes.
      for (int m = 0; m < n_; ++m) {
        for (int j = 0; j < n_; ++j) {
          std::memcpy(static_cast<char*>(posts[m]->buffer) + j * a.bytes,
                      static_cast<const char*>(posts[j]->send) + m * a.bytes, a.bytes);
        }
      }
      return absl::OkStatus();
    }
    if (a.kind == Post::Kind::kAllGather) {
      for (int m = 0; m < n_; ++m) {
        for (int j = 0; j < n_; ++j) {
          std::memcpy(static_cast<char*>(posts[m]->buffer) + j * a.bytes, posts[j]->send,
                      a.bytes);
        }
      }
      return absl::OkStatus();
    }
    for (const auto& p : posts) {
      if (p->op != a.op || p->count != a.count ||
          (a.op == FakeReduce::kAverage && (p->code != a.code || p->divisor != a.divisor))) {
        mismatch_ = true;
        return absl::InternalError("mismatched collectives (NCCL would hang or mix data)");
      }
    }
    if (a.op == FakeReduce::kLayoutMax) {
      for (size_t i = 0; i < a.count; ++i) {
        int64_t m = static_cast<int64_t*>(posts[0]->buffer)[i];
        for (const auto& p : posts) m = std::max(m, static_cast<int64_t*>(p->buffer)[i]);
        for (const auto& p : posts) static_cast<int64_t*>(p->buffer)[i] = m;
      }
      return absl::OkStatus();
    }
    if (a.op == FakeReduce::kCommitSum) {
      int64_t sum = 0;
      for (const auto& p : posts) sum += *static_cast<int64_t*>(p->buffer);
      for (const auto& p : posts) *static_cast<int64_t*>(p->buffer) = sum;
      return absl::OkStatus();
    }
    // ncclAvg as NCCL computes it: sum of x * (1/n rounded to the dtype), rounded per step; with
    // another divisor d, ncclRedOpCreatePreMulSum with 1/d rounded the same way.
    const double scale = RoundTo(a.code, 1.0 / a.divisor);
    for (size_t i = 0; i < a.count; ++i) {
      double sum = 0;
      for (const auto& p : posts) {
        sum = RoundTo(a.code, sum + RoundTo(a.code, LoadAs(p->buffer, a.code, i) * scale));
      }
      for (const auto& p : posts) StoreAs(p->buffer, a.code, i, sum);
    }
    return absl::OkStatus();
  }

  const int n_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::vector<std::optional<Post>>> posts_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, absl::Status> results_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<std::pair<FakeWorld*, int64_t>>> pairs_ ABSL_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  bool mismatch_ ABSL_GUARDED_BY(mu_) = false;
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
};

// One member's device. Work enqueued on a stream runs only when the host waits (Wait,
// WaitLocal, Free, as cudaFree synchronizes), in stream order, each stream's head once the
// event it waits for (if any) has fired; between streams, `policy` picks which ready head runs
// next, so that a missing event shows as wrong values or an out-of-order run. `log` records the
// operations as they are enqueued, `exec` as they run.
class FakeOps : public DeviceOps, public OuterKernels {
 public:
  enum class Policy {
    kCallerFirst,  // the stream being waited on runs whenever it can (others lag)
    kOthersFirst,  // every other ready stream runs first (the waited-on stream lags)
  };

  FakeOps(FakeWorld* world, int member) : world_(world), member_(member) {}
  ~FakeOps() override {
    for (auto& [p, n] : live_) std::free(p);
  }

  absl::Status Malloc(void** p, size_t bytes) override {
    *p = nullptr;
    if (fail_mallocs > 0 || fail_malloc_after == 0) {
      if (fail_mallocs > 0) --fail_mallocs;
      fail_malloc_after = -1;
      return absl::ResourceExhaustedError("cudaMalloc: out of memory (simulated)");
    }
    if (fail_malloc_after > 0) --fail_malloc_after;
    *p = std::malloc(bytes);
    std::memset(*p, 0x7f, bytes);  // garbage, as cudaMalloc gives
    live_[*p] = bytes;
    ++mallocs;
    return absl::OkStatus();
  }
  void Free(void* p) override {
    DrainAll();  // cudaFree waits for the device
    ASSERT_EQ(live_.erase(p), 1u) << "free of memory that is not a live allocation";
    std::free(p);
  }
  absl::Status MallocHost(void** p, size_t bytes) override {
    ++host_mallocs;
    return Malloc(p, bytes);
  }
  void FreeHost(void* p) override { Free(p); }
  absl::Status Zero(void* p, size_t bytes, void* stream) override {
    log.push_back(absl::StrCat("zero", bytes));
    return Enqueue(stream, "zero", [this, p, bytes] {
      if (!Live(p, bytes) && !IsParams(p, bytes)) return Illegal("memset");
      std::memset(p, 0, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes, void* stream) override {
    log.push_back(absl::StrCat("copy", bytes));
    if (dst == nullptr || src == nullptr) return Illegal("memcpy");
    return Enqueue(stream, "copy", [dst, src, bytes] {
      std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status Gather(const StagingChunk* chunks, int64_t n, void* staging, int32_t code,
                      void* stream) override {
    log.push_back("gather");
    if (fail_gathers > 0) {
      --fail_gathers;
      return absl::InternalError("gather launch failed (simulated)");
    }
    ++gathers;
    return Enqueue(stream, absl::StrCat("gather@", StreamName(stream)),
                   [=] { return Stage(chunks, n, staging, code, /*gather=*/true); });
  }
  absl::Status Scatter(const StagingChunk* chunks, int64_t n, const void* staging, int32_t code,
                       void* stream) override {
    log.push_back("scatter");
    return Enqueue(stream, absl::StrCat("scatter@", StreamName(stream)), [=] {
      return Stage(chunks, n, const_cast<void*>(staging), code, /*gather=*/false);
    });
  }
  // The finite check's kernels (finite_kernels.cu), with the host scan's rules.
  absl::Status CheckFinite(const StagingChunk* chunks, int64_t n, int32_t* code,
                           void* stream) override {
    log.push_back("check_finite");
    ++finite_checks;
    return Enqueue(stream, absl::StrCat("check_finite@", StreamName(stream)), [=] {
      if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
      if (!Live(code, sizeof(int32_t))) return Illegal("finite code word");
      for (int64_t c = 0; c < n; ++c) {
        const StagingChunk& ch = chunks[c];
        for (int64_t i = 0; i < ch.numel; ++i) {
          const double v = LoadAs(ch.tensor, ch.tensor_dtype, i);
          if (std::isfinite(v)) continue;
          NonFiniteFinding f;
          f.tensor = ch.tensor_index;
          f.value = std::isnan(v) ? NonFiniteValue::kNaN
                                  : (v > 0 ? NonFiniteValue::kPosInf : NonFiniteValue::kNegInf);
          *code = std::min<int32_t>(*code, static_cast<int32_t>(FindingCode(f)));
        }
      }
      return absl::OkStatus();
    });
  }
  absl::Status WriteFiniteSlots(int32_t* code, void* slots, int members, int member,
                                int32_t staging_code, void* stream) override {
    log.push_back("finite_slots");
    return Enqueue(stream, absl::StrCat("finite_slots@", StreamName(stream)), [=] {
      if (!Live(code, sizeof(int32_t))) return Illegal("finite code word");
      const size_t bytes = static_cast<size_t>(members) * FiniteSlotWidth(staging_code) *
                           StagingCodeSize(staging_code);
      if (!Live(slots, bytes)) return Illegal("finite slots");
      const int64_t mine = *code == std::numeric_limits<int32_t>::max() ? 0 : *code;
      ::modelavg::client::WriteFiniteSlots(slots, staging_code, members, member, mine);
      *code = std::numeric_limits<int32_t>::max();
      return absl::OkStatus();
    });
  }
  absl::Status AllReduce(void* buffer, size_t count, FakeReduce op, int32_t code, int divisor,
                         void* stream) override {
    const std::string name = op == FakeReduce::kLayoutMax   ? std::string("check")
                             : op == FakeReduce::kCommitSum ? std::string("commit")
                                                        : absl::StrCat("avg", count);
    log.push_back(name);
    if (aborted) return absl::InternalError("communicator aborted");
    if (op == FakeReduce::kAverage && fail_averages > 0) {
      --fail_averages;
      return absl::InternalError("ncclAllReduce failed (simulated)");
    }
    if (op == FakeReduce::kAverage) {
      last_average_ = {buffer, count * StagingCodeSize(code)};
      // A ring all-reduce: 2 (n - 1) / n of the buffer leaves this member.
      const int64_t b = static_cast<int64_t>(count * StagingCodeSize(code));
      wire_bytes += 2 * (b * (world_->size() - 1) / world_->size());
    }
    if (op == FakeReduce::kCommitSum && skip_commits > 0) {
      // This member never issues the commit (it died, or hangs, right after the data).
      --skip_commits;
      return absl::UnavailableError("the commit was never issued (simulated)");
    }
    ops.push_back(name);
    const int64_t seq = seq_++;
    const Post post{op, count, code, buffer, divisor};
    return Enqueue(stream, absl::StrCat(name, "@", StreamName(stream)), [this, seq, post] {
      if (aborted) return absl::InternalError("communicator aborted");
      absl::Status s = world_->Collective(member_, seq, post);
      if (!s.ok() && async_error_.ok()) async_error_ = s;
      return absl::OkStatus();
    });
  }
  // The compressed round's codec (payload_kernels.cu), with the host codec's arithmetic.
  absl::Status EncodeParts(WireFormat format, const float* in, int64_t numel, int64_t part,
                           int parts, size_t stride, void* wire, void* stream) override {
    log.push_back("encode");
    if (!Live(wire, stride * parts)) return Illegal("wire buffer");
    return Enqueue(stream, "encode", [=] {
      std::vector<float> tmp(static_cast<size_t>(part));
      for (int j = 0; j < parts; ++j) {
        std::fill(tmp.begin(), tmp.end(), 0.0f);
        const int64_t lo = std::min<int64_t>(numel, j * part);
        const int64_t len = std::min<int64_t>(numel, lo + part) - lo;
        if (len > 0) std::memcpy(tmp.data(), in + lo, static_cast<size_t>(len) * sizeof(float));
        uint8_t* out = static_cast<uint8_t*>(wire) + j * stride;
        std::memset(out, 0, stride);
        EncodePayload(format, tmp.data(), part, out);
      }
      return absl::OkStatus();
    });
  }
  absl::Status DecodeSumParts(WireFormat format, const void* wire, int parts, int64_t part,
                              size_t stride, float scale, float* out, void* stream) override {
    log.push_back("decode_sum");
    if (!Live(wire, stride * parts)) return Illegal("wire buffer");
    if (!Live(out, static_cast<size_t>(part) * sizeof(float))) return Illegal("wire part");
    return Enqueue(stream, "decode_sum", [=] {
      std::fill(out, out + part, 0.0f);
      for (int j = 0; j < parts; ++j) {
        DecodeAddPayload(format, static_cast<const uint8_t*>(wire) + j * stride, part, out);
      }
      for (int64_t i = 0; i < part; ++i) out[i] *= scale;
      return absl::OkStatus();
    });
  }
  absl::Status DecodeParts(WireFormat format, const void* wire, int64_t numel, int64_t part,
                           size_t stride, float* out, void* stream) override {
    log.push_back("decode");
    const int64_t parts = part > 0 ? (numel + part - 1) / part : 0;
    if (!Live(wire, stride * parts)) return Illegal("wire buffer");
    return Enqueue(stream, "decode", [=] {
      std::vector<float> tmp(static_cast<size_t>(part));
      for (int64_t lo = 0, j = 0; lo < numel; lo += part, ++j) {
        DecodePayload(format, static_cast<const uint8_t*>(wire) + j * stride, part, tmp.data());
        const int64_t len = std::min<int64_t>(numel - lo, part);
        std::memcpy(out + lo, tmp.data(), static_cast<size_t>(len) * sizeof(float));
      }
      return absl::OkStatus();
    });
  }
  // Error feedback's passes (OuterKernels: client/outer/cuda/outer_kernels.cu), with the host's
  // arithmetic.
  absl::Status FeedbackAdd(float* u, const float* e, int64_t n, double beta,
                           void* stream) override {
    log.push_back("feedback_add");
    if (!Live(u, static_cast<size_t>(n) * sizeof(float)) ||
        !Live(e, static_cast<size_t>(n) * sizeof(float))) {
      return Illegal("error feedback buffer");
    }
    return Enqueue(stream, "feedback_add", [=] {
      for (int64_t i = 0; i < n; ++i) {
        u[i] = static_cast<float>(beta * static_cast<double>(e[i]) + static_cast<double>(u[i]));
      }
      return absl::OkStatus();
    });
  }
  absl::Status FeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                void* stream) override {
    log.push_back("feedback_residual");
    if (!Live(u, static_cast<size_t>(n) * sizeof(float)) ||
        !Live(c, static_cast<size_t>(n) * sizeof(float)) ||
        !Live(e, static_cast<size_t>(n) * sizeof(float))) {
      return Illegal("error feedback buffer");
    }
    return Enqueue(stream, "feedback_residual", [=] {
      for (int64_t i = 0; i < n; ++i) e[i] = u[i] - c[i];
      return absl::OkStatus();
    });
  }
  // A paced round's weighted copy (OuterKernels::ScaleCopy): the product in double, stored as
  // the staging reference stores a double. Run at once, as OuterDifference.
  absl::Status ScaleCopy(const void* from, void* to, int64_t n, int32_t code, double scale,
                         void* stream) override {
    log.push_back("scale_copy");
    if (!Live(to, static_cast<size_t>(n) * StagingCodeSize(code))) return Illegal("weighted copy");
    MODELAVG_RETURN_IF_ERROR(Drain(stream));
    for (int64_t i = 0; i < n; ++i) StoreAs(to, code, i, scale * LoadAs(from, code, i));
    return absl::OkStatus();
  }
  absl::Status AllToAll(const void* send, void* recv, size_t bytes, void* stream) override {
    return Bytes(Post::Kind::kAllToAll, "alltoall", send, recv, bytes, stream);
  }
  absl::Status AllGather(const void* send, void* recv, size_t bytes, void* stream) override {
    return Bytes(Post::Kind::kAllGather, "allgather", send, recv, bytes, stream);
  }

  absl::Status Wait(void* stream, const char* what) override {
    log.push_back("wait");
    if (aborted) return absl::InternalError("communicator aborted");
    MODELAVG_RETURN_IF_ERROR(Drain(stream));
    if (!async_error_.ok()) return async_error_;
    if (lose_commits > 0 && std::string(what) == "commit of the averaging round") {
      // The commit ran everywhere (its peers completed the round) but this member's wait for it
      // failed, as when its last receive breaks.
      --lose_commits;
      return absl::UnavailableError("the commit's last receive broke on this member (simulated)");
    }
    if (fail_average_waits > 0 && std::string(what) == "ncclAllReduce") {
      // The collective ran (its peers have their result) but failed here: NCCL leaves the
      // buffer partly reduced.
      --fail_average_waits;
      std::memset(last_average_.first, 0x5b, last_average_.second);
      return absl::InternalError("ncclAllReduce: a network error (simulated)");
    }
    return absl::OkStatus();
  }
  absl::Status WaitLocal(void* stream, const char*) override {
    log.push_back("wait_local");
    return Drain(stream);
  }
  void AbortCommunicator() override { aborted = true; }
  // The outer optimizer's kernels (OuterKernels: client/outer/cuda/outer_kernels.cu), element by
  // element with the same arithmetic: every operation in the state dtype S, rounded on its own.
  absl::Status OuterDifference(const StagingChunk* chunks, int64_t n, const void* anchor,
                               void* gradient, int32_t code, void* stream) override {
    log.push_back("outer_difference");
    if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
    // Run at once, after what `stream` holds: the outer state's device and the communicator's
    // are separate fakes here (one stream on a GPU), so the pass must not wait in a queue.
    MODELAVG_RETURN_IF_ERROR(Drain(stream));
    return code == kStageF64 ? Difference<double>(chunks, n, anchor, gradient)
                             : Difference<float>(chunks, n, anchor, gradient);
  }
  absl::Status OuterStep(const StagingChunk* chunks, int64_t n, const OuterStepArgs& args,
                         void* stream) override {
    log.push_back("outer_step");
    if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
    MODELAVG_RETURN_IF_ERROR(Drain(stream));  // as OuterDifference
    return args.state_code == kStageF64 ? SgdStep<double>(chunks, n, args)
                                        : SgdStep<float>(chunks, n, args);
  }

  absl::Status OuterMix(const StagingChunk* chunks, int64_t n, const void* local, int32_t code,
                        double mix, void* stream) override {
    log.push_back("outer_mix");
    if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
    MODELAVG_RETURN_IF_ERROR(Drain(stream));  // as OuterDifference
    for (int64_t c = 0; c < n; ++c) {
      const StagingChunk& ch = chunks[c];
      if (!Live(local, (ch.staging_offset + ch.numel) * StagingCodeSize(code))) {
        return Illegal("copy of the parameters");
      }
      for (int64_t i = 0; i < ch.numel; ++i) {
        const double v = (1.0 - mix) * LoadAs(ch.tensor, ch.tensor_dtype, i) +
                         mix * LoadAs(local, code, ch.staging_offset + i);
        StoreAs(ch.tensor, ch.tensor_dtype, i,
                ch.tensor_dtype == kStageF64 ? v : static_cast<double>(static_cast<float>(v)));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CreateStream(void** stream) override {
    streams_.push_back(std::make_unique<int>(static_cast<int>(streams_.size()) + 1));
    *stream = streams_.back().get();
    return absl::OkStatus();
  }
  void DestroyStream(void* stream) override {
    DrainAll();
    EXPECT_TRUE(queues_[stream].empty());
    ++destroyed_streams;
  }
  absl::Status CreateEvent(void** event) override {
    events_.push_back(std::make_unique<Event>());
    *event = events_.back().get();
    return absl::OkStatus();
  }
  void DestroyEvent(void*) override { ++destroyed_events; }
  absl::Status RecordEvent(void* event, void* stream) override {
    auto* e = static_cast<Event*>(event);
    const int64_t version = ++e->recorded;
    return Enqueue(stream, "record", [e, version] {
      e->fired = std::max(e->fired, version);
      return absl::OkStatus();
    });
  }
  absl::Status StreamWaitEvent(void* stream, void* event) override {
    auto* e = static_cast<Event*>(event);
    Op op;
    op.name = "wait_event";
    op.event = e;
    op.version = e->recorded;  // the last record at the time of the call, as CUDA's
    op.run = [] { return absl::OkStatus(); };
    queues_[stream].push_back(std::move(op));
    return absl::OkStatus();
  }

  // The caller's tensors (which are not device allocations of this fake): Zero may write them.
  void SetParams(const void* p, size_t bytes) { params_ = {p, bytes}; }

  int fail_mallocs = 0;        // the next this many mallocs fail
  int fail_malloc_after = -1;  // the malloc after this many successful ones fails
  int fail_gathers = 0;
  int fail_averages = 0;
  int fail_average_waits = 0;  // the next this many data all-reduces fail after running
  int skip_commits = 0;        // the next this many commits are not issued by this member
  int lose_commits = 0;        // the next this many commits complete but fail on this member
  int64_t wire_bytes = 0;  // what the data collectives sent from this member (the transport's)
  int mallocs = 0;
  int host_mallocs = 0;  // of which pinned host memory
  int gathers = 0;
  int finite_checks = 0;
  int destroyed_streams = 0;
  int destroyed_events = 0;
  bool aborted = false;
  bool illegal = false;
  bool deadlock = false;  // a wait found no stream able to run (an event never recorded)
  Policy policy = Policy::kCallerFirst;
  std::vector<std::string> ops;   // the collectives this member issued
  std::vector<std::string> log;   // every operation, in the order enqueued
  std::vector<std::string> exec;  // every operation that ran, in the order it ran

 private:
  struct Event {
    int64_t recorded = 0;
    int64_t fired = 0;
  };
  struct Op {
    std::string name;
    std::function<absl::Status()> run;
    Event* event = nullptr;  // a wait: ready once event->fired >= version
    int64_t version = 0;
  };

  // A byte collective of a compressed round: every member's piece but its own leaves it.
  absl::Status Bytes(Post::Kind kind, const std::string& name, const void* send, void* recv,
                     size_t bytes, void* stream) {
    log.push_back(name);
    if (aborted) return absl::InternalError("communicator aborted");
    const int n = world_->size();
    const size_t sent = kind == Post::Kind::kAllToAll ? bytes * n : bytes;
    if (!Live(send, sent) || !Live(recv, bytes * n)) return Illegal(name.c_str());
    wire_bytes += static_cast<int64_t>(bytes) * (n - 1);
    ops.push_back(name);
    const int64_t seq = seq_++;
    Post post{FakeReduce::kAverage, 0, 0, recv, 1};
    post.kind = kind;
    post.send = send;
    post.bytes = bytes;
    return Enqueue(stream, absl::StrCat(name, "@", StreamName(stream)), [this, seq, post] {
      if (aborted) return absl::InternalError("communicator aborted");
      absl::Status s = world_->Collective(member_, seq, post);
      if (!s.ok() && async_error_.ok()) async_error_ = s;
      return absl::OkStatus();
    });
  }
  std::string StreamName(void* stream) const {
    return stream == nullptr ? "caller" : absl::StrCat("s", *static_cast<int*>(stream));
  }
  absl::Status Enqueue(void* stream, std::string name, std::function<absl::Status()> run) {
    Op op;
    op.name = std::move(name);
    op.run = std::move(run);
    queues_[stream].push_back(std::move(op));
    return absl::OkStatus();
  }
  bool Ready(void* stream) {
    auto it = queues_.find(stream);
    if (it == queues_.end() || it->second.empty()) return false;
    const Op& head = it->second.front();
    return head.event == nullptr || head.event->fired >= head.version;
  }
  void RunHead(void* stream) {
    Op op = std::move(queues_[stream].front());
    queues_[stream].pop_front();
    if (op.event == nullptr) exec.push_back(op.name);
    absl::Status s = op.run();
    if (!s.ok() && local_error_.ok()) local_error_ = s;
  }
  // Runs work until `stream` is empty.
  absl::Status Drain(void* stream) {
    while (!queues_[stream].empty()) {
      void* next = nullptr;
      bool found = false;
      if (policy == Policy::kCallerFirst && Ready(stream)) {
        next = stream;
        found = true;
      }
      for (auto& [s, q] : queues_) {
        if (found) break;
        if (s != stream && Ready(s)) {
          next = s;
          found = true;
        }
      }
      if (!found && Ready(stream)) {
        next = stream;
        found = true;
      }
      if (!found) {
        deadlock = true;
        return absl::InternalError("a stream waits for an event that never fires");
      }
      RunHead(next);
    }
    return local_error_;
  }
  void DrainAll() {
    for (auto& [s, q] : queues_) {
      if (!q.empty()) Drain(s).IgnoreError();
    }
  }
  bool IsParams(const void* p, size_t bytes) const {
    const char* b = static_cast<const char*>(params_.first);
    const char* q = static_cast<const char*>(p);
    return b != nullptr && q >= b && q + bytes <= b + params_.second;
  }
  bool Live(const void* p, size_t bytes) const {
    for (const auto& [base, n] : live_) {
      const char* b = static_cast<const char*>(base);
      const char* q = static_cast<const char*>(p);
      if (q >= b && q + bytes <= b + n) return true;
    }
    return false;
  }
  absl::Status Illegal(const char* what) {
    illegal = true;
    return absl::InternalError(absl::StrCat(what, ": an illegal memory access"));
  }
  absl::Status Stage(const StagingChunk* chunks, int64_t n, void* staging, int32_t code,
                     bool gather) {
    if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
    for (int64_t c = 0; c < n; ++c) {
      const StagingChunk& ch = chunks[c];
      const size_t end = (ch.staging_offset + ch.numel) * StagingCodeSize(code);
      if (!Live(staging, end)) return Illegal("staging buffer");
      for (int64_t i = 0; i < ch.numel; ++i) {
        if (gather) {
          StoreAs(staging, code, ch.staging_offset + i, LoadAs(ch.tensor, ch.tensor_dtype, i));
        } else {
          StoreAs(ch.tensor, ch.tensor_dtype, i, LoadAs(staging, code, ch.staging_offset + i));
        }
      }
    }
    return absl::OkStatus();
  }

  template <typename S>
  absl::Status Difference(const StagingChunk* chunks, int64_t n, const void* anchor,
                          void* gradient) {
    for (int64_t c = 0; c < n; ++c) {
      const StagingChunk& ch = chunks[c];
      const size_t end = (ch.staging_offset + ch.numel) * sizeof(S);
      if (!Live(anchor, end) || !Live(gradient, end)) return Illegal("outer state buffer");
      const S* a = static_cast<const S*>(anchor) + ch.staging_offset;
      S* d = static_cast<S*>(gradient) + ch.staging_offset;
      for (int64_t i = 0; i < ch.numel; ++i) {
        d[i] = a[i] - static_cast<S>(LoadAs(ch.tensor, ch.tensor_dtype, i));
      }
    }
    return absl::OkStatus();
  }
  template <typename S>
  absl::Status SgdStep(const StagingChunk* chunks, int64_t n, const OuterStepArgs& args) {
    if (args.rule.kind != OuterRuleKind::kSgd) {
      return absl::UnimplementedError("the simulated device restates the SGD rule only");
    }
    const S lr = static_cast<S>(args.rule.lr);
    const S mu = static_cast<S>(args.rule.momentum);
    for (int64_t c = 0; c < n; ++c) {
      const StagingChunk& ch = chunks[c];
      const size_t end = (ch.staging_offset + ch.numel) * sizeof(S);
      if (!Live(args.gradient, end) || !Live(args.anchor, end) ||
          (args.rule.momentum != 0 && !Live(args.momentum, end))) {
        return Illegal("outer state buffer");
      }
      const S* d = static_cast<const S*>(args.gradient) + ch.staging_offset;
      S* a = static_cast<S*>(args.anchor) + ch.staging_offset;
      S* m = args.rule.momentum != 0 ? static_cast<S*>(args.momentum) + ch.staging_offset
                                      : nullptr;
      for (int64_t i = 0; i < ch.numel; ++i) {
        S g = d[i];
        if (m != nullptr) {
          const S buf = args.momentum_set ? static_cast<S>(m[i] * mu) + d[i] : d[i];
          m[i] = buf;
          g = args.rule.nesterov ? d[i] + static_cast<S>(mu * buf) : buf;
        }
        a[i] = a[i] + static_cast<S>(-lr * g);
        StoreAs(ch.tensor, ch.tensor_dtype, i, a[i]);
      }
    }
    return absl::OkStatus();
  }

  FakeWorld* const world_;
  const int member_;
  int64_t seq_ = 0;
  std::map<void*, size_t> live_;
  std::pair<void*, size_t> last_average_{nullptr, 0};
  std::pair<const void*, size_t> params_{nullptr, 0};
  std::map<void*, std::deque<Op>> queues_;
  std::vector<std::unique_ptr<Event>> events_;
  std::vector<std::unique_ptr<int>> streams_;
  absl::Status async_error_;  // a collective's failure, reported by the next Wait
  absl::Status local_error_;  // a local operation's failure (an illegal access)
};

// Host memory standing in for one member's CUDA tensors.
struct Params {
  std::vector<std::vector<char>> storage;
  std::vector<TensorView> views;

  Params() = default;
  // A copy points its views into its own storage.
  Params(const Params& o) : storage(o.storage), views(o.views) {
    for (TensorView& v : views) {
      for (size_t k = 0; k < storage.size(); ++k) {
        const char* b = o.storage[k].data();
        const char* p = static_cast<const char*>(v.data);
        if (p >= b && p < b + o.storage[k].size()) {
          v.data = storage[k].data() + (p - b);
          break;
        }
      }
    }
  }
  Params& operator=(const Params& o) {
    Params copy(o);
    storage.swap(copy.storage);
    views.swap(copy.views);
    return *this;
  }

  // Separately allocated tensors (the staged path).
  static Params Separate(const std::vector<std::pair<DType, int64_t>>& spec) {
    Params p;
    p.storage.reserve(spec.size());
    for (const auto& [dtype, n] : spec) {
      p.storage.emplace_back(DTypeSize(dtype) * n + 64);
      // 16-byte aligned storage, like cudaMalloc's.
      char* base = p.storage.back().data();
      char* aligned = base + ((16 - reinterpret_cast<uintptr_t>(base) % 16) % 16);
      p.views.push_back(TensorView{aligned, n, dtype, Device::Cuda(0), nullptr});
    }
    return p;
  }
  // One buffer of one dtype (the zero-copy path).
  // Separately allocated tensors, each starting `shift` bytes past a 16-byte boundary (a
  // multiple of its element size): the kernels' unaligned path.
  static Params Misaligned(const std::vector<std::pair<DType, int64_t>>& spec) {
    Params p;
    p.storage.reserve(spec.size());
    for (size_t t = 0; t < spec.size(); ++t) {
      const auto& [dtype, n] = spec[t];
      p.storage.emplace_back(DTypeSize(dtype) * n + 64);
      char* base = p.storage.back().data();
      char* aligned = base + ((16 - reinterpret_cast<uintptr_t>(base) % 16) % 16);
      const size_t shift = DTypeSize(dtype) * (1 + t % 3) % 16;
      p.views.push_back(TensorView{aligned + shift, n, dtype, Device::Cuda(0), nullptr});
    }
    return p;
  }
  static Params Contiguous(DType dtype, const std::vector<int64_t>& numels) {
    Params p;
    int64_t total = 0;
    for (int64_t n : numels) total += n;
    p.storage.emplace_back(DTypeSize(dtype) * total + 16);
    char* at = p.storage.back().data();
    for (int64_t n : numels) {
      p.views.push_back(TensorView{at, n, dtype, Device::Cuda(0), nullptr});
      at += DTypeSize(dtype) * n;
    }
    return p;
  }
  void Fill(double base) {
    for (size_t t = 0; t < views.size(); ++t) {
      for (int64_t i = 0; i < views[t].numel; ++i) {
        StoreAs(views[t].data, StagingCodeOf(views[t].dtype), i, base + 0.37 * t + 0.011 * i);
      }
    }
  }
  double At(size_t t, int64_t i) const {
    return LoadAs(views[t].data, StagingCodeOf(views[t].dtype), i);
  }
};

// A member's float32 tensors back to back, as one vector.
inline std::vector<float> Flat(const Params& p) {
  std::vector<float> out;
  for (const TensorView& v : p.views) {
    const float* f = static_cast<const float*>(v.data);
    out.insert(out.end(), f, f + v.numel);
  }
  return out;
}

// One FakeOps's outer kernels as an object of their own (LocalDevice owns its operations and its
// kernels apart), so that the kernels check their buffers against that FakeOps's allocations.
class FakeKernelsOf : public OuterKernels {
 public:
  explicit FakeKernelsOf(FakeOps* ops) : ops_(ops) {}
  absl::Status OuterDifference(const StagingChunk* chunks, int64_t num_chunks, const void* anchor,
                               void* gradient, int32_t state_code, void* stream) override {
    return ops_->OuterDifference(chunks, num_chunks, anchor, gradient, state_code, stream);
  }
  absl::Status OuterStep(const StagingChunk* chunks, int64_t num_chunks,
                         const OuterStepArgs& args, void* stream) override {
    return ops_->OuterStep(chunks, num_chunks, args, stream);
  }
  absl::Status OuterMix(const StagingChunk* chunks, int64_t num_chunks, const void* local,
                        int32_t state_code, double mix, void* stream) override {
    return ops_->OuterMix(chunks, num_chunks, local, state_code, mix, stream);
  }
  absl::Status FeedbackAdd(float* u, const float* e, int64_t n, double beta,
                           void* stream) override {
    return ops_->FeedbackAdd(u, e, n, beta, stream);
  }
  absl::Status FeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                void* stream) override {
    return ops_->FeedbackResidual(u, c, n, e, stream);
  }
  absl::Status ScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code, double scale,
                         void* stream) override {
    return ops_->ScaleCopy(from, to, n, dtype_code, scale, stream);
  }

 private:
  FakeOps* const ops_;
};

// An OuterDevice's LocalDeviceFactory on the simulated device: one FakeOps (no collectives) per
// opening, for member `member`; `*opened` (if given) is set to it.
inline LocalDeviceFactory FakeLocalDevice(int member, FakeOps** opened = nullptr) {
  return [member, opened](int, absl::Duration) -> absl::StatusOr<LocalDevice> {
    auto ops = std::make_unique<FakeOps>(nullptr, member);
    if (opened != nullptr) *opened = ops.get();
    LocalDevice d;
    d.kernels = std::make_unique<FakeKernelsOf>(ops.get());
    d.ops = std::move(ops);
    return d;
  };
}

}  // namespace modelavg::client

#endif  // MODELAVG_TESTS_TESTING_FAKE_NCCL_DEVICE_H_
