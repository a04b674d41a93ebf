// The outer optimizer on CUDA parameters (DeviceOuterState, RunDeviceOuterStep: DiLoCo on the
// NCCL path) with simulated members as threads on the fake device of
// tests/testing/fake_nccl_device.h: each member's state in its own simulated device memory, its
// rounds on NcclCore over a FakeWorld per (level, subgroup). Every member, every step, against
// the independent double-precision restatement of the rule in tests/reference/outer_reference.h
// (the trace worker's synthetic update, here applied to every element with a per-element offset,
// which the rule carries along unchanged). And the device those states live on (OuterDevice).
// Runs without a GPU; tests/gpu runs the kernels.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_state.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/naive_schedule.h"
#include "tests/reference/outer_reference.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/testing/fake_nccl_group.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::MakeSpec;
using ::modelavg::testing::NaiveDecide;
using ::modelavg::testing::NaiveDecision;
using ::modelavg::testing::OuterReference;
using ::modelavg::testing::SetOuter;
using ::testing::HasSubstr;

// Element (t, i)'s offset from the rank's scalar trace value.
double Offset(size_t t, int64_t i) { return 0.25 * static_cast<double>(t) + 0.001 * i; }

// One simulated trainer: its parameters, and per outer level its state on its own device.
struct Member {
  std::unique_ptr<FakeOps> device;  // the state's memory and kernels (no collectives)
  Params params;
  std::vector<std::unique_ptr<OuterLevelState>> outer;  // per level; null for a plain level
  GrowableBuffer gradient;
  ~Member() {
    outer.clear();
    gradient.Release(*device);
  }
};

class NcclOuterTest : public ::testing::Test {
 protected:
  // Members of `spec`'s world with tensors `shape` (separate allocations, the staged path for
  // plain rounds); parameters x_r = r + Offset(t, i).
  void Start(const v1::JobSpec& spec, const std::vector<std::pair<DType, int64_t>>& shape,
             bool pinned_host = false) {
    spec_ = spec;
    for (int r = 0; r < spec.world_size(); ++r) {
      auto m = std::make_unique<Member>();
      m->device = std::make_unique<FakeOps>(nullptr, r);
      m->params = Params::Separate(shape);
      for (int l = 0; l < spec.levels_size(); ++l) {
        if (!spec.levels(l).has_outer()) {
          m->outer.push_back(nullptr);
          continue;
        }
        auto state = std::make_unique<OuterLevelState>(l, OuterSgdOf(spec.levels(l)));
        EXPECT_TRUE(state
                        ->AttachDevice(std::make_unique<DeviceOuterState>(
                            m->device.get(), m->device.get(), l, OuterSgdOf(spec.levels(l)),
                            pinned_host))
                        .ok());
        m->outer.push_back(std::move(state));
      }
      Set(*m, [&](size_t t, int64_t i) { return r + Offset(t, i); });
      members_.push_back(std::move(m));
    }
  }

  template <typename F>
  static void Set(Member& m, F value) {
    for (size_t t = 0; t < m.params.views.size(); ++t) {
      const TensorView& v = m.params.views[t];
      for (int64_t i = 0; i < v.numel; ++i) {
        StoreAs(v.data, StagingCodeOf(v.dtype), i, value(t, i));
      }
    }
  }

