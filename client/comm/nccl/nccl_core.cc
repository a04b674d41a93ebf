#include "client/comm/nccl/nccl_core.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"
#include "client/payload/payload_codec.h"
#include "client/rpc/coordinator_client.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

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

absl::Status UploadChunkTable(NcclDeviceOps& ops, const std::vector<StagingChunk>& chunks,
                              std::vector<StagingChunk>* host, GrowableBuffer* device,
                              void* stream) {
  host->clear();
  MODELAVG_RETURN_IF_ERROR(device->Reserve(ops, chunks.size() * sizeof(StagingChunk)));
  *host = chunks;
  absl::Status s =
      ops.Copy(device->data(), host->data(), host->size() * sizeof(StagingChunk), stream);
  if (!s.ok()) host->clear();
  return s;
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
                             bool failed_locally, int member, int divisor, int64_t step) {
  constexpr int64_t kAnyStep = std::numeric_limits<int64_t>::min();
  return LayoutSignature{count,
                         -count,
                         staging_code,
                         -staging_code,
                         total,
                         -total,
                         failed_locally ? member + 1 : 0,
                         divisor,
                         -divisor,
                         step >= 0 ? step : kAnyStep,
                         step >= 0 ? -step : kAnyStep};
}

LayoutDecision DecideLayout(const LayoutSignature& reduced, int64_t count, int64_t total,
                            const absl::Status& local, int64_t step) {
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
    d.status = SetErrorKind(absl::InvalidArgumentError(absl::StrCat(
        "the members of this subgroup pass different parameter layouts: total element counts "
        "range from ", -reduced[5], " to ", reduced[4], " (this rank: ", total, ")",
        reduced[2] != -reduced[3] ? " and the dtypes differ" : "",
        "; every member must average the same list of tensors")), ErrorKind::kLayoutMismatch);
    return d;
  }
  // Every member that passes a step passes the same one, and every member divides alike:
  // anything else is a disagreement on the round itself (never a mixed average).
  const bool steps_differ =
      reduced[9] != std::numeric_limits<int64_t>::min() && reduced[9] != -reduced[10];
  if (steps_differ || reduced[7] != -reduced[8]) {
    d.status = SetErrorKind(absl::InternalError(absl::StrCat(
        "the members of this subgroup are averaging different rounds: ",
        steps_differ ? absl::StrCat("steps range from ", -reduced[10], " to ", reduced[9],
                                    " (this rank: ", step, ")")
                     : absl::StrCat("divisors (contributing members) range from ", -reduced[8],
                                    " to ", reduced[7]),
        "; no member averaged; this is a bug in modelavg's round agreement, please report it")),
        ErrorKind::kRoundMismatch);
    return d;
  }
  d.unpadded = reduced[0] != -reduced[1] || reduced[0] != count;
  return d;
}

