#include "client/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/host_staging.h"
#include "gloo/allreduce.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace modelavg::client {
namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// A Gloo exception as a status a person can act on.
absl::Status FromGlooException(const std::exception& e, absl::string_view what) {
  const std::string msg = e.what();
  const std::string lower = absl::AsciiStrToLower(msg);
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, " timed out: a peer did not take part in time (dead, stuck, or passing a "
              "different schedule); Gloo: ", msg));
  }
  if (absl::StrContains(msg, "Connection reset") || absl::StrContains(msg, "Connection closed") ||
      absl::StrContains(msg, "Broken pipe") || absl::StrContains(msg, "closed by peer") ||
      absl::StrContains(msg, "Connection refused") || dynamic_cast<const gloo::IoException*>(&e)) {
    return absl::UnavailableError(
        absl::StrCat(what, " failed: a peer's connection broke (it probably died); Gloo: ", msg));
  }
  return absl::InternalError(absl::StrCat(what, " failed; Gloo: ", msg));
}

// Where Gloo's ring all-reduce (gloo/allreduce.cc) leaves the fully reduced data: the buffer is
// cut into segments of at most kMaxSegmentSize bytes, at least two per member and a multiple
// of the member count; member r ends the reduce-scatter holding chunk r, its segments
// [r * per_rank, (r + 1) * per_rank). Each reduction of a segment of chunk r at member r is
// that segment's last, so dividing there (1/size of the data, while it is in cache) gives the
// average without a pass of its own.
struct RingChunk {
  size_t begin = 0;  // bytes
  size_t end = 0;
};

size_t RoundUp(size_t v, size_t m) { return v % m == 0 ? v : v + m - v % m; }

RingChunk GlooRingChunk(size_t total_bytes, int size, int rank, size_t elem) {
  const size_t n = static_cast<size_t>(size);
  const size_t max_segment =
      elem * (gloo::detail::AllreduceOptionsImpl::kMaxSegmentSize / elem);
  const size_t segment =
      RoundUp(std::min((total_bytes + (n * 2 - 1)) / (n * 2), max_segment), elem);
  const size_t segments = RoundUp(std::max((total_bytes + segment - 1) / segment, n * 2), n);
  const size_t per_rank = segments / n;
  RingChunk c;
  c.begin = std::min(total_bytes, rank * per_rank * segment);
  c.end = std::min(total_bytes, (rank + 1) * per_rank * segment);
  return c;
}

// The ring's reduction: a sum, divided by the group size where it is final (this member's
// chunk). Counts the elements it divided, so the caller can check the layout assumption.
template <typename T>
gloo::AllreduceOptions::Func AverageReduction(const void* base, RingChunk chunk, int size,
                                              int64_t* divided) {
  return [base, chunk, size, divided](void* c, const void* a, const void* b, size_t n) {
    gloo::sum<T>(c, a, b, n);
    const size_t offset = static_cast<const char*>(c) - static_cast<const char*>(base);
    if (offset >= chunk.begin && offset < chunk.end) {
      DivideInto(static_cast<const T*>(c), static_cast<int64_t>(n), static_cast<T>(size),
                 static_cast<T*>(c));
      *divided += static_cast<int64_t>(n);
    }
  };
}

