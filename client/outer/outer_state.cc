#include "client/outer/outer_state.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/base/half.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_rule.h"
#include "client/payload/payload_codec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// A parameter element read as, and written from, the state type S.
template <typename S>
S ReadAs(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<S>(static_cast<const float*>(data)[i]);
    case DType::kFloat64:
      return static_cast<S>(static_cast<const double*>(data)[i]);
    case DType::kFloat16:
      return static_cast<S>(HalfToFloat(static_cast<const uint16_t*>(data)[i]));
    case DType::kBFloat16:
      return static_cast<S>(BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]));
  }
  return S{};
}

// Writes state-typed values `a` into a parameter tensor of `dtype`.
template <typename S>
void StoreAll(const S* a, void* data, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kFloat32: {
      float* p = static_cast<float*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(a[i]);
      return;
    }
    case DType::kFloat64: {
      double* p = static_cast<double*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(a[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] = FloatToHalf(static_cast<float>(a[i]));
      return;
    }
    case DType::kBFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) p[i] = FloatToBFloat16(static_cast<float>(a[i]));
      return;
    }
  }
}

template <typename S>
void Difference(const S* a, const void* x, DType x_dtype, S* out, int64_t n) {
  if (x_dtype == DType::kFloat32 && sizeof(S) == sizeof(float)) {
    const float* xf = static_cast<const float*>(x);
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] - static_cast<S>(xf[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] - ReadAs<S>(x, x_dtype, i);
}

// The level's rule (outer_rule.h), element by element in S; `m` null where it keeps no state.
template <typename S>
void RuleStep(const OuterRuleParams& rule, bool momentum_set, const S* d, S* m, S* a,
              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    OuterRuleStep(rule, momentum_set, d[i], m == nullptr ? nullptr : m + i, a + i);
  }
}

std::string Describe(const TensorView& t) {
  return absl::StrCat(t.numel, " ", DTypeName(t.dtype));
}

}  // namespace

DType OuterStateDType(DType param) {
  return param == DType::kFloat16 || param == DType::kBFloat16 ? DType::kFloat32 : param;
}

void OuterBuffer::Shape(absl::Span<const TensorView> params) {
  numel_.clear();
  dtype_.clear();
  offset_.clear();
  size_t offset = 0;
  for (const TensorView& t : params) {
    const DType d = OuterStateDType(t.dtype);
    // Aligned to the element size only: tensors of one dtype lie back to back, so that Gloo
    // reduces a float32 (or float64) state in place, without staging.
    const size_t align = DTypeSize(d);
    offset = (offset + align - 1) / align * align;
    numel_.push_back(t.numel);
    dtype_.push_back(d);
    offset_.push_back(offset);
    offset += static_cast<size_t>(t.numel) * DTypeSize(d);
  }
  // A fresh buffer is zeros (what it contributes where it is not written); a reused one keeps
  // its bytes, which its users overwrite.
  bytes_.resize(offset);
}

std::vector<TensorView> OuterBuffer::Views(size_t first, size_t n) {
  std::vector<TensorView> out;
  out.reserve(n);
  for (size_t i = first; i < first + n && i < numel_.size(); ++i) {
    TensorView v;
    v.data = numel_[i] > 0 ? data(i) : nullptr;
    v.numel = numel_[i];
    v.dtype = dtype_[i];
    v.device = Device::Host();
    out.push_back(v);
  }
  return out;
}

OuterLevelState::OuterLevelState(int level, OuterSgd rule) : level_(level), rule_(rule) {}

void OuterLevelState::set_rule(const OuterSgd& rule) {
  rule_ = rule;
  if (device_ != nullptr) device_->set_rule(rule);
}
OuterLevelState::~OuterLevelState() = default;

bool OuterLevelState::has_anchor() const {
  return device_ != nullptr ? device_->has_anchor() : has_anchor_;
}
bool OuterLevelState::has_momentum() const {
  return device_ != nullptr ? device_->has_momentum() : has_momentum_;
}
size_t OuterLevelState::bytes() const {
  return device_ != nullptr ? device_->bytes()
                            : anchor_.total_bytes() + momentum_.total_bytes() +
                                  residual_.total_bytes();
}

absl::Status OuterLevelState::AttachDevice(std::unique_ptr<DeviceOuterState> device) {
  if (has_anchor_) {
    const std::vector<StateTensor> a = AnchorTensors();
    const std::vector<StateTensor> m = MomentumTensors();
    if (absl::Status s = device->Load(a, has_momentum_ ? &m : nullptr); !s.ok()) return s;
    // A residual loaded from a state_dict goes with the anchor.
    if (has_residual_) {
      if (absl::Status s = device->LoadResidual(ResidualTensors()); !s.ok()) return s;
    }
  }
  anchor_ = OuterBuffer();
  momentum_ = OuterBuffer();
  residual_ = OuterBuffer();
  has_anchor_ = false;
  has_momentum_ = false;
  has_residual_ = false;
  device_ = std::move(device);
  return absl::OkStatus();
}

