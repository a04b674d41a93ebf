// Builds a JobSpec from the few numbers tests vary: shared by the client's unit and integration
// tests.
#ifndef MODELAVG_TESTS_TOOLS_MAKE_JOB_SPEC_H_
#define MODELAVG_TESTS_TOOLS_MAKE_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::testing {

// `levels` are {period, group_size} in the job's order.
inline v1::JobSpec MakeSpec(const std::string& id, int world, v1::Mode mode,
                            const std::vector<std::pair<int64_t, int32_t>>& levels,
                            int64_t warmup, int64_t heartbeat_ms = 0) {
  v1::JobSpec spec;
  spec.set_job_id(id);
  spec.set_world_size(world);
  spec.set_mode(mode);
  spec.set_warmup_steps(warmup);
  spec.set_heartbeat_timeout_ms(heartbeat_ms);
  for (const auto& [p, g] : levels) {
    v1::Level* l = spec.add_levels();
    l->set_period(p);
    l->set_group_size(g);
  }
  return spec;
}

// `text`, a JobSpec in protobuf text format; a test failure that shows it if it does not parse.
inline v1::JobSpec SpecFromText(const std::string& text) {
  v1::JobSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

// Gives level `level` of `spec` an outer optimizer (DiLoCo, Level.outer).
inline void SetOuter(v1::JobSpec* spec, int level, double lr, double momentum, bool nesterov) {
  v1::OuterOptimizer* o = spec->mutable_levels(level)->mutable_outer();
  o->set_lr(lr);
  o->set_momentum(momentum);
  o->set_nesterov(nesterov);
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_MAKE_JOB_SPEC_H_
