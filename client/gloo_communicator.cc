#include "client/gloo_communicator.h"

#include <chrono>
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
    int size, absl::Duration timeout, std::function<absl::Status()> store_error) {
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
        new GlooCommunicator(std::move(context), rank, size, timeout));
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
                                   absl::Duration timeout)
    : context_(std::move(context)), rank_(rank), size_(size), timeout_(timeout) {}

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
  if (staging_.size() * sizeof(double) < bytes) staging_.resize((bytes + 7) / 8);
  PackDivided(tensors, dtype, static_cast<double>(size_), staging_.data());
  absl::Status s = RunSum(staging_.data(), *total, dtype);
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
