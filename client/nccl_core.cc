#include "client/nccl_core.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/coordinator_client.h"
#include "common/status_util.h"

namespace modelavg::client {

absl::Status GrowableBuffer::Reserve(NcclDeviceOps& ops, size_t bytes, bool* grown) {
  if (grown != nullptr) *grown = false;
  if (bytes <= capacity_ && data_ != nullptr) return absl::OkStatus();
  Release(ops);
  void* p = nullptr;
  absl::Status s = pinned_host_ ? ops.MallocHost(&p, bytes) : ops.Malloc(&p, bytes);
  if (!s.ok()) return s;
  data_ = p;
  capacity_ = bytes;
  if (grown != nullptr) *grown = true;
  return absl::OkStatus();
}

void GrowableBuffer::Release(NcclDeviceOps& ops) {
  if (data_ != nullptr) {
    if (pinned_host_) {
      ops.FreeHost(data_);
    } else {
      ops.Free(data_);
    }
  }
  data_ = nullptr;
  capacity_ = 0;
}

LayoutSignature EncodeLayout(int64_t count, int32_t staging_code, int64_t total,
                             bool failed_locally, int member) {
  return LayoutSignature{count, -count, staging_code, -staging_code, total, -total,
                         failed_locally ? member + 1 : 0, 0};
}

LayoutDecision DecideLayout(const LayoutSignature& reduced, int64_t count, int64_t total,
                            const absl::Status& local) {
  LayoutDecision d;
  if (reduced[6] > 0) {
    d.status = !local.ok()
                   ? local
                   : absl::AbortedError(absl::StrCat(
                         "member ", reduced[6] - 1,
                         " of this subgroup failed before the collective (see its error; the "
                         "highest-numbered one that failed); no member averaged and the "
                         "communicator remains usable"));
    return d;
  }
  if (reduced[4] != -reduced[5] || reduced[2] != -reduced[3]) {
    d.status = absl::InvalidArgumentError(absl::StrCat(
        "the members of this subgroup pass different parameter layouts: total element counts "
        "range from ", -reduced[5], " to ", reduced[4], " (this rank: ", total, ")",
        reduced[2] != -reduced[3] ? " and the dtypes differ" : "",
        "; every member must average the same list of tensors"));
    return d;
  }
  d.unpadded = reduced[0] != -reduced[1] || reduced[0] != count;
  return d;
}

NcclCore::NcclCore(NcclDeviceOps* ops, int member, int device)
    : ops_(ops), member_(member), device_(device) {}

NcclCore::~NcclCore() { Release(); }

void NcclCore::Release() {
  chunks_host_.clear();
  staging_.Release(*ops_);
  chunks_device_.Release(*ops_);
  sig_device_.Release(*ops_);
  sig_host_.Release(*ops_);
}

absl::Status NcclCore::Init() {
  const size_t bytes = kLayoutWords * sizeof(int64_t);
  MODELAVG_RETURN_IF_ERROR(sig_device_.Reserve(*ops_, bytes));
  return sig_host_.Reserve(*ops_, bytes);
}

absl::Status NcclCore::Fail(absl::Status status) {
  ops_->AbortCommunicator();
  broken_ = status;
  return status;
}

absl::Status NcclCore::PrepareStaged(const StagingLayout& layout, int32_t code, void* stream) {
  const size_t bytes = static_cast<size_t>(layout.elems) * StagingCodeSize(code);
  const bool same_table =
      layout.chunks.size() == chunks_host_.size() &&
      std::memcmp(layout.chunks.data(), chunks_host_.data(),
                  layout.chunks.size() * sizeof(StagingChunk)) == 0 &&
      chunks_device_.data() != nullptr && staging_.capacity() >= bytes;
  if (!same_table) {
    // Forget the old table first: if anything below fails, the next call uploads again.
    chunks_host_.clear();
    bool grown = false;
    MODELAVG_RETURN_IF_ERROR(staging_.Reserve(*ops_, bytes, &grown));
    // Padding gaps are reduced along: keep them zero.
    MODELAVG_RETURN_IF_ERROR(ops_->Zero(staging_.data(), bytes, stream));
    MODELAVG_RETURN_IF_ERROR(
        chunks_device_.Reserve(*ops_, layout.chunks.size() * sizeof(StagingChunk)));
    // The upload may read the host table asynchronously: it is the member's copy, unchanged
    // until a later call's layout differs (every call waits on the stream before that).
    chunks_host_ = layout.chunks;
    absl::Status s = ops_->Copy(chunks_device_.data(), chunks_host_.data(),
                                chunks_host_.size() * sizeof(StagingChunk), stream);
    if (!s.ok()) {
      chunks_host_.clear();
      return s;
    }
  }
  return ops_->Gather(static_cast<const StagingChunk*>(chunks_device_.data()),
                      static_cast<int64_t>(layout.chunks.size()), staging_.data(), code, stream);
}

absl::Status NcclCore::Run(absl::Span<const TensorView> tensors) {
  if (!broken_.ok()) return broken_;
  // Step 1: local preparation. Every failure here is carried into the layout check.
  absl::Status local;
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size() && local.ok(); ++i) {
    const TensorView& t = tensors[i];
    if (!t.device.is_cuda() || t.device.index != device_) {
      local = absl::InvalidArgumentError(absl::StrCat("tensor ", i, " is on ",
                                                      t.device.ToString(),
                                                      " but this NCCL communicator is on cuda:",
                                                      device_));
    } else {
      local = ValidateTensorView(i, t);
    }
    total += t.numel;
  }
  void* stream = tensors.empty() ? nullptr : tensors[0].cuda_stream;
  const int32_t code = StagingCode(tensors);
  const bool zero_copy = local.ok() && IsZeroCopy(tensors);
  StagingLayout layout;
  int64_t count = total;
  if (local.ok() && !zero_copy && total > 0) {
    layout = BuildStagingLayout(tensors, code, /*pad=*/true);
    count = layout.elems;
    local = PrepareStaged(layout, code, stream);
  }
  last_zero_copy_ = zero_copy;

