// Error feedback on CUDA parameters (Level.error_feedback, docs/streaming.md; DeviceOuterState's
// residual, RunDeviceStreamingStep and DevicePendingSync::Fill over NcclCore's INT4 and TOPK
// rounds) with simulated members as threads on the fake device of
// tests/testing/fake_nccl_device.h, against the rule restated naively here, apart from the codec:
//
//   D_m = fl32(A - x_m);  U_m = fl32(beta E_m + D_m) (in double);  C_m = decode(encode(U_m))
//   (blocks of 1024 of the whole buffer); mean = fl32(sum over m in order of C_m) * fl32(1 / n);
//   R = decode(encode(mean)) (TOPK and TOPK_INT2: as TOPK, min(1024, n k) entries a block);
//   A := A - R (lr 1);
//   x_m := A;  E_m := fl32(U_m - C_m) once the round has succeeded (a failed round leaves it).
//
// Every member, every step, beta 1 and 0.9, INT4, TOPK and TOPK_INT2, in place and staged (the
// finite check), blocking and background (Fill), residual in device or pinned host memory: the
// parameters, the anchors and every member's residual bit for bit. Also the residual's
// state_dict round trip, a host residual taken over by AttachDevice, and a replacement's zero
// residual. Runs without a GPU; tests/gpu runs the kernels against the host codec.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/base/half.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_state.h"
#include "client/payload/payload_codec.h"
#include "gtest/gtest.h"
#include "tests/reference/naive_payload.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/testing/fake_nccl_group.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::NaivePayloadRoundTrip;

// Tensors whose sizes put INT4/TOPK blocks across tensor boundaries, the last one short.
const std::vector<int64_t> kSizes = {700, 1500, 333, 1};

// Member m's local training at step s, element e: magnitudes that differ by block and step,
// many ties (eighths), signs mixed.
float Update(int m, int64_t s, int64_t e) {
  const float q =
      std::round(8.0f * std::sin(0.37f * static_cast<float>(e) + 1.3f * m + 0.7f * s)) / 8.0f;
  return std::ldexp(q, static_cast<int>((e / 700 + s) % 5) - 2);
}

std::vector<float> FlatTensors(const std::vector<StateTensor>& t) {
  std::vector<float> out;
  for (const StateTensor& s : t) {
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(s.numel));
    std::memcpy(out.data() + at, s.bytes.data(), s.bytes.size());
  }
  return out;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Member {
  std::unique_ptr<FakeOps> device;  // the outer state's memory and kernels (no collectives)
  Params params;
  std::unique_ptr<DeviceOuterState> state;
  GrowableBuffer gradient;
  GrowableBuffer local;
  ~Member() {
    state.reset();
    gradient.Release(*device);
    local.Release(*device);
  }
};

struct Case {
  Payload payload;
  int32_t topk;
  double beta;
  bool check_finite;  // staged (unpadded) rather than in place
  bool background;    // DevicePendingSync::Fill rather than RunDeviceStreamingStep
  bool pinned_host;
};

std::string Name(const Case& c) {
  return absl::StrCat(PayloadName(c.payload), c.topk > 0 ? absl::StrCat("_k", c.topk) : "",
                      "_beta", c.beta == 1 ? "1" : "09", c.check_finite ? "_Staged" : "_InPlace",
                      c.background ? "_Background" : "_Blocking",
                      c.pinned_host ? "_Pinned" : "");
}

// The case's name in test listings (ctest's), not its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << Name(c); }

class NcclFeedbackTest : public ::testing::TestWithParam<Case> {
 protected:
  static constexpr int kMembers = 3;

  void SetUp() override {
    group_ = std::make_unique<FakeNcclGroup>(kMembers);
    std::vector<std::pair<DType, int64_t>> spec;
    for (int64_t k : kSizes) spec.emplace_back(DType::kFloat32, k);
    for (int m = 0; m < kMembers; ++m) {
      auto member = std::make_unique<Member>();
      member->device = std::make_unique<FakeOps>(nullptr, m);
      member->params = Params::Separate(spec);
      OuterSgd rule;
      rule.lr = 1.0;  // A := A - R, exact in float32: the restatement needs no SGD arithmetic
      member->state = std::make_unique<DeviceOuterState>(
          member->device.get(), member->device.get(), 0, rule, GetParam().pinned_host);
      int64_t e = 0;
      for (const TensorView& v : member->params.views) {
        for (int64_t i = 0; i < v.numel; ++i, ++e) {
          static_cast<float*>(v.data)[i] = 0.5f * Update(m, -1, e);
        }
      }
      members_.push_back(std::move(member));
    }
  }
  void TearDown() override { members_.clear(); }