uint64_t LayoutFingerprint(absl::Span<const TensorView> tensors, int32_t code, int64_t count) {
  // FNV-1a over the words that make the layout.
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= (v >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(tensors.size());
  mix(static_cast<uint64_t>(code));
  mix(static_cast<uint64_t>(count));
  for (const TensorView& t : tensors) {
    mix(static_cast<uint64_t>(t.numel));
    mix(static_cast<uint64_t>(t.dtype));
  }
  return h;
}

NcclCore::NcclCore(NcclDeviceOps* ops, int member, int size, int device, size_t bucket_bytes)
    : ops_(ops), member_(member), size_(size), device_(device), bucket_bytes_(bucket_bytes) {}

NcclCore::~NcclCore() { Release(); }

void NcclCore::Release() {
  chunks_host_.clear();
  pending_ = Pending::kNone;
  staging_.Release(*ops_);
  chunks_device_.Release(*ops_);
  backup_.Release(*ops_);
  pending_buffer_.Release(*ops_);
  wire_send_.Release(*ops_);
  wire_recv_.Release(*ops_);
  wire_part_.Release(*ops_);
  sig_device_.Release(*ops_);
  sig_host_.Release(*ops_);
  for (void* e : gathered_) ops_->DestroyEvent(e);
  gathered_.clear();
  if (start_event_ != nullptr) ops_->DestroyEvent(start_event_);
  if (gather_stream_ != nullptr) ops_->DestroyStream(gather_stream_);
  start_event_ = gather_stream_ = nullptr;
  streams_made_ = false;
  gathers_pending_ = false;
}

StagingLayout NcclCore::MakeLayout(absl::Span<const TensorView> tensors, int32_t code,
                                   bool pad) const {
  StagingLayout layout = BuildStagingLayout(tensors, code, pad);
  SplitIntoBuckets(&layout, BucketElems(code));
  return layout;
}

int64_t NcclCore::BucketElems(int32_t code) const {
  return std::max<int64_t>(1, static_cast<int64_t>(bucket_bytes_ / StagingCodeSize(code)));
}

absl::Status NcclCore::JoinGathers(void* stream) {
  if (!gathers_pending_) return absl::OkStatus();
  gathers_pending_ = false;
  // The gather stream runs in order: its last bucket's event covers every earlier one.
  for (auto it = gathered_.rbegin(); it != gathered_.rend(); ++it) {
    if (*it != nullptr) return ops_->StreamWaitEvent(stream, *it);
  }
  return absl::OkStatus();
}

void NcclCore::SettleGathers(void* stream) {
  if (!gathers_pending_) return;
  absl::Status s = JoinGathers(stream);
  if (s.ok()) s = ops_->WaitLocal(stream, "the gathers of a failed call");
  if (!s.ok()) spdlog::warn("NCCL member {}: {}", member_, s.ToString());
}

absl::Status NcclCore::ReduceBuckets(void* buffer, int64_t count, int32_t code, int divisor,
                                     void* stream) {
  const std::vector<std::pair<int64_t, int64_t>> buckets =
      BucketRanges(count, BucketElems(code));
  const bool pipelined = gathers_pending_;
  gathers_pending_ = false;
  for (size_t k = 0; k < buckets.size(); ++k) {
    const auto [begin, end] = buckets[k];
    if (pipelined && k < gathered_.size()) {
      MODELAVG_RETURN_IF_ERROR(ops_->StreamWaitEvent(stream, gathered_[k]));
    }
    MODELAVG_RETURN_IF_ERROR(ops_->AllReduce(
        static_cast<char*>(buffer) + begin * static_cast<int64_t>(StagingCodeSize(code)),
        static_cast<size_t>(end - begin), NcclDeviceOps::Reduce::kAverage, code, divisor,
        stream));
  }
  // A ring all-reduce hands every member 2 (n - 1) / n of the buffer to send.
  const int64_t bytes = count * static_cast<int64_t>(StagingCodeSize(code));
  bytes_sent_ += 2 * (bytes * (size_ - 1) / size_);
  return absl::OkStatus();
}

absl::Status NcclCore::ReduceCompressed(void* buffer, int64_t count, Payload payload,
                                        int divisor, void* stream) {
  // Gathers pending on the gather stream must have filled the buffer first.
  MODELAVG_RETURN_IF_ERROR(JoinGathers(stream));
  const int n = size_;
  const int64_t part = (count + n - 1) / n;
  // Every part at a 16-byte aligned offset, so that the kernels read the INT8 scales aligned.
  const size_t stride = (EncodedBytes(payload, part) + 15) / 16 * 16;
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_send_.Reserve(*ops_, stride * n),
                                    "allocating the compressed round's send buffer"));
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_recv_.Reserve(*ops_, stride * n),
                                    "allocating the compressed round's receive buffer"));
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_part_.Reserve(*ops_, static_cast<size_t>(part) * 4),
                                    "allocating the compressed round's part"));
  float* data = static_cast<float*>(buffer);
  float* mine = static_cast<float*>(wire_part_.data());
  MODELAVG_RETURN_IF_ERROR(
      ops_->EncodeParts(payload, data, count, part, n, stride, wire_send_.data(), stream));
  MODELAVG_RETURN_IF_ERROR(ops_->AllToAll(wire_send_.data(), wire_recv_.data(), stride, stream));
  // This member's part: the float32 sum of every member's decoded piece, in member order, then
  // times 1/divisor (as the Gloo path computes it).
  const float scale = 1.0f / static_cast<float>(divisor);
  MODELAVG_RETURN_IF_ERROR(
      ops_->DecodeSumParts(payload, wire_recv_.data(), n, part, stride, scale, mine, stream));
  MODELAVG_RETURN_IF_ERROR(
      ops_->EncodeParts(payload, mine, part, part, 1, stride, wire_send_.data(), stream));
  MODELAVG_RETURN_IF_ERROR(ops_->AllGather(wire_send_.data(), wire_recv_.data(), stride, stream));
  // Every member decodes the same bytes: the results agree bit for bit.
  MODELAVG_RETURN_IF_ERROR(
      ops_->DecodeParts(payload, wire_recv_.data(), count, part, stride, data, stream));
  bytes_sent_ += 2 * static_cast<int64_t>(stride) * (n - 1);
  return absl::OkStatus();
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

