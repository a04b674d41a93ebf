// Streaming sync on CUDA parameters (docs/streaming.md; RunDeviceStreamingStep and
// DevicePendingSync of client/outer/device_outer_state.h over NcclCore) with simulated members as threads on
// the fake device of tests/testing/fake_nccl_device.h: fragments F = 4, each with its own device
// outer state; sync_delay tau > 0, whose all-reduce runs on a thread of its own, on a stream of
// its own, from the call at s to the call at s + tau; mix alpha; payloads FP32, BF16 and INT8.
// Every member's every element after every step against the independent re-statement of the
// rule in tests/reference/streaming_reference.h (the trace worker's update, here on every
// element with a per-element offset, which the rule carries along unchanged), the compressed
// payloads within their documented bound, added up over the outer steps (docs/streaming.md);
// every group's anchors bit-identical. Runs without a GPU; tests/gpu runs the kernels.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/outer/device_outer_state.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/streaming_reference.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/testing/fake_nccl_group.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::MakeSpec;
using ::modelavg::testing::SetOuter;
using ::modelavg::testing::StreamingReference;
using ::modelavg::testing::StreamingStep;

constexpr int kTensors = 8;
// Not a multiple of the group sizes' parts: an INT8 block holds pieces of two tensors.
constexpr int64_t kNumel = 271;

double Offset(size_t t, int64_t i) { return 0.125 * static_cast<double>(t) + 0.002 * i; }

Payload PayloadOf(const v1::Level& l) {
  return l.payload() == v1::BF16 ? Payload::kBf16
         : l.payload() == v1::INT8 ? Payload::kInt8
                                   : Payload::kFp32;
}

int FragmentsOf(const v1::Level& l) { return std::max(1, l.fragments()); }

// A sync in flight on one member.
struct InFlight {
  int64_t apply = 0;
  int level = 0;
  int fragment = 0;
  std::unique_ptr<DevicePendingSync> sync;
  absl::Status result;
  std::thread thread;
  ~InFlight() {
    if (thread.joinable()) thread.join();
  }
};

struct Member {
  std::unique_ptr<FakeOps> device;  // the outer state's memory and kernels (no collectives)
  Params params;
  // [level][fragment]; empty for a plain level.
  std::vector<std::vector<std::unique_ptr<DeviceOuterState>>> outer;
  GrowableBuffer gradient;
  GrowableBuffer local;
  std::vector<std::unique_ptr<InFlight>> pending;
  ~Member() {
    pending.clear();
    outer.clear();
    gradient.Release(*device);
    local.Release(*device);
  }
};

class NcclStreamingTest : public ::testing::Test {
 protected:
  void Start(const v1::JobSpec& spec) {
    spec_ = spec;
    const std::vector<std::pair<DType, int64_t>> shape(kTensors, {DType::kFloat32, kNumel});
    for (int r = 0; r < spec.world_size(); ++r) {
      auto m = std::make_unique<Member>();
      m->device = std::make_unique<FakeOps>(nullptr, r);
      m->params = Params::Separate(shape);
      m->outer.resize(spec.levels_size());
      for (int l = 0; l < spec.levels_size(); ++l) {
        if (!spec.levels(l).has_outer()) continue;
        for (int f = 0; f < FragmentsOf(spec.levels(l)); ++f) {
          m->outer[l].push_back(std::make_unique<DeviceOuterState>(
              m->device.get(), m->device.get(), l, OuterSgdOf(spec.levels(l)), /*pinned_host=*/false));
        }
      }
      for (size_t t = 0; t < m->params.views.size(); ++t) {
        for (int64_t i = 0; i < kNumel; ++i) {
          static_cast<float*>(m->params.views[t].data)[i] = static_cast<float>(r + Offset(t, i));
        }
      }
      members_.push_back(std::move(m));
    }
  }

  // Tensors of `fragment` (equal tensors: the reference's split, t / (T / F)).
  static absl::Span<const TensorView> FragmentOf(const Member& m, const v1::Level& l,
                                                 int fragment) {
    const int per = kTensors / FragmentsOf(l);
    return absl::MakeConstSpan(m.params.views).subspan(fragment * per, per);
  }

