#include "client/outer/device_outer_state.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/outer/outer_state.h"
#include "client/payload/staging_layout.h"
#include "common/status_util.h"

namespace modelavg::client {

DeviceOuterState::DeviceOuterState(DeviceOps* ops, OuterKernels* kernels, int level,
                                   OuterSgd rule, bool pinned_host)
    : ops_(ops),
      kernels_(kernels),
      level_(level),
      rule_(rule),
      pinned_host_(pinned_host),
      anchor_(pinned_host),
      momentum_(pinned_host) {}

DeviceOuterState::~DeviceOuterState() {
  residual_.reset();
  anchor_.Release(*ops_);
  momentum_.Release(*ops_);
  feedback_wire_.Release(*ops_);
  feedback_decoded_.Release(*ops_);
  chunks_device_.Release(*ops_);
}

int64_t DeviceOuterState::elems() const {
  int64_t n = 0;
  for (int64_t k : numel_) n += k;
  return n;
}

size_t DeviceOuterState::bytes_per_buffer() const {
  return static_cast<size_t>(elems()) * StagingCodeSize(code_);
}

size_t DeviceOuterState::bytes() const {
  if (!has_anchor_) return 0;
  const size_t residual = residual_ != nullptr ? static_cast<size_t>(elems()) * sizeof(float) : 0;
  return (has_momentum_ ? 2 * bytes_per_buffer() : bytes_per_buffer()) + residual;
}

absl::Status DeviceOuterState::AddResidual(double beta, const GrowableBuffer& gradient) {
  if (residual_ == nullptr) return absl::OkStatus();
  const int64_t n = elems();
  // NextResidual and LoadResidual allocate exactly the state's elements: another size is a
  // residual of another layout (the anchor was set anew since).
  if (code_ != kStageF32 ||
      residual_->buffer().capacity() != static_cast<size_t>(n) * sizeof(float) ||
      gradient.capacity() < static_cast<size_t>(n) * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "level ", level_, ": the residual holds ", residual_->buffer().capacity() / sizeof(float),
        " float32 elements, the pseudo-gradient ", n, code_ == kStageF32 ? "" : " float64"));
  }
  return kernels_->FeedbackAdd(static_cast<float*>(gradient.data()),
                           static_cast<const float*>(residual_->buffer().data()), n, beta,
                           stream_);
}

absl::StatusOr<std::unique_ptr<OwnedDeviceBuffer>> DeviceOuterState::NextResidual(
    WireFormat format, const GrowableBuffer& gradient) {
  if (code_ != kStageF32) {
    return absl::UnimplementedError(absl::StrCat(
        "level ", level_, ": error feedback keeps a float32 residual; the outer state is float64"));
  }
  const int64_t n = elems();
  const size_t stride = (EncodedBytes(format, n) + 15) / 16 * 16;
  auto next = std::make_unique<OwnedDeviceBuffer>(ops_, pinned_host_);
  MODELAVG_RETURN_IF_ERROR(Annotate(
      next->get()->Reserve(*ops_, static_cast<size_t>(n) * sizeof(float)),
      "allocating the error feedback residual"));
  MODELAVG_RETURN_IF_ERROR(Annotate(feedback_wire_.Reserve(*ops_, std::max<size_t>(stride, 16)),
                                    "allocating the error feedback's encoding"));
  MODELAVG_RETURN_IF_ERROR(
      Annotate(feedback_decoded_.Reserve(*ops_, static_cast<size_t>(n) * sizeof(float)),
               "allocating the error feedback's decoding"));
  const float* u = static_cast<const float*>(gradient.data());
  float* decoded = static_cast<float*>(feedback_decoded_.data());
  MODELAVG_RETURN_IF_ERROR(
      ops_->EncodeParts(format, u, n, n, 1, stride, feedback_wire_.data(), stream_));
  MODELAVG_RETURN_IF_ERROR(
      ops_->DecodeParts(format, feedback_wire_.data(), n, n, stride, decoded, stream_));
  MODELAVG_RETURN_IF_ERROR(kernels_->FeedbackResidual(
      u, decoded, n, static_cast<float*>(next->get()->data()), stream_));
  MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream_, "computing the error feedback residual"));
  return next;
}