  // The trace update of step s, then every member's averaging call of step s (each subgroup's
  // members at once, as threads).
  void Step(int64_t s) {
    for (int r = 0; r < spec_.world_size(); ++r) {
      Member& m = *members_[r];
      const double add = (r + 1) * (s + 1) * 0.5;
      for (size_t t = 0; t < m.params.views.size(); ++t) {
        const TensorView& v = m.params.views[t];
        for (int64_t i = 0; i < v.numel; ++i) {
          const int32_t code = StagingCodeOf(v.dtype);
          StoreAs(v.data, code, i, LoadAs(v.data, code, i) + add);
        }
      }
    }
    std::map<std::pair<int, int>, std::vector<int>> groups;  // (level, first rank) -> ranks
    for (int r = 0; r < spec_.world_size(); ++r) {
      const NaiveDecision d = NaiveDecide(spec_, s, r);
      if (d.average) groups[{d.level, d.group.front()}].push_back(r);
    }
    for (const auto& entry : groups) {
      // (Not a structured binding: the threads' lambda captures these, which C++17 allows only
      // for variables.)
      const std::pair<int, int>& key = entry.first;
      const std::vector<int>& ranks = entry.second;
      const int level = key.first;
      auto& group = groups_[key];
      if (group == nullptr) {
        group = std::make_unique<FakeNcclGroup>(static_cast<int>(ranks.size()));
      }
      std::vector<absl::Status> out(ranks.size());
      std::vector<std::thread> threads;
      for (size_t k = 0; k < ranks.size(); ++k) {
        threads.emplace_back([&, k] {
          Member& m = *members_[ranks[k]];
          NcclCore* core = group->cores[k].get();
          if (m.outer[level] == nullptr) {
            out[k] = core->Run(m.params.views);
            return;
          }
          DeviceOuterState* state = m.outer[level]->device();
          out[k] = RunDeviceOuterStep(
              state, &m.gradient, m.params.views, /*first_step=*/!state->has_anchor(),
              /*joining=*/false,
              [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
                RoundOptions options;
                options.layout_signature = layout_signature;
                return core->Run(tensors, options, nullptr);
              });
        });
      }
      for (auto& t : threads) t.join();
      for (size_t k = 0; k < ranks.size(); ++k) {
        ASSERT_TRUE(out[k].ok()) << "step " << s << " rank " << ranks[k] << ": " << out[k];
      }
      EXPECT_FALSE(group->world->mismatch());
      EXPECT_FALSE(group->world->hang());
    }
    for (const auto& m : members_) ASSERT_FALSE(m->device->illegal) << "step " << s;
  }

  // Every member's every element after each step against the reference; `rel`: the tolerance
  // relative to max(1, |value|). Members of one group must agree exactly.
  void RunAndCheck(int64_t steps, double rel, const v1::JobSpec* reference_spec = nullptr) {
    const auto expected = OuterReference(reference_spec ? *reference_spec : spec_, steps);
    for (int64_t s = 0; s < steps; ++s) {
      Step(s);
      if (HasFatalFailure()) return;
      for (int r = 0; r < spec_.world_size(); ++r) {
        const Params& p = members_[r]->params;
        for (size_t t = 0; t < p.views.size(); ++t) {
          for (int64_t i = 0; i < p.views[t].numel; i += 1 + p.views[t].numel / 97) {
            const double want = expected[s][r].value + Offset(t, i);
            ASSERT_NEAR(p.At(t, i), want, rel * std::max(1.0, std::abs(want)))
                << "step " << s << " rank " << r << " tensor " << t << " element " << i
                << (expected[s][r].outer ? " (outer level)" : "");
          }
        }
        const NaiveDecision d = NaiveDecide(spec_, s, r);
        if (d.average) {
          EXPECT_EQ(Bytes(p), Bytes(members_[d.group.front()]->params))
              << "step " << s << ": rank " << r << " differs from rank " << d.group.front();
        }
      }
    }
  }

  static std::vector<std::string> Bytes(const Params& p) {
    std::vector<std::string> out;
    for (const TensorView& v : p.views) {
      out.emplace_back(static_cast<const char*>(v.data), v.nbytes());
    }
    return out;
  }

  v1::JobSpec spec_;
  std::vector<std::unique_ptr<Member>> members_;
  std::map<std::pair<int, int>, std::unique_ptr<FakeNcclGroup>> groups_;
};

v1::JobSpec Periodic(int world, int64_t period, int64_t warmup, double lr, double momentum,
                     bool nesterov) {
  v1::JobSpec spec = MakeSpec("outer", world, v1::PERIODIC, {{period, world}}, warmup);
  SetOuter(&spec, 0, lr, momentum, nesterov);
  return spec;
}

const std::vector<std::pair<DType, int64_t>> kFp32 = {
    {DType::kFloat32, 1}, {DType::kFloat32, 33}, {DType::kFloat32, kStagingChunkElems + 7}};