namespace {
absl::Status OnDevice(int level) {
  return absl::InternalError(absl::StrCat("the outer state of level ", level,
                                          " is on a CUDA device; host tensors were passed"));
}
}  // namespace

absl::Status OuterLevelState::SetAnchor(absl::Span<const TensorView> params) {
  if (device_ != nullptr) return OnDevice(level_);
  anchor_.Shape(params);
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorView& x = params[i];
    if (x.numel == 0) continue;
    if (anchor_.dtype(i) == DType::kFloat64) {
      double* a = static_cast<double*>(anchor_.data(i));
      for (int64_t j = 0; j < x.numel; ++j) a[j] = ReadAs<double>(x.data, x.dtype, j);
    } else {
      float* a = static_cast<float*>(anchor_.data(i));
      for (int64_t j = 0; j < x.numel; ++j) a[j] = ReadAs<float>(x.data, x.dtype, j);
    }
  }
  momentum_ = OuterBuffer();
  has_anchor_ = true;
  has_momentum_ = false;
  return absl::OkStatus();
}

absl::Status OuterLevelState::CheckLayout(size_t first,
                                          absl::Span<const TensorView> params) const {
  if (device_ != nullptr) {
    if (first != 0) {
      // On CUDA a streaming level keeps one device state per fragment, over its tensors alone.
      return absl::InternalError(absl::StrCat(
          "level ", level_, ": a CUDA outer state covers its own tensors only (one state per "
          "fragment); tensor ", first, " of a longer list was asked for"));
    }
    return device_->CheckLayout(params);
  }
  if (!has_anchor_) {
    return absl::FailedPreconditionError(absl::StrCat("level ", level_, " has no anchor yet"));
  }
  if (first + params.size() > anchor_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the outer state of level ", level_, " holds ", anchor_.size(), " tensors but ",
        first + params.size(), " parameters were passed: pass the same parameter list at every "
        "step (or load a state_dict made for this model)"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t k = first + i;
    if (params[i].numel != anchor_.numel(k) ||
        OuterStateDType(params[i].dtype) != anchor_.dtype(k)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", k, " is ", Describe(params[i]), " but the outer state of level ",
          level_, " holds ", anchor_.numel(k), " ", DTypeName(anchor_.dtype(k)),
          " for it: pass the same parameter list at every step (or load a state_dict made for "
          "this model)"));
    }
  }
  return absl::OkStatus();
}

absl::Status OuterLevelState::PseudoGradient(size_t first, absl::Span<const TensorView> params,
                                             absl::Span<const TensorView> out) const {
  if (device_ != nullptr) return OnDevice(level_);
  if (absl::Status s = CheckLayout(first, params); !s.ok()) return s;
  if (out.size() != params.size()) {
    return absl::InternalError("pseudo-gradient buffer of the wrong tensor count");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t k = first + i;
    const int64_t n = params[i].numel;
    if (n == 0) continue;
    if (anchor_.dtype(k) == DType::kFloat64) {
      Difference(static_cast<const double*>(anchor_.data(k)), params[i].data, params[i].dtype,
                 static_cast<double*>(out[i].data), n);
    } else {
      Difference(static_cast<const float*>(anchor_.data(k)), params[i].data, params[i].dtype,
                 static_cast<float*>(out[i].data), n);
    }
  }
  return absl::OkStatus();
}