std::unique_ptr<OwnedDeviceBuffer> DeviceOuterState::SwapResidual(
    std::unique_ptr<OwnedDeviceBuffer> residual) {
  std::swap(residual, residual_);
  return residual;
}

absl::StatusOr<std::vector<StateTensor>> DeviceOuterState::ResidualTensors() const {
  std::vector<StateTensor> out;
  if (residual_ == nullptr || !has_anchor_ || code_ != kStageF32) return out;
  MODELAVG_RETURN_IF_ERROR(Download(residual_->buffer(), &out));
  return out;
}

absl::Status DeviceOuterState::LoadResidual(const std::vector<StateTensor>& residual) {
  if (residual.empty()) {
    residual_.reset();
    return absl::OkStatus();
  }
  if (!has_anchor_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "level ", level_, ": a residual without an anchor (load the anchor first)"));
  }
  if (residual.size() != numel_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("residual of level ", level_, " has ",
                                                   residual.size(), " tensors but its anchor has ",
                                                   numel_.size()));
  }
  std::vector<uint8_t> all;
  for (size_t i = 0; i < residual.size(); ++i) {
    const StateTensor& t = residual[i];
    if (t.dtype != DType::kFloat32 || t.numel != numel_[i] ||
        t.bytes.size() != static_cast<size_t>(t.numel) * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "residual[", i, "] of level ", level_, " must be float32 with ", numel_[i],
          " elements (its anchor's), got ", t.numel, " ", DTypeName(t.dtype)));
    }
    all.insert(all.end(), t.bytes.begin(), t.bytes.end());
  }
  auto e = std::make_unique<OwnedDeviceBuffer>(ops_, pinned_host_);
  MODELAVG_RETURN_IF_ERROR(Annotate(e->get()->Reserve(*ops_, all.size()),
                                    "allocating the error feedback residual"));
  if (!all.empty()) {
    MODELAVG_RETURN_IF_ERROR(ops_->Copy(e->get()->data(), all.data(), all.size(), stream_));
  }
  MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream_, "copying the residual to the device"));
  residual_ = std::move(e);
  return absl::OkStatus();
}

absl::Status DeviceOuterState::Shape(absl::Span<const TensorView> params, int32_t* code) const {
  *code = kStageF32;
  for (size_t i = 0; i < params.size(); ++i) {
    const int32_t c = StagingCodeOf(OuterStateDType(params[i].dtype));
    if (i == 0) *code = c;
    if (c != *code) {
      return absl::UnimplementedError(absl::StrCat(
          "parameter ", i, " is ", DTypeName(params[i].dtype), " but parameter 0 is ",
          DTypeName(params[0].dtype), ": on CUDA an outer level (level ", level_,
          ") keeps one state dtype, so float64 parameters cannot be mixed with other dtypes; "
          "convert them, or average them with a plain level"));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceOuterState::CheckLayout(absl::Span<const TensorView> params) const {
  if (!has_anchor_) {
    return absl::FailedPreconditionError(absl::StrCat("level ", level_, " has no anchor yet"));
  }
  if (params.size() != numel_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the outer state of level ", level_, " holds ", numel_.size(), " tensors but ",
        params.size(), " parameters were passed: pass the same parameter list at every step "
        "(or load a state_dict made for this model)"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel != numel_[i] ||
        StagingCodeOf(OuterStateDType(params[i].dtype)) != code_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", i, " is ", params[i].numel, " ", DTypeName(params[i].dtype),
          " but the outer state of level ", level_, " holds ", numel_[i], " ",
          code_ == kStageF64 ? "float64" : "float32",
          " for it: pass the same parameter list at every step (or load a state_dict made for "
          "this model)"));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceOuterState::UseTable(absl::Span<const TensorView> params, int32_t code,
                                        void* stream) {
  // The staging layout without padding: tensor i's elements at its offset in the state buffers.
  const StagingLayout layout = BuildStagingLayout(params, code, /*pad=*/false);
  if (layout.chunks.size() == chunks_host_.size() &&
      (layout.chunks.empty() ||
       std::memcmp(layout.chunks.data(), chunks_host_.data(),
                   layout.chunks.size() * sizeof(StagingChunk)) == 0)) {
    return absl::OkStatus();
  }
  return UploadChunkTable(*ops_, layout.chunks, &chunks_host_, &chunks_device_, stream);
}

absl::Status DeviceOuterState::SetAnchor(absl::Span<const TensorView> params) {
  int32_t code = kStageF32;
  MODELAVG_RETURN_IF_ERROR(Shape(params, &code));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  int64_t total = 0;
  for (const TensorView& t : params) total += t.numel;
  has_anchor_ = false;
  has_momentum_ = false;
  MODELAVG_RETURN_IF_ERROR(
      anchor_.Reserve(*ops_, static_cast<size_t>(total) * StagingCodeSize(code)));
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code, stream));
  // A := x is the staging gather in the state dtype.
  MODELAVG_RETURN_IF_ERROR(ops_->Gather(static_cast<const StagingChunk*>(chunks_device_.data()),
                                        static_cast<int64_t>(chunks_host_.size()),
                                        anchor_.data(), code, stream));
  MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream, "setting the outer anchor"));
  AnchorSetFor(params, code, stream);
  return absl::OkStatus();
}

