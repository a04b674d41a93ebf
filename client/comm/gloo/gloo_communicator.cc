#include "client/comm/gloo/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
#include "client/comm/finite_check.h"
#include "client/comm/gloo/gloo_exchange.h"
#include "client/comm/gloo/gloo_mesh.h"
#include "client/comm/peer_probe.h"
#include "client/payload/finite_scan.h"
#include "client/payload/host_staging.h"
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "common/status_util.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/allgatherv.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "gloo/transport/pair.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// Where Gloo's ring all-reduce (gloo/allreduce.cc) leaves the fully reduced data: the buffer is
// cut into a multiple of `size` segments (at least two per member, each at most
// `max_segment` bytes unless that needs more), all of one size; member r ends the
// reduce-scatter holding chunk r, its segments [r * per_rank, (r + 1) * per_rank). The only
// reduction of a chunk-r segment at member r is that segment's last, so dividing there (1/size
// of the data, while it is in cache) gives the average without a pass of its own. Gloo does
// not promise this layout: GlooCommunicator checks it at creation (see ProbeFusedAverage) and
// counts, on every call, that exactly its chunk was divided.
struct RingChunk {
  size_t begin = 0;  // bytes
  size_t end = 0;
};

size_t RoundUp(size_t v, size_t m) { return v % m == 0 ? v : v + m - v % m; }

RingChunk GlooRingChunk(size_t total_bytes, int size, int rank, size_t elem,
                        size_t max_segment) {
  const size_t n = static_cast<size_t>(size);
  const size_t segments =
      RoundUp(std::max((total_bytes + max_segment - 1) / max_segment, n * 2), n);
  const size_t segment = RoundUp((total_bytes + segments - 1) / segments, elem);
  const size_t per_rank = segments / n;
  RingChunk c;
  c.begin = std::min(total_bytes, rank * per_rank * segment);
  c.end = std::min(total_bytes, (rank + 1) * per_rank * segment);
  return c;
}

// What one member sends in a ring all-reduce of `bytes`: a chunk of bytes / n in each of the
// n - 1 steps of the reduce-scatter and of the all-gather.
int64_t RingBytesSent(size_t bytes, int n) {
  return static_cast<int64_t>(2 * (static_cast<unsigned __int128>(bytes) * (n - 1) / n));
}

constexpr size_t kDefaultMaxSegment = gloo::detail::AllreduceOptionsImpl::kMaxSegmentSize;

// The ring's reduction: a sum, divided by the group size where it is final (this member's
// chunk). Counts the elements it divided, so the caller can check the layout assumption.
// With a backup, each segment is first copied there — it is about to be read for the sum
// anyway — so that a failed collective can be undone; `saved` lists the copied byte ranges.
struct RingState {
  const void* base = nullptr;
  void* backup = nullptr;
  RingChunk final_chunk;
  // What the final reduction divides by: the number of contributing members.
  int size = 1;
  int64_t divided = 0;
  std::vector<std::pair<size_t, size_t>> saved;
};

