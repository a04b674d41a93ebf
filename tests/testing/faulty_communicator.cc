#include "tests/testing/faulty_communicator.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"
#include "client/comm/gloo/coordinator_store.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"
#if MODELAVG_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace modelavg::testing {
namespace {

using client::Device;
using client::RoundOutcome;
using client::TensorView;

// Copies `bytes` between host memory and the memory of `device` (host or CUDA), waited for.
absl::Status CopyBytes(void* dst, const void* src, size_t bytes, const Device& device,
                       void* stream) {
  if (bytes == 0) return absl::OkStatus();
  if (device.is_host()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
#if MODELAVG_HAVE_CUDA
  ScopedCudaDevice on(device.index);
  MODELAVG_RETURN_IF_ERROR(on.status());
  auto s = static_cast<cudaStream_t>(stream);
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
#else
  (void)stream;
  return absl::UnimplementedError(
      "the faulty communicator copies CUDA tensors only in a build with CUDA");
#endif
}

// Every tensor's bytes.
absl::StatusOr<std::vector<std::string>> Save(absl::Span<const TensorView> tensors) {
  std::vector<std::string> out;
  for (const TensorView& t : tensors) {
    std::string bytes(t.nbytes(), '\0');
    MODELAVG_RETURN_IF_ERROR(CopyBytes(bytes.data(), t.data, bytes.size(), t.device,
                                       t.cuda_stream));
    out.push_back(std::move(bytes));
  }
  return out;
}

absl::Status Load(const std::vector<std::string>& saved, absl::Span<const TensorView> tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    MODELAVG_RETURN_IF_ERROR(CopyBytes(tensors[i].data, saved[i].data(), saved[i].size(),
                                       tensors[i].device, tensors[i].cuda_stream));
  }
  return absl::OkStatus();
}

}  // namespace

void CommunicatorFaults::LoseCommitAt(int64_t step) {
  absl::MutexLock l(&mu_);
  lose_commit_step_ = step;
}

void CommunicatorFaults::StrayConnectionFirst() {
  absl::MutexLock l(&mu_);
  stray_first_ = true;
}

bool CommunicatorFaults::LostCommitDue(int64_t step) const {
  absl::MutexLock l(&mu_);
  return lose_commit_step_ != kNone && (lose_commit_step_ == kAnyStep || lose_commit_step_ == step);
}

bool CommunicatorFaults::TakeLostCommit(int64_t step) {
  absl::MutexLock l(&mu_);
  if (lose_commit_step_ == kNone) return false;
  if (lose_commit_step_ != kAnyStep && lose_commit_step_ != step) return false;
  lose_commit_step_ = kNone;
  return true;
}

bool CommunicatorFaults::TakeStrayConnection() {
  absl::MutexLock l(&mu_);
  const bool due = stray_first_;
  stray_first_ = false;
  return due;
}

FaultyCommunicator::FaultyCommunicator(std::unique_ptr<client::Communicator> inner,
                                       std::shared_ptr<CommunicatorFaults> faults)
    : inner_(std::move(inner)), faults_(std::move(faults)) {}

absl::Status FaultyCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors,
                                                  const client::RoundOptions& options,
                                                  RoundOutcome* outcome) {
  RoundOutcome ignored;
  if (outcome == nullptr) outcome = &ignored;
  *outcome = RoundOutcome::kFailedWithoutResult;
  {
    absl::MutexLock l(&mu_);
    if (!broken_.ok()) return broken_;
    holding_ = false;
    kept_.clear();
  }
  if (!options.commit || !faults_->LostCommitDue(options.step)) {
    return inner_->AllReduceAverage(tensors, options, outcome);
  }
  // The tensors as they were, so that the round can be undone on this member.
  absl::StatusOr<std::vector<std::string>> before = Save(tensors);
  if (!before.ok()) return Annotate(before.status(), "saving the tensors before a lost commit");
  absl::Status s = inner_->AllReduceAverage(tensors, options, outcome);
  if (!s.ok() || *outcome != RoundOutcome::kCompleted || !faults_->TakeLostCommit(options.step)) {
    return s;
  }
  spdlog::warn("round at step {}: injecting a lost commit on this member (test fault)",
               options.step);
  absl::StatusOr<std::vector<std::string>> result = Save(tensors);
  if (result.ok()) s = Load(*before, tensors);
  if (!result.ok() || !s.ok()) {
    return Annotate(result.ok() ? s : result.status(), "undoing a round for a lost commit");
  }
  const absl::Status lost = client::SetErrorKind(
      absl::UnavailableError("injected commit failure (test)"), client::ErrorKind::kPeerFailure);
  // As after a real failure of the commit: the communicator is broken, and its peers' next
  // collective on it fails.
  inner_->Abort(lost);
  absl::MutexLock l(&mu_);
  broken_ = lost;
  kept_ = *std::move(result);
  holding_ = true;
  *outcome = RoundOutcome::kFailedHoldingResult;
  return lost;
}

absl::Status FaultyCommunicator::AdoptPendingResult(absl::Span<const TensorView> tensors) {
  absl::MutexLock l(&mu_);
  if (!holding_) return inner_->AdoptPendingResult(tensors);
  bool same = tensors.size() == kept_.size();
  for (size_t i = 0; same && i < tensors.size(); ++i) {
    same = tensors[i].nbytes() == kept_[i].size();
  }
  if (!same) {
    return absl::InvalidArgumentError(
        "the kept result has another layout than these tensors: pass the list of the round that "
        "kept it");
  }
  MODELAVG_RETURN_IF_ERROR(Load(kept_, tensors));
  holding_ = false;
  kept_.clear();
  return absl::OkStatus();
}

FaultyCommunicatorFactory::FaultyCommunicatorFactory(
    std::unique_ptr<client::CommunicatorFactory> inner, std::shared_ptr<CommunicatorFaults> faults,
    std::string gloo_hostname, StrayKind stray_kind)
    : inner_(std::move(inner)),
      faults_(std::move(faults)),
      gloo_hostname_(std::move(gloo_hostname)),
      stray_kind_(stray_kind) {}

absl::StatusOr<std::unique_ptr<client::Communicator>> FaultyCommunicatorFactory::Create(
    const client::CommunicatorSetup& setup, const Device& device) {
  absl::StatusOr<std::unique_ptr<client::Communicator>> made =
      device.is_host() && faults_->TakeStrayConnection() ? CreateGlooWithStray(setup)
                                                         : inner_->Create(setup, device);
  if (!made.ok()) return made.status();
  return std::make_unique<FaultyCommunicator>(*std::move(made), faults_);
}

absl::StatusOr<std::unique_ptr<client::Communicator>>
FaultyCommunicatorFactory::CreateGlooWithStray(const client::CommunicatorSetup& setup) {
  MODELAVG_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> device,
                            client::CreateGlooDevice(gloo_hostname_));
  client::CoordinatorStore store(setup, "gloo/" + setup.MemberScope());
  StrayConnectionStore stray(&store, setup.MemberIndex(), setup.MemberCount(), &strays_,
                             stray_kind_);
  MODELAVG_ASSIGN_OR_RETURN(
      std::unique_ptr<client::GlooCommunicator> gloo,
      client::GlooCommunicator::Create(stray, std::move(device), setup.MemberIndex(),
                                       setup.MemberCount(), setup.timeout,
                                       [&store] { return store.last_error(); },
                                       setup.gloo_in_place, setup.cancel));
  gloo->SetNewGenerationRequest(setup.request_new_generation);
  return gloo;
}

}  // namespace modelavg::testing