void DeviceOuterState::AnchorSetFor(absl::Span<const TensorView> params, int32_t code,
                                    void* stream) {
  numel_.clear();
  for (const TensorView& t : params) numel_.push_back(t.numel);
  code_ = code;
  stream_ = stream;
  has_anchor_ = true;
}

absl::StatusOr<std::vector<TensorView>> DeviceOuterState::GradientViews(
    absl::Span<const TensorView> params, GrowableBuffer* gradient) {
  int32_t code = kStageF32;
  MODELAVG_RETURN_IF_ERROR(Shape(params, &code));
  int64_t total = 0;
  for (const TensorView& t : params) total += t.numel;
  const size_t elem = StagingCodeSize(code);
  MODELAVG_RETURN_IF_ERROR(
      Annotate(gradient->Reserve(*ops_, static_cast<size_t>(total) * elem),
               "allocating the pseudo-gradient buffer"));
  std::vector<TensorView> out;
  int64_t at = 0;
  for (const TensorView& t : params) {
    TensorView v;
    v.data = static_cast<char*>(gradient->data()) + at * elem;
    v.numel = t.numel;
    v.dtype = code == kStageF64 ? DType::kFloat64 : DType::kFloat32;
    v.device = t.device;
    v.cuda_stream = t.cuda_stream;
    out.push_back(v);
    at += t.numel;
  }
  return out;
}

absl::Status DeviceOuterState::PseudoGradient(absl::Span<const TensorView> params,
                                              const GrowableBuffer& gradient) {
  MODELAVG_RETURN_IF_ERROR(CheckLayout(params));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  stream_ = stream;
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code_, stream));
  return kernels_->OuterDifference(static_cast<const StagingChunk*>(chunks_device_.data()),
                                   static_cast<int64_t>(chunks_host_.size()), anchor_.data(),
                                   gradient.data(), code_, stream);
}

