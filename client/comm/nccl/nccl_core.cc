#include "client/comm/nccl/nccl_core.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/comm/finite_check.h"
#include "client/payload/payload_codec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

NcclCore::NcclCore(DeviceOps* ops, int member, int size, int device, size_t bucket_bytes)
    : ops_(ops),
      member_(member),
      size_(size),
      device_(device),
      bucket_bytes_(bucket_bytes),
      agreement_(member, size, "NCCL") {}

NcclCore::~NcclCore() { Release(); }

void NcclCore::Release() {
  chunks_host_.clear();
  kept_.Forget();
  staging_.Release(*ops_);
  chunks_device_.Release(*ops_);
  backup_.Release(*ops_);
  pending_buffer_.Release(*ops_);
  wire_send_.Release(*ops_);
  wire_recv_.Release(*ops_);
  wire_part_.Release(*ops_);
  finite_code_.Release(*ops_);
  slots_host_.Release(*ops_);
  slots_device_.Release(*ops_);
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
                                     void* stream, int64_t tail) {
  std::vector<std::pair<int64_t, int64_t>> buckets = BucketRanges(count, BucketElems(code));
  // The slots ride with the last bucket, whose gather event comes after their write.
  if (tail > 0 && !buckets.empty()) buckets.back().second += tail;
  count += tail;
  const bool pipelined = gathers_pending_;
  gathers_pending_ = false;
  for (size_t k = 0; k < buckets.size(); ++k) {
    const auto [begin, end] = buckets[k];
    if (pipelined && k < gathered_.size()) {
      MODELAVG_RETURN_IF_ERROR(ops_->StreamWaitEvent(stream, gathered_[k]));
    }
    MODELAVG_RETURN_IF_ERROR(ops_->AllReduce(
        static_cast<char*>(buffer) + begin * static_cast<int64_t>(StagingCodeSize(code)),
        static_cast<size_t>(end - begin), DeviceOps::Reduce::kAverage, code, divisor,
        stream));
  }
  // A ring all-reduce hands every member 2 (n - 1) / n of the buffer to send.
  const int64_t bytes = count * static_cast<int64_t>(StagingCodeSize(code));
  bytes_sent_ += 2 * (bytes * (size_ - 1) / size_);
  return absl::OkStatus();
}

absl::Status NcclCore::ReduceCompressed(void* buffer, int64_t count, WireFormat format,
                                        int divisor, void* stream) {
  // Gathers pending on the gather stream must have filled the buffer first.
  MODELAVG_RETURN_IF_ERROR(JoinGathers(stream));
  const int n = size_;
  // The all-gather's format: TOPK sends every non-zero of the mean (at most n k a block), as
  // the Gloo path does (payload_codec.h).
  const WireFormat gather = GatherFormat(format, n);
  // Parts cut at multiples of the payload's block, so that every block of the buffer is encoded
  // whole: what the peers decode of this member's buffer is decode(encode(x)) of the whole
  // buffer (RoundTripPayload), whatever the number of members, which error feedback relies on.
  // The last parts are zero-padded (at most n - 1 blocks more on the wire).
  const int64_t align = PayloadBlock(format.payload);
  const int64_t part = ((count + align - 1) / align + n - 1) / n * align;
  // Every part at a 16-byte aligned offset, so that the kernels read the scales and the TOPK
  // entries aligned; large enough for both phases' encodings.
  const size_t stride =
      (std::max(EncodedBytes(format, part), EncodedBytes(gather, part)) + 15) / 16 * 16;
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_send_.Reserve(*ops_, stride * n),
                                    "allocating the compressed round's send buffer"));
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_recv_.Reserve(*ops_, stride * n),
                                    "allocating the compressed round's receive buffer"));
  MODELAVG_RETURN_IF_ERROR(Annotate(wire_part_.Reserve(*ops_, static_cast<size_t>(part) * 4),
                                    "allocating the compressed round's part"));
  float* data = static_cast<float*>(buffer);
  float* mine = static_cast<float*>(wire_part_.data());
  MODELAVG_RETURN_IF_ERROR(
      ops_->EncodeParts(format, data, count, part, n, stride, wire_send_.data(), stream));
  MODELAVG_RETURN_IF_ERROR(ops_->AllToAll(wire_send_.data(), wire_recv_.data(), stride, stream));
  // This member's part: the float32 sum of every member's decoded piece, in member order, then
  // times 1/divisor (as the Gloo path computes it).
  const float scale = 1.0f / static_cast<float>(divisor);
  MODELAVG_RETURN_IF_ERROR(
      ops_->DecodeSumParts(format, wire_recv_.data(), n, part, stride, scale, mine, stream));
  MODELAVG_RETURN_IF_ERROR(
      ops_->EncodeParts(gather, mine, part, part, 1, stride, wire_send_.data(), stream));
  MODELAVG_RETURN_IF_ERROR(ops_->AllGather(wire_send_.data(), wire_recv_.data(), stride, stream));
  // Every member decodes the same bytes: the results agree bit for bit.
  MODELAVG_RETURN_IF_ERROR(
      ops_->DecodeParts(gather, wire_recv_.data(), count, part, stride, data, stream));
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