absl::Status OuterLevelState::Step(size_t first, absl::Span<const TensorView> mean,
                                   absl::Span<const TensorView> params) {
  if (device_ != nullptr) return OnDevice(level_);
  if (absl::Status s = CheckLayout(first, params); !s.ok()) return s;
  if (keeps_momentum() && momentum_.size() == 0) {
    // Allocated at the first outer step; unset until then (PyTorch's momentum_buffer None).
    std::vector<TensorView> shape;
    for (size_t k = 0; k < anchor_.size(); ++k) {
      TensorView v;
      v.numel = anchor_.numel(k);
      v.dtype = anchor_.dtype(k);
      shape.push_back(v);
    }
    momentum_.Shape(shape);
  }
  // A fragment's momentum is set by its first step; the whole list's flag is kept here (a
  // fragmented level would keep one per fragment).
  const bool momentum_set = has_momentum_;
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t k = first + i;
    const int64_t n = params[i].numel;
    if (n == 0) continue;
    void* m = keeps_momentum() ? momentum_.data(k) : nullptr;
    if (anchor_.dtype(k) == DType::kFloat64) {
      double* a = static_cast<double*>(anchor_.data(k));
      RuleStep(OuterRuleParamsOf(rule_), momentum_set, static_cast<const double*>(mean[i].data),
              static_cast<double*>(m), a, n);
      StoreAll(a, params[i].data, params[i].dtype, n);
    } else {
      float* a = static_cast<float*>(anchor_.data(k));
      RuleStep(OuterRuleParamsOf(rule_), momentum_set, static_cast<const float*>(mean[i].data),
              static_cast<float*>(m), a, n);
      StoreAll(a, params[i].data, params[i].dtype, n);
    }
  }
  if (keeps_momentum()) has_momentum_ = true;
  return absl::OkStatus();
}

namespace {
std::vector<StateTensor> Copy(const OuterBuffer& b) {
  std::vector<StateTensor> out;
  for (size_t i = 0; i < b.size(); ++i) {
    StateTensor t;
    t.dtype = b.dtype(i);
    t.numel = b.numel(i);
    const uint8_t* p = static_cast<const uint8_t*>(b.data(i));
    t.bytes.assign(p, p + b.nbytes(i));
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status Fill(const std::vector<StateTensor>& tensors, const char* what, int level,
                  OuterBuffer* b) {
  std::vector<TensorView> shape;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StateTensor& t = tensors[i];
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", level, "][", i, "] is ", DTypeName(t.dtype),
          ": outer state is float32 or float64 (float32 for float16/bfloat16 parameters)"));
    }
    if (t.numel < 0 || t.bytes.size() != static_cast<size_t>(t.numel) * DTypeSize(t.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(what, "[", level, "][", i, "] has ",
                                                     t.bytes.size(), " bytes for ", t.numel,
                                                     " ", DTypeName(t.dtype), " elements"));
    }
    TensorView v;
    v.numel = t.numel;
    v.dtype = t.dtype;
    shape.push_back(v);
  }
  b->Shape(shape);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].bytes.empty()) {
      std::memcpy(b->data(i), tensors[i].bytes.data(), tensors[i].bytes.size());
    }
  }
  return absl::OkStatus();
}
}  // namespace

std::vector<StateTensor> OuterLevelState::AnchorTensors() const {
  if (device_ != nullptr) {
    absl::StatusOr<std::vector<StateTensor>> a = device_->AnchorTensors();
    if (a.ok()) return *std::move(a);
    // A device that cannot copy its memory out is broken: its next call fails too.
    spdlog::error("level {}: copying the outer anchor from the device failed: {}", level_,
                  a.status().ToString());
    return {};
  }
  return has_anchor_ ? Copy(anchor_) : std::vector<StateTensor>{};
}

std::vector<StateTensor> OuterLevelState::MomentumTensors() const {
  if (device_ != nullptr) {
    absl::StatusOr<std::vector<StateTensor>> m = device_->MomentumTensors();
    if (m.ok()) return *std::move(m);
    spdlog::error("level {}: copying the outer momentum from the device failed: {}", level_,
                  m.status().ToString());
    return {};
  }
  return has_momentum_ ? Copy(momentum_) : std::vector<StateTensor>{};
}

absl::Status OuterLevelState::Load(const std::vector<StateTensor>& anchor,
                                   const std::vector<StateTensor>* momentum_or_null) {
  static const std::vector<StateTensor> kNone;
  if (device_ != nullptr) return device_->Load(anchor, momentum_or_null);
  const std::vector<StateTensor>& momentum = momentum_or_null ? *momentum_or_null : kNone;
  if (momentum_or_null != nullptr && !keeps_momentum()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "momenta[", level_, "] given, but level ", level_, "'s outer optimizer has no momentum"));
  }
  if (momentum_or_null != nullptr) {
    if (momentum.size() != anchor.size()) {
      return absl::InvalidArgumentError(absl::StrCat("momenta[", level_, "] has ",
                                                     momentum.size(), " tensors but anchors[",
                                                     level_, "] has ", anchor.size()));
    }
    for (size_t i = 0; i < anchor.size(); ++i) {
      if (momentum[i].numel != anchor[i].numel || momentum[i].dtype != anchor[i].dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "momenta[", level_, "][", i, "] does not match anchors[", level_, "][", i, "]"));
      }
    }
  }
  OuterBuffer a, m;
  if (absl::Status s = Fill(anchor, "anchors", level_, &a); !s.ok()) return s;
  if (absl::Status s = Fill(momentum, "momenta", level_, &m); !s.ok()) return s;
  anchor_ = std::move(a);
  momentum_ = std::move(m);
  has_anchor_ = true;
  has_momentum_ = momentum_or_null != nullptr;
  return absl::OkStatus();
}

