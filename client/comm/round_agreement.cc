#include "client/comm/round_agreement.h"

#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

constexpr int64_t kAnyStep = std::numeric_limits<int64_t>::min();

// Where each pair of words lies (the first of the pair holds the maximum).
enum Word : int {
  kCount = 0,
  kDtype = 2,
  kTotal = 4,
  kFailed = 6,
  kDivisor = 7,
  kStep = 9,
  kSignature = 11,
  kCheckFinite = 13,
};

// The pair at `w` holds one value on every member (max == min).
bool Agreed(const LayoutSignature& reduced, int w) { return reduced[w] == -reduced[w + 1]; }

}  // namespace

LayoutSignature EncodeLayout(const RoundLayout& layout, bool failed_locally, int member) {
  const int64_t step = layout.step >= 0 ? layout.step : kAnyStep;
  const int64_t neg_step = layout.step >= 0 ? -layout.step : kAnyStep;
  return LayoutSignature{layout.count,
                         -layout.count,
                         layout.dtype,
                         -layout.dtype,
                         layout.total,
                         -layout.total,
                         failed_locally ? member + 1 : 0,
                         layout.divisor,
                         -layout.divisor,
                         step,
                         neg_step,
                         layout.fragment_signature,
                         ~layout.fragment_signature,
                         layout.check_finite ? 1 : 0,
                         layout.check_finite ? -1 : 0};
}