template <typename T>
gloo::AllreduceOptions::Func AverageReduction(RingState* st) {
  return [st](void* c, const void* a, const void* b, size_t n) {
    const size_t offset = static_cast<const char*>(c) - static_cast<const char*>(st->base);
    if (st->backup != nullptr) {
      CopyToBackup(static_cast<char*>(st->backup) + offset, c, n * sizeof(T));
      st->saved.emplace_back(offset, n * sizeof(T));
    }
    gloo::sum<T>(c, a, b, n);
    if (offset >= st->final_chunk.begin && offset < st->final_chunk.end) {
      DivideInto(static_cast<const T*>(c), static_cast<int64_t>(n), static_cast<T>(st->size),
                 static_cast<T*>(c));
      st->divided += static_cast<int64_t>(n);
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

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
    int size, absl::Duration timeout, std::function<absl::Status()> store_error, bool in_place,
    std::shared_ptr<SetupCanceller> cancel, GlooAlgorithms algorithms) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gloo communicator rank ", rank, " of size ", size, " is out of range"));
  }
  if (device == nullptr) return absl::InvalidArgumentError("Gloo device is null");
  IgnoreDefaultSigpipe();
  if (cancel == nullptr) cancel = std::make_shared<SetupCanceller>();
  const absl::Time started = absl::Now();
  // The whole set-up is bounded by `timeout`: past it, a watchdog cancels it (a connect waits
  // for its peer with no deadline of ours otherwise).
  absl::Notification finished;
  std::thread watchdog([&finished, cancel, timeout, size] {
    if (finished.WaitForNotificationWithTimeout(timeout)) return;
    cancel->Cancel(SetErrorKind(
        absl::DeadlineExceededError(absl::StrCat(
            "the Gloo set-up of ", size, " members did not complete within ",
            absl::FormatDuration(timeout),
            " (ClientOptions.collective_timeout): a member did not arrive or connect")),
        ErrorKind::kTimeout));
  });
  absl::Cleanup stop_watchdog = [&] {
    finished.Notify();
    watchdog.join();
  };
  try {
    std::vector<sockaddr_storage> peers;
    auto waits = std::make_shared<MeshWaits>();
    absl::StatusOr<std::shared_ptr<gloo::Context>> context =
        ConnectMesh(store, device, rank, size, timeout, started + timeout, cancel, &peers,
                    waits);
    if (!context.ok()) return context.status();
    std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(
        *std::move(context), std::move(waits), rank, size, timeout, in_place, algorithms));
    comm->peer_addresses_ = std::move(peers);
    if (size > 2 && algorithms.scatter_max_bytes > algorithms.direct_max_bytes) {
      spdlog::debug("Gloo communicator of {} members: the direct exchange up to {} bytes, the "
                    "scatter-gather exchange up to {}, Gloo's ring above",
                    size, algorithms.direct_max_bytes, algorithms.scatter_max_bytes);
    }
    if (absl::Status probe = comm->ProbeFusedAverage(); !probe.ok()) {
      MODELAVG_RETURN_IF_ERROR(cancel->status());
      return probe;
    }
    return comm;
  } catch (const std::exception& e) {
    MODELAVG_RETURN_IF_ERROR(cancel->status());
    if (store_error) {
      absl::Status s = store_error();
      if (!s.ok()) return s;
    }
    return FromGlooException(e, absl::StrCat("Gloo rendezvous of ", size, " members"), started,
                             timeout);
  } catch (...) {
    return absl::InternalError("Gloo rendezvous failed with an unknown exception");
  }
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<gloo::Context> context,
                                   std::shared_ptr<MeshWaits> waits, int rank, int size,
                                   absl::Duration timeout, bool in_place,
                                   GlooAlgorithms algorithms)
    : context_(std::move(context)),
      waits_(std::move(waits)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      in_place_(in_place),
      algorithms_(algorithms),
      agreement_(rank, size, "Gloo") {}

GlooCommunicator::~GlooCommunicator() = default;

void GlooCommunicator::SetNewGenerationRequest(std::function<void(const absl::Status&)> request) {
  absl::MutexLock l(&mu_);
  agreement_.SetNewGenerationRequest(std::move(request));
}

void GlooCommunicator::Abort(const absl::Status& why) {
  {
    absl::MutexLock l(&abort_mu_);
    if (!aborted_.ok()) return;
    aborted_ = why.ok() ? absl::AbortedError("the Gloo communicator was aborted") : why;
  }
  CloseMesh(absl::StrCat("aborted by modelavg: ", why.message()));
  // What failing the pairs does not wake (a send queued in a pair's transmit queue) ends here.
  waits_->AbortAll();
}

void GlooCommunicator::ThrowIfAborted() const {
  // A collective that an abort cut short may return without an exception (Gloo's algorithms do
  // not look at what an aborted wait returns): its result is incomplete.
  if (waits_->aborted()) {
    throw gloo::IoException("the collective was aborted by modelavg before it completed");
  }
}

void GlooCommunicator::CloseMesh(const std::string& msg) {
  // The pairs exist for the communicator's whole life (Create returns after the mesh is
  // connected), and their table is not changed after it: reading it from this thread is safe.
  for (int i = 0; i < size_; ++i) {
    if (i != rank_) FailPair(context_->getPair(i).get(), i, msg);
  }
}

absl::StatusOr<std::vector<PeerReach>> GlooCommunicator::ProbePeers(absl::Duration timeout) {
  return ProbeTcpPeers(peer_addresses_, rank_, timeout);
}

absl::Status GlooCommunicator::AbortedOr(absl::Status failure) const {
  absl::MutexLock l(&abort_mu_);
  return aborted_.ok() ? failure : aborted_;
}

absl::Status GlooCommunicator::Break(const absl::Status& failure) {
  broken_ = AbortedOr(failure);
  // Gloo leaves a mesh's other pairs open when one fails: a member waiting on this one would
  // wait out its timeout. Closing them passes the failure on at once.
  CloseMesh(absl::StrCat("a peer's collective failed: ", failure.message()));
  return broken_;
}

absl::Status GlooCommunicator::RunSum(void* data, int64_t numel, DType dtype) {
  if (numel == 0) return absl::OkStatus();
  const absl::Time started = absl::Now();
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
    ThrowIfAborted();
    bytes_sent_ += RingBytesSent(static_cast<size_t>(numel) * DTypeSize(dtype), size_);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromGlooException(e, absl::StrCat("Gloo all-reduce of ", numel, " elements"), started,
                             timeout_);
  } catch (...) {
    return absl::InternalError("Gloo all-reduce failed with an unknown exception");
  }
}