absl::Status OuterLevelState::AddResidual(double beta, absl::Span<const TensorView> u) const {
  if (!has_residual_) return absl::OkStatus();
  if (residual_.size() != u.size()) {
    return absl::InvalidArgumentError(absl::StrCat("level ", level_, ": the residual has ",
                                                   residual_.size(), " tensors, the step ",
                                                   u.size()));
  }
  for (size_t i = 0; i < u.size(); ++i) {
    if (u[i].dtype != DType::kFloat32 || residual_.numel(i) != u[i].numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "level ", level_, ": residual tensor ", i, " has ", residual_.numel(i),
          " float32 elements, the pseudo-gradient ", u[i].numel, " ", DTypeName(u[i].dtype)));
    }
    const float* e = static_cast<const float*>(residual_.data(i));
    float* d = static_cast<float*>(u[i].data);
    for (int64_t j = 0; j < u[i].numel; ++j) {
      d[j] = static_cast<float>(beta * static_cast<double>(e[j]) + static_cast<double>(d[j]));
    }
  }
  return absl::OkStatus();
}

OuterBuffer OuterLevelState::NextResidual(WireFormat format, absl::Span<const TensorView> u) {
  // Packed in order, as the compressed all-reduce packs its tensors: the payload's blocks run
  // across tensor boundaries.
  int64_t total = 0;
  for (const TensorView& t : u) total += t.numel;
  std::vector<float> packed(static_cast<size_t>(total));
  int64_t at = 0;
  for (const TensorView& t : u) {
    std::memcpy(packed.data() + at, t.data, static_cast<size_t>(t.numel) * sizeof(float));
    at += t.numel;
  }
  std::vector<float> decoded(packed.size());
  RoundTripPayload(format, packed.data(), total, decoded.data());
  OuterBuffer e;
  e.Shape(u);
  at = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    float* out = static_cast<float*>(e.data(i));
    for (int64_t j = 0; j < u[i].numel; ++j, ++at) out[j] = packed[at] - decoded[at];
  }
  return e;
}

std::pair<OuterBuffer, bool> OuterLevelState::SwapResidual(OuterBuffer residual, bool present) {
  std::pair<OuterBuffer, bool> old(std::move(residual_), has_residual_);
  residual_ = std::move(residual);
  has_residual_ = present;
  return old;
}

void OuterLevelState::ClearResidual() {
  has_residual_ = false;
  if (device_ != nullptr) device_->ClearResidual();
}

bool OuterLevelState::has_residual() const {
  return device_ != nullptr ? device_->has_residual() : has_residual_;
}

std::vector<StateTensor> OuterLevelState::ResidualTensors() const {
  if (device_ != nullptr) {
    absl::StatusOr<std::vector<StateTensor>> e = device_->ResidualTensors();
    if (e.ok()) return *std::move(e);
    spdlog::error("level {}: copying the error feedback residual from the device failed: {}",
                  level_, e.status().ToString());
    return {};
  }
  return has_residual_ ? Copy(residual_) : std::vector<StateTensor>{};
}

absl::Status OuterLevelState::LoadResidual(const std::vector<StateTensor>& residual) {
  if (device_ != nullptr) return device_->LoadResidual(residual);
  if (residual.empty()) {
    residual_ = OuterBuffer();
    has_residual_ = false;
    return absl::OkStatus();
  }
  const std::vector<StateTensor> anchor = AnchorTensors();
  if (residual.size() != anchor.size()) {
    return absl::InvalidArgumentError(absl::StrCat("residual of level ", level_, " has ",
                                                   residual.size(), " tensors but its anchor has ",
                                                   anchor.size()));
  }
  for (size_t i = 0; i < residual.size(); ++i) {
    if (residual[i].dtype != DType::kFloat32 || residual[i].numel != anchor[i].numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          "residual[", i, "] of level ", level_, " must be float32 with ", anchor[i].numel,
          " elements (its anchor's), got ", residual[i].numel, " ", DTypeName(residual[i].dtype)));
    }
  }
  OuterBuffer e;
  MODELAVG_RETURN_IF_ERROR(Fill(residual, "residual", level_, &e));
  residual_ = std::move(e);
  has_residual_ = true;
  return absl::OkStatus();
}

}  // namespace modelavg::client