const std::vector<std::pair<DType, int64_t>> kHalves = {
    {DType::kBFloat16, 9}, {DType::kFloat16, 17}, {DType::kBFloat16, 300}};

TEST_F(NcclOuterTest, Periodic_WarmUp_Nesterov_Fp32_EveryMemberEveryStepFollowsTheRule) {
  Start(Periodic(4, 3, 2, 0.7, 0.9, true), kFp32);
  RunAndCheck(14, 2e-5);
}

TEST_F(NcclOuterTest, Periodic_MomentumWithoutNesterov_Fp32) {
  Start(Periodic(3, 2, 1, 0.5, 0.5, false), kFp32);
  RunAndCheck(11, 2e-5);
}

TEST_F(NcclOuterTest, Periodic_NoMomentum_Fp32) {
  Start(Periodic(2, 2, 0, 0.8, 0.0, false), kFp32);
  RunAndCheck(9, 2e-5);
}

TEST_F(NcclOuterTest, LrOneMomentumZero_EqualsPlainAveraging) {
  v1::JobSpec plain = Periodic(4, 2, 1, 1.0, 0.0, false);
  plain.mutable_levels(0)->clear_outer();
  Start(Periodic(4, 2, 1, 1.0, 0.0, false), kFp32);
  RunAndCheck(9, 2e-5, &plain);
}

TEST_F(NcclOuterTest, TwoOuterLevelsAndAPlainOne_Hierarchical) {
  v1::JobSpec spec;
  spec.set_job_id("outer");
  spec.set_world_size(4);
  spec.set_warmup_steps(1);
  spec.set_mode(v1::HIERARCHICAL);
  v1::Level* plain = spec.add_levels();
  plain->set_period(1);
  plain->set_group_size(1);
  v1::Level* inner = spec.add_levels();
  inner->set_period(2);
  inner->set_group_size(2);
  inner->mutable_outer()->set_lr(0.5);
  inner->mutable_outer()->set_momentum(0.5);
  v1::Level* outer = spec.add_levels();
  outer->set_period(6);
  outer->set_group_size(4);
  outer->mutable_outer()->set_lr(0.7);
  outer->mutable_outer()->set_momentum(0.9);
  outer->mutable_outer()->set_nesterov(true);
  Start(spec, kFp32);
  RunAndCheck(20, 2e-5);
}

TEST_F(NcclOuterTest, HalfPrecisionParameters_Float32State_FollowTheRule) {
  Start(Periodic(2, 2, 0, 0.7, 0.9, true), kHalves);
  // bfloat16 keeps 8 bits: the parameters round at every write, the float32 state does not.
  RunAndCheck(8, 3e-2);
  for (const auto& m : members_) {
    const std::vector<StateTensor> a = m->outer[0]->AnchorTensors();
    ASSERT_EQ(a.size(), kHalves.size());
    for (const StateTensor& t : a) EXPECT_EQ(t.dtype, DType::kFloat32);
  }
}

// The same run with the state on the device and in pinned host memory: bit for bit the same
// parameters, anchors and momenta; the pinned run allocates its state with MallocHost.
TEST_F(NcclOuterTest, BackupDeviceHost_ValuesIdenticalToOnDevice) {
  const v1::JobSpec spec = Periodic(3, 2, 1, 0.7, 0.9, true);
  std::vector<std::vector<std::string>> params[2];
  std::vector<std::vector<StateTensor>> anchors[2], momenta[2];
  for (int pinned = 0; pinned < 2; ++pinned) {
    members_.clear();
    groups_.clear();
    Start(spec, kFp32, pinned == 1);
    RunAndCheck(9, 2e-5);
    if (HasFatalFailure()) return;
    for (const auto& m : members_) {
      params[pinned].push_back(Bytes(m->params));
      anchors[pinned].push_back(m->outer[0]->AnchorTensors());
      momenta[pinned].push_back(m->outer[0]->MomentumTensors());
      // Anchor and momentum, pinned; the pseudo-gradient and chunk table on the device.
      EXPECT_EQ(m->device->host_mallocs, pinned == 1 ? 2 : 0);
    }
  }
  EXPECT_EQ(params[0], params[1]);
  ASSERT_EQ(anchors[0].size(), anchors[1].size());
  for (size_t r = 0; r < anchors[0].size(); ++r) {
    ASSERT_EQ(anchors[0][r].size(), anchors[1][r].size());
    for (size_t t = 0; t < anchors[0][r].size(); ++t) {
      EXPECT_EQ(anchors[0][r][t].bytes, anchors[1][r][t].bytes) << "rank " << r << " tensor " << t;
      EXPECT_EQ(momenta[0][r][t].bytes, momenta[1][r][t].bytes) << "rank " << r << " tensor " << t;
    }
  }
}