absl::Status GlooCommunicator::RunAverage(void* data, int64_t numel, DType dtype, void* backup,
                                          size_t max_segment, int divisor, bool commit,
                                          bool* holding) {
  const size_t elem = DTypeSize(dtype);
  const size_t bytes = static_cast<size_t>(numel) * elem;
  RingState st;
  st.base = data;
  st.backup = backup;
  st.final_chunk = GlooRingChunk(bytes, size_, rank_, elem, max_segment);
  st.size = divisor;
  if (backup != nullptr) {
    // The chunk this member sends first is never reduced here (the hook above never sees it)
    // but is overwritten by the all-gather: save it up front.
    const RingChunk first =
        GlooRingChunk(bytes, size_, (rank_ + 1) % size_, elem, max_segment);
    CopyToBackup(static_cast<char*>(backup) + first.begin,
                 static_cast<char*>(data) + first.begin, first.end - first.begin);
    st.saved.emplace_back(first.begin, first.end - first.begin);
  }
  auto restore = [&] {
    for (const auto& [offset, len] : st.saved) {
      std::memcpy(static_cast<char*>(data) + offset, static_cast<char*>(backup) + offset, len);
    }
  };
  const absl::Time started = absl::Now();
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    opts.setTag(next_tag_++);
    opts.setMaxSegmentSize(max_segment);
    if (dtype == DType::kFloat64) {
      opts.setOutput(static_cast<double*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(AverageReduction<double>(&st));
    } else {
      opts.setOutput(static_cast<float*>(data), static_cast<size_t>(numel));
      opts.setReduceFunction(AverageReduction<float>(&st));
    }
    gloo::allreduce(opts);
    ThrowIfAborted();
    bytes_sent_ += RingBytesSent(bytes, size_);
  } catch (const std::exception& e) {
    if (backup != nullptr) restore();
    return FromGlooException(e, absl::StrCat("Gloo all-reduce of ", numel, " elements"), started,
                             timeout_);
  } catch (...) {
    if (backup != nullptr) restore();
    return absl::InternalError("Gloo all-reduce failed with an unknown exception");
  }
  const int64_t expected =
      static_cast<int64_t>((st.final_chunk.end - st.final_chunk.begin) / elem);
  if (st.divided != expected) {
    if (backup != nullptr) restore();
    return absl::InternalError(absl::StrCat(
        "Gloo's ring all-reduce finished ", st.divided, " elements on this member where ",
        expected, " were expected: this Gloo build cuts buffers differently than modelavg "
        "assumes; the parameters may be partly reduced; report the Gloo version"));
  }
  if (commit) {
    if (absl::Status c = Commit(); !c.ok()) {
      // The result is kept aside; the caller's data goes back to what it was.
      const size_t words = (bytes + 7) / 8;
      if (pending_.size() < words) pending_.resize(words);
      std::memcpy(pending_.data(), data, bytes);
      kept_.Keep(KeptResult::Form::kOneBuffer, numel, static_cast<int32_t>(dtype));
      if (backup != nullptr) restore();
      if (holding != nullptr) *holding = true;
      return c;
    }
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceWords(int64_t* words, size_t n, bool max,
                                              const char* what) {
  const absl::Time started = absl::Now();
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
    opts.setTag(next_tag_++);
    opts.setOutput(words, n);
    opts.setReduceFunction(max ? static_cast<ReduceFn>(&gloo::max<int64_t>)
                               : static_cast<ReduceFn>(&gloo::sum<int64_t>));
    gloo::allreduce(opts);
    ThrowIfAborted();
  } catch (const std::exception& e) {
    return FromGlooException(e, what, started, timeout_);
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, " failed with an unknown exception"));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::Commit() {
  const uint32_t tag = next_tag_;
  next_tag_ += 2;
  const absl::Time started = absl::Now();
  try {
    ExchangeVote(*context_, tag, (static_cast<uint64_t>(tag) << 1) | 1,
                 std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
  } catch (const std::exception& e) {
    return FromGlooException(e, "Gloo commit of an averaging round", started, timeout_);
  } catch (...) {
    return absl::InternalError("Gloo commit of an averaging round failed with an unknown "
                               "exception");
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::ProbeFusedAverage() {
  // A small buffer cut into many segments, so that every branch of the layout rule is used.
  constexpr int64_t kProbe = 1000;
  constexpr size_t kProbeSegment = 256;
  std::vector<float> probe(kProbe, static_cast<float>(rank_ + 1));
  absl::MutexLock l(&mu_);
  absl::Status s =
      RunAverage(probe.data(), kProbe, DType::kFloat32, nullptr, kProbeSegment, size_);
  // Every member runs the same Gloo, so every member reaches the same verdict.
  const float mean = static_cast<float>(size_ + 1) / 2;  // exact
  bool right = s.ok();
  for (float v : probe) right = right && v == mean;
  if (!s.ok() && s.code() != absl::StatusCode::kInternal) return s;  // transport failure
  fused_ = right;
  bytes_sent_ = 0;  // the probe is set-up, not averaging
  if (!fused_) {
    spdlog::warn("this Gloo build's ring all-reduce does not lay buffers out as modelavg "
                 "expects; averaging falls back to a staging copy with a separate division");
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::PrepareRound(absl::Span<const TensorView> tensors,
                                            const RoundOptions& options,
                                            RoundLayout* layout) const {
  const DType dtype = StagingDType(tensors);
  layout->dtype = static_cast<int32_t>(dtype);
  layout->divisor = options.contributors > 0 ? options.contributors : size_;
  layout->step = options.AgreedStep();
  layout->fragment_signature = options.layout_signature;
  layout->check_finite = options.check_finite;
  absl::StatusOr<int64_t> total = CheckHostTensors(tensors);
  if (!total.ok()) return total.status();
  layout->total = layout->count = *total;
  if (layout->divisor > size_ || (!options.contribute && layout->divisor >= size_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        layout->divisor, " contributing members of ", size_,
        options.contribute ? "" : " (this one not)", ": the round has no valid divisor"));
  }
  if (options.payload != Payload::kFp32 && *total > 0 && dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", PayloadName(options.payload),
        " payload takes float32/float16/bfloat16 tensors; these include float64"));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AgreeOnRound(absl::Span<const TensorView> tensors,
                                            const RoundOptions& options,
                                            const RoundLayout& layout,
                                            const absl::Status& local_arg) {
  absl::Status local = local_arg;
  // Gloo packs without padding: its collectives depend on the total and the dtype alone, not
  // on how the tensors split them.
  const uint64_t fingerprint = LayoutFingerprint({}, layout.dtype, layout.count);
  bool agree = agreement_.Due(options.layout_signature, layout.divisor, layout.check_finite);
  if (!agree && local.ok()) {
    local = agreement_.CheckUnchanged(fingerprint, tensors.size(), layout.total, &agree);
  }
  // A world of one carries a local failure in the agreement, as at a first call.
  if (!local.ok() && size_ == 1) agree = true;
  if (!agree) {
    // The peers are entering the data all-reduce: a member that cannot take part cannot say so
    // in band. Closing the mesh fails their collective at once.
    if (local.ok()) return absl::OkStatus();
    return agreement_.FailedAlone(Break(local));
  }
  absl::StatusOr<LayoutDecision> decision =
      agreement_.Agree(layout, local, [this](LayoutSignature& words)
                                          ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                                            return AllReduceWords(words.data(), words.size(),
                                                                  /*max=*/true,
                                                                  "Gloo layout check");
                                          });
  if (!decision.ok()) return Break(decision.status());
  // Every member decided alike: nobody averages, and the communicator stays usable.
  if (!decision->status.ok()) return decision->status;
  if (options.layout_signature == 0) {
    agreement_.Record(layout, fingerprint, /*unpadded=*/false, tensors.size());
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors,
                                                const RoundOptions& options,
                                                RoundOutcome* outcome) {
  RoundOutcome ignored;
  if (outcome == nullptr) outcome = &ignored;
  *outcome = RoundOutcome::kFailedWithoutResult;
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  if (absl::Status a = AbortedOr(absl::OkStatus()); !a.ok()) return broken_ = a;
  kept_.Forget();
  RoundLayout layout;
  const absl::Status local = PrepareRound(tensors, options, &layout);
  MODELAVG_RETURN_IF_ERROR(AgreeOnRound(tensors, options, layout, local));
  const int64_t total = layout.total;
  const DType dtype = static_cast<DType>(layout.dtype);
  if (total == 0) {
    *outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  }
  if (options.payload != Payload::kFp32) {
    return AverageCompressed(tensors, options, total, dtype, layout.divisor, outcome);
  }
  if (Direct(static_cast<size_t>(total) * DTypeSize(dtype))) {
    return AverageDirect(tensors, options, total, dtype, layout.divisor, outcome);
  }
  void* single = SingleBuffer(tensors);
  // The finite check travels in slots after the data (finite_check.h): staged.
  if (fused_ && single != nullptr && options.contribute && !options.check_finite) {
    return AverageInPlace(single, options, total, dtype, layout.divisor, outcome);
  }
  return AverageStaged(tensors, options, total, dtype, layout.divisor, outcome);
}

absl::Status GlooCommunicator::AverageDirect(absl::Span<const TensorView> tensors,
                                             const RoundOptions& options, int64_t total,
                                             DType dtype, int divisor, RoundOutcome* outcome) {
  const size_t elem = DTypeSize(dtype);
  const size_t bytes = static_cast<size_t>(total) * elem;
  // One contributing buffer is sent from where it is; its pieces are saved to the backup (the
  // staging buffer) just before their mean is written, unless in place in a plain round. Other
  // tensors are packed piece by piece into the staging buffer, which then holds them for a
  // restore (a member that does not contribute sends zeros but keeps its tensors there too).
  char* single = options.contribute ? static_cast<char*>(SingleBuffer(tensors)) : nullptr;
  const bool backup = single == nullptr || !in_place_ || options.commit;
  if (backup && staging_.size() * sizeof(double) < bytes) staging_.resize((bytes + 7) / 8);
  char* keep = reinterpret_cast<char*>(staging_.data());
  DirectPlan plan;
  plan.total = total;
  plan.dtype = dtype;
  plan.divisor = divisor;
  plan.source = single != nullptr ? single : options.contribute ? keep : nullptr;
  plan.tag = next_tag_;
  next_tag_ += 3;
  plan.deadline = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_));
  if (options.commit) plan.vote = (static_cast<uint64_t>(plan.tag) << 1) | 1;
  // The finite check: this member's finding, from one read of its tensors before the first
  // piece is sent (a member that does not contribute has none); every member's code is known
  // before any piece is written (gloo_exchange.h).
  plan.check_finite = options.check_finite;
  if (options.check_finite && options.contribute) {
    plan.finite_code = FindingCode(ScanTensors(tensors));
  }
  const auto prepare = [&](int64_t begin, int64_t n) {
    if (single == nullptr) PackRange(tensors, dtype, begin, n, keep);
  };
  const auto write = [&](int64_t begin, int64_t n, const void* mean) {
    const size_t at = static_cast<size_t>(begin) * elem, len = static_cast<size_t>(n) * elem;
    if (single == nullptr) {
      UnpackRange(mean, dtype, tensors, begin, n);
      return;
    }
    if (backup) CopyToBackup(keep + at, single + at, len);
    std::memcpy(single + at, mean, len);
  };
  // Puts back what the round wrote: [0, written) elements.
  const auto restore = [&](int64_t written) {
    if (!backup) return;  // in place: left undefined, as documented
    if (single == nullptr) {
      UnpackRange(keep, dtype, tensors, 0, written);
    } else {
      std::memcpy(single, keep, static_cast<size_t>(written) * elem);
    }
  };
  DirectProgress progress;
  const absl::Time started = absl::Now();
  absl::Status failed;
  try {
    if (ScatterGather(bytes) && total >= size_) {
      // Each peer's range out, then this member's range's mean to every peer: about
      // 2 (n - 1) / n of the buffer.
      ScatterGatherAverage(*context_, plan, &direct_, prepare, write, &progress);
      bytes_sent_ += ScatterGatherSentElements(total, rank_, size_) * static_cast<int64_t>(elem);
    } else {
      DirectAverage(*context_, plan, &direct_, prepare, write, &progress);
      bytes_sent_ += static_cast<int64_t>(bytes) * (size_ - 1);
    }
    if (options.check_finite) {
      // Every member read the same codes: all decide alike, nothing was written, and the
      // communicator stays usable.
      MODELAVG_RETURN_IF_ERROR(DecideFinite(progress.codes, options.step));
    }
    *outcome = RoundOutcome::kCompleted;
    return absl::OkStatus();
  } catch (const std::exception& e) {
    failed = FromGlooException(
        e, absl::StrCat(progress.holding ? "Gloo commit of an averaging round"
                                         : absl::StrCat("Gloo direct all-reduce of ", total,
                                                        " elements")),
        started, timeout_);
  } catch (...) {
    failed = absl::InternalError("Gloo direct all-reduce failed with an unknown exception");
  }
  if (progress.holding && options.commit) {
    // Every contribution arrived: only the vote (or the last piece's send) failed. The result
    // is kept aside — the means written so far, then the last piece's from the exchange's sum
    // when it was not written — and the tensors go back to what they were.
    if (pending_.size() * sizeof(double) < bytes) pending_.resize((bytes + 7) / 8);
    const size_t written = static_cast<size_t>(progress.written) * elem;
    char* kept = reinterpret_cast<char*>(pending_.data());
    if (single == nullptr) {
      PackRange(tensors, dtype, 0, progress.written, kept);
      kept_.Keep(KeptResult::Form::kStaged, total, static_cast<int32_t>(dtype));
    } else {
      std::memcpy(kept, single, written);
      kept_.Keep(KeptResult::Form::kOneBuffer, total, static_cast<int32_t>(dtype));
    }
    std::memcpy(kept + written, progress.rest, bytes - written);
    restore(progress.written);
    *outcome = RoundOutcome::kFailedHoldingResult;
  } else {
    restore(progress.written);
    *outcome = RoundOutcome::kFailedWithoutResult;
  }
  return Break(failed);
}

absl::Status GlooCommunicator::AverageCompressed(absl::Span<const TensorView> tensors,
                                                 const RoundOptions& options, int64_t total,
                                                 DType dtype, int divisor,
                                                 RoundOutcome* outcome) {
  const size_t bytes = static_cast<size_t>(total) * DTypeSize(dtype);
  // float32 only (PrepareRound). Packed into the staging (zeros for a member that does not
  // contribute); the compressed result lands in the second half, and the tensors are written
  // only on success.
  const size_t words = (2 * bytes + 7) / 8;
  if (staging_.size() < words) staging_.resize(words);
  float* in = reinterpret_cast<float*>(staging_.data());
  float* result = in + total;
  NonFiniteFinding finding;
  if (options.contribute) {
    PackDivided(tensors, dtype, 1.0, in, options.check_finite ? &finding : nullptr);
  } else {
    std::memset(in, 0, bytes);
  }
  // With the finite check, every member's code rides in each encoded part it sends: after the
  // all-to-all every member has all of them, and all decide alike before the all-gather.
  std::vector<int64_t> codes;
  absl::Status s = RunCompressed(in, total, WireFormat(options.payload, options.topk), divisor,
                                 result, options.check_finite ? &codes : nullptr,
                                 FindingCode(finding));
  if (!s.ok()) return Break(s);
  if (options.check_finite) MODELAVG_RETURN_IF_ERROR(DecideFinite(codes, options.step));
  if (options.commit) {
    if (absl::Status c = Commit(); !c.ok()) {
      pending_.assign(reinterpret_cast<const double*>(result),
                      reinterpret_cast<const double*>(result) + (bytes + 7) / 8);
      kept_.Keep(KeptResult::Form::kStaged, total, static_cast<int32_t>(dtype));
      *outcome = RoundOutcome::kFailedHoldingResult;
      return Break(c);
    }
  }
  Unpack(result, dtype, tensors);
  *outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AverageInPlace(void* single, const RoundOptions& options,
                                              int64_t total, DType dtype, int divisor,
                                              RoundOutcome* outcome) {
  const size_t bytes = static_cast<size_t>(total) * DTypeSize(dtype);
  // Reduced in place, the division fused into the ring. Unless in_place, every segment is saved
  // to a backup as the ring first touches it, and restored if the collective fails; a committed
  // round needs the backup to undo (in_place is only for plain rounds).
  void* backup = nullptr;
  if (!in_place_ || options.commit) {
    if (staging_.size() * sizeof(double) < bytes) staging_.resize((bytes + 7) / 8);
    backup = staging_.data();
  }
  bool holding = false;
  absl::Status s = RunAverage(single, total, dtype, backup, kDefaultMaxSegment, divisor,
                              options.commit, &holding);
  if (!s.ok()) {
    *outcome = holding ? RoundOutcome::kFailedHoldingResult : RoundOutcome::kFailedWithoutResult;
    return Break(s);
  }
  *outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AverageStaged(absl::Span<const TensorView> tensors,
                                             const RoundOptions& options, int64_t total,
                                             DType dtype, int divisor, RoundOutcome* outcome) {
  const size_t bytes = static_cast<size_t>(total) * DTypeSize(dtype);
  // With the finite check, one slot per member after the data (finite_check.h).
  const int slots = options.check_finite ? size_ : 0;
  const size_t staged = bytes + static_cast<size_t>(slots) * DTypeSize(dtype);
  // One flat staging buffer, copied back only on success. A member that does not contribute
  // reduces zeros.
  if (staging_.size() * sizeof(double) < staged) staging_.resize((staged + 7) / 8);
  absl::Status s;
  if (!options.contribute) std::memset(staging_.data(), 0, bytes);
  void* slot_area = reinterpret_cast<char*>(staging_.data()) + bytes;
  if (options.check_finite) {
    // Divided before the sum, as PyTorch does (the largest floats cannot overflow into a
    // false Inf), the test fused into the copy; the slots are summed whole.
    NonFiniteFinding finding;
    if (options.contribute) {
      PackDivided(tensors, dtype, static_cast<double>(divisor), staging_.data(), &finding);
    }
    WriteFiniteSlots(slot_area, StagingCodeOf(dtype), size_, rank_, FindingCode(finding));
    s = RunSum(staging_.data(), total + slots, dtype);
  } else if (fused_) {
    if (options.contribute) PackDivided(tensors, dtype, 1.0, staging_.data());
    s = RunAverage(staging_.data(), total, dtype, /*backup=*/nullptr, kDefaultMaxSegment,
                   divisor);
  } else {
    if (options.contribute) {
      PackDivided(tensors, dtype, static_cast<double>(divisor), staging_.data());
    }
    s = RunSum(staging_.data(), total, dtype);
  }
  if (!s.ok()) return Break(s);
  if (options.check_finite) {
    // Every member read the same slots: all decide alike, nobody writes a result a NaN or an
    // Inf went into, and the communicator stays usable.
    MODELAVG_RETURN_IF_ERROR(
        DecideFinite(ReadFiniteSlots(slot_area, StagingCodeOf(dtype), size_), options.step));
  }
  if (options.commit) {
    if (absl::Status c = Commit(); !c.ok()) {
      // Keep the packed result aside; the tensors were never touched.
      pending_.swap(staging_);
      kept_.Keep(KeptResult::Form::kStaged, total, static_cast<int32_t>(dtype));
      *outcome = RoundOutcome::kFailedHoldingResult;
      return Break(c);
    }
  }
  Unpack(staging_.data(), dtype, tensors);
  *outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

absl::Status GlooCommunicator::RunCompressed(const float* data, int64_t numel, WireFormat format,
                                             int divisor, float* out,
                                             std::vector<int64_t>* codes, int64_t code) {
  const int n = size_;
  const Payload payload = format.payload;
  // The all-gather's format (payload_codec.h): TOPK sends every non-zero of the mean.
  const WireFormat gather = GatherFormat(format, n);
  // Piece j: elements [lo_j, lo_j + len_j), cut at multiples of the payload's block so that
  // every block is encoded whole, as the member's own decode(encode(x)) sees it
  // (RoundTripPayload); member j reduces piece j. Pieces may be empty. With `codes`, each part
  // of the all-to-all also carries this member's finite-check code after its encoding
  // (`tail` bytes).
  const int64_t align = PayloadBlock(payload);
  const int64_t units = (numel + align - 1) / align;
  const int64_t per = (units + n - 1) / n;
  const int64_t tail = codes != nullptr ? static_cast<int64_t>(sizeof(int64_t)) : 0;
  std::vector<int64_t> lo(n), len(n), enc(n), genc(n);
  int64_t send_total = 0, gather_total = 0;
  for (int j = 0; j < n; ++j) {
    lo[j] = std::min<int64_t>(numel, j * per * align);
    len[j] = std::min<int64_t>(numel, lo[j] + per * align) - lo[j];
    enc[j] = static_cast<int64_t>(EncodedBytes(format, len[j]));
    genc[j] = static_cast<int64_t>(EncodedBytes(gather, len[j]));
    send_total += enc[j] + tail;
    gather_total += genc[j];
  }
  const int me = rank_;
  wire_send_.assign(static_cast<size_t>(std::max<int64_t>(send_total, 1)), 0);
  wire_recv_.assign(
      static_cast<size_t>(std::max({gather_total, (enc[me] + tail) * n, int64_t{1}})), 0);
  chunk_.assign(static_cast<size_t>(std::max<int64_t>(len[me], 1)), 0.0f);
  {
    int64_t at = 0;
    for (int j = 0; j < n; ++j) {
      EncodePayload(format, data + lo[j], len[j], wire_send_.data() + at);
      at += enc[j];
      if (codes != nullptr) {
        std::memcpy(wire_send_.data() + at, &code, sizeof(code));
        at += tail;
      }
    }
  }
  const absl::Time started = absl::Now();
  try {
    {
      // Member i sends its encoding of piece j to member j: this member receives n encodings
      // of its own piece.
      gloo::AlltoallvOptions opts(context_);
      opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
      opts.setTag(next_tag_++);
      std::vector<int64_t> parts(enc.begin(), enc.end());
      for (int64_t& p : parts) p += tail;
      opts.setInput(wire_send_.data(), parts);
      opts.setOutput(wire_recv_.data(), std::vector<int64_t>(n, enc[me] + tail));
      gloo::alltoallv(opts);
      ThrowIfAborted();
    }
    bytes_sent_ += send_total - enc[me] - tail;
    const int64_t part = enc[me] + tail;
    if (codes != nullptr) {
      codes->assign(n, 0);
      bool any = false;
      for (int i = 0; i < n; ++i) {
        std::memcpy(&(*codes)[i], wire_recv_.data() + i * part + enc[me], sizeof(int64_t));
        any = any || (*codes)[i] != 0;
      }
      // Every member received every code: all stop here alike, before the all-gather.
      if (any) return absl::OkStatus();
    }
    // This member's piece: the float32 sum of every member's decoded piece, in rank order.
    std::fill(chunk_.begin(), chunk_.end(), 0.0f);
    for (int i = 0; i < n; ++i) {
      DecodeAddPayload(format, wire_recv_.data() + i * part, len[me], chunk_.data());
    }
    const float inv = 1.0f / static_cast<float>(divisor);
    for (float& v : chunk_) v *= inv;
    std::vector<uint8_t> mine(static_cast<size_t>(std::max<int64_t>(genc[me], 1)));
    EncodePayload(gather, chunk_.data(), len[me], mine.data());
    {
      gloo::AllgathervOptions opts(context_);
      opts.setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
      opts.setTag(next_tag_++);
      opts.setInput(mine.data(), static_cast<size_t>(genc[me]));
      opts.setOutput(wire_recv_.data(), std::vector<size_t>(genc.begin(), genc.end()));
      gloo::allgatherv(opts);
      ThrowIfAborted();
    }
    bytes_sent_ += genc[me] * (n - 1);
  } catch (const std::exception& e) {
    return FromGlooException(
        e, absl::StrCat("Gloo ", PayloadName(payload), " all-reduce of ", numel, " elements"),
        started, timeout_);
  } catch (...) {
    return absl::InternalError("Gloo compressed all-reduce failed with an unknown exception");
  }
  // Every member decodes the same bytes: the results agree bit for bit.
  int64_t at = 0;
  for (int j = 0; j < n; ++j) {
    if (len[j] > 0) DecodePayload(gather, wire_recv_.data() + at, len[j], out + lo[j]);
    at += genc[j];
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AdoptPendingResult(absl::Span<const TensorView> tensors) {
  absl::MutexLock l(&mu_);
  MODELAVG_RETURN_IF_ERROR(kept_.CheckHeld());
  absl::StatusOr<int64_t> total = CheckHostTensors(tensors);
  if (!total.ok()) return total.status();
  const DType dtype = StagingDType(tensors);
  void* single = SingleBuffer(tensors);
  MODELAVG_RETURN_IF_ERROR(
      kept_.CheckLayout(*total, static_cast<int32_t>(dtype), single != nullptr));
  if (kept_.form() == KeptResult::Form::kStaged) {
    Unpack(pending_.data(), dtype, tensors);
  } else {
    std::memcpy(single, pending_.data(), static_cast<size_t>(*total) * DTypeSize(dtype));
  }
  kept_.Forget();
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduceSum(void* data, int64_t numel, DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64) {
    return absl::InvalidArgumentError("AllReduceSum takes float32 or float64");
  }
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  if (absl::Status a = AbortedOr(absl::OkStatus()); !a.ok()) return broken_ = a;
  absl::Status s = RunSum(data, numel, dtype);
  if (!s.ok()) s = Break(s);
  return s;
}

}  // namespace modelavg::client
