#include "client/comm/nccl/cuda/nccl_communicator.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/base/half.h"
#include "client/comm/nccl/nccl_bootstrap.h"
#include "client/rpc/coordinator_client.h"
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

// Sleep between polls once the first ~100 spins found the stream still busy.
constexpr absl::Duration kPollSleep = absl::Microseconds(20);

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
  ScopedCudaDevice on(device);
  MODELAVG_RETURN_IF_ERROR(on.status());
  ncclUniqueId id;
  absl::StatusOr<std::string> blob =
      ExchangeNcclUniqueId(setup, [&id]() -> absl::StatusOr<std::string> {
        MODELAVG_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
        return std::string(id.internal, sizeof(id.internal));
      });
  if (!blob.ok()) return blob.status();
  if (blob->size() != sizeof(id.internal)) {
    return absl::InternalError(absl::StrCat("the published NCCL unique id has ", blob->size(),
                                            " bytes, expected ", sizeof(id.internal)));
  }
  std::memcpy(id.internal, blob->data(), sizeof(id.internal));
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> out =
      CreateWithId(id, setup.MemberIndex(), setup.MemberCount(), device, setup.timeout,
                   setup.check_alive);
  if (out.ok() && setup.request_new_generation) {
    absl::MutexLock l(&(*out)->mu_);
    (*out)->core_.SetNewGenerationRequest(setup.request_new_generation);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::CreateWithId(
    const ncclUniqueId& id, int member, int size, int device, absl::Duration timeout,
    std::function<absl::Status()> check_alive) {
  ScopedCudaDevice on(device);
  MODELAVG_RETURN_IF_ERROR(on.status());
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
  std::unique_ptr<NcclCommunicator> out(
      new NcclCommunicator(comm, member, size, device, timeout, std::move(check_alive)));
  {
    absl::MutexLock l(&out->mu_);
    s = out->core_.Init();
    // Without its signature buffers a member could not take part in the layout check.
    if (!s.ok()) out->core_.Fail(s).IgnoreError();
  }
  if (!s.ok()) return Annotate(s, "allocating the layout check's buffers");
  return out;
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int member, int size, int device,
                                   absl::Duration timeout,
                                   std::function<absl::Status()> check_alive)
    : CudaLocalOps(device, timeout),
      comm_(comm),
      member_(member),
      size_(size),
      check_alive_(std::move(check_alive)),
      core_(this, member, size, device) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock l(&mu_);
  ScopedCudaDevice on(device());
  if (!aborted_.load()) {
    // A healthy non-blocking communicator is finalized (flushing its work, polled with a
    // deadline) and then destroyed; one that does not finalize in time is aborted.
    bool finalized = false;
    if (core_.broken().ok()) {
      const ncclResult_t r = ncclCommFinalize(comm_);  // may answer ncclInProgress
      if (r == ncclSuccess || r == ncclInProgress) {
        const absl::Time deadline = absl::Now() + timeout();
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
      AbortCommunicator();
    }
  }
  core_.Release();
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

void NcclCommunicator::AbortCommunicator() {
  if (!aborted_.exchange(true)) {
    ncclCommAbort(comm_);
    spdlog::error("NCCL communicator (member {} of {}) aborted", member_, size_);
  }
}

absl::Status NcclCommunicator::AllReduce(void* buffer, size_t count, Reduce op,
                                         int32_t staging_code, int divisor, void* stream) {
  const char* what = op == Reduce::kLayoutMax   ? "ncclAllReduce (layout check)"
                     : op == Reduce::kCommitSum ? "ncclAllReduce (commit)"
                                                : "ncclAllReduce";
  ncclDataType_t type = ncclInt64;
  ncclRedOp_t red = op == Reduce::kLayoutMax ? ncclMax : ncclSum;
  // A divisor other than the size (a round where admitted members contribute nothing):
  // ncclRedOpCreatePreMulSum with 1/divisor, rounded to the reduction dtype exactly as NCCL
  // rounds ncclAvg's 1/size (float(1.0/n), then to half or bfloat16). It is then ncclAvg's own
  // arithmetic for a group of `divisor` members, in the same single pass; a sum followed by a
  // scale would cost a second pass over the buffer and risk float16 overflow in the sum.
  bool custom = false;
  if (op == Reduce::kAverage) {
    type = NcclType(staging_code);
    red = ncclAvg;
    if (divisor != size_) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 11, 0)
      union {
        double f64;
        float f32;
        uint16_t f16;
      } scalar;
      const double inverse = 1.0 / divisor;
      switch (staging_code) {
        case kStageF64:
          scalar.f64 = inverse;
          break;
        case kStageF16:
          scalar.f16 = FloatToHalf(static_cast<float>(inverse));
          break;
        case kStageBF16:
          scalar.f16 = FloatToBFloat16(static_cast<float>(inverse));
          break;
        default:
          scalar.f32 = static_cast<float>(inverse);
      }
      const ncclResult_t c =
          ncclRedOpCreatePreMulSum(&red, &scalar, type, ncclScalarHostImmediate, comm_);
      if (c != ncclSuccess) {
        return NcclStatus(c, "ncclRedOpCreatePreMulSum", __FILE__, __LINE__);
      }
      custom = true;
#else
      return absl::UnimplementedError(absl::StrCat(
          "averaging over ", divisor, " of ", size_, " members needs NCCL 2.11 or later"));
#endif
    }
  }
  const ncclResult_t r =
      ncclAllReduce(buffer, buffer, count, type, red, comm_, static_cast<cudaStream_t>(stream));
  absl::Status s = r == ncclInProgress ? WaitNcclReady(what)
                                       : NcclStatus(r, what, __FILE__, __LINE__);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 11, 0)
  // NCCL allows destroying the operation once the last call given it has returned; after a
  // failure the communicator is aborted anyway, which frees it.
  if (custom && s.ok()) ncclRedOpDestroy(red, comm_);