// The tensors as one buffer when they are float32/float64 of one dtype, back to back in memory
// (one tensor, or ContiguousParameters); nullptr otherwise.
void* SingleBuffer(absl::Span<const TensorView> tensors) {
  const TensorView* first = nullptr;
  char* next = nullptr;
  for (const TensorView& t : tensors) {
    if (t.numel == 0) continue;
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) return nullptr;
    if (first == nullptr) {
      first = &t;
    } else if (t.dtype != first->dtype || static_cast<char*>(t.data) != next) {
      return nullptr;
    }
    next = static_cast<char*>(t.data) + t.nbytes();
  }
  return first == nullptr ? nullptr : first->data;
}

}  // namespace

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

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
    int size, absl::Duration timeout, std::function<absl::Status()> store_error, bool in_place) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gloo communicator rank ", rank, " of size ", size, " is out of range"));
  }
  if (device == nullptr) return absl::InvalidArgumentError("Gloo device is null");
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
    context->connectFullMesh(store, device);
    return std::unique_ptr<GlooCommunicator>(
        new GlooCommunicator(std::move(context), rank, size, timeout, in_place));
  } catch (const std::exception& e) {
    if (store_error) {
      absl::Status s = store_error();
      if (!s.ok()) return s;
    }
    return FromGlooException(e, absl::StrCat("Gloo rendezvous of ", size, " members"));
  } catch (...) {
    return absl::InternalError("Gloo rendezvous failed with an unknown exception");
  }
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<gloo::Context> context, int rank, int size,
                                   absl::Duration timeout, bool in_place)
    : context_(std::move(context)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      in_place_(in_place) {}

GlooCommunicator::~GlooCommunicator() = default;

absl::Status GlooCommunicator::RunSum(void* data, int64_t numel, DType dtype) {
  if (numel == 0) return absl::OkStatus();
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    opts.setTag(next_tag_++);
    if (dtype == DType::kFloat64) {
      opts.setOutput(static_cast<double*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<double>));
    } else {
      opts.setOutput(static_cast<float*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(static_cast<ReduceFn>(&gloo::sum<float>));
    }
    gloo::allreduce(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromGlooException(e, absl::StrCat("Gloo all-reduce of ", numel, " elements"));
  } catch (...) {
    return absl::InternalError("Gloo all-reduce failed with an unknown exception");
  }
}

absl::Status GlooCommunicator::RunAverage(void* data, int64_t numel, DType dtype) {
  const size_t elem = DTypeSize(dtype);
  const RingChunk chunk =
      GlooRingChunk(static_cast<size_t>(numel) * elem, size_, rank_, elem);
  int64_t divided = 0;
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    opts.setTag(next_tag_++);
    if (dtype == DType::kFloat64) {
      opts.setOutput(static_cast<double*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(AverageReduction<double>(data, chunk, size_, &divided));
    } else {
      opts.setOutput(static_cast<float*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(AverageReduction<float>(data, chunk, size_, &divided));
    }
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return FromGlooException(e, absl::StrCat("Gloo all-reduce of ", numel, " elements"));
  } catch (...) {
    return absl::InternalError("Gloo all-reduce failed with an unknown exception");
  }
  const int64_t expected = static_cast<int64_t>((chunk.end - chunk.begin) / elem);
  if (divided != expected) {
    return absl::InternalError(absl::StrCat(
        "Gloo's ring all-reduce finished ", divided, " elements on this member where ",
        expected, " were expected: this Gloo build cuts buffers differently than modelavg "
        "assumes; report the Gloo version"));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::CheckLayout(int64_t numel, DType dtype) {
  // max over [n, -n, d, -d] gives [max n, -min n, max d, -min d]: equal iff all agree.
  int64_t sig[4] = {numel, -numel, static_cast<int64_t>(dtype), -static_cast<int64_t>(dtype)};
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    opts.setTag(next_tag_++);
    opts.setOutput(sig, 4);
    opts.setReduceFunction(static_cast<ReduceFn>(&gloo::max<int64_t>));
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return FromGlooException(e, "Gloo layout check");
  } catch (...) {
    return absl::InternalError("Gloo layout check failed with an unknown exception");
  }
  if (sig[0] != -sig[1] || sig[2] != -sig[3]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the members of this subgroup pass different parameter layouts: total element counts "
        "range from ", -sig[1], " to ", sig[0], " (this rank: ", numel,
        ")", sig[2] != -sig[3] ? " and the dtypes differ (float64 on some members only)" : "",
        "; every member must average the same list of tensors"));
  }
  layout_checked_ = true;
  checked_numel_ = numel;
  checked_dtype_ = dtype;
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors) {
  absl::StatusOr<int64_t> total = CheckHostTensors(tensors);
  if (!total.ok()) return total.status();
  const DType dtype = StagingDType(tensors);
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  if (!layout_checked_ || checked_numel_ != *total || checked_dtype_ != dtype) {
    absl::Status s = CheckLayout(*total, dtype);
    if (!s.ok()) {
      if (s.code() != absl::StatusCode::kInvalidArgument) broken_ = s;
      return s;
    }
  }
  if (*total == 0) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(*total) * DTypeSize(dtype);
  if (void* single = SingleBuffer(tensors); single != nullptr) {
    // One buffer: reduced in place, the division fused into the ring. Unless in_place, a
    // backup taken first restores it if the collective fails.
    if (!in_place_) {
      if (staging_.size() * sizeof(double) < bytes) staging_.resize((bytes + 7) / 8);
      std::memcpy(staging_.data(), single, bytes);
    }
    absl::Status s = RunAverage(single, *total, dtype);
    if (!s.ok()) {
      if (!in_place_) std::memcpy(single, staging_.data(), bytes);
      broken_ = s;
    }
    return s;
  }
  if (staging_.size() * sizeof(double) < bytes) staging_.resize((bytes + 7) / 8);
  PackDivided(tensors, dtype, 1.0, staging_.data());
  absl::Status s = RunAverage(staging_.data(), *total, dtype);
  if (!s.ok()) {
    broken_ = s;
    return s;
  }
  Unpack(staging_.data(), dtype, tensors);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceSum(void* data, int64_t numel, DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64) {
    return absl::InvalidArgumentError("AllReduceSum takes float32 or float64");
  }
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  absl::Status s = RunSum(data, numel, dtype);
  if (!s.ok()) broken_ = s;
  return s;
}

absl::Status SoloCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors) {
  // The mean of one member is its own value; only the arguments are checked.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel < 0 || (tensors[i].numel > 0 && tensors[i].data == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " has numel ", tensors[i].numel, " and data ",
                       tensors[i].data == nullptr ? "null" : "set"));
    }
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