absl::Status NcclCore::FailAlone(absl::Status status) {
  Fail(status).IgnoreError();
  spdlog::error("NCCL member {} of {}: {}; asking for a new generation so that its peers' "
                "collective is aborted", member_, size_, status.ToString());
  if (request_new_generation_) request_new_generation_(status);
  return status;
}

absl::Status NcclCore::UseTable(const StagingLayout& layout, size_t bytes, bool may_grow,
                                void* stream) {
  const bool same_table =
      layout.chunks.size() == chunks_host_.size() &&
      std::memcmp(layout.chunks.data(), chunks_host_.data(),
                  layout.chunks.size() * sizeof(StagingChunk)) == 0 &&
      chunks_device_.data() != nullptr && staging_.capacity() >= bytes;
  if (same_table) return absl::OkStatus();
  // Forget the old table first: if anything below fails, the next call uploads again.
  chunks_host_.clear();
  if (may_grow) {
    bool grown = false;
    MODELAVG_RETURN_IF_ERROR(staging_.Reserve(*ops_, bytes, &grown));
    // Padding gaps are reduced along: keep them zero.
    MODELAVG_RETURN_IF_ERROR(ops_->Zero(staging_.data(), bytes, stream));
  } else if (staging_.data() == nullptr || staging_.capacity() < bytes) {
    return absl::InternalError(absl::StrCat("the staging buffer holds ", staging_.capacity(),
                                            " bytes where ", bytes, " are needed"));
  }
  return UploadChunkTable(*ops_, layout.chunks, &chunks_host_, &chunks_device_, stream);
}

absl::Status NcclCore::PrepareStaged(const StagingLayout& layout, int32_t code, bool contribute,
                                     void* stream) {
  const size_t bytes = static_cast<size_t>(layout.elems) * StagingCodeSize(code);
  // A re-staging (the unpadded fallback, a failed call's gathers) must not race the gathers
  // still on the gather stream.
  MODELAVG_RETURN_IF_ERROR(JoinGathers(stream));
  MODELAVG_RETURN_IF_ERROR(UseTable(layout, bytes, /*may_grow=*/true, stream));
  // A member that does not contribute reduces zeros (its tensors are only written).
  if (!contribute) return ops_->Zero(staging_.data(), bytes, stream);
  const auto* table = static_cast<const StagingChunk*>(chunks_device_.data());
  if (!streams_made_) {
    MODELAVG_RETURN_IF_ERROR(ops_->CreateStream(&gather_stream_));
    if (absl::Status e = ops_->CreateEvent(&start_event_); !e.ok()) {
      ops_->DestroyStream(gather_stream_);
      gather_stream_ = nullptr;
      return Annotate(e, "creating the staging pipeline's events");
    }
    streams_made_ = true;
  }
  if (gather_stream_ == nullptr) {
    // No stream of its own: one gather on the caller's stream, in order.
    return ops_->Gather(table, static_cast<int64_t>(layout.chunks.size()), staging_.data(), code,
                        stream);
  }
  while (gathered_.size() < layout.buckets.size()) {
    void* e = nullptr;
    MODELAVG_RETURN_IF_ERROR(ops_->CreateEvent(&e));
    gathered_.push_back(e);
  }
  // The gathers start after the caller's earlier work on its stream (the parameters' last
  // writes, the staging buffer's zeroing and the table's upload).
  MODELAVG_RETURN_IF_ERROR(ops_->RecordEvent(start_event_, stream));
  MODELAVG_RETURN_IF_ERROR(ops_->StreamWaitEvent(gather_stream_, start_event_));
  for (size_t k = 0; k < layout.buckets.size(); ++k) {
    const StagingBucket& b = layout.buckets[k];
    if (b.num_chunks > 0) {
      MODELAVG_RETURN_IF_ERROR(ops_->Gather(table + b.first_chunk, b.num_chunks,
                                            staging_.data(), code, gather_stream_));
    }
    MODELAVG_RETURN_IF_ERROR(ops_->RecordEvent(gathered_[k], gather_stream_));
    gathers_pending_ = true;
  }
  return absl::OkStatus();
}

