#include "client/nccl_communicator.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "common/cuda_check.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

ncclDataType_t NcclType(int32_t code) {
  switch (code) {
    case kStageF64:
      return ncclFloat64;
    case kStageF16:
      return ncclFloat16;
    case kStageBF16:
      return ncclBfloat16;
    default:
      return ncclFloat32;
  }
}

int32_t Code(DType d) {
  switch (d) {
    case DType::kFloat64:
      return kStageF64;
    case DType::kFloat16:
      return kStageF16;
    case DType::kBFloat16:
      return kStageBF16;
    default:
      return kStageF32;
  }
}

size_t CodeSize(int32_t c) { return c == kStageF64 ? 8 : (c == kStageF32 ? 4 : 2); }

// Sleep between polls once the first ~100 spins found the stream still busy.
constexpr absl::Duration kPollSleep = absl::Microseconds(20);

// The staging dtype: the common dtype when there is one (NCCL averages float16/bfloat16
// natively), else float64 if any tensor is float64, else float32.
int32_t StagingCode(absl::Span<const TensorView> tensors) {
  if (tensors.empty()) return kStageF32;
  bool same = true, any64 = false;
  for (const TensorView& t : tensors) {
    same = same && t.dtype == tensors[0].dtype;
    any64 = any64 || t.dtype == DType::kFloat64;
  }
  if (same) return Code(tensors[0].dtype);
  return any64 ? kStageF64 : kStageF32;
}

absl::Status WaitInit(ncclComm_t comm, absl::Time deadline,
                      const std::function<absl::Status()>& check_alive) {
  while (true) {
    ncclResult_t state = ncclInProgress;
    MODELAVG_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return NcclStatus(state, "ncclCommInitRankConfig (async)", __FILE__, __LINE__);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "NCCL communicator init did not complete in time: a member did not call it (dead or "
          "on another schedule)");
    }
    if (check_alive) MODELAVG_RETURN_IF_ERROR(check_alive());
    absl::SleepFor(absl::Microseconds(200));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const CommunicatorSetup& setup, int device) {
  const int member = setup.rank - setup.subgroup.first_rank;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclUniqueId id;
  if (member == 0) {
    MODELAVG_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    v1::PublishCommIdRequest req;
    setup.ScopeCommIdRequest("", &req);
    req.set_unique_id(std::string(id.internal, sizeof(id.internal)));
    MODELAVG_RETURN_IF_ERROR(
        Annotate(setup.coordinator->PublishCommId(req), "publishing the NCCL unique id"));
  } else {
    v1::GetCommIdRequest req;
    setup.ScopeCommIdRequest("", &req);
    req.set_timeout_ms(absl::ToInt64Milliseconds(setup.timeout));
    absl::StatusOr<std::string> blob = setup.coordinator->GetCommId(req);
    if (!blob.ok()) return Annotate(blob.status(), "fetching the NCCL unique id");
    if (blob->size() != sizeof(id.internal)) {
      return absl::InternalError(absl::StrCat("the published NCCL unique id has ", blob->size(),
                                              " bytes, expected ", sizeof(id.internal)));
    }
    std::memcpy(id.internal, blob->data(), sizeof(id.internal));
  }
  return CreateWithId(id, member, setup.subgroup.size, device, setup.timeout, setup.check_alive);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::CreateWithId(
    const ncclUniqueId& id, int member, int size, int device, absl::Duration timeout,
    std::function<absl::Status()> check_alive) {
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t res = ncclCommInitRankConfig(&comm, size, id, member, &config);
  if (res != ncclSuccess && res != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclStatus(res, "ncclCommInitRankConfig", __FILE__, __LINE__);
  }
  absl::Status s = WaitInit(comm, absl::Now() + timeout, check_alive);
  if (!s.ok()) {
    ncclCommAbort(comm);
    return s;
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, member, size, device, timeout, std::move(check_alive)));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int member, int size, int device,
                                   absl::Duration timeout,
                                   std::function<absl::Status()> check_alive)
    : comm_(comm),
      member_(member),
      size_(size),
      device_(device),
      timeout_(timeout),
      check_alive_(std::move(check_alive)) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock l(&mu_);
  cudaSetDevice(device_);
  if (!aborted_) {
    // A healthy non-blocking communicator is finalized (flushing its work, polled with a
    // deadline) and then destroyed; one that does not finalize in time is aborted.
    bool finalized = false;
    if (broken_.ok()) {
      const ncclResult_t r = ncclCommFinalize(comm_);  // may answer ncclInProgress
      if (r == ncclSuccess || r == ncclInProgress) {
        const absl::Time deadline = absl::Now() + timeout_;
        ncclResult_t state = ncclInProgress;
        while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess &&
               state == ncclInProgress && absl::Now() < deadline) {
          absl::SleepFor(absl::Microseconds(100));
        }
        finalized = state == ncclSuccess;
      }
    }
    if (finalized) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (staging_ != nullptr) cudaFree(staging_);
  if (chunks_device_ != nullptr) cudaFree(chunks_device_);
  if (sig_device_ != nullptr) cudaFree(sig_device_);
  if (sig_host_ != nullptr) cudaFreeHost(sig_host_);
}

