#include "client/payload/host_staging.h"

#include <cstdint>
#include <vector>

#include "client/base/half.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

TensorView View(std::vector<float>& v) {
  return TensorView{v.data(), static_cast<int64_t>(v.size()), DType::kFloat32};
}
TensorView View(std::vector<double>& v) {
  return TensorView{v.data(), static_cast<int64_t>(v.size()), DType::kFloat64};
}
TensorView View16(std::vector<uint16_t>& v, DType dtype) {
  return TensorView{v.data(), static_cast<int64_t>(v.size()), dtype};
}

TEST(StagingTest, DTypePromotesToFloat64OnlyWhenPresent) {
  std::vector<float> f(2);
  std::vector<double> d(2);
  std::vector<uint16_t> h(2);
  std::vector<TensorView> a = {View(f), View16(h, DType::kFloat16)};
  EXPECT_EQ(StagingDType(a), DType::kFloat32);
  a.push_back(View(d));
  EXPECT_EQ(StagingDType(a), DType::kFloat64);
  EXPECT_EQ(StagingDType({}), DType::kFloat32);
}

TEST(StagingTest, PackDividesAndUnpackRestoresMixedDTypes) {
  std::vector<float> f = {2, 4, 6};
  std::vector<uint16_t> h = {FloatToHalf(8), FloatToHalf(-2)};
  std::vector<uint16_t> b = {FloatToBFloat16(16)};
  std::vector<float> empty;
  std::vector<TensorView> views = {View(f), View(empty), View16(h, DType::kFloat16),
                                   View16(b, DType::kBFloat16)};
  std::vector<float> staging(6);
  PackDivided(views, DType::kFloat32, 2.0, staging.data());
  EXPECT_THAT(staging, ::testing::ElementsAre(1, 2, 3, 4, -1, 8));
  for (float& x : staging) x *= 3;
  Unpack(staging.data(), DType::kFloat32, views);
  EXPECT_THAT(f, ::testing::ElementsAre(3, 6, 9));
  EXPECT_EQ(HalfToFloat(h[0]), 12.0f);
  EXPECT_EQ(HalfToFloat(h[1]), -3.0f);
  EXPECT_EQ(BFloat16ToFloat(b[0]), 24.0f);
}

TEST(StagingTest, Float64StagingKeepsDoublePrecision) {
  std::vector<double> d = {1.0 / 3.0};
  std::vector<float> f = {1.5f};
  std::vector<TensorView> views = {View(d), View(f)};
  std::vector<double> staging(2);
  PackDivided(views, DType::kFloat64, 1.0, staging.data());
  EXPECT_EQ(staging[0], 1.0 / 3.0);
  EXPECT_EQ(staging[1], 1.5);
  staging[0] = 0.1;
  Unpack(staging.data(), DType::kFloat64, views);
  EXPECT_EQ(d[0], 0.1);
}

TEST(StagingTest, CheckHostTensorsRejectsBadViews) {
  std::vector<float> f(3);
  std::vector<TensorView> ok = {View(f)};
  ASSERT_TRUE(CheckHostTensors(ok).ok());
  EXPECT_EQ(*CheckHostTensors(ok), 3);
  TensorView null_data{nullptr, 4, DType::kFloat32};
  EXPECT_EQ(CheckHostTensors({null_data}).status().code(), absl::StatusCode::kInvalidArgument);
  TensorView negative{f.data(), -1, DType::kFloat32};
  EXPECT_EQ(CheckHostTensors({negative}).status().code(), absl::StatusCode::kInvalidArgument);
  TensorView cuda{f.data(), 3, DType::kFloat32, Device::Cuda(0)};
  EXPECT_THAT(std::string(CheckHostTensors({cuda}).status().message()),
              ::testing::HasSubstr("cuda:0"));
  TensorView empty_null{nullptr, 0, DType::kFloat32};
  EXPECT_TRUE(CheckHostTensors({empty_null}).ok());
}

}  // namespace
}  // namespace modelavg::client