absl::Status NcclCore::Commit(void* stream, int64_t step) {
  auto* vote = static_cast<int64_t*>(sig_host_.data());
  *vote = 1;
  absl::Status s = ops_->Copy(sig_device_.data(), vote, sizeof(int64_t), stream);
  if (s.ok()) {
    s = ops_->AllReduce(sig_device_.data(), 1, NcclDeviceOps::Reduce::kCommitSum, 0, 1, stream);
  }
  if (s.ok()) s = ops_->Copy(vote, sig_device_.data(), sizeof(int64_t), stream);
  if (s.ok()) s = ops_->Wait(stream, "commit of the averaging round");
  if (!s.ok()) return Annotate(s, "commit of the averaging round");
  if (*vote != size_) {
    return absl::InternalError(absl::StrCat("the commit of the averaging round counted ", *vote,
                                            " of ", size_, " members"));
  }
  if (faults_ != nullptr && faults_->TakeLostCommit(step)) {
    spdlog::warn("round at step {}: injecting a lost commit on this member (test fault)", step);
    return absl::UnavailableError("injected commit failure (test)");
  }
  return absl::OkStatus();
}

absl::Status NcclCore::Restore(void* data, size_t bytes, void* stream) {
  absl::Status r = ops_->Copy(data, backup_.data(), bytes, stream);
  if (r.ok()) r = ops_->WaitLocal(stream, "restoring the parameters from the backup");
  return r;
}

absl::Status NcclCore::FailAndRestore(absl::Status status, void* data, size_t bytes,
                                      bool restore, void* stream) {
  // Abort first: the collective may still be running on the stream, and the restore must come
  // after it ends.
  Fail(status).IgnoreError();
  if (!restore) return status;
  if (absl::Status r = Restore(data, bytes, stream); !r.ok()) {
    return broken_ = absl::Status(
               status.code(),
               absl::StrCat(status.message(), "; restoring the parameters from their backup failed "
                            "too (", r.message(), "): they are undefined"));
  }
  return status;
}

