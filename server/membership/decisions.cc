#include "server/membership/decisions.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"

namespace modelavg::server {
namespace {

// How often a window polls its cancellation, in steps.
constexpr int64_t kCancelPollSteps = 4096;

// True (now and then, every kCancelPollSteps steps) once the caller went away.
bool Gone(const std::function<bool()>& cancelled, int64_t i) {
  return i % kCancelPollSteps == 0 && cancelled != nullptr && cancelled();
}

absl::Status Cancelled() {
  return absl::CancelledError("the GetSchedule call was cancelled by its caller");
}

std::string TooBig(const v1::GetScheduleRequest& request) {
  return absl::StrCat("the answer for count ", request.count(), " would exceed ",
                      kMaxScheduleReplyBytes,
                      " bytes (gRPC's default message limit); ask for a smaller count",
                      request.has_rank() ? "" : " or for one rank");
}

}  // namespace

bool ApplyMembers(const MemberSteps& view, v1::StepDecision* d) {
  if (view.all_from_start || d->action() != v1::AVERAGE) return false;
  const int64_t step = d->step();
  auto* members = d->mutable_members();
  members->Clear();
  d->clear_joining();
  bool left_out = false;
  for (int32_t r : d->ranks()) {
    const int64_t from = view.from_step[r];
    if (from == kNotMember || from > step || step >= view.until_step[r]) {
      left_out = true;
      continue;
    }
    members->Add(r);
    if (from == step) d->add_joining(r);
  }
  return left_out;
}

absl::Status CheckDecisionWindow(const PlanHistory& plans, const v1::GetScheduleRequest& request,
                                 const std::string& job_id,
                                 const std::function<bool()>& cancelled) {
  if (request.from_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_step must be >= 0, got ", request.from_step()));
  }
  if (request.count() < 1 || request.count() > kMaxScheduleCount) {
    return absl::InvalidArgumentError(absl::StrCat("count must be in [1, ", kMaxScheduleCount,
                                                   "], got ", request.count()));
  }
  if (request.from_step() > INT64_MAX - request.count()) {
    return absl::InvalidArgumentError("from_step + count overflows int64");
  }
  const int32_t world = plans.world_size();
  if (request.has_rank() && (request.rank() < 0 || request.rank() >= world)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank(), " is outside [0, ",
                                                   world, ") for job ", job_id));
  }
  // A cheap estimate first (20 bytes a decision, 1 a listed rank: a lower bound) so that a huge
  // answer is never built; the exact size is checked once built.
  int64_t bytes = 0;
  for (int64_t s = request.from_step(); s < request.from_step() + request.count(); ++s) {
    if (Gone(cancelled, s - request.from_step())) return Cancelled();
    const Schedule& schedule = plans.At(s);
    const int level = schedule.LevelAt(s);
    if (level < 0) {
      bytes += 20;
      continue;
    }
    // Subgroups of g / S ranks, world / g * S of them.
    const int64_t g = schedule.spec().levels[level].group_size;
    const int64_t shards = schedule.replica_size();
    bytes += request.has_rank() ? 20 + g / shards : 20 * (world / g * shards) + int64_t{world};
    if (bytes > kMaxScheduleReplyBytes) return absl::InvalidArgumentError(TooBig(request));
  }
  return absl::OkStatus();
}

absl::Status DecisionWindow(const PlanHistory& plans, const MemberSteps& members,
                            int64_t generation, const v1::GetScheduleRequest& request,
                            v1::GetScheduleResponse* response,
                            const std::function<bool()>& cancelled) {
  response->set_generation(generation);
  const std::vector<Decision> decisions =
      request.has_rank() ? plans.Window(request.from_step(), request.count(), request.rank())
                         : plans.WindowAllSubgroups(request.from_step(), request.count());
  response->mutable_decisions()->Reserve(static_cast<int>(decisions.size()));
  for (size_t i = 0; i < decisions.size(); ++i) {
    if (Gone(cancelled, static_cast<int64_t>(i) + 1)) {
      response->Clear();
      return Cancelled();
    }
    v1::StepDecision* out = response->add_decisions();
    DecisionToProto(decisions[i], generation, out);
    // A block with no member at that step does not average: listed for every subgroup, it is
    // left out.
    if (ApplyMembers(members, out) && out->members().empty() && !request.has_rank()) {
      response->mutable_decisions()->RemoveLast();
    }
  }
  if (static_cast<int64_t>(response->ByteSizeLong()) > kMaxScheduleReplyBytes) {
    response->Clear();
    return absl::InvalidArgumentError(TooBig(request));
  }
  return absl::OkStatus();
}

}  // namespace modelavg::server