absl::Status NcclCore::PrepareFiniteCheck(size_t host_bytes, void* stream) {
  MODELAVG_RETURN_IF_ERROR(slots_host_.Reserve(*ops_, std::max(host_bytes, sizeof(int32_t))));
  if (finite_code_.data() != nullptr && !finite_code_dirty_) return absl::OkStatus();
  MODELAVG_RETURN_IF_ERROR(finite_code_.Reserve(*ops_, sizeof(int32_t)));
  // The word starts at "no finding"; WriteFiniteSlots sets it back after each round (or, where a
  // failed call scanned without writing the slots, this copy does). The copy reads the pinned
  // buffer when the stream runs it, before this call's slots come back there.
  finite_code_dirty_ = false;
  const int32_t none = std::numeric_limits<int32_t>::max();
  std::memcpy(slots_host_.data(), &none, sizeof(none));
  return ops_->Copy(finite_code_.data(), slots_host_.data(), sizeof(none), stream);
}

absl::Status NcclCore::PrepareStaged(const StagingLayout& layout, int32_t code, bool contribute,
                                     void* stream, bool check_finite) {
  const int64_t slots = check_finite ? static_cast<int64_t>(size_) * FiniteSlotWidth(code) : 0;
  const size_t bytes = static_cast<size_t>(layout.elems + slots) * StagingCodeSize(code);
  // A re-staging (the unpadded fallback, a failed call's gathers) must not race the gathers
  // still on the gather stream.
  MODELAVG_RETURN_IF_ERROR(JoinGathers(stream));
  MODELAVG_RETURN_IF_ERROR(UseTable(layout, bytes, /*may_grow=*/true, stream));
  if (check_finite) {
    MODELAVG_RETURN_IF_ERROR(
        PrepareFiniteCheck(static_cast<size_t>(slots) * StagingCodeSize(code), stream));
  }
  // A member that does not contribute reduces zeros (its tensors are only written), its slots
  // included.
  if (!contribute) return ops_->Zero(staging_.data(), bytes, stream);
  const auto* table = static_cast<const StagingChunk*>(chunks_device_.data());
  auto* finite_code = static_cast<int32_t*>(finite_code_.data());
  void* slot_area = static_cast<char*>(staging_.data()) +
                    static_cast<size_t>(layout.elems) * StagingCodeSize(code);
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
    const int64_t n = static_cast<int64_t>(layout.chunks.size());
    MODELAVG_RETURN_IF_ERROR(ops_->Gather(table, n, staging_.data(), code, stream));
    if (!check_finite) return absl::OkStatus();
    finite_code_dirty_ = true;
    MODELAVG_RETURN_IF_ERROR(ops_->CheckFinite(table, n, finite_code, stream));
    MODELAVG_RETURN_IF_ERROR(
        ops_->WriteFiniteSlots(finite_code, slot_area, size_, member_, code, stream));
    finite_code_dirty_ = false;
    return absl::OkStatus();
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
      if (check_finite) {
        finite_code_dirty_ = true;
        MODELAVG_RETURN_IF_ERROR(
            ops_->CheckFinite(table + b.first_chunk, b.num_chunks, finite_code, gather_stream_));
      }
    }
    // The slots are reduced with the last bucket: written before its event.
    if (check_finite && k + 1 == layout.buckets.size()) {
      MODELAVG_RETURN_IF_ERROR(ops_->WriteFiniteSlots(finite_code, slot_area, size_, member_,
                                                      code, gather_stream_));
      finite_code_dirty_ = false;
    }
    MODELAVG_RETURN_IF_ERROR(ops_->RecordEvent(gathered_[k], gather_stream_));
    gathers_pending_ = true;
  }
  return absl::OkStatus();
}