absl::Status NcclCore::Run(absl::Span<const TensorView> tensors, const RoundOptions& options,
                           RoundOutcome* outcome_arg) {
  RoundOutcome ignored;
  RoundOutcome* outcome = outcome_arg != nullptr ? outcome_arg : &ignored;
  *outcome = RoundOutcome::kFailedWithoutResult;
  if (!broken_.ok()) return broken_;
  pending_ = Pending::kNone;
  // Step 1: local preparation. Every failure here is carried into the layout check.
  absl::Status local;
  const int divisor = options.contributors > 0 ? options.contributors : size_;
  if (divisor > size_ || (!options.contribute && divisor >= size_)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        divisor, " contributing members of ", size_, options.contribute ? "" : " (this one not)",
        ": the round has no valid divisor"));
  }
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
  if (local.ok() && options.payload != Payload::kFp32 && total > 0 && code != kStageF32) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "a ", PayloadName(options.payload),
        " payload takes float32/float16/bfloat16 tensors; these include float64"));
  }
  const bool zero_copy = local.ok() && IsZeroCopy(tensors);
  // Step 2 is due at the first call, and later only where every member knows alike that it is:
  // another divisor (the round after an admission), or a fragment round (each fragment its own
  // layout). Otherwise the agreed layout is compared locally.
  // A world of one has no peer to leave in a mismatched collective: it agrees again instead.
  bool agree = !agreed_ || options.layout_signature != 0 || divisor != agreed_divisor_;
  StagingLayout layout;
  int64_t count = total;
  if (!agree && local.ok()) {
    if (!zero_copy && total > 0) {
      layout = MakeLayout(tensors, code, /*pad=*/!agreed_unpadded_);
      count = layout.elems;
    }
    if (LayoutFingerprint(tensors, code, count) != agreed_fingerprint_) {
      if (size_ == 1) {
        agree = true;
      } else {
        local = SetErrorKind(
            absl::InvalidArgumentError(absl::StrCat(
                "this member's parameter layout changed after its NCCL communicator agreed on "
                "one (agreed: ", agreed_tensors_, " tensors, ", agreed_total_, " elements; now ",
                tensors.size(), " tensors, ", total, " elements",
                total == agreed_total_ ? ", other sizes or dtypes" : "",
                "); every member must average the same list of tensors on every call. This "
                "member fails out of the job so that its peers are aborted")),
            ErrorKind::kLayoutMismatch);
      }
    }
  }
  if (agree && local.ok() && !zero_copy && total > 0) {
    layout = MakeLayout(tensors, code, /*pad=*/true);
    count = layout.elems;
  }
  if (local.ok() && !zero_copy && total > 0) {
    local = PrepareStaged(layout, code, options.contribute, stream);
  }
  // At world 1 a local failure is carried in the agreement, as at a first call.
  if (!local.ok() && size_ == 1) agree = true;
  // The zero-copy path reduces the caller's buffer in place: a committed round (or a member
  // that does not contribute, whose buffer is zeroed) first copies it to the backup, so that a
  // failure leaves it as it was. Enqueued before the all-reduce, it costs no wait of its own.
  const size_t bytes = static_cast<size_t>(total) * StagingCodeSize(code);
  const bool backup = zero_copy && total > 0 && (options.commit || !options.contribute);
  if (local.ok() && backup) {
    local = backup_.Reserve(*ops_, bytes);
    if (local.ok()) local = ops_->Copy(backup_.data(), tensors[0].data, bytes, stream);
    if (!local.ok()) local = Annotate(local, "backing up the parameters");
  }
  last_zero_copy_ = zero_copy;

  absl::Status s;
  bool unpadded = agreed_unpadded_;
  if (!agree) {
    // The peers are entering the data all-reduce: a member that cannot take part cannot say so
    // in band.
    if (!local.ok()) {
      SettleGathers(stream);
      return FailAlone(local);
    }
  } else {
    // Step 2: the layout agreement.
    if (sig_host_.data() == nullptr || sig_device_.data() == nullptr) {
      return Fail(absl::InternalError("NcclCore::Run before Init"));
    }
    auto* sig = static_cast<int64_t*>(sig_host_.data());
    const LayoutSignature mine =
        EncodeLayout(count, code, total, !local.ok(), member_, divisor, options.step);
    std::memcpy(sig, mine.data(), sizeof(mine));
    s = ops_->Copy(sig_device_.data(), sig, sizeof(mine), stream);
    if (s.ok()) {
      s = ops_->AllReduce(sig_device_.data(), kLayoutWords, NcclDeviceOps::Reduce::kLayoutMax,
                          code, divisor, stream);
    }
    if (s.ok()) s = ops_->Copy(sig, sig_device_.data(), sizeof(mine), stream);
    if (s.ok()) s = ops_->Wait(stream, "layout check");
    if (!s.ok()) return Fail(Annotate(s, "layout check"));
    LayoutSignature reduced;
    std::memcpy(reduced.data(), sig, sizeof(reduced));

    // Step 3: the shared decision.
    const LayoutDecision d = DecideLayout(reduced, count, total, local, options.step);
    if (!d.status.ok()) {
      // Nobody reduces: no gather may still read the caller's tensors once the call returns.
      SettleGathers(stream);
      return d.status;
    }
    unpadded = d.unpadded;
    if (d.unpadded && !zero_copy && total > 0) {
      layout = MakeLayout(tensors, code, /*pad=*/false);
      s = PrepareStaged(layout, code, options.contribute, stream);
      if (!s.ok()) return Fail(Annotate(s, "staging the unpadded layout"));
    }
    if (options.layout_signature == 0) {
      agreed_ = true;
      agreed_fingerprint_ = LayoutFingerprint(tensors, code, zero_copy ? total : layout.elems);
      agreed_divisor_ = divisor;
      agreed_unpadded_ = d.unpadded;
      agreed_tensors_ = tensors.size();
      agreed_total_ = total;
    }
  }
  if (total == 0) {
    *outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  count = total;
  if (!zero_copy) count = layout.elems;

  // Step 4: the data collective, the commit and the copy back.
  void* buffer = zero_copy ? tensors[0].data : staging_.data();
  if (zero_copy && !options.contribute) {
    s = ops_->Zero(buffer, bytes, stream);
    if (!s.ok()) return FailAndRestore(s, buffer, bytes, backup, stream);
  }
  s = options.payload == Payload::kFp32
          ? ReduceBuckets(buffer, count, code, divisor, stream)
          : ReduceCompressed(buffer, count, options.payload, divisor, stream);
  if (s.ok()) s = ops_->Wait(stream, "ncclAllReduce");
  if (!s.ok()) return FailAndRestore(s, buffer, bytes, backup, stream);
  // A failure once the result is in the staging buffer: the communicator is broken, the result
  // kept there for AdoptPendingResult.
  const auto keep_staged = [&](const absl::Status& failure) {
    Fail(failure).IgnoreError();
    pending_ = Pending::kStaged;
    pending_padded_ = !unpadded;
    pending_code_ = code;
    pending_total_ = total;
    pending_elems_ = layout.elems;
    *outcome = RoundOutcome::kFailedHoldingResult;
    return failure;
  };
  if (options.commit) {
    s = Commit(stream, options.step);
    if (!s.ok()) {
      if (!zero_copy) {
        // The result stays in the staging buffer; the tensors were never touched.
        return keep_staged(s);
      }
      // Keep the result aside, then give the caller's buffer back its values (after the abort:
      // the commit may still be on the stream).
      Fail(s).IgnoreError();
      absl::Status kept = pending_buffer_.Reserve(*ops_, bytes);
      if (kept.ok()) kept = ops_->Copy(pending_buffer_.data(), buffer, bytes, stream);
      if (absl::Status r = Restore(buffer, bytes, stream); !r.ok()) {
        return broken_ = absl::Status(
                   s.code(), absl::StrCat(s.message(), "; restoring the parameters from their "
                                          "backup failed too (", r.message(),
                                          "): they are undefined"));
      }
      if (!kept.ok()) {
        return broken_ = absl::Status(
                   s.code(), absl::StrCat(s.message(), "; keeping the result aside failed (",
                                          kept.message(), "): the parameters are as before the "
                                          "call"));
      }
      pending_ = Pending::kZeroCopy;
      pending_code_ = code;
      pending_total_ = total;
      *outcome = RoundOutcome::kFailedHoldingResult;
      return s;
    }
  }
  if (zero_copy) {
    *outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  // The copy-back is enqueued only once the reduction has finished, so that an aborted
  // collective never leaks a half-reduced staging buffer into the caller's tensors.
  s = ops_->Scatter(static_cast<const StagingChunk*>(chunks_device_.data()),
                    static_cast<int64_t>(chunks_host_.size()), staging_.data(), code, stream);
  if (!options.commit) {
    if (s.ok()) s = ops_->Wait(stream, "scatter of the averaged parameters");
    if (!s.ok()) return Fail(s);
    *outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  // Committed: the round is over on every member that confirmed; only local work remains (no
  // generation check, which could otherwise fail a round its peers completed).
  if (s.ok()) s = ops_->WaitLocal(stream, "scatter of the averaged parameters");
  if (!s.ok()) {
    // The staging buffer still holds the result.
    return keep_staged(s);
  }
  *outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

absl::Status NcclCore::Adopt(absl::Span<const TensorView> tensors) {
  if (pending_ == Pending::kNone) {
    return absl::FailedPreconditionError("no averaging result is kept aside on this member");
  }
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (!t.device.is_cuda() || t.device.index != device_) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " is on ",
                                                     t.device.ToString(),
                                                     " but this NCCL communicator is on cuda:",
                                                     device_));
    }
    MODELAVG_RETURN_IF_ERROR(ValidateTensorView(i, t));
    total += t.numel;
  }
  const int32_t code = StagingCode(tensors);
  if (total != pending_total_ || code != pending_code_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the kept result has ", pending_total_, " elements of staging code ", pending_code_,
        "; these tensors have ", total, " of code ", code,
        ": pass the list of the round that kept it"));
  }
  void* stream = tensors[0].cuda_stream;
  const size_t bytes = static_cast<size_t>(total) * StagingCodeSize(code);
  absl::Status s;
  if (pending_ == Pending::kZeroCopy) {
    if (!IsZeroCopy(tensors)) {
      return absl::InvalidArgumentError(
          "the kept result is one buffer; these tensors are not back to back in one");
    }
    s = ops_->Copy(tensors[0].data, pending_buffer_.data(), bytes, stream);
  } else {
    const StagingLayout layout = MakeLayout(tensors, code, pending_padded_);
    if (layout.elems != pending_elems_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the kept result spans ", pending_elems_, " staging elements; these tensors ",
          layout.elems, ": pass the list of the round that kept it"));
    }
    s = JoinGathers(stream);
    if (s.ok()) {
      s = UseTable(layout, static_cast<size_t>(layout.elems) * StagingCodeSize(code),
                   /*may_grow=*/false, stream);
    }
    if (s.ok()) {
      s = ops_->Scatter(static_cast<const StagingChunk*>(chunks_device_.data()),
                        static_cast<int64_t>(chunks_host_.size()), staging_.data(), code,
                        stream);
    }
  }
  if (s.ok()) s = ops_->WaitLocal(stream, "adopting the kept averaging result");
  // On a failure the result is still kept: the call can be repeated.
  if (!s.ok()) return Annotate(s, "adopting the kept averaging result");
  pending_ = Pending::kNone;
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