LayoutDecision DecideLayout(const LayoutSignature& reduced, const RoundLayout& mine,
                            const absl::Status& local) {
  LayoutDecision d;
  if (reduced[kFailed] > 0) {
    d.status = !local.ok()
                   ? local
                   : absl::AbortedError(absl::StrCat(
                         "member ", reduced[kFailed] - 1,
                         " of this subgroup failed before the collective (see its error; the "
                         "highest-numbered one that failed); no member averaged and the "
                         "communicator remains usable"));
    return d;
  }
  if (!Agreed(reduced, kTotal) || !Agreed(reduced, kDtype)) {
    d.status = SetErrorKind(
        absl::InvalidArgumentError(absl::StrCat(
            "the members of this subgroup pass different parameter layouts: total element "
            "counts range from ", -reduced[kTotal + 1], " to ", reduced[kTotal], " (this rank: ",
            mine.total, ")", Agreed(reduced, kDtype) ? "" : " and the dtypes differ",
            "; every member must average the same list of tensors")),
        ErrorKind::kLayoutMismatch);
    return d;
  }
  if (!Agreed(reduced, kCheckFinite)) {
    d.status = SetErrorKind(
        absl::InvalidArgumentError(
            "the members of this subgroup differ on the finite check of their contributions "
            "(some check for NaN and Inf, some do not): every member of a job must check alike "
            "(JobSpec.skip_finite_check is the job's, not a member's)"),
        ErrorKind::kLayoutMismatch);
    return d;
  }
  // ~s is monotone decreasing: the max of ~s is ~(min s).
  if (reduced[kSignature] != ~reduced[kSignature + 1]) {
    d.status = SetErrorKind(
        absl::InvalidArgumentError(absl::StrCat(
            "the members of this subgroup split their parameters into fragments differently "
            "(the tensors' sizes or dtypes differ between members, with the same total of ",
            mine.total, " elements in this fragment); every member must average the same list "
            "of tensors, in the same order")),
        ErrorKind::kLayoutMismatch);
    return d;
  }
  // Every member that passes a step passes the same one, and every member divides alike:
  // anything else is a disagreement on the round itself (never a mixed average).
  const bool steps_differ = reduced[kStep] != kAnyStep && !Agreed(reduced, kStep);
  if (steps_differ || !Agreed(reduced, kDivisor)) {
    d.status = SetErrorKind(
        absl::InternalError(absl::StrCat(
            "the members of this subgroup are averaging different rounds: ",
            steps_differ
                ? absl::StrCat("steps range from ", -reduced[kStep + 1], " to ", reduced[kStep],
                               " (this rank: ", mine.step, ")")
                : absl::StrCat("divisors (contributing members) range from ",
                               -reduced[kDivisor + 1], " to ", reduced[kDivisor]),
            "; no member averaged; this is a bug in modelavg's round agreement, please report "
            "it")),
        ErrorKind::kRoundMismatch);
    return d;
  }
  d.unpadded = !Agreed(reduced, kCount) || reduced[kCount] != mine.count;
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

absl::Status CommitVote(int size, absl::FunctionRef<absl::Status(int64_t&)> all_reduce_sum) {
  int64_t votes = 1;
  if (absl::Status s = all_reduce_sum(votes); !s.ok()) return s;
  if (votes != size) {
    return absl::InternalError(absl::StrCat("the commit of the averaging round counted ", votes,
                                            " of ", size, " members"));
  }
  return absl::OkStatus();
}

RoundAgreement::RoundAgreement(int member, int size, absl::string_view backend)
    : member_(member), size_(size), backend_(backend) {}

bool RoundAgreement::Due(int64_t fragment_signature, int divisor, bool check_finite) const {
  return !agreed_ || fragment_signature != 0 || divisor != divisor_ ||
         check_finite != check_finite_;
}

absl::Status RoundAgreement::CheckUnchanged(uint64_t fingerprint, size_t tensors, int64_t total,
                                            bool* agree_instead) const {
  if (fingerprint == fingerprint_) return absl::OkStatus();
  if (size_ == 1) {
    *agree_instead = true;
    return absl::OkStatus();
  }
  return SetErrorKind(
      absl::InvalidArgumentError(absl::StrCat(
          "this member's parameter layout changed after its ", backend_,
          " communicator agreed on one (agreed: ", tensors_, " tensors, ", total_,
          " elements; now ", tensors, " tensors, ", total, " elements",
          total == total_ ? ", other sizes or dtypes" : "",
          "); every member must average the same list of tensors on every call. This member "
          "fails out of the job so that its peers are aborted")),
      ErrorKind::kLayoutMismatch);
}

absl::StatusOr<LayoutDecision> RoundAgreement::Agree(
    const RoundLayout& mine, const absl::Status& local,
    absl::FunctionRef<absl::Status(LayoutSignature&)> all_reduce_max) const {
  LayoutSignature words = EncodeLayout(mine, !local.ok(), member_);
  if (absl::Status s = all_reduce_max(words); !s.ok()) return s;
  return DecideLayout(words, mine, local);
}

void RoundAgreement::Record(const RoundLayout& agreed, uint64_t fingerprint, bool unpadded,
                            size_t tensors) {
  agreed_ = true;
  fingerprint_ = fingerprint;
  divisor_ = agreed.divisor;
  check_finite_ = agreed.check_finite;
  unpadded_ = unpadded;
  tensors_ = tensors;
  total_ = agreed.total;
}

absl::Status RoundAgreement::FailedAlone(absl::Status status) const {
  spdlog::error("{} member {} of {}: {}; asking for a new generation so that its peers' "
                "collective is aborted",
                backend_, member_, size_, status.ToString());
  if (request_new_generation_) request_new_generation_(status);
  return status;
}

void KeptResult::Keep(Form form, int64_t total, int32_t dtype, int64_t staged_elems,
                      bool padded) {
  held_ = true;
  form_ = form;
  total_ = total;
  dtype_ = dtype;
  staged_elems_ = staged_elems;
  padded_ = padded;
}

absl::Status KeptResult::CheckHeld() const {
  if (held_) return absl::OkStatus();
  return absl::FailedPreconditionError("no averaging result is kept aside on this member");
}

absl::Status KeptResult::CheckLayout(int64_t total, int32_t dtype, bool one_buffer) const {
  if (total != total_ || dtype != dtype_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the kept result has ", total_, " elements of dtype code ", dtype_,
        "; these tensors have ", total, " of code ", dtype,
        ": pass the list of the round that kept it"));
  }
  if (form_ == Form::kOneBuffer && !one_buffer) {
    return absl::InvalidArgumentError(
        "the kept result is one buffer; these tensors are not back to back in one");
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
