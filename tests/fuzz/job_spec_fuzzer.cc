// libFuzzer target: a JobSpec as the wire delivers it (binary protobuf) through the spec
// validation, and, when valid, the schedule it implies. Properties: validation never crashes;
// a spec it accepts gives a Schedule whose decisions are consistent (level in range, the rank
// inside its subgroup, the subgroup inside the world).
#include <cstddef>
#include <cstdint>

#include "common/job_spec.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  modelavg::v1::JobSpec spec;
  if (!spec.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<modelavg::ScheduleSpec> parsed = modelavg::ScheduleSpecFromProto(spec);
  if (!parsed.ok()) {
    if (parsed.status().message().empty()) __builtin_trap();  // every refusal says why
    return 0;
  }
  (void)modelavg::ScheduleWarnings(*parsed);
  absl::StatusOr<modelavg::Schedule> schedule = modelavg::Schedule::Create(*parsed);
  if (!schedule.ok()) __builtin_trap();  // validated specs make schedules
  const int32_t world = schedule->world_size();
  const int64_t starts[] = {0, spec.warmup_steps(), modelavg::kMaxWarmupSteps,
                            INT64_MAX - 64};
  for (int64_t from : starts) {
    for (int64_t step = from; step < from + 8 && step >= 0; ++step) {
      for (int32_t rank : {0, world / 2, world - 1}) {
        const modelavg::Decision d = schedule->DecisionFor(step, rank);
        if (!d.average) continue;
        if (d.level < 0 || d.level >= schedule->num_levels()) __builtin_trap();
        if (!d.subgroup.Contains(rank)) __builtin_trap();
        if (d.subgroup.first_rank + d.subgroup.size > world) __builtin_trap();
      }
    }
  }
  (void)schedule->WindowAllSubgroups(spec.warmup_steps(), 4);
  return 0;
}
