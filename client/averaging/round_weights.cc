#include "client/averaging/round_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/base/half.h"
#include "common/status_util.h"

namespace modelavg::client {
absl::StatusOr<RoundWeight> WeightOf(const Decision& decision, int32_t rank) {
  RoundWeight out;
  if (decision.weights.empty()) return out;
  out.weighted = true;
  const std::string where = absl::StrCat("the weights of round ", decision.round, " at step ",
                                         decision.step, " (level ", decision.level, ")");
  const std::vector<int32_t> members = decision.Members();
  if (decision.weights.size() != members.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", decision.weights.size(), " weights for ", members.size(),
        " members [", absl::StrJoin(members, ","), "]; a paced decision carries one per member"));
  }
  int me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    const double w = decision.weights[i];
    if (!std::isfinite(w) || w < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": rank ", members[i], "'s weight is ", w,
          "; a weight is finite and not negative"));
    }
    if (members[i] == rank) me = static_cast<int>(i);
    if (std::find(decision.joining.begin(), decision.joining.end(), members[i]) !=
        decision.joining.end()) {
      continue;  // a joining member contributes nothing: it is no part of W
    }
    out.total += w;
    ++out.contributors;
  }
  if (me < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": rank ", rank,
                                                   " is not among the round's members [",
                                                   absl::StrJoin(members, ","), "]"));
  }
  if (out.contributors > 0 && (!(out.total > 0) || !std::isfinite(out.total))) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the contributing members' weights sum to ", out.total,
        "; a paced round needs a positive, finite total"));
  }
  const bool joining = std::find(decision.joining.begin(), decision.joining.end(), rank) !=
                       decision.joining.end();
  out.weight = joining ? 0 : decision.weights[me];
  // s_i = k w_i / W: the communicator divides the sum of the contributions by k.
  out.scale = joining ? 0 : out.contributors * (out.weight / out.total);
  return out;
}

bool CompletesPacedBudget(const std::vector<ScheduleLevel>& levels, const Decision& decision) {
  if (!decision.average || decision.round < 0 || levels.empty()) return false;
  if (decision.level != static_cast<int>(levels.size()) - 1) return false;
  const ScheduleLevel& level = levels.back();
  return level.paced && level.rounds > 0 && decision.round >= level.rounds - 1;
}

void ScaleInto(absl::Span<const TensorView> from, double scale,
               absl::Span<const TensorView> to) {
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    const int64_t n = std::min(from[i].numel, to[i].numel);
    for (int64_t j = 0; j < n; ++j) SetElementAt(to[i], j, scale * ElementAt(from[i], j));
  }
}

absl::Status WeighWithFeedback(const OuterLevelState& state, double beta, WireFormat format,
                               absl::Span<const TensorView> d, double scale,
                               absl::Span<const TensorView> u, OuterBuffer* residual) {
  ScaleInto(d, scale, u);
  MODELAVG_RETURN_IF_ERROR(state.AddResidual(beta, u));
  *residual = OuterLevelState::NextResidual(format, u);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TensorView>> WeightedInput::Fill(const RoundWeight& weight,
                                                            absl::Span<const TensorView> tensors,
                                                            const FillFn& fill) {
  views_.clear();
  on_device_ = !tensors.empty() && !tensors[0].device.is_host();
  size_t offset = 0;
  std::vector<size_t> offsets;
  for (const TensorView& t : tensors) {
    if (t.device != tensors[0].device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a paced (weighted) round's tensors are on ", tensors[0].device.ToString(), " and ",
          t.device.ToString(), ": pass the tensors of one device to each call"));
    }
    // Aligned to the element size only: tensors of one dtype lie back to back, so that Gloo
    // (or NCCL) reduces the copy as one buffer, as it would the caller's.
    const size_t align = DTypeSize(t.dtype);
    offset = (offset + align - 1) / align * align;
    offsets.push_back(offset);
    offset += t.nbytes();
  }
  if (on_device_ && (device_ == nullptr || fill)) {
    return absl::UnimplementedError(absl::StrCat(
        "a paced (weighted) round on ", tensors[0].device.ToString(), " tensors ",
        device_ == nullptr
            ? "needs the averager's CUDA device, which this round was not given"
            : "with a level's own weighting (error feedback) runs on host tensors only in this "
              "version: set the level's error_feedback to 0, or average host tensors"));
  }
  uint8_t* base = nullptr;
  if (on_device_) {
    MODELAVG_RETURN_IF_ERROR(device_->Open(tensors[0].device));
    MODELAVG_ASSIGN_OR_RETURN(void* copy, device_->WeightedCopy(offset));
    base = static_cast<uint8_t*>(copy);
  } else {
    bytes_.assign(offset, 0);
    base = bytes_.data();
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorView v = tensors[i];
    v.data = base + offsets[i];
    views_.push_back(v);
  }
  if (fill) {
    MODELAVG_RETURN_IF_ERROR(fill(weight.scale, views_));
  } else if (on_device_) {
    MODELAVG_RETURN_IF_ERROR(device_->ScaleInto(tensors, weight.scale, views_));
  } else {
    ScaleInto(tensors, weight.scale, views_);
  }
  return views_;
}

absl::StatusOr<absl::Span<const TensorView>> WeightedInput::For(
    const Decision& decision, int32_t rank, absl::Span<const TensorView> tensors,
    const FillFn& fill) {
  MODELAVG_ASSIGN_OR_RETURN(const RoundWeight weight, WeightOf(decision, rank));
  if (!weight.weighted) return tensors;
  MODELAVG_RETURN_IF_ERROR(Fill(weight, tensors, fill).status());
  return absl::MakeConstSpan(views_);
}

absl::Status WeightedInput::Finish(absl::Span<const TensorView> tensors) const {
  if (on_device_) return device_->CopyInto(views_, tensors);
  for (size_t i = 0; i < tensors.size() && i < views_.size(); ++i) {
    if (tensors[i].nbytes() > 0) std::memcpy(tensors[i].data, views_[i].data, tensors[i].nbytes());
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