void NcclCommunicator::Abort(const absl::Status& why) {
  absl::MutexLock l(&abort_mu_);
  if (!abort_why_.ok()) return;
  abort_why_ = why.ok() ? absl::AbortedError("the NCCL communicator was aborted") : why;
  abort_requested_.store(true, std::memory_order_release);
}

absl::Status NcclCommunicator::AbortRequested() const {
  if (!abort_requested_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock l(&abort_mu_);
  return abort_why_;
}

absl::Status NcclCommunicator::Fail(absl::Status status) {
  if (!aborted_) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  broken_ = status;
  spdlog::error("NCCL communicator aborted: {}", std::string(status.message()));
  return status;
}

absl::Status NcclCommunicator::WaitNcclReady(const char* what) {
  const absl::Time deadline = absl::Now() + timeout_;
  while (true) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return Fail(NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return Fail(NcclStatus(state, what, __FILE__, __LINE__));
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(what, " did not start in time")));
    }
    if (absl::Status a = AbortRequested(); !a.ok()) return Fail(a);
    absl::SleepFor(kPollSleep);
  }
}

absl::Status NcclCommunicator::Wait(cudaStream_t stream, const char* what) {
  const absl::Time deadline = absl::Now() + timeout_;
  int polls = 0;
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return Fail(CudaStatus(q, what, __FILE__, __LINE__));
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return Fail(NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__));
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(NcclStatus(state, what, __FILE__, __LINE__));
    }
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          what, " did not finish within ", absl::FormatDuration(timeout_),
          ": a peer is dead or stuck; the communicator was aborted")));
    }
    if (absl::Status a = AbortRequested(); !a.ok()) return Fail(a);
    // The generation check is cheap (no RPC) but not free: every 64 polls.
    if (check_alive_ && (++polls & 63) == 0) {
      absl::Status alive = check_alive_();
      if (!alive.ok()) return Fail(Annotate(alive, absl::StrCat(what, " abandoned")));
    }
    if (polls > 100) absl::SleepFor(kPollSleep);
  }
}

absl::Status NcclCommunicator::CheckLayout(int64_t numel, int32_t dtype, cudaStream_t stream) {
  if (sig_device_ == nullptr) {
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&sig_device_, 4 * sizeof(int64_t)));
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaMallocHost(&sig_host_, 4 * sizeof(int64_t)));
  }
  sig_host_[0] = numel;
  sig_host_[1] = -numel;
  sig_host_[2] = dtype;
  sig_host_[3] = -dtype;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sig_device_, sig_host_, 4 * sizeof(int64_t),
                                                cudaMemcpyHostToDevice, stream));
  ncclResult_t r = ncclAllReduce(sig_device_, sig_device_, 4, ncclInt64, ncclMax, comm_, stream);
  if (r == ncclInProgress) {
    MODELAVG_RETURN_IF_ERROR(WaitNcclReady("ncclAllReduce (layout check)"));
  } else if (r != ncclSuccess) {
    return Fail(NcclStatus(r, "ncclAllReduce (layout check)", __FILE__, __LINE__));
  }
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sig_host_, sig_device_, 4 * sizeof(int64_t),
                                                cudaMemcpyDeviceToHost, stream));
  MODELAVG_RETURN_IF_ERROR(Wait(stream, "layout check"));
  if (sig_host_[0] != -sig_host_[1] || sig_host_[2] != -sig_host_[3]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the members of this subgroup pass different parameter layouts: total element counts "
        "range from ", -sig_host_[1], " to ", sig_host_[0], " (this rank: ", numel, ")",
        sig_host_[2] != -sig_host_[3] ? " and the dtypes differ" : "",
        "; every member must average the same list of tensors"));
  }
  layout_checked_ = true;
  checked_numel_ = numel;
  checked_dtype_ = dtype;
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors) {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  if (absl::Status a = AbortRequested(); !a.ok()) return Fail(a);
  return Run(tensors);
}