  // One round of member k (the pseudo-gradient's in the case's payload); `fail` fails it.
  absl::Status Round(int k, absl::Span<const TensorView> tensors, int64_t signature) {
    RoundOptions o;
    o.layout_signature = signature;
    o.check_finite = GetParam().check_finite;
    if (signature == kOuterRoundSignature) {
      o.payload = GetParam().payload;
      o.topk = GetParam().topk;
    }
    return group_->cores[k]->Run(tensors, o, nullptr);
  }

  DeviceFeedback Feedback() const {
    DeviceFeedback f;
    f.beta = GetParam().beta;
    f.format = WireFormat(GetParam().payload, GetParam().topk);
    return f;
  }

  // Every member's averaging call of one step, at once.
  std::vector<absl::Status> StepAll(bool first, bool fail_round) {
    std::vector<absl::Status> out(kMembers);
    std::vector<std::thread> threads;
    for (int k = 0; k < kMembers; ++k) {
      threads.emplace_back([&, k] { out[k] = StepOne(k, first, fail_round); });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  absl::Status StepOne(int k, bool first, bool fail_round) {
    Member& m = *members_[k];
    auto round = [&](absl::Span<const TensorView> tensors, int64_t signature) {
      if (fail_round && signature == kOuterRoundSignature) {
        return absl::UnavailableError("the round failed (simulated)");
      }
      return Round(k, tensors, signature);
    };
    if (!GetParam().background || first) {
      return RunDeviceStreamingStep(m.state.get(), &m.gradient, &m.local, m.params.views,
                                    first, /*joining=*/false, /*mix=*/0.0, round,
                                    first ? DeviceFeedback{} : Feedback());
    }
    // The background path, started and applied within the step: Fill leaves U in the sync's
    // buffer and the next residual, which the state takes once the round starts and gives
    // back if it fails (StreamingLevel::StartDevice, ApplyOne).
    DevicePendingSync sync(m.device.get(), m.state.get(), /*first=*/false);
    std::unique_ptr<OwnedDeviceBuffer> next;
    absl::StatusOr<std::vector<TensorView>> views = sync.Fill(m.params.views, Feedback(), &next);
    if (!views.ok()) return views.status();
    std::unique_ptr<OwnedDeviceBuffer> before = m.state->SwapResidual(std::move(next));
    absl::Status s = round(*views, kOuterRoundSignature);
    if (s.ok()) s = sync.Apply(m.params.views, 0.0, &m.local);
    if (!s.ok()) m.state->SwapResidual(std::move(before));
    return s;
  }

  std::unique_ptr<FakeNcclGroup> group_;
  std::vector<std::unique_ptr<Member>> members_;
};

TEST_P(NcclFeedbackTest, EveryMemberEveryStep_FollowsTheRuleBitForBit) {
  const Case c = GetParam();
  const int n = kMembers;
  const int64_t total = [] {
    int64_t t = 0;
    for (int64_t k : kSizes) t += k;
    return t;
  }();
  // The first sync: a plain average, the anchor.
  for (const absl::Status& s : StepAll(/*first=*/true, false)) ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<std::vector<StateTensor>> a0 = members_[0]->state->AnchorTensors();
  ASSERT_TRUE(a0.ok()) << a0.status();
  std::vector<float> anchor = FlatTensors(*a0);
  std::vector<std::vector<float>> x(n), e(n, std::vector<float>(total, 0.0f));
  for (int m = 0; m < n; ++m) {
    x[m] = Flat(members_[m]->params);
    ASSERT_TRUE(SameBits(x[m], anchor)) << "member " << m;
    EXPECT_FALSE(members_[m]->state->has_residual());
  }
  const int32_t gather_k = std::min(1024, n * c.topk);
  int64_t failed = 0;
  for (int64_t s = 0; s < 7; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    // Local training.
    for (int m = 0; m < n; ++m) {
      int64_t at = 0;
      for (const TensorView& v : members_[m]->params.views) {
        float* p = static_cast<float*>(v.data);
        for (int64_t i = 0; i < v.numel; ++i, ++at) {
          p[i] = p[i] + Update(m, s, at);
          x[m][at] = x[m][at] + Update(m, s, at);
        }
      }
    }
    // Step 3's round fails on every member: nothing changes.
    const bool fail = s == 3;
    const std::vector<absl::Status> out = StepAll(/*first=*/false, fail);
    for (int m = 0; m < n; ++m) {
      if (fail) {
        ASSERT_EQ(out[m].code(), absl::StatusCode::kUnavailable) << out[m];
      } else {
        ASSERT_TRUE(out[m].ok()) << "member " << m << ": " << out[m];
      }
    }
    EXPECT_FALSE(group_->world->mismatch());
    EXPECT_FALSE(group_->world->hang());
    if (!fail) {
      // The rule, naively.
      std::vector<float> sum(total, 0.0f);
      std::vector<std::vector<float>> next_e(n);
      for (int m = 0; m < n; ++m) {
        std::vector<float> u(total);
        for (int64_t i = 0; i < total; ++i) {
          const float d = anchor[i] - x[m][i];
          u[i] = static_cast<float>(c.beta * static_cast<double>(e[m][i]) +
                                    static_cast<double>(d));
        }
        const std::vector<float> sent = NaivePayloadRoundTrip(c.payload, c.topk, u);
        next_e[m].resize(total);
        for (int64_t i = 0; i < total; ++i) {
          next_e[m][i] = u[i] - sent[i];
          sum[i] += sent[i];
        }
      }
      const float inv = 1.0f / static_cast<float>(n);
      for (float& v : sum) v *= inv;
      // The mean travels back as the payload's gather: TOPK's for TOPK_INT2 (bfloat16 entries).
      const Payload gather = c.payload == Payload::kTopkInt2 ? Payload::kTopk : c.payload;
      const std::vector<float> r = NaivePayloadRoundTrip(gather, gather_k, sum);
      for (int64_t i = 0; i < total; ++i) anchor[i] = anchor[i] - r[i];
      for (int m = 0; m < n; ++m) {
        x[m] = anchor;
        e[m] = next_e[m];
      }
    } else {
      ++failed;
    }
    for (int m = 0; m < n; ++m) {
      ASSERT_FALSE(members_[m]->device->illegal) << "member " << m;
      ASSERT_TRUE(SameBits(Flat(members_[m]->params), x[m])) << "member " << m << "'s parameters";
      absl::StatusOr<std::vector<StateTensor>> a = members_[m]->state->AnchorTensors();
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(SameBits(FlatTensors(*a), anchor)) << "member " << m << "'s anchor";
      ASSERT_TRUE(members_[m]->state->has_residual()) << "member " << m;
      absl::StatusOr<std::vector<StateTensor>> got = members_[m]->state->ResidualTensors();
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), kSizes.size());
      for (size_t t = 0; t < kSizes.size(); ++t) {
        EXPECT_EQ((*got)[t].dtype, DType::kFloat32);
        EXPECT_EQ((*got)[t].numel, kSizes[t]);
      }
      ASSERT_TRUE(SameBits(FlatTensors(*got), e[m])) << "member " << m << "'s residual";
    }
    if (s == 0) {
      // Something was lost and is fed back.
      double fed = 0;
      for (float v : e[0]) fed += std::fabs(v);
      EXPECT_GT(fed, 0);
    }
  }
  EXPECT_EQ(failed, 1);
  for (int m = 0; m < n; ++m) {
    EXPECT_EQ(members_[m]->state->bytes(), 2 * static_cast<size_t>(total) * sizeof(float))
        << "the anchor and the residual";
    if (c.pinned_host) EXPECT_GT(members_[m]->device->host_mallocs, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Payloads, NcclFeedbackTest,
    ::testing::Values(Case{Payload::kInt4, 0, 1.0, false, false, false},
                      Case{Payload::kInt4, 0, 0.9, true, false, false},
                      Case{Payload::kInt4, 0, 0.9, false, true, true},
                      Case{Payload::kTopk, 21, 1.0, true, false, false},
                      Case{Payload::kTopk, 21, 0.9, false, false, true},
                      Case{Payload::kTopkInt2, 21, 1.0, true, false, false},
                      Case{Payload::kTopkInt2, 21, 0.9, false, false, true},
                      Case{Payload::kTopkInt2, 308, 1.0, true, true, false},
                      Case{Payload::kTopk, 1, 1.0, true, true, false},
                      Case{Payload::kTopk, 308, 0.9, true, true, false}),
    [](const auto& info) { return Name(info.param); });

// The residual's state_dict round trip on the device, and its checks.
TEST(DeviceResidual, StateDictRoundTrip_AndItsErrors) {
  FakeOps ops(nullptr, 0);
  Params p = Params::Separate({{DType::kFloat32, 5}, {DType::kFloat32, 3}});
  for (const TensorView& v : p.views) {
    for (int64_t i = 0; i < v.numel; ++i) static_cast<float*>(v.data)[i] = 0.25f * i;
  }
  OuterSgd rule;
  rule.lr = 1.0;
  DeviceOuterState state(&ops, &ops, 0, rule, /*pinned_host=*/false);
  std::vector<StateTensor> e(2);
  for (size_t t = 0; t < 2; ++t) {
    e[t].dtype = DType::kFloat32;
    e[t].numel = p.views[t].numel;
    std::vector<float> v(static_cast<size_t>(e[t].numel));
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * static_cast<float>(t) - 0.125f * i;
    e[t].bytes.resize(v.size() * sizeof(float));
    std::memcpy(e[t].bytes.data(), v.data(), e[t].bytes.size());
  }
  EXPECT_EQ(state.LoadResidual(e).code(), absl::StatusCode::kFailedPrecondition)
      << "no anchor yet";
  ASSERT_TRUE(state.SetAnchor(p.views).ok());
  ASSERT_TRUE(state.LoadResidual(e).ok());
  EXPECT_TRUE(state.has_residual());
  absl::StatusOr<std::vector<StateTensor>> back = state.ResidualTensors();
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  for (size_t t = 0; t < 2; ++t) EXPECT_EQ((*back)[t].bytes, e[t].bytes) << "tensor " << t;
  std::vector<StateTensor> wrong = e;
  wrong[1].numel = 4;
  wrong[1].bytes.resize(16);
  EXPECT_EQ(state.LoadResidual(wrong).code(), absl::StatusCode::kInvalidArgument);
  wrong = e;
  wrong[0].dtype = DType::kFloat64;
  EXPECT_EQ(state.LoadResidual(wrong).code(), absl::StatusCode::kInvalidArgument);
  // Nothing changed on the errors.
  back = state.ResidualTensors();
  ASSERT_TRUE(back.ok());
  EXPECT_EQ((*back)[0].bytes, e[0].bytes);
  ASSERT_TRUE(state.LoadResidual({}).ok());
  EXPECT_FALSE(state.has_residual());
  EXPECT_TRUE(state.ResidualTensors()->empty());
  ASSERT_TRUE(state.LoadResidual(e).ok());
  state.ClearResidual();  // a plan update changed the payload
  EXPECT_FALSE(state.has_residual());
}

// A state_dict loaded before the parameters reached the device: AttachDevice takes the host
// residual over with the anchor, and the level's state answers for the device's.
TEST(DeviceResidual, AttachDevice_TakesTheHostResidualOver) {
  FakeOps ops(nullptr, 0);
  OuterSgd rule;
  rule.lr = 1.0;
  OuterLevelState level(0, rule);
  std::vector<StateTensor> anchor(1), residual(1);
  anchor[0].dtype = residual[0].dtype = DType::kFloat32;
  anchor[0].numel = residual[0].numel = 6;
  anchor[0].bytes.assign(24, 0);
  std::vector<float> r = {1, -2, 3, -4, 5, -6};
  residual[0].bytes.resize(24);
  std::memcpy(residual[0].bytes.data(), r.data(), 24);
  ASSERT_TRUE(level.Load(anchor, nullptr).ok());
  ASSERT_TRUE(level.LoadResidual(residual).ok());
  ASSERT_TRUE(
      level.AttachDevice(std::make_unique<DeviceOuterState>(&ops, &ops, 0, rule, false)).ok());
  ASSERT_NE(level.device(), nullptr);
  EXPECT_TRUE(level.device()->has_residual());
  EXPECT_TRUE(level.has_residual());
  EXPECT_EQ(level.ResidualTensors()[0].bytes, residual[0].bytes);
  EXPECT_EQ(level.bytes(), 48u) << "the anchor and the residual, on the device";
  level.ClearResidual();
  EXPECT_FALSE(level.device()->has_residual());
}

// A replacement (joining: it contributes nothing and receives the mean) keeps no residual: it
// starts at E = 0 at its first contributing step, while its peers keep theirs.
TEST(DeviceResidual, Replacement_StartsWithoutResidual) {
  const int n = 3;
  FakeNcclGroup group(n);
  std::vector<std::unique_ptr<Member>> members;
  OuterSgd rule;
  rule.lr = 1.0;
  for (int m = 0; m < n; ++m) {
    auto member = std::make_unique<Member>();
    member->device = std::make_unique<FakeOps>(nullptr, m);
    member->params = Params::Separate({{DType::kFloat32, 2000}});
    member->state = std::make_unique<DeviceOuterState>(member->device.get(), member->device.get(),
                                                       0, rule, false);
    for (int64_t i = 0; i < 2000; ++i) {
      static_cast<float*>(member->params.views[0].data)[i] = Update(m, 0, i);
    }
    members.push_back(std::move(member));
  }
  DeviceFeedback feedback;
  feedback.beta = 1.0;
  feedback.format = WireFormat(Payload::kInt4);
  for (int step = 0; step < 2; ++step) {
    std::vector<absl::Status> out(n);
    std::vector<std::thread> threads;
    for (int k = 0; k < n; ++k) {
      threads.emplace_back([&, k] {
        Member& m = *members[k];
        // Member 2 is admitted at step 1: the others' first sync was step 0.
        const bool joining = k == 2 && step == 1;
        if (k == 2 && step == 0) return;
        auto round = [&](absl::Span<const TensorView> tensors, int64_t signature) {
          RoundOptions o;
          o.layout_signature = signature;
          o.check_finite = true;  // staged: the member that contributes nothing zeroes its copy
          if (signature == kOuterRoundSignature) o.payload = Payload::kInt4;
          o.contributors = 2;
          o.contribute = !joining;
          return group.cores[k]->Run(tensors, o, nullptr);
        };
        out[k] = RunDeviceStreamingStep(m.state.get(), &m.gradient, &m.local, m.params.views,
                                        /*first_step=*/step == 0, joining, 0.0, round,
                                        step == 0 ? DeviceFeedback{} : feedback);
      });
    }
    if (step == 0) {
      // Member 2 is not in the job yet; in this world of three it takes part in the first sync
      // as a member that contributes nothing (the mean is of members 0 and 1).
      Member& m = *members[2];
      RoundOptions o;
      o.contributors = 2;
      o.contribute = false;
      o.check_finite = true;
      out[2] = group.cores[2]->Run(m.params.views, o, nullptr);
    }
    for (auto& t : threads) t.join();
    for (int k = 0; k < n; ++k) {
      ASSERT_TRUE(out[k].ok()) << "step " << step << " member " << k << ": " << out[k];
    }
    if (step == 0) {
      // The admission's hand-over: the replacement receives the level's anchor.
      absl::StatusOr<std::vector<StateTensor>> a = members[0]->state->AnchorTensors();
      ASSERT_TRUE(a.ok());
      ASSERT_TRUE(members[2]->state->Load(*a, nullptr).ok());
    }
  }
  EXPECT_TRUE(members[0]->state->has_residual());
  EXPECT_TRUE(members[1]->state->has_residual());
  EXPECT_FALSE(members[2]->state->has_residual()) << "a replacement starts at E = 0";
  EXPECT_TRUE(members[2]->state->has_anchor());
  for (int k = 1; k < n; ++k) {
    EXPECT_TRUE(SameBits(Flat(members[k]->params), Flat(members[0]->params))) << "member " << k;
  }
}

}  // namespace
}  // namespace modelavg::client