absl::Status DeviceOuterState::Step(absl::Span<const TensorView> params,
                                    const GrowableBuffer& gradient) {
  MODELAVG_RETURN_IF_ERROR(CheckLayout(params));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  stream_ = stream;
  const size_t bytes = bytes_per_buffer();
  if (OuterRuleKeepsState(OuterRuleParamsOf(rule_))) {
    // Allocated at the first outer step; unset until then (PyTorch's momentum_buffer None).
    MODELAVG_RETURN_IF_ERROR(momentum_.Reserve(*ops_, bytes));
  }
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code_, stream));
  OuterStepArgs args;
  args.gradient = gradient.data();
  args.anchor = anchor_.data();
  args.momentum = OuterRuleKeepsState(OuterRuleParamsOf(rule_)) ? momentum_.data() : nullptr;
  args.rule = OuterRuleParamsOf(rule_);
  args.state_code = code_;
  args.momentum_set = has_momentum_;
  MODELAVG_RETURN_IF_ERROR(
      kernels_->OuterStep(static_cast<const StagingChunk*>(chunks_device_.data()),
                          static_cast<int64_t>(chunks_host_.size()), args, stream));
  // The kernel has written A and x in place: whatever the wait says, the state moved on.
  if (OuterRuleKeepsState(OuterRuleParamsOf(rule_))) has_momentum_ = true;
  return ops_->WaitLocal(stream, "the outer optimizer step");
}

absl::Status DeviceOuterState::Snapshot(absl::Span<const TensorView> params,
                                        GrowableBuffer* local) {
  int32_t code = kStageF32;
  MODELAVG_RETURN_IF_ERROR(Shape(params, &code));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  int64_t total = 0;
  for (const TensorView& t : params) total += t.numel;
  MODELAVG_RETURN_IF_ERROR(Annotate(
      local->Reserve(*ops_, static_cast<size_t>(total) * StagingCodeSize(code)),
      "allocating the copy of the parameters"));
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code, stream));
  // The staging gather in the state dtype: exact for every parameter dtype.
  MODELAVG_RETURN_IF_ERROR(ops_->Gather(static_cast<const StagingChunk*>(chunks_device_.data()),
                                        static_cast<int64_t>(chunks_host_.size()),
                                        local->data(), code, stream));
  return ops_->WaitLocal(stream, "copying the parameters");
}

absl::Status DeviceOuterState::Mix(absl::Span<const TensorView> params,
                                   const GrowableBuffer& local, double mix) {
  int32_t code = kStageF32;
  MODELAVG_RETURN_IF_ERROR(Shape(params, &code));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code, stream));
  MODELAVG_RETURN_IF_ERROR(
      kernels_->OuterMix(static_cast<const StagingChunk*>(chunks_device_.data()),
                         static_cast<int64_t>(chunks_host_.size()), local.data(), code, mix,
                         stream));
  return ops_->WaitLocal(stream, "mixing the synced fragment with the local parameters");
}

absl::Status DeviceOuterState::SetAnchorFrom(absl::Span<const TensorView> params,
                                             const GrowableBuffer& mean) {
  int32_t code = kStageF32;
  MODELAVG_RETURN_IF_ERROR(Shape(params, &code));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  int64_t total = 0;
  for (const TensorView& t : params) total += t.numel;
  const size_t bytes = static_cast<size_t>(total) * StagingCodeSize(code);
  has_anchor_ = false;
  has_momentum_ = false;
  MODELAVG_RETURN_IF_ERROR(anchor_.Reserve(*ops_, bytes));
  if (bytes > 0) MODELAVG_RETURN_IF_ERROR(ops_->Copy(anchor_.data(), mean.data(), bytes, stream));
  MODELAVG_RETURN_IF_ERROR(UseTable(params, code, stream));
  // params := A is the staging scatter from the state dtype.
  MODELAVG_RETURN_IF_ERROR(ops_->Scatter(static_cast<const StagingChunk*>(chunks_device_.data()),
                                         static_cast<int64_t>(chunks_host_.size()),
                                         anchor_.data(), code, stream));
  MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream, "setting the outer anchor"));
  AnchorSetFor(params, code, stream);
  return absl::OkStatus();
}