absl::Status NcclCommunicator::Run(absl::Span<const TensorView> tensors) {
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (!t.device.is_cuda() || t.device.index != device_) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " is on ",
                                                     t.device.ToString(),
                                                     " but this NCCL communicator is on cuda:",
                                                     device_));
    }
    if (t.numel < 0 || (t.numel > 0 && t.data == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " has numel ", t.numel,
                                                     " and a ", t.data ? "set" : "null",
                                                     " data pointer"));
    }
    total += t.numel;
  }
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream =
      tensors.empty() ? nullptr : static_cast<cudaStream_t>(tensors[0].cuda_stream);
  const int32_t dtype = StagingCode(tensors);
  if (!layout_checked_ || checked_numel_ != total || checked_dtype_ != dtype) {
    MODELAVG_RETURN_IF_ERROR(CheckLayout(total, dtype, stream));
  }
  if (total == 0) return absl::OkStatus();

  // Back to back in memory, one dtype: reduce in place, no copies.
  bool contiguous = true;
  for (size_t i = 1; i < tensors.size() && contiguous; ++i) {
    contiguous = tensors[i].dtype == tensors[0].dtype &&
                 static_cast<char*>(tensors[i].data) ==
                     static_cast<char*>(tensors[i - 1].data) + tensors[i - 1].nbytes();
  }
  last_zero_copy_ = contiguous;
  void* buffer = nullptr;
  if (contiguous) {
    buffer = tensors[0].data;
  } else {
    const size_t bytes = static_cast<size_t>(total) * CodeSize(dtype);
    if (bytes > staging_bytes_) {
      if (staging_ != nullptr) MODELAVG_CUDA_RETURN_IF_ERROR(cudaFree(staging_));
      staging_ = nullptr;
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&staging_, bytes));
      staging_bytes_ = bytes;
    }
    std::vector<StagingChunk> chunks;
    int64_t offset = 0;
    for (const TensorView& t : tensors) {
      for (int64_t start = 0; start < t.numel; start += kStagingChunkElems) {
        StagingChunk c{};
        c.tensor = static_cast<char*>(t.data) + start * DTypeSize(t.dtype);
        c.staging_offset = offset + start;
        c.numel = std::min(kStagingChunkElems, t.numel - start);
        c.tensor_dtype = Code(t.dtype);
        chunks.push_back(c);
      }
      offset += t.numel;
    }
    // The table is uploaded only when the layout (pointers) changed: usually once.
    const bool same = chunks.size() == chunks_host_.size() &&
                      std::memcmp(chunks.data(), chunks_host_.data(),
                                  chunks.size() * sizeof(StagingChunk)) == 0;
    if (!same) {
      if (chunks.size() > chunks_capacity_) {
        if (chunks_device_ != nullptr) MODELAVG_CUDA_RETURN_IF_ERROR(cudaFree(chunks_device_));
        chunks_device_ = nullptr;
        MODELAVG_CUDA_RETURN_IF_ERROR(
            cudaMalloc(&chunks_device_, chunks.size() * sizeof(StagingChunk)));
        chunks_capacity_ = chunks.size();
      }
      chunks_host_ = std::move(chunks);
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chunks_device_, chunks_host_.data(),
                                                    chunks_host_.size() * sizeof(StagingChunk),
                                                    cudaMemcpyHostToDevice, stream));
    }
    MODELAVG_CUDA_RETURN_IF_ERROR(LaunchGather(
        chunks_device_, static_cast<int64_t>(chunks_host_.size()), staging_, dtype, stream));
    buffer = staging_;
  }
  ncclResult_t r =
      ncclAllReduce(buffer, buffer, static_cast<size_t>(total), NcclType(dtype), ncclAvg, comm_,
                    stream);
  if (r == ncclInProgress) {
    MODELAVG_RETURN_IF_ERROR(WaitNcclReady("ncclAllReduce"));
  } else if (r != ncclSuccess) {
    return Fail(NcclStatus(r, "ncclAllReduce", __FILE__, __LINE__));
  }
  MODELAVG_RETURN_IF_ERROR(Wait(stream, "ncclAllReduce"));
  if (contiguous) return absl::OkStatus();
  // The copy-back is enqueued only once the reduction has finished, so that an aborted
  // collective never leaks a half-reduced staging buffer into the caller's tensors.
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchScatter(
      chunks_device_, static_cast<int64_t>(chunks_host_.size()), staging_, dtype, stream));
  return Wait(stream, "scatter of the averaged parameters");
}

absl::Status NcclCommunicator::RawAllReduceAvg(void* data, int64_t numel, DType dtype,
                                               cudaStream_t stream) {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  ncclResult_t r = ncclAllReduce(data, data, static_cast<size_t>(numel), NcclType(Code(dtype)),
                                 ncclAvg, comm_, stream);
  if (r == ncclInProgress) {
    MODELAVG_RETURN_IF_ERROR(WaitNcclReady("ncclAllReduce"));
  } else if (r != ncclSuccess) {
    return Fail(NcclStatus(r, "ncclAllReduce", __FILE__, __LINE__));
  }
  return Wait(stream, "ncclAllReduce");
}

}  // namespace modelavg::client