  // The round of a member on its group's core: a fragment's layout agrees afresh (its own
  // signature), the pseudo-gradient travels in the level's payload.
  static absl::Status Round(NcclCore* core, const v1::Level& l, int fragment,
                            absl::Span<const TensorView> tensors, int64_t layout_signature) {
    RoundOptions options;
    options.layout_signature = layout_signature ^ (FragmentsOf(l) > 1 ? 0x100 + fragment : 0);
    if (layout_signature == kOuterRoundSignature) options.payload = PayloadOf(l);
    return core->Run(tensors, options, nullptr);
  }

  void Step(int64_t s, const std::vector<StreamingStep>& want) {
    // The trace update of step s.
    for (int r = 0; r < spec_.world_size(); ++r) {
      for (size_t t = 0; t < kTensors; ++t) {
        float* x = static_cast<float*>(members_[r]->params.views[t].data);
        const double add = (t + 1) * (r + 1) * (s + 1) * 0.5;
        for (int64_t i = 0; i < kNumel; ++i) x[i] = static_cast<float>(x[i] + add);
      }
    }
    // Syncs due at s first: the call at s + tau waits for the background round and applies it.
    for (int r = 0; r < spec_.world_size(); ++r) {
      Member& m = *members_[r];
      for (size_t k = 0; k < m.pending.size();) {
        if (m.pending[k]->apply != s) {
          ++k;
          continue;
        }
        InFlight& p = *m.pending[k];
        p.thread.join();
        ASSERT_TRUE(p.result.ok()) << "step " << s << " rank " << r << ": " << p.result;
        const v1::Level& l = spec_.levels(p.level);
        absl::Status a = p.sync->Apply(FragmentOf(m, l, p.fragment), l.mix(), &m.local);
        ASSERT_TRUE(a.ok()) << "step " << s << " rank " << r << ": " << a;
        m.pending.erase(m.pending.begin() + k);
      }
    }
    if (!want[0].average) return;
    const int level = want[0].level;
    const int fragment = want[0].fragment;
    const v1::Level& l = spec_.levels(level);
    const int g = l.group_size();
    for (int first = 0; first < spec_.world_size(); first += g) {
      auto& group = groups_[{level, first}];
      if (group == nullptr) group = std::make_unique<FakeNcclGroup>(g);
      std::vector<absl::Status> out(g);
      std::vector<std::thread> threads;
      for (int k = 0; k < g; ++k) {
        threads.emplace_back([&, k] {
          Member& m = *members_[first + k];
          NcclCore* core = group->cores[k].get();
          if (!l.has_outer()) {
            out[k] = core->Run(m.params.views);
            return;
          }
          DeviceOuterState* state = m.outer[level][fragment].get();
          const absl::Span<const TensorView> x = FragmentOf(m, l, fragment);
          auto round = [&](absl::Span<const TensorView> tensors, int64_t signature) {
            return Round(core, l, fragment, tensors, signature);
          };
          if (l.sync_delay() == 0) {
            out[k] = RunDeviceStreamingStep(state, &m.gradient, &m.local, x,
                                            /*first_step=*/!state->has_anchor(),
                                            /*joining=*/false, l.mix(), round);
            return;
          }
          auto p = std::make_unique<InFlight>();
          p->apply = s + l.sync_delay();
          p->level = level;
          p->fragment = fragment;
          const bool first_sync = !state->has_anchor();
          p->sync = std::make_unique<DevicePendingSync>(m.device.get(), state, first_sync);
          absl::StatusOr<std::vector<TensorView>> views = p->sync->Fill(x);
          if (!views.ok()) {
            out[k] = views.status();
            return;
          }
          InFlight* raw = p.get();
          const int64_t signature = first_sync ? 0 : kOuterRoundSignature;
          raw->thread = std::thread([raw, core, &l, fragment, signature, v = *views] {
            raw->result = Round(core, l, fragment, v, signature);
          });
          m.pending.push_back(std::move(p));
        });
      }
      for (auto& t : threads) t.join();
      for (int k = 0; k < g; ++k) {
        ASSERT_TRUE(out[k].ok()) << "step " << s << " rank " << first + k << ": " << out[k];
      }
    }
  }