absl::Status DeviceOuterState::Download(const GrowableBuffer& from,
                                        std::vector<StateTensor>* out) const {
  out->clear();
  std::vector<uint8_t> all(bytes_per_buffer());
  if (!all.empty()) {
    MODELAVG_RETURN_IF_ERROR(ops_->Copy(all.data(), from.data(), all.size(), stream_));
    MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream_, "copying the outer state to the host"));
  }
  const size_t elem = StagingCodeSize(code_);
  size_t at = 0;
  for (int64_t n : numel_) {
    StateTensor t;
    t.dtype = code_ == kStageF64 ? DType::kFloat64 : DType::kFloat32;
    t.numel = n;
    t.bytes.assign(all.begin() + at, all.begin() + at + n * elem);
    at += n * elem;
    out->push_back(std::move(t));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StateTensor>> DeviceOuterState::AnchorTensors() const {
  std::vector<StateTensor> out;
  if (has_anchor_) MODELAVG_RETURN_IF_ERROR(Download(anchor_, &out));
  return out;
}

absl::StatusOr<std::vector<StateTensor>> DeviceOuterState::MomentumTensors() const {
  std::vector<StateTensor> out;
  if (has_momentum_) MODELAVG_RETURN_IF_ERROR(Download(momentum_, &out));
  return out;
}

absl::Status DeviceOuterState::Load(const std::vector<StateTensor>& anchor,
                                    const std::vector<StateTensor>* momentum) {
  if (momentum != nullptr && !OuterRuleKeepsState(OuterRuleParamsOf(rule_))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "momenta[", level_, "] given, but level ", level_, "'s outer optimizer has no momentum"));
  }
  int32_t code = kStageF32;
  std::vector<int64_t> numel;
  std::vector<uint8_t> a, m;
  for (size_t i = 0; i < anchor.size(); ++i) {
    const StateTensor& t = anchor[i];
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "anchors[", level_, "][", i, "] is ", DTypeName(t.dtype),
          ": outer state is float32 or float64 (float32 for float16/bfloat16 parameters)"));
    }
    const int32_t c = StagingCodeOf(t.dtype);
    if (i == 0) code = c;
    if (c != code) {
      return absl::UnimplementedError(absl::StrCat(
          "anchors[", level_, "] mixes float32 and float64 tensors: on CUDA an outer level "
          "keeps one state dtype"));
    }
    if (t.numel < 0 || t.bytes.size() != static_cast<size_t>(t.numel) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("anchors[", level_, "][", i, "] has ",
                                                     t.bytes.size(), " bytes for ", t.numel,
                                                     " ", DTypeName(t.dtype), " elements"));
    }
    if (momentum != nullptr) {
      if (momentum->size() != anchor.size()) {
        return absl::InvalidArgumentError(absl::StrCat("momenta[", level_, "] has ",
                                                       momentum->size(), " tensors but anchors[",
                                                       level_, "] has ", anchor.size()));
      }
      const StateTensor& mt = (*momentum)[i];
      if (mt.numel != t.numel || mt.dtype != t.dtype || mt.bytes.size() != t.bytes.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "momenta[", level_, "][", i, "] does not match anchors[", level_, "][", i, "]"));
      }
      m.insert(m.end(), mt.bytes.begin(), mt.bytes.end());
    }
    numel.push_back(t.numel);
    a.insert(a.end(), t.bytes.begin(), t.bytes.end());
  }
  MODELAVG_RETURN_IF_ERROR(anchor_.Reserve(*ops_, a.size()));
  if (momentum != nullptr) MODELAVG_RETURN_IF_ERROR(momentum_.Reserve(*ops_, m.size()));
  has_anchor_ = false;
  has_momentum_ = false;
  if (!a.empty()) MODELAVG_RETURN_IF_ERROR(ops_->Copy(anchor_.data(), a.data(), a.size(), stream_));
  if (!m.empty()) {
    MODELAVG_RETURN_IF_ERROR(ops_->Copy(momentum_.data(), m.data(), m.size(), stream_));
  }
  MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream_, "copying the outer state to the device"));
  numel_ = std::move(numel);
  code_ = code;
  has_anchor_ = true;
  has_momentum_ = momentum != nullptr;
  return absl::OkStatus();
}

