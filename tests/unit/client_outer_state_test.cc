// OuterLevelState (client/outer/outer_state.h) on its own: the SGD step against the rule written out
// by hand, the state dtypes, and the errors of a state that does not fit.
#include "client/outer/outer_state.h"

#include <cstring>
#include <vector>

#include "client/base/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

TensorView View(std::vector<float>& v) {
  return TensorView{v.data(), static_cast<int64_t>(v.size()), DType::kFloat32, Device::Host()};
}
TensorView View(std::vector<double>& v) {
  return TensorView{v.data(), static_cast<int64_t>(v.size()), DType::kFloat64, Device::Host()};
}

// One member alone (the group's mean pseudo-gradient is its own): three outer steps of
// lr 0.5, momentum 0.5, nesterov, written out step by step.
TEST(OuterLevelStateTest, Step_FollowsPyTorchSgdWithNesterov) {
  OuterLevelState state(0, OuterSgd{0.5, 0.5, true});
  std::vector<double> x = {1.0, -2.0};
  ASSERT_TRUE(state.SetAnchor({View(x)}).ok());
  EXPECT_TRUE(state.has_anchor());
  EXPECT_FALSE(state.has_momentum());
  double a[2] = {1.0, -2.0}, m[2] = {0, 0};
  bool m_set = false;
  for (int step = 0; step < 3; ++step) {
    x[0] += 0.75 * (step + 1);
    x[1] -= 0.25;
    OuterBuffer d;
    d.Shape({View(x)});
    std::vector<TensorView> dv = d.Views();
    ASSERT_TRUE(state.PseudoGradient(0, {View(x)}, dv).ok());
    for (int i = 0; i < 2; ++i) {
      const double g = a[i] - x[i];
      EXPECT_EQ(static_cast<double*>(dv[0].data)[i], g);
      m[i] = m_set ? 0.5 * m[i] + g : g;
      a[i] -= 0.5 * (g + 0.5 * m[i]);
    }
    m_set = true;
    ASSERT_TRUE(state.Step(0, dv, {View(x)}).ok());
    EXPECT_TRUE(state.has_momentum());
    EXPECT_DOUBLE_EQ(x[0], a[0]) << "step " << step;
    EXPECT_DOUBLE_EQ(x[1], a[1]) << "step " << step;
  }
  // The saved state is the anchor and the momentum, in float64 for float64 parameters.
  std::vector<StateTensor> anchor = state.AnchorTensors(), momentum = state.MomentumTensors();
  ASSERT_EQ(anchor.size(), 1u);
  EXPECT_EQ(anchor[0].dtype, DType::kFloat64);
  double saved[2];
  std::memcpy(saved, anchor[0].bytes.data(), sizeof(saved));
  EXPECT_DOUBLE_EQ(saved[0], a[0]);
  std::memcpy(saved, momentum[0].bytes.data(), sizeof(saved));
  EXPECT_DOUBLE_EQ(saved[1], m[1]);
}

// Without momentum no buffer is kept; lr 1 takes the parameters to A - (A - x) = x.
TEST(OuterLevelStateTest, NoMomentum_KeepsNoBuffer_LrOneIsIdentity) {
  OuterLevelState state(1, OuterSgd{1.0, 0.0, false});
  std::vector<float> x = {3.0f, 4.0f, 5.0f};
  ASSERT_TRUE(state.SetAnchor({View(x)}).ok());
  x = {3.5f, 2.0f, 5.25f};
  OuterBuffer d;
  d.Shape({View(x)});
  std::vector<TensorView> dv = d.Views();
  ASSERT_TRUE(state.PseudoGradient(0, {View(x)}, dv).ok());
  ASSERT_TRUE(state.Step(0, dv, {View(x)}).ok());
  EXPECT_FALSE(state.has_momentum());
  EXPECT_TRUE(state.MomentumTensors().empty());
  EXPECT_EQ(x, (std::vector<float>{3.5f, 2.0f, 5.25f}));
}

// bfloat16 / float16 parameters keep a float32 anchor: an update below the parameters' precision
// accumulates in the anchor.
TEST(OuterLevelStateTest, HalfParameters_Float32State) {
  EXPECT_EQ(OuterStateDType(DType::kBFloat16), DType::kFloat32);
  EXPECT_EQ(OuterStateDType(DType::kFloat16), DType::kFloat32);
  EXPECT_EQ(OuterStateDType(DType::kFloat64), DType::kFloat64);
  OuterLevelState state(0, OuterSgd{0.5, 0.0, false});
  std::vector<uint16_t> h = {FloatToBFloat16(1.0f)};
  TensorView hv{h.data(), 1, DType::kBFloat16, Device::Host()};
  ASSERT_TRUE(state.SetAnchor({hv}).ok());
  ASSERT_EQ(state.AnchorTensors()[0].dtype, DType::kFloat32);
  // x = 1 - 2^-6: D = 2^-6, A = 1 - 2^-7 (a bfloat16 of 1 has 8 bits: 1 - 2^-7 rounds to 1).
  h[0] = FloatToBFloat16(1.0f - 1.0f / 64);
  OuterBuffer d;
  d.Shape({hv});
  ASSERT_EQ(d.dtype(0), DType::kFloat32);
  std::vector<TensorView> dv = d.Views();
  ASSERT_TRUE(state.PseudoGradient(0, {hv}, dv).ok());
  EXPECT_EQ(static_cast<float*>(dv[0].data)[0], 1.0f / 64);
  ASSERT_TRUE(state.Step(0, dv, {hv}).ok());
  float anchor;
  std::memcpy(&anchor, state.AnchorTensors()[0].bytes.data(), sizeof(anchor));
  EXPECT_EQ(anchor, 1.0f - 1.0f / 128);
  EXPECT_EQ(BFloat16ToFloat(h[0]), BFloat16ToFloat(FloatToBFloat16(1.0f - 1.0f / 128)));
}