// The state's host copies (state_dict) and a load into a fresh device state continue exactly.
TEST_F(NcclOuterTest, StateDictFromTheDevice_LoadedIntoAFreshState_ContinuesExactly) {
  Start(Periodic(2, 2, 0, 0.7, 0.9, true), kFp32);
  RunAndCheck(5, 2e-5);  // steps 0 (anchor), 2, 4 (outer steps)
  for (auto& m : members_) {
    const std::vector<StateTensor> a = m->outer[0]->AnchorTensors();
    const std::vector<StateTensor> mo = m->outer[0]->MomentumTensors();
    ASSERT_FALSE(mo.empty());
    auto fresh = std::make_unique<OuterLevelState>(0, OuterSgdOf(spec_.levels(0)));
    ASSERT_TRUE(fresh->Load(a, &mo).ok());  // host, as load_state_dict leaves it
    ASSERT_TRUE(fresh
                    ->AttachDevice(std::make_unique<DeviceOuterState>(
                        m->device.get(), m->device.get(), 0, OuterSgdOf(spec_.levels(0)), false))
                    .ok());
    EXPECT_TRUE(fresh->has_momentum());
    EXPECT_EQ(fresh->AnchorTensors()[2].bytes, a[2].bytes);
    m->outer[0] = std::move(fresh);
  }
  const auto expected = OuterReference(spec_, 9);
  for (int64_t s = 5; s < 9; ++s) {
    Step(s);
    if (HasFatalFailure()) return;
    for (int r = 0; r < 2; ++r) {
      ASSERT_NEAR(members_[r]->params.At(2, 100), expected[s][r].value + Offset(2, 100),
                  2e-5 * std::max(1.0, std::abs(expected[s][r].value)))
          << "step " << s << " rank " << r;
    }
  }
}

TEST_F(NcclOuterTest, MixedFloat64AndFloat32_Unimplemented_SayingWhy) {
  FakeOps device(nullptr, 0);
  DeviceOuterState state(&device, &device, 0, OuterSgd{0.7, 0.9, true}, false);
  Params p = Params::Separate({{DType::kFloat32, 3}, {DType::kFloat64, 3}});
  const absl::Status s = state.SetAnchor(p.views);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("float64"));
  EXPECT_FALSE(state.has_anchor());
}

TEST_F(NcclOuterTest, OtherParameterList_InvalidArgument_NothingChanges) {
  Start(Periodic(2, 1, 0, 0.7, 0.9, true), kFp32);
  RunAndCheck(2, 2e-5);
  Member& m = *members_[0];
  Params other = Params::Separate({{DType::kFloat32, 1}, {DType::kFloat32, 34}});
  const std::vector<StateTensor> before = m.outer[0]->AnchorTensors();
  const absl::Status s = RunDeviceOuterStep(m.outer[0]->device(), &m.gradient, other.views,
                                            false, false,
                                            [](absl::Span<const TensorView>, int64_t) {
                                              ADD_FAILURE() << "no round for a bad list";
                                              return absl::OkStatus();
                                            });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(m.outer[0]->AnchorTensors()[1].bytes, before[1].bytes);
}