absl::Status RunDeviceOuterStep(
    DeviceOuterState* state, GrowableBuffer* gradient, absl::Span<const TensorView> params,
    bool first_step, bool joining,
    const std::function<absl::Status(absl::Span<const TensorView>, int64_t layout_signature)>&
        round,
    const DeviceFeedback& feedback) {
  if (joining && !first_step) {
    // The replacement's D is never read (it contributes nothing); the round hands it the state.
    MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> d, state->GradientViews(params, gradient));
    MODELAVG_RETURN_IF_ERROR(round(d, kOuterRoundSignature));
    return state->Step(params, *gradient);
  }
  if (!state->has_anchor()) {
    if (!first_step) return absl::FailedPreconditionError("no outer state for this level");
    MODELAVG_RETURN_IF_ERROR(round(params, 0));
    return state->SetAnchor(params);
  }
  MODELAVG_RETURN_IF_ERROR(state->CheckLayout(params));
  MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> d, state->GradientViews(params, gradient));
  MODELAVG_RETURN_IF_ERROR(state->PseudoGradient(params, *gradient));
  // Error feedback: U = beta * E + D is sent, and E := U - decode(encode(U)) once it is.
  std::unique_ptr<OwnedDeviceBuffer> residual;
  if (feedback.beta != 0) {
    MODELAVG_RETURN_IF_ERROR(state->AddResidual(feedback.beta, *gradient));
    MODELAVG_ASSIGN_OR_RETURN(residual, state->NextResidual(feedback.format, *gradient));
  }
  // The parameters and the state change only once the round has succeeded.
  MODELAVG_RETURN_IF_ERROR(round(d, kOuterRoundSignature));
  if (residual != nullptr) state->SwapResidual(std::move(residual));
  return state->Step(params, *gradient);
}

absl::Status RunDeviceStreamingStep(
    DeviceOuterState* state, GrowableBuffer* gradient, GrowableBuffer* local,
    absl::Span<const TensorView> params, bool first_step, bool joining, double mix,
    const std::function<absl::Status(absl::Span<const TensorView>, int64_t layout_signature)>&
        round,
    const DeviceFeedback& feedback) {
  // A replacement's first sync of the fragment takes the plain average alone (as on the host).
  const bool mixes = mix != 0 && !(joining && first_step);
  if (mixes && !joining) MODELAVG_RETURN_IF_ERROR(state->Snapshot(params, local));
  absl::Status s = RunDeviceOuterStep(
      state, gradient, params, first_step, joining,
      [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
        MODELAVG_RETURN_IF_ERROR(round(tensors, layout_signature));
        // x_local of a replacement: the block's mean it has just received in the round.
        if (mixes && joining) return state->Snapshot(params, local);
        return absl::OkStatus();
      },
      feedback);
  MODELAVG_RETURN_IF_ERROR(s);
  if (mixes) return state->Mix(params, *local, mix);
  return absl::OkStatus();
}

DevicePendingSync::DevicePendingSync(DeviceOps* ops, DeviceOuterState* state, bool first)
    : ops_(ops), state_(state), first_(first) {}

DevicePendingSync::~DevicePendingSync() {
  buffer_.Release(*ops_);
  if (stream_made_) ops_->DestroyStream(stream_);
}