TEST(OuterLevelStateTest, OtherLayout_InvalidArgument) {
  OuterLevelState state(2, OuterSgd{0.7, 0.9, true});
  std::vector<float> x = {1, 2, 3};
  ASSERT_TRUE(state.SetAnchor({View(x)}).ok());
  std::vector<float> shorter = {1, 2};
  absl::Status s = state.CheckLayout(0, {View(shorter)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("parameter 0 is 2 float32"));
  std::vector<double> other = {1, 2, 3};
  EXPECT_EQ(state.CheckLayout(0, {View(other)}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state.CheckLayout(0, {View(x), View(x)}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OuterLevelStateTest, Load_RefusesWhatDoesNotFit) {
  OuterLevelState plain(0, OuterSgd{0.7, 0.0, false});
  StateTensor t{DType::kFloat32, 2, std::vector<uint8_t>(8)};
  std::vector<StateTensor> one = {t};
  EXPECT_THAT(std::string(plain.Load(one, &one).message()), HasSubstr("has no momentum"));
  OuterLevelState state(0, OuterSgd{0.7, 0.9, false});
  StateTensor short_bytes{DType::kFloat32, 3, std::vector<uint8_t>(8)};
  EXPECT_THAT(std::string(state.Load({short_bytes}, nullptr).message()),
              HasSubstr("8 bytes for 3 float32"));
  StateTensor half{DType::kFloat16, 4, std::vector<uint8_t>(8)};
  EXPECT_THAT(std::string(state.Load({half}, nullptr).message()), HasSubstr("float16"));
  StateTensor other{DType::kFloat32, 1, std::vector<uint8_t>(4)};
  std::vector<StateTensor> mismatched = {other};
  EXPECT_THAT(std::string(state.Load(one, &mismatched).message()), HasSubstr("does not match"));
  EXPECT_FALSE(state.has_anchor());  // nothing changed
  ASSERT_TRUE(state.Load(one, &one).ok());
  EXPECT_TRUE(state.has_anchor());
  EXPECT_TRUE(state.has_momentum());
}

// Error feedback's residual: U = beta E + D against the rule written out, E = U - the INT4
// round trip of U restated by hand (one block: s = max|U| / 7, q = round(U / s)), the swap that
// restores it after a failed round, and state_dict's copy and its checks.
TEST(OuterLevelStateTest, Residual_FollowsRule_SwapsAndLoads) {
  OuterLevelState state(0, OuterSgd{1.0, 0.0, false});
  std::vector<float> x = {0.0f, 0.0f, 0.0f};
  ASSERT_TRUE(state.SetAnchor({View(x)}).ok());
  EXPECT_FALSE(state.has_residual());
  EXPECT_TRUE(state.ResidualTensors().empty());
  // No residual yet: U = D.
  std::vector<float> u = {7.0f, 1.2f, -0.4f};
  ASSERT_TRUE(state.AddResidual(0.9, {View(u)}).ok());
  EXPECT_EQ(u, (std::vector<float>{7.0f, 1.2f, -0.4f}));
  // s = 1: C = (7, 1, 0), E = U - C.
  OuterBuffer e = OuterLevelState::NextResidual(Payload::kInt4, {View(u)});
  const float* ev = static_cast<const float*>(e.data(0));
  EXPECT_FLOAT_EQ(ev[0], 0.0f);
  EXPECT_FLOAT_EQ(ev[1], 1.2f - 1.0f);
  EXPECT_FLOAT_EQ(ev[2], -0.4f);
  auto [before, had] = state.SwapResidual(std::move(e), true);
  EXPECT_FALSE(had);
  EXPECT_TRUE(state.has_residual());
  // The next sync: U = 0.9 E + D.
  std::vector<float> d = {1.0f, 2.0f, 3.0f};
  ASSERT_TRUE(state.AddResidual(0.9, {View(d)}).ok());
  EXPECT_FLOAT_EQ(d[0], 1.0f);
  EXPECT_FLOAT_EQ(d[1], static_cast<float>(0.9 * (1.2f - 1.0f) + 2.0));
  EXPECT_FLOAT_EQ(d[2], static_cast<float>(0.9 * -0.4f + 3.0));
  // state_dict's copy, and a failed round's restore of the previous (absent) residual.
  const std::vector<StateTensor> saved = state.ResidualTensors();
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].numel, 3);
  state.SwapResidual(std::move(before), had);
  EXPECT_FALSE(state.has_residual());
  ASSERT_TRUE(state.LoadResidual(saved).ok());
  EXPECT_EQ(state.ResidualTensors()[0].bytes, saved[0].bytes);
  // A residual that does not fit the anchor.
  std::vector<StateTensor> wrong = saved;
  wrong[0].numel = 2;
  wrong[0].bytes.resize(8);
  absl::Status s = state.LoadResidual(wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("residual[0]"));
  std::vector<float> two = {1.0f, 2.0f};
  EXPECT_EQ(state.AddResidual(1.0, {View(two)}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(state.LoadResidual({}).ok());
  EXPECT_FALSE(state.has_residual());
}

}  // namespace
}  // namespace modelavg::client
