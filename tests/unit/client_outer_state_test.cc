// OuterLevelState (client/averaging/outer_state.h) on its own: the SGD step against the rule written out
// by hand, the state dtypes, and the errors of a state that does not fit.
#include "client/averaging/outer_state.h"

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

}  // namespace
}  // namespace modelavg::client