  void RunAndCheck(int64_t steps) {
    const auto want = StreamingReference(spec_, steps, kTensors);
    // The compressed payloads' bound, added up over each tensor's outer steps.
    std::vector<std::vector<double>> allowed(spec_.world_size(),
                                             std::vector<double>(kTensors, 0.0));
    int inexact = 0;
    bool compressed = false;
    for (int64_t s = 0; s < steps; ++s) {
      Step(s, want[s]);
      if (HasFatalFailure()) return;
      for (auto& [key, group] : groups_) {
        EXPECT_FALSE(group->world->mismatch()) << "step " << s;
        EXPECT_FALSE(group->world->hang()) << "step " << s;
      }
      for (int r = 0; r < spec_.world_size(); ++r) {
        const StreamingStep& w = want[s][r];
        Payload payload = Payload::kFp32;
        if (w.average && spec_.levels(w.level).has_outer()) {
          payload = PayloadOf(spec_.levels(w.level));
        }
        compressed = compressed || payload != Payload::kFp32;
        double m_fragment = 0;
        for (double m : w.max_delta) m_fragment = std::max(m_fragment, m);
        const Params& p = members_[r]->params;
        ASSERT_FALSE(members_[r]->device->illegal) << "step " << s;
        for (int t = 0; t < kTensors; ++t) {
          // docs/streaming.md: INT8 2 M / 254 (an INT8 block may hold two tensors of the
          // fragment: M is at most the fragment's largest |A - x|), BF16 2^-8 * 2 M.
          if (payload == Payload::kInt8 && w.max_delta[t] > 0) {
            allowed[r][t] += 2 * m_fragment / 254 * 1.01;
          }
          if (payload == Payload::kBf16) allowed[r][t] += std::ldexp(2 * w.max_delta[t], -8) * 1.01;
          for (int64_t i = 0; i < kNumel; i += 7) {
            const double expect = w.values[t] + Offset(t, i);
            const double tol = std::max(1e-4, 4e-6 * std::fabs(expect)) + allowed[r][t];
            const double got = p.At(t, i);
            ASSERT_NEAR(got, expect, tol) << "step " << s << " rank " << r << " tensor " << t
                                          << " element " << i;
            inexact += std::fabs(got - expect) > 1e-3;
          }
        }
      }
      ExpectAnchorsAgree(s);
    }
    // Syncs started near the end are still in flight: let them end before reading the logs.
    for (auto& m : members_) {
      for (auto& p : m->pending) {
        if (p->thread.joinable()) p->thread.join();
      }
    }
    // A delayed level's rounds ran on the sync's own stream, none on the caller's.
    for (auto& [key, group] : groups_) {
      const v1::Level& l = spec_.levels(key.first);
      if (!l.has_outer() || l.sync_delay() == 0) continue;
      int own = 0, caller = 0;
      for (const std::string& op : group->ops[0]->exec) {
        const bool data = op.rfind("avg", 0) == 0 || op.rfind("alltoall", 0) == 0;
        own += data && op.find("@s") != std::string::npos;
        caller += data && op.find("@caller") != std::string::npos;
      }
      EXPECT_GT(own, 0) << "level " << key.first;
      EXPECT_EQ(caller, 0) << "level " << key.first << ": a background round on the caller's stream";
    }
    if (compressed) {
      EXPECT_GT(inexact, 0) << "the payload was not compressed";
      int alltoall = 0;
      for (auto& [key, group] : groups_) {
        alltoall += std::count(group->ops[0]->ops.begin(), group->ops[0]->ops.end(), "alltoall");
      }
      EXPECT_GT(alltoall, 0) << "no compressed round ran";
    }
  }