// An elastic job's committed round with the outer step: member 2 is admitted at an outer step
// (it receives the state from member 0 within the round, as the averager's hand-over does, and
// contributes nothing: divisor 2); member 1's commit is lost after it succeeded everywhere, so it
// adopts the kept pseudo-gradient. Every member ends with the rule's values for the two
// contributors, computed here in double from the state and parameters before the step.
TEST_F(NcclOuterTest, ElasticCommittedRound_JoinerAndLostCommit_EveryMemberFollowsTheRule) {
  const v1::JobSpec spec = Periodic(3, 2, 0, 0.7, 0.9, true);
  Start(spec, kFp32);
  RunAndCheck(5, 2e-5);  // steps 0, 2, 4 averaged: anchors and momenta set
  if (HasFatalFailure()) return;
  const OuterSgd rule = OuterSgdOf(spec.levels(0));
  // Step 5 (a skip) moves the members apart; at step 6, rank 2 is a fresh replacement.
  for (int r = 0; r < 3; ++r) {
    Set(*members_[r], [&](size_t t, int64_t i) {
      return members_[r]->params.At(t, i) + (r + 1) * 0.75 + 0.01 * t;
    });
  }
  Member& joiner = *members_[2];
  joiner.outer[0] = std::make_unique<OuterLevelState>(0, rule);
  ASSERT_TRUE(joiner.outer[0]
                  ->AttachDevice(std::make_unique<DeviceOuterState>(
                      joiner.device.get(), joiner.device.get(), 0, rule, false))
                  .ok());
  Set(joiner, [](size_t, int64_t) { return 999.0; });
  // The expected values, in double, from member 0's state (equal on 0 and 1) and x_0, x_1.
  const std::vector<StateTensor> a0 = members_[0]->outer[0]->AnchorTensors();
  const std::vector<StateTensor> m0 = members_[0]->outer[0]->MomentumTensors();
  std::vector<std::vector<double>> want(a0.size());
  for (size_t t = 0; t < a0.size(); ++t) {
    for (int64_t i = 0; i < a0[t].numel; ++i) {
      const double a = reinterpret_cast<const float*>(a0[t].bytes.data())[i];
      const double mo = reinterpret_cast<const float*>(m0[t].bytes.data())[i];
      const double d = ((a - members_[0]->params.At(t, i)) + (a - members_[1]->params.At(t, i))) / 2;
      const double buf = rule.momentum * mo + d;
      want[t].push_back(a - rule.lr * (d + rule.momentum * buf));
    }
  }
  FakeNcclGroup group(3);
  group.ops[1]->lose_commits = 1;
  std::vector<absl::Status> out(3);
  std::vector<RoundOutcome> outcomes(3, RoundOutcome::kCompleted);
  std::vector<std::thread> threads;
  for (int k = 0; k < 3; ++k) {
    threads.emplace_back([&, k] {
      Member& m = *members_[k];
      OuterLevelState* level = m.outer[0].get();
      RoundOptions options;
      options.step = 6;
      options.commit = true;
      options.contributors = 2;
      options.contribute = k != 2;
      out[k] = RunDeviceOuterStep(
          level->device(), &m.gradient, m.params.views, /*first_step=*/false,
          /*joining=*/k == 2, [&](absl::Span<const TensorView> d, int64_t layout_signature) {
            options.layout_signature = layout_signature;
            if (k == 2) {
              // The hand-over (OuterLevel::HandOver): the donor's host copies.
              std::vector<StateTensor> mo = m0;
              absl::Status s = level->Load(a0, &mo);
              if (!s.ok()) return s;
            }
            // The joiner's communicator zeroes its (device) pseudo-gradient buffer.
            group.ops[k]->SetParams(d[0].data, m.gradient.capacity());
            absl::Status s = group.cores[k]->Run(d, options, &outcomes[k]);
            if (!s.ok() && outcomes[k] == RoundOutcome::kFailedHoldingResult) {
              // A peer completed the round (the averager learns it from the round notes).
              return group.cores[k]->Adopt(d);
            }
            return s;
          });
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(group.world->mismatch());
  EXPECT_FALSE(group.world->hang());
  EXPECT_EQ(outcomes[1], RoundOutcome::kFailedHoldingResult);
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(out[k].ok()) << "member " << k << ": " << out[k];
    for (size_t t = 0; t < want.size(); ++t) {
      for (int64_t i = 0; i < static_cast<int64_t>(want[t].size()); i += 1 + want[t].size() / 97) {
        ASSERT_NEAR(members_[k]->params.At(t, i), want[t][i],
                    2e-5 * std::max(1.0, std::abs(want[t][i])))
            << "member " << k << " tensor " << t << " element " << i;
      }
    }
    EXPECT_EQ(Bytes(members_[k]->params), Bytes(members_[0]->params)) << "member " << k;
    const std::vector<StateTensor> a = members_[k]->outer[0]->AnchorTensors();
    const std::vector<StateTensor> mo = members_[k]->outer[0]->MomentumTensors();
    for (size_t t = 0; t < a.size(); ++t) {
      EXPECT_EQ(a[t].bytes, members_[0]->outer[0]->AnchorTensors()[t].bytes) << "member " << k;
      EXPECT_EQ(mo[t].bytes, members_[0]->outer[0]->MomentumTensors()[t].bytes) << "member " << k;
    }
  }
}

// A failed round changes neither the state nor the parameters (the round is retried).
TEST_F(NcclOuterTest, RoundFails_StateAndParametersUnchanged) {
  Start(Periodic(2, 1, 0, 0.7, 0.9, true), kFp32);
  RunAndCheck(3, 2e-5);
  if (HasFatalFailure()) return;
  Member& m = *members_[0];
  const std::vector<std::string> before = Bytes(m.params);
  const std::vector<StateTensor> a = m.outer[0]->AnchorTensors();
  const std::vector<StateTensor> mo = m.outer[0]->MomentumTensors();
  const absl::Status s = RunDeviceOuterStep(
      m.outer[0]->device(), &m.gradient, m.params.views, false, false,
      [](absl::Span<const TensorView>, int64_t) {
        return absl::UnavailableError("peer died (test)");
      });
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_EQ(Bytes(m.params), before);
  for (size_t t = 0; t < a.size(); ++t) {
    EXPECT_EQ(m.outer[0]->AnchorTensors()[t].bytes, a[t].bytes);
    EXPECT_EQ(m.outer[0]->MomentumTensors()[t].bytes, mo[t].bytes);
  }
}

// The device the averager's outer states live on: none in a build without CUDA (a clear error,
// nothing attached); else the one it is given opens once, and a second device is refused.
TEST(OuterDeviceTest, NoDeviceGiven_Unimplemented_NamingTheBuildOption) {
  OuterDevice device(absl::Seconds(1), /*pinned_host=*/false, nullptr);
  OuterLevelState state(0, OuterSgd{0.7, 0.9, true});
  const absl::StatusOr<DeviceOuterState*> on = device.StateOf(&state, Device::Cuda(0));
  EXPECT_EQ(on.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(on.status().message(), HasSubstr("MODELAVG_WITH_CUDA=ON"));
  EXPECT_EQ(state.device(), nullptr);
}

TEST(OuterDeviceTest, OpensItsDeviceOnce_AnotherDevice_InvalidArgument) {
  std::vector<int> opened;
  OuterDevice device(absl::Seconds(1), /*pinned_host=*/false,
                     [&](int index, absl::Duration) -> absl::StatusOr<LocalDevice> {
                       opened.push_back(index);
                       LocalDevice d;
                       d.ops = std::make_unique<FakeOps>(nullptr, 0);
                       d.kernels = std::make_unique<FakeOps>(nullptr, 0);
                       return d;
                     });
  OuterLevelState a(0, OuterSgd{0.7, 0.9, true});
  OuterLevelState b(1, OuterSgd{0.7, 0.0, false});
  OuterLevelState c(2, OuterSgd{0.7, 0.0, false});
  ASSERT_TRUE(device.StateOf(&a, Device::Cuda(1)).ok());
  ASSERT_TRUE(device.StateOf(&b, Device::Cuda(1)).ok());
  EXPECT_NE(a.device(), nullptr);
  EXPECT_NE(b.device(), nullptr);
  EXPECT_EQ(opened, std::vector<int>{1});
  const absl::StatusOr<DeviceOuterState*> other = device.StateOf(&c, Device::Cuda(0));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(), HasSubstr("cuda:1"));
  EXPECT_EQ(c.device(), nullptr);
  EXPECT_EQ(opened, std::vector<int>{1});
}

}  // namespace
}  // namespace modelavg::client