  // Step 2: the layout check, on every call.
  if (sig_host_.data() == nullptr || sig_device_.data() == nullptr) {
    return Fail(absl::InternalError("NcclCore::Run before Init"));
  }
  auto* sig = static_cast<int64_t*>(sig_host_.data());
  const LayoutSignature mine = EncodeLayout(count, code, total, !local.ok(), member_);
  std::memcpy(sig, mine.data(), sizeof(mine));
  absl::Status s = ops_->Copy(sig_device_.data(), sig, sizeof(mine), stream);
  if (s.ok()) {
    s = ops_->AllReduce(sig_device_.data(), kLayoutWords, NcclDeviceOps::Reduce::kLayoutMax,
                        code, stream);
  }
  if (s.ok()) s = ops_->Copy(sig, sig_device_.data(), sizeof(mine), stream);
  if (s.ok()) s = ops_->Wait(stream, "layout check");
  if (!s.ok()) return Fail(Annotate(s, "layout check"));
  LayoutSignature reduced;
  std::memcpy(reduced.data(), sig, sizeof(reduced));

  // Step 3: the shared decision.
  const LayoutDecision d = DecideLayout(reduced, count, total, local);
  if (!d.status.ok()) return d.status;
  if (total == 0) return absl::OkStatus();
  if (d.unpadded && !zero_copy) {
    layout = BuildStagingLayout(tensors, code, /*pad=*/false);
    s = PrepareStaged(layout, code, stream);
    if (!s.ok()) return Fail(Annotate(s, "staging the unpadded layout"));
  }
  count = total;
  if (!zero_copy) count = layout.elems;

  // Step 4: the data collective and the copy back.
  void* buffer = zero_copy ? tensors[0].data : staging_.data();
  s = ops_->AllReduce(buffer, static_cast<size_t>(count), NcclDeviceOps::Reduce::kAverage, code,
                      stream);
  if (s.ok()) s = ops_->Wait(stream, "ncclAllReduce");
  if (!s.ok()) return Fail(s);
  if (zero_copy) return absl::OkStatus();
  // The copy-back is enqueued only once the reduction has finished, so that an aborted
  // collective never leaks a half-reduced staging buffer into the caller's tensors.
  s = ops_->Scatter(static_cast<const StagingChunk*>(chunks_device_.data()),
                    static_cast<int64_t>(chunks_host_.size()), staging_.data(), code, stream);
  if (s.ok()) s = ops_->Wait(stream, "scatter of the averaged parameters");
  if (!s.ok()) return Fail(s);
  return absl::OkStatus();
}

std::string NcclUniqueIdKey(int32_t attempt) { return absl::StrCat("nccl/", attempt); }

absl::StatusOr<std::string> ExchangeNcclUniqueId(
    const CommunicatorSetup& setup, const std::function<absl::StatusOr<std::string>()>& draw) {
  const int member = setup.MemberIndex();
  const std::string key = setup.MemberScope() + NcclUniqueIdKey(setup.bootstrap_attempt);
  if (member == 0) {
    absl::StatusOr<std::string> id = draw();
    if (!id.ok()) return id.status();
    v1::PublishCommIdRequest req;
    setup.ScopeCommIdRequest(key, &req);
    req.set_unique_id(*id);
    MODELAVG_RETURN_IF_ERROR(Annotate(
        setup.coordinator->PublishCommId(req),
        absl::StrCat("publishing the NCCL unique id (bootstrap attempt ", setup.bootstrap_attempt,
                     ")")));
    return id;
  }
  v1::GetCommIdRequest req;
  setup.ScopeCommIdRequest(key, &req);
  req.set_timeout_ms(absl::ToInt64Milliseconds(setup.timeout));
  absl::StatusOr<std::string> blob = setup.coordinator->GetCommId(req);
  if (!blob.ok()) {
    return Annotate(blob.status(), absl::StrCat("fetching the NCCL unique id (bootstrap attempt ",
                                                setup.bootstrap_attempt, ")"));
  }
  return blob;
}

}  // namespace modelavg::client