  // The members of a group hold bit-identical anchors, fragment by fragment.
  void ExpectAnchorsAgree(int64_t s) {
    for (int l = 0; l < spec_.levels_size(); ++l) {
      if (!spec_.levels(l).has_outer()) continue;
      const int g = spec_.levels(l).group_size();
      for (int r = 0; r < spec_.world_size(); ++r) {
        const int first = r / g * g;
        for (int f = 0; f < FragmentsOf(spec_.levels(l)); ++f) {
          const auto mine = members_[r]->outer[l][f]->AnchorTensors();
          const auto theirs = members_[first]->outer[l][f]->AnchorTensors();
          ASSERT_TRUE(mine.ok() && theirs.ok());
          ASSERT_EQ(mine->size(), theirs->size());
          for (size_t t = 0; t < mine->size(); ++t) {
            EXPECT_EQ((*mine)[t].bytes, (*theirs)[t].bytes)
                << "step " << s << " level " << l << " fragment " << f << ": rank " << r
                << "'s anchor differs from rank " << first << "'s";
          }
        }
      }
    }
  }

  // Syncs still in flight past the last step end before their communicators go.
  void TearDown() override {
    for (auto& m : members_) m->pending.clear();
  }

  v1::JobSpec spec_;
  std::vector<std::unique_ptr<Member>> members_;
  std::map<std::pair<int, int>, std::unique_ptr<FakeNcclGroup>> groups_;
};

v1::JobSpec Streaming(int world, int64_t period, int fragments, int64_t delay, double mix,
                      v1::Payload payload, double lr, double momentum, bool nesterov) {
  v1::JobSpec spec = MakeSpec("streaming", world, v1::PERIODIC, {{period, world}}, 1);
  v1::Level* l = spec.mutable_levels(0);
  l->set_fragments(fragments);
  l->set_sync_delay(delay);
  l->set_mix(mix);
  l->set_payload(payload);
  SetOuter(&spec, 0, lr, momentum, nesterov);
  return spec;
}

TEST_F(NcclStreamingTest, Fragments4_NoDelay_Mix_Nesterov_Fp32_FollowsTheRule) {
  Start(Streaming(4, 8, 4, 0, 0.25, v1::FP32, 0.7, 0.9, true));
  RunAndCheck(26);
}

TEST_F(NcclStreamingTest, Fragments4_Delay2_Mix_Momentum_Fp32_FollowsTheRule) {
  Start(Streaming(4, 16, 4, 2, 0.5, v1::FP32, 0.7, 0.9, false));
  RunAndCheck(40);
}

TEST_F(NcclStreamingTest, Fragments4_Delay3_Bf16_WithinBound) {
  Start(Streaming(4, 16, 4, 3, 0.25, v1::BF16, 1.0, 0.0, false));
  RunAndCheck(40);
}

TEST_F(NcclStreamingTest, Fragments4_Delay1_Int8_WithinBound) {
  Start(Streaming(4, 8, 4, 1, 0.0, v1::INT8, 1.0, 0.0, false));
  RunAndCheck(30);
}

TEST_F(NcclStreamingTest, OneFragment_NoDelay_Int8_WithinBound) {
  Start(Streaming(3, 3, 1, 0, 0.0, v1::INT8, 1.0, 0.0, false));
  RunAndCheck(16);
}

// A plain level inside pairs every other step, and a streaming outer level over the world
// whose background syncs are in flight across the plain level's averages.
TEST_F(NcclStreamingTest, Hierarchical_PlainLevelBetweenStartAndApply_Int8_WithinBound) {
  v1::JobSpec spec = Streaming(4, 16, 4, 3, 0.5, v1::INT8, 1.0, 0.0, false);
  spec.set_mode(v1::HIERARCHICAL);
  spec.set_warmup_steps(0);
  v1::JobSpec two;
  two.CopyFrom(spec);
  two.clear_levels();
  v1::Level* plain = two.add_levels();
  plain->set_period(2);
  plain->set_group_size(2);
  *two.add_levels() = spec.levels(0);
  Start(two);
  RunAndCheck(40);
}

}  // namespace
}  // namespace modelavg::client