absl::StatusOr<std::vector<TensorView>> DevicePendingSync::Fill(
    absl::Span<const TensorView> params, const DeviceFeedback& feedback,
    std::unique_ptr<OwnedDeviceBuffer>* next_residual) {
  if (!first_) MODELAVG_RETURN_IF_ERROR(state_->CheckLayout(params));
  MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> views, state_->GradientViews(params, &buffer_));
  if (first_) {
    MODELAVG_RETURN_IF_ERROR(state_->Snapshot(params, &buffer_));
  } else {
    MODELAVG_RETURN_IF_ERROR(state_->PseudoGradient(params, buffer_));
    // The background round reads the buffer on another stream, and the caller may change the
    // parameters as soon as this returns.
    MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(params.empty() ? nullptr : params[0].cuda_stream,
                                             "computing the pseudo-gradient"));
    if (feedback.beta != 0 && next_residual != nullptr) {
      // U = beta * E + D is sent (NextResidual waits for it).
      MODELAVG_RETURN_IF_ERROR(state_->AddResidual(feedback.beta, buffer_));
      MODELAVG_ASSIGN_OR_RETURN(*next_residual, state_->NextResidual(feedback.format, buffer_));
    }
  }
  if (!stream_made_) {
    MODELAVG_RETURN_IF_ERROR(Annotate(ops_->CreateStream(&stream_),
                                      "creating the background all-reduce's stream"));
    stream_made_ = true;
  }
  numel_.clear();
  for (TensorView& v : views) {
    // A device without streams of its own (null) keeps the parameters' stream.
    if (stream_ != nullptr) v.cuda_stream = stream_;
    numel_.push_back(v.numel);
    f64_ = v.dtype == DType::kFloat64;
  }
  return views;
}

absl::Status DevicePendingSync::Apply(absl::Span<const TensorView> params, double mix,
                                      GrowableBuffer* local) {
  if (params.size() != numel_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the fragment had ", numel_.size(), " tensors when its sync started and has ",
        params.size(), " now; pass the same parameter list to every call"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel != numel_[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " of the fragment had ", numel_[i], " elements when its sync started "
          "and has ", params[i].numel, " now"));
    }
  }
  if (mix != 0) MODELAVG_RETURN_IF_ERROR(state_->Snapshot(params, local));
  if (first_) {
    MODELAVG_RETURN_IF_ERROR(state_->SetAnchorFrom(params, buffer_));
  } else {
    MODELAVG_RETURN_IF_ERROR(state_->CheckLayout(params));
    MODELAVG_RETURN_IF_ERROR(state_->Step(params, buffer_));
  }
  if (mix != 0) return state_->Mix(params, *local, mix);
  return absl::OkStatus();
}

absl::Status DevicePendingSync::LoadResult(absl::Span<const TensorView> params,
                                           absl::Span<const TensorView> result) {
  if (result.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the saved sync's result has ", result.size(), " tensors but the fragment has ",
        params.size()));
  }
  MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> views, state_->GradientViews(params, &buffer_));
  void* stream = params.empty() ? nullptr : params[0].cuda_stream;
  numel_.clear();
  for (size_t i = 0; i < views.size(); ++i) {
    if (result[i].numel != views[i].numel || result[i].dtype != views[i].dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the saved sync's result tensor ", i, " is ", result[i].numel, " ",
          DTypeName(result[i].dtype), " but the fragment's tensor needs ", views[i].numel, " ",
          DTypeName(views[i].dtype)));
    }
    if (views[i].numel > 0) {
      MODELAVG_RETURN_IF_ERROR(
          ops_->Copy(views[i].data, result[i].data, result[i].nbytes(), stream));
    }
    numel_.push_back(views[i].numel);
    f64_ = views[i].dtype == DType::kFloat64;
  }
  return ops_->WaitLocal(stream, "copying a saved sync's result to the device");
}

absl::StatusOr<std::vector<StateTensor>> DevicePendingSync::ResultTensors() const {
  const size_t elem = f64_ ? 8 : 4;
  int64_t total = 0;
  for (int64_t n : numel_) total += n;
  std::vector<uint8_t> all(static_cast<size_t>(total) * elem);
  if (!all.empty()) {
    MODELAVG_RETURN_IF_ERROR(ops_->Copy(all.data(), buffer_.data(), all.size(), stream_));
    MODELAVG_RETURN_IF_ERROR(ops_->WaitLocal(stream_, "copying a pending sync's result"));
  }
  std::vector<StateTensor> out;
  size_t at = 0;
  for (int64_t n : numel_) {
    StateTensor t;
    t.dtype = f64_ ? DType::kFloat64 : DType::kFloat32;
    t.numel = n;
    t.bytes.assign(all.begin() + at, all.begin() + at + n * elem);
    at += n * elem;
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace modelavg::client