absl::Status NcclCore::AllReduceMax(LayoutSignature& words, int32_t code, int divisor,
                                    void* stream) {
  auto* sig = static_cast<int64_t*>(sig_host_.data());
  std::memcpy(sig, words.data(), sizeof(words));
  absl::Status s = ops_->Copy(sig_device_.data(), sig, sizeof(words), stream);
  if (s.ok()) {
    s = ops_->AllReduce(sig_device_.data(), kLayoutWords, DeviceOps::Reduce::kLayoutMax, code,
                        divisor, stream);
  }
  if (s.ok()) s = ops_->Copy(sig, sig_device_.data(), sizeof(words), stream);
  if (s.ok()) s = ops_->Wait(stream, "layout check");
  if (s.ok()) std::memcpy(words.data(), sig, sizeof(words));
  return s;
}

absl::Status NcclCore::Commit(void* stream) {
  return CommitVote(size_, [this, stream](int64_t& votes) {
    auto* vote = static_cast<int64_t*>(sig_host_.data());
    *vote = votes;
    absl::Status s = ops_->Copy(sig_device_.data(), vote, sizeof(int64_t), stream);
    if (s.ok()) {
      s = ops_->AllReduce(sig_device_.data(), 1, DeviceOps::Reduce::kCommitSum, 0, 1, stream);
    }
    if (s.ok()) s = ops_->Copy(vote, sig_device_.data(), sizeof(int64_t), stream);
    if (s.ok()) s = ops_->Wait(stream, "commit of the averaging round");
    if (!s.ok()) return Annotate(s, "commit of the averaging round");
    votes = *vote;
    return absl::OkStatus();
  });
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
                           RoundOutcome* outcome) {
  RoundOutcome ignored;
  Round r;
  r.tensors = tensors;
  r.options = &options;
  r.outcome = outcome != nullptr ? outcome : &ignored;
  *r.outcome = RoundOutcome::kFailedWithoutResult;
  if (!broken_.ok()) return broken_;
  kept_.Forget();
  ValidateRound(r);
  PlanLayout(r);
  PrepareBuffers(r);
  last_zero_copy_ = r.zero_copy;
  MODELAVG_RETURN_IF_ERROR(AgreeOnLayout(r));
  if (r.proposal.total == 0) {
    *r.outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  void* buffer = r.zero_copy ? tensors[0].data : staging_.data();
  MODELAVG_RETURN_IF_ERROR(ReduceData(r, buffer));
  // Every member read the same slots: all decide alike, nobody scatters a result a NaN or an
  // Inf went into, and the communicator stays usable.
  MODELAVG_RETURN_IF_ERROR(FiniteVerdict(r));
  if (options.commit) MODELAVG_RETURN_IF_ERROR(CommitRound(r, buffer));
  if (r.zero_copy) {
    *r.outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  return CopyBack(r);
}

void NcclCore::ValidateRound(Round& r) const {
  const RoundOptions& options = *r.options;
  RoundLayout& p = r.proposal;
  p.divisor = options.contributors > 0 ? options.contributors : size_;
  p.step = options.AgreedStep();
  p.fragment_signature = options.layout_signature;
  p.check_finite = options.check_finite;
  if (p.divisor > size_ || (!options.contribute && p.divisor >= size_)) {
    r.local = absl::InvalidArgumentError(absl::StrCat(
        p.divisor, " contributing members of ", size_,
        options.contribute ? "" : " (this one not)", ": the round has no valid divisor"));
  }
  for (size_t i = 0; i < r.tensors.size() && r.local.ok(); ++i) {
    const TensorView& t = r.tensors[i];
    if (!t.device.is_cuda() || t.device.index != device_) {
      r.local = absl::InvalidArgumentError(absl::StrCat("tensor ", i, " is on ",
                                                        t.device.ToString(),
                                                        " but this NCCL communicator is on cuda:",
                                                        device_));
    } else {
      r.local = ValidateTensorView(i, t);
    }
    p.total += t.numel;
  }
  r.stream = r.tensors.empty() ? nullptr : r.tensors[0].cuda_stream;
  p.dtype = StagingCode(r.tensors);
  p.count = p.total;
  if (r.local.ok() && options.payload != Payload::kFp32 && p.total > 0 &&
      p.dtype != kStageF32) {
    r.local = absl::InvalidArgumentError(absl::StrCat(
        "a ", PayloadName(options.payload),
        " payload takes float32/float16/bfloat16 tensors; these include float64"));
  }
  if (r.local.ok() && PayloadInfoOf(options.payload).topk &&
      (options.topk < 1 || options.topk > kInt8Block)) {
    r.local = absl::InvalidArgumentError(absl::StrCat(
        "a ", PayloadName(options.payload), " payload keeps 1 to ", kInt8Block, " entries a block; the round asks for ",
        options.topk));
  }
  r.pad = options.payload == Payload::kFp32;
  // The finite check's slots ride after the data in the staging buffer: staged.
  r.zero_copy = r.local.ok() && IsZeroCopy(r.tensors) && !options.check_finite;
  if (options.check_finite) {
    r.slots = options.payload == Payload::kFp32
                  ? static_cast<int64_t>(size_) * FiniteSlotWidth(p.dtype)
                  : size_;
  }
  r.bytes = static_cast<size_t>(p.total) * StagingCodeSize(p.dtype);
}

void NcclCore::PlanLayout(Round& r) const {
  RoundLayout& p = r.proposal;
  const bool staged = !r.zero_copy && p.total > 0;
  // The agreement is due at the first call, and later only where every member knows alike that
  // it is: another divisor (the round after an admission), or a fragment round (each fragment
  // its own layout). Otherwise the agreed layout is compared locally; a world of one agrees
  // again instead of failing.
  // A round whose padding rule differs from the agreed one's (an FP32 round after a compressed
  // one, or the reverse: every member passes the same payload) agrees afresh, its count being
  // another.
  r.agree = agreement_.Due(p.fragment_signature, p.divisor, p.check_finite) ||
            r.pad != agreed_pad_;
  if (!r.agree && r.local.ok()) {
    if (staged) {
      r.layout = MakeLayout(r.tensors, p.dtype, /*pad=*/r.pad && !agreement_.unpadded());
      p.count = r.layout.elems;
    }
    r.local = agreement_.CheckUnchanged(LayoutFingerprint(r.tensors, p.dtype, p.count),
                                        r.tensors.size(), p.total, &r.agree);
  }
  if (r.agree && r.local.ok() && staged) {
    r.layout = MakeLayout(r.tensors, p.dtype, /*pad=*/r.pad);
    p.count = r.layout.elems;
  }
}

void NcclCore::PrepareBuffers(Round& r) {
  const RoundOptions& options = *r.options;
  const RoundLayout& p = r.proposal;
  if (r.local.ok() && !r.zero_copy && p.total > 0) {
    r.local = PrepareStaged(r.layout, p.dtype, options.contribute, r.stream,
                            options.check_finite && options.payload == Payload::kFp32);
  }
  // At world 1 a local failure is carried in the agreement, as at a first call.
  if (!r.local.ok() && size_ == 1) r.agree = true;
  // The zero-copy path reduces the caller's buffer in place: a committed round (or a member
  // that does not contribute, whose buffer is zeroed) first copies it to the backup, so that a
  // failure leaves it as it was. Enqueued before the all-reduce, it costs no wait of its own.
  r.backup = r.zero_copy && p.total > 0 && (options.commit || !options.contribute);
  if (r.local.ok() && r.backup) {
    r.local = backup_.Reserve(*ops_, r.bytes);
    if (r.local.ok()) {
      r.local = ops_->Copy(backup_.data(), r.tensors[0].data, r.bytes, r.stream);
    }
    if (!r.local.ok()) r.local = Annotate(r.local, "backing up the parameters");
  }
}

absl::Status NcclCore::AgreeOnLayout(Round& r) {
  RoundLayout& p = r.proposal;
  r.unpadded = agreement_.unpadded() || !r.pad;
  if (!r.agree) {
    if (r.local.ok()) return absl::OkStatus();
    // The peers are entering the data all-reduce: a member that cannot take part cannot say so
    // in band.
    SettleGathers(r.stream);
    Fail(r.local).IgnoreError();
    return agreement_.FailedAlone(r.local);
  }
  if (sig_host_.data() == nullptr || sig_device_.data() == nullptr) {
    return Fail(absl::InternalError("NcclCore::Run before Init"));
  }
  absl::StatusOr<LayoutDecision> decision =
      agreement_.Agree(p, r.local, [this, &r](LayoutSignature& words) {
        return AllReduceMax(words, r.proposal.dtype, r.proposal.divisor, r.stream);
      });
  if (!decision.ok()) return Fail(Annotate(decision.status(), "layout check"));
  if (!decision->status.ok()) {
    // Nobody reduces: no gather may still read the caller's tensors once the call returns.
    SettleGathers(r.stream);
    return decision->status;
  }
  r.unpadded = decision->unpadded || !r.pad;
  // A compressed round's layout is unpadded already.
  if (decision->unpadded && r.pad && !r.zero_copy && p.total > 0) {
    r.layout = MakeLayout(r.tensors, p.dtype, /*pad=*/false);
    absl::Status s =
        PrepareStaged(r.layout, p.dtype, r.options->contribute, r.stream,
                      r.options->check_finite && r.options->payload == Payload::kFp32);
    if (!s.ok()) return Fail(Annotate(s, "staging the unpadded layout"));
  }
  if (p.fragment_signature == 0) {
    agreement_.Record(
        p, LayoutFingerprint(r.tensors, p.dtype, r.zero_copy ? p.total : r.layout.elems),
        r.unpadded, r.tensors.size());
    agreed_pad_ = r.pad;
  }
  return absl::OkStatus();
}

absl::Status NcclCore::ReduceData(Round& r, void* buffer) {
  const RoundLayout& p = r.proposal;
  const int64_t count = r.zero_copy ? p.total : r.layout.elems;
  if (r.zero_copy && !r.options->contribute) {
    absl::Status s = ops_->Zero(buffer, r.bytes, r.stream);
    if (!s.ok()) return FailAndRestore(s, buffer, r.bytes, r.backup, r.stream);
  }
  const bool fp32 = r.options->payload == Payload::kFp32;
  absl::Status s = absl::OkStatus();
  if (r.slots > 0 && !fp32) {
    // A compressed round's slots go apart, in float32: its values are quantized.
    s = PrepareFiniteCheck(static_cast<size_t>(r.slots) * sizeof(float), r.stream);
    if (s.ok()) s = slots_device_.Reserve(*ops_, static_cast<size_t>(r.slots) * sizeof(float));
    if (s.ok() && r.options->contribute) {
      finite_code_dirty_ = true;
      s = ops_->CheckFinite(static_cast<const StagingChunk*>(chunks_device_.data()),
                            static_cast<int64_t>(chunks_host_.size()),
                            static_cast<int32_t*>(finite_code_.data()), r.stream);
      if (s.ok()) {
        s = ops_->WriteFiniteSlots(static_cast<int32_t*>(finite_code_.data()),
                                   slots_device_.data(), size_, member_, kStageF32, r.stream);
      }
      if (s.ok()) finite_code_dirty_ = false;
    } else if (s.ok()) {
      s = ops_->Zero(slots_device_.data(), static_cast<size_t>(r.slots) * sizeof(float),
                     r.stream);
    }
    if (s.ok()) {
      s = ops_->AllReduce(slots_device_.data(), static_cast<size_t>(r.slots),
                          DeviceOps::Reduce::kAverage, kStageF32, p.divisor, r.stream);
    }
    if (s.ok()) {
      s = ops_->Copy(slots_host_.data(), slots_device_.data(),
                     static_cast<size_t>(r.slots) * sizeof(float), r.stream);
    }
  }
  if (s.ok()) {
    s = fp32 ? ReduceBuckets(buffer, count, p.dtype, p.divisor, r.stream,
                             r.zero_copy ? 0 : r.slots)
             : ReduceCompressed(buffer, count,
                                WireFormat(r.options->payload, r.options->topk), p.divisor,
                                r.stream);
  }
  if (s.ok() && r.slots > 0 && fp32) {
    // The slots come back with the data collective's wait.
    s = ops_->Copy(slots_host_.data(),
                   static_cast<char*>(buffer) +
                       static_cast<size_t>(count) * StagingCodeSize(p.dtype),
                   static_cast<size_t>(r.slots) * StagingCodeSize(p.dtype), r.stream);
  }
  if (s.ok()) s = ops_->Wait(r.stream, "ncclAllReduce");
  if (!s.ok()) return FailAndRestore(s, buffer, r.bytes, r.backup, r.stream);
  return absl::OkStatus();
}

absl::Status NcclCore::FiniteVerdict(const Round& r) const {
  if (r.slots == 0) return absl::OkStatus();
  const bool fp32 = r.options->payload == Payload::kFp32;
  return DecideFinite(ReadFiniteSlots(slots_host_.data(), fp32 ? r.proposal.dtype : kStageF32,
                                      size_, 1.0 / r.proposal.divisor),
                      r.options->step);
}

absl::Status NcclCore::KeepStaged(Round& r, absl::Status failure) {
  Fail(failure).IgnoreError();
  kept_.Keep(KeptResult::Form::kStaged, r.proposal.total, r.proposal.dtype, r.layout.elems,
             /*padded=*/!r.unpadded);
  *r.outcome = RoundOutcome::kFailedHoldingResult;
  return failure;
}

absl::Status NcclCore::CommitRound(Round& r, void* buffer) {
  const absl::Status s = Commit(r.stream);
  if (s.ok()) return s;
  // The staged path: the result stays in the staging buffer; the tensors were never touched.
  if (!r.zero_copy) return KeepStaged(r, s);
  // The zero-copy path: keep the result aside, then give the caller's buffer back its values
  // (after the abort: the commit may still be on the stream).
  Fail(s).IgnoreError();
  absl::Status kept = pending_buffer_.Reserve(*ops_, r.bytes);
  if (kept.ok()) kept = ops_->Copy(pending_buffer_.data(), buffer, r.bytes, r.stream);
  if (absl::Status restored = Restore(buffer, r.bytes, r.stream); !restored.ok()) {
    return broken_ = absl::Status(
               s.code(), absl::StrCat(s.message(), "; restoring the parameters from their "
                                      "backup failed too (", restored.message(),
                                      "): they are undefined"));
  }
  if (!kept.ok()) {
    return broken_ = absl::Status(
               s.code(), absl::StrCat(s.message(), "; keeping the result aside failed (",
                                      kept.message(), "): the parameters are as before the "
                                      "call"));
  }
  kept_.Keep(KeptResult::Form::kOneBuffer, r.proposal.total, r.proposal.dtype);
  *r.outcome = RoundOutcome::kFailedHoldingResult;
  return s;
}

absl::Status NcclCore::CopyBack(Round& r) {
  // The copy-back is enqueued only once the reduction has finished, so that an aborted
  // collective never leaks a half-reduced staging buffer into the caller's tensors.
  absl::Status s = ops_->Scatter(static_cast<const StagingChunk*>(chunks_device_.data()),
                                 static_cast<int64_t>(chunks_host_.size()), staging_.data(),
                                 r.proposal.dtype, r.stream);
  if (!r.options->commit) {
    if (s.ok()) s = ops_->Wait(r.stream, "scatter of the averaged parameters");
    if (!s.ok()) return Fail(s);
    *r.outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  // Committed: the round is over on every member that confirmed; only local work remains (no
  // generation check, which could otherwise fail a round its peers completed).
  if (s.ok()) s = ops_->WaitLocal(r.stream, "scatter of the averaged parameters");
  // The staging buffer still holds the result.
  if (!s.ok()) return KeepStaged(r, s);
  *r.outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

absl::Status NcclCore::Adopt(absl::Span<const TensorView> tensors) {
  MODELAVG_RETURN_IF_ERROR(kept_.CheckHeld());
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
  MODELAVG_RETURN_IF_ERROR(kept_.CheckLayout(total, code, IsZeroCopy(tensors)));
  void* stream = tensors[0].cuda_stream;
  const size_t bytes = static_cast<size_t>(total) * StagingCodeSize(code);
  absl::Status s;
  if (kept_.form() == KeptResult::Form::kOneBuffer) {
    s = ops_->Copy(tensors[0].data, pending_buffer_.data(), bytes, stream);
  } else {
    const StagingLayout layout = MakeLayout(tensors, code, kept_.padded());
    if (layout.elems != kept_.staged_elems()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the kept result spans ", kept_.staged_elems(), " staging elements; these tensors ",
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
  kept_.Forget();
  return absl::OkStatus();
}

}  // namespace modelavg::client