#endif
  (void)custom;
  return s;
}

absl::Status NcclCommunicator::WaitNcclReady(const char* what) {
  const absl::Time deadline = absl::Now() + timeout();
  while (true) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, what, __FILE__, __LINE__);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " did not start in time"));
    }
    MODELAVG_RETURN_IF_ERROR(AbortRequested());
    absl::SleepFor(kPollSleep);
  }
}

absl::Status NcclCommunicator::Wait(void* stream_arg, const char* what) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_arg);
  const absl::Time deadline = absl::Now() + timeout();
  int polls = 0;
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return CudaStatus(q, what, __FILE__, __LINE__);
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__);
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclStatus(state, what, __FILE__, __LINE__);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " did not finish within ", absl::FormatDuration(timeout()),
                       ": a peer is dead or stuck; the communicator was aborted"));
    }
    ++polls;
    MODELAVG_RETURN_IF_ERROR(AbortRequested());
    // The generation check is cheap (no RPC) but not free: every 64 polls.
    if (check_alive_ && (polls & 63) == 0) {
      absl::Status alive = check_alive_();
      if (!alive.ok()) return Annotate(alive, absl::StrCat(what, " abandoned"));
    }
    if (polls > 100) absl::SleepFor(kPollSleep);
  }
}

bool NcclCommunicator::last_was_zero_copy() const {
  absl::MutexLock l(&mu_);
  return core_.last_was_zero_copy();
}

absl::Status NcclCommunicator::AdoptPendingResult(absl::Span<const TensorView> tensors) {
  absl::MutexLock l(&mu_);
  ScopedCudaDevice on(device());
  MODELAVG_RETURN_IF_ERROR(on.status());
  return core_.Adopt(tensors);
}

absl::Status NcclCommunicator::AllToAll(const void* send, void* recv, size_t bytes,
                                        void* stream) {
  const char* what = "ncclSend/ncclRecv (compressed all-to-all)";
  auto s_ = static_cast<cudaStream_t>(stream);
  ncclResult_t r = ncclGroupStart();
  for (int peer = 0; peer < size_ && r == ncclSuccess; ++peer) {
    r = ncclSend(static_cast<const char*>(send) + peer * bytes, bytes, ncclUint8, peer, comm_,
                 s_);
    if (r == ncclSuccess || r == ncclInProgress) {
      r = ncclRecv(static_cast<char*>(recv) + peer * bytes, bytes, ncclUint8, peer, comm_, s_);
    }
    if (r == ncclInProgress) r = ncclSuccess;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r != ncclSuccess) return NcclStatus(r, what, __FILE__, __LINE__);
  return end == ncclInProgress ? WaitNcclReady(what) : NcclStatus(end, what, __FILE__, __LINE__);
}

absl::Status NcclCommunicator::AllGather(const void* send, void* recv, size_t bytes,
                                         void* stream) {
  const char* what = "ncclAllGather (compressed)";
  const ncclResult_t r =
      ncclAllGather(send, recv, bytes, ncclUint8, comm_, static_cast<cudaStream_t>(stream));
  return r == ncclInProgress ? WaitNcclReady(what) : NcclStatus(r, what, __FILE__, __LINE__);
}

int64_t NcclCommunicator::bytes_sent() const { return bytes_sent_.load(); }

absl::Status NcclCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors,
                                                const RoundOptions& options,
                                                RoundOutcome* outcome) {
  if (outcome != nullptr) *outcome = RoundOutcome::kFailedWithoutResult;
  absl::MutexLock l(&mu_);
  if (!core_.broken().ok()) return core_.broken();
  ScopedCudaDevice on(device());
  MODELAVG_RETURN_IF_ERROR(on.status());
  if (absl::Status a = AbortRequested(); !a.ok()) return core_.Fail(a);
  absl::Status s = core_.Run(tensors, options, outcome);
  // Read without mu_ (a background round may hold it for long).
  bytes_sent_.store(core_.bytes_sent());
  return s;
}

absl::Status NcclCommunicator::RawAllReduce(void* data, int64_t numel, DType dtype,
                                            cudaStream_t stream, bool sum) {
  absl::MutexLock l(&mu_);
  if (!core_.broken().ok()) return core_.broken();
  ScopedCudaDevice on(device());
  MODELAVG_RETURN_IF_ERROR(on.status());
  const ncclResult_t r = ncclAllReduce(data, data, static_cast<size_t>(numel),
                                       NcclType(StagingCodeOf(dtype)), sum ? ncclSum : ncclAvg,
                                       comm_, stream);
  absl::Status s = r == ncclInProgress ? WaitNcclReady("ncclAllReduce")
                                       : NcclStatus(r, "ncclAllReduce", __FILE__, __LINE__);
  if (s.ok()) s = Wait(stream, "ncclAllReduce");
  if (!s.ok()) return core_.Fail(s);
  return absl::OkStatus();
}

}  // namespace modelavg::client
