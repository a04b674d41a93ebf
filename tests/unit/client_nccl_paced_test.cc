// A paced round's weighted contribution on CUDA tensors (client/averaging/round_weights.h: the
// copy on the averager's OuterDevice, weighed by OuterKernels::ScaleCopy), members as threads on
// the simulated device of tests/testing/fake_nccl_device.h, the round on NcclCore over a
// FakeWorld. Each member weighs as RoundRunner does (WeightOf, the round on WeightedInput's copy,
// Finish) with a crafted paced Decision. Checked against sum_i w_i x_i / W recomputed here in
// double, for float32, float16 and bfloat16 parameters: a plain level, and an outer level
// (RunDeviceOuterStep as OuterLevel runs it, lr 1 without momentum: its first sync a weighted
// plain average, the next the anchor less the weighted mean of the pseudo-gradients); each
// member's weighted copy against fl(s_i x) restated here; and the cases still refused, with
// the caller's tensors untouched. Runs without a GPU; tests/gpu runs the kernel.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/averaging/round_weights.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_state.h"
#include "client/payload/staging_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/staging_reference.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/testing/fake_nccl_group.h"
#include "tests/tools/paced_decision.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::PacedDecision;
using ::testing::HasSubstr;

constexpr int kMembers = 3;

// A member: its parameters ("CUDA" tensors in host memory) and the averager's device.
struct Member {
  Params params;
  FakeOps* ops = nullptr;  // the device's, once opened
  std::unique_ptr<OuterDevice> device;
};

// Half a unit in the last place of `dtype`, relative.
double Epsilon(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
    case DType::kFloat64:
      return std::ldexp(1.0, -53);
    case DType::kFloat32:
      break;
  }
  return std::ldexp(1.0, -24);
}

class NcclPacedTest : public ::testing::TestWithParam<DType> {
 protected:
  // Members with two tensors of `dtype`, member r's element (t, j) a value of its own.
  void Start(DType dtype) {
    for (int r = 0; r < kMembers; ++r) {
      auto m = std::make_unique<Member>();
      m->params = Params::Separate({{dtype, 37}, {dtype, 1000}});
      for (size_t t = 0; t < m->params.views.size(); ++t) {
        const TensorView& v = m->params.views[t];
        for (int64_t j = 0; j < v.numel; ++j) {
          StoreAs(v.data, StagingCodeOf(dtype), j,
                  (r + 1) * std::sin(0.37 * j + t) + 0.5 * r - 0.25 * static_cast<double>(t));
        }
      }
      m->device = std::make_unique<OuterDevice>(absl::Seconds(10), /*pinned_host=*/false,
                                                FakeLocalDevice(r, &m->ops));
      members_.push_back(std::move(m));
    }
    group_ = std::make_unique<FakeNcclGroup>(kMembers);
  }

  // Member r's tensors, element by element, as doubles.
  std::vector<std::vector<double>> Values(int r) const {
    std::vector<std::vector<double>> out;
    for (size_t t = 0; t < members_[r]->params.views.size(); ++t) {
      out.emplace_back();
      for (int64_t j = 0; j < members_[r]->params.views[t].numel; ++j) {
        out.back().push_back(members_[r]->params.At(t, j));
      }
    }
    return out;
  }

  // sum_i w_i x_i / sum_i w_i, in double.
  static std::vector<std::vector<double>> NaiveWeightedMean(
      const std::vector<std::vector<std::vector<double>>>& xs, const std::vector<double>& w) {
    double total = 0;
    for (double v : w) total += v;
    std::vector<std::vector<double>> out = xs[0];
    for (size_t t = 0; t < out.size(); ++t) {
      for (size_t j = 0; j < out[t].size(); ++j) {
        double sum = 0;
        for (size_t i = 0; i < xs.size(); ++i) sum += w[i] * xs[i][t][j];
        out[t][j] = sum / total;
      }
    }
    return out;
  }

  // Every member's round of `tensors` (its own, from `of`) as RoundRunner runs a paced one:
  // WeightOf, the round on the weighted copy, then Finish. `copies`: each member's weighted
  // copy as it entered the round; `untouched`: whether its tensors were still the caller's
  // values once the round had run (before Finish).
  std::vector<absl::Status> WeightedRound(const Decision& decision,
                                          const std::function<std::vector<TensorView>(int r)>& of,
                                          int64_t layout_signature,
                                          std::vector<std::vector<std::string>>* copies,
                                          std::vector<bool>* untouched) {
    std::vector<absl::Status> status(kMembers);
    copies->assign(kMembers, {});
    untouched->assign(kMembers, false);
    std::vector<std::thread> threads;
    for (int r = 0; r < kMembers; ++r) {
      threads.emplace_back([&, r] {
        status[r] = [&]() -> absl::Status {
          const std::vector<TensorView> tensors = of(r);
          MODELAVG_ASSIGN_OR_RETURN(RoundWeight weight, WeightOf(decision, r));
          WeightedInput copy(members_[r]->device.get());
          MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> views,
                                    copy.Fill(weight, tensors, nullptr));
          for (const TensorView& v : views) {
            (*copies)[r].emplace_back(static_cast<const char*>(v.data), v.nbytes());
          }
          std::vector<std::string> before;
          for (const TensorView& v : tensors) {
            before.emplace_back(static_cast<const char*>(v.data), v.nbytes());
          }
          RoundOptions options;
          options.layout_signature = layout_signature;
          MODELAVG_RETURN_IF_ERROR(group_->cores[r]->Run(views, options, nullptr));
          bool same = true;
          for (size_t t = 0; t < tensors.size(); ++t) {
            same = same && std::memcmp(tensors[t].data, before[t].data(), before[t].size()) == 0;
          }
          (*untouched)[r] = same;
          return copy.Finish(tensors);
        }();
      });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  // Member r's weighted copy of `x` (its tensors' values, of `dtype`) against fl(s x): the
  // product in double, stored as a double is stored into `dtype`.
  static void ExpectWeightedCopy(const std::vector<std::string>& copy,
                                 const std::vector<std::vector<double>>& x, DType dtype,
                                 double scale, int r) {
    ASSERT_EQ(copy.size(), x.size());
    const int32_t code = StagingCodeOf(dtype);
    for (size_t t = 0; t < x.size(); ++t) {
      ASSERT_EQ(copy[t].size(), x[t].size() * DTypeSize(dtype));
      for (size_t j = 0; j < x[t].size(); ++j) {
        char want[8];
        const double product = scale * x[t][j];
        if (dtype == DType::kFloat64) {
          std::memcpy(want, &product, sizeof(product));
        } else {
          const float f = static_cast<float>(product);
          if (dtype == DType::kFloat32) {
            std::memcpy(want, &f, sizeof(f));
          } else {
            const uint16_t h = dtype == DType::kFloat16 ? FloatToHalf(f) : FloatToBFloat16(f);
            std::memcpy(want, &h, sizeof(h));
          }
        }
        ASSERT_EQ(std::memcmp(copy[t].data() + j * DTypeSize(dtype), want, DTypeSize(dtype)), 0)
            << "member " << r << " tensor " << t << " element " << j << ": "
            << LoadAs(copy[t].data(), code, static_cast<int64_t>(j)) << " for " << scale << " * "
            << x[t][j];
      }
    }
  }

  void ExpectNoDeviceFault() {
    for (const auto& m : members_) {
      ASSERT_NE(m->ops, nullptr) << "the weighted round never opened the device";
      EXPECT_FALSE(m->ops->illegal);
    }
    EXPECT_FALSE(group_->world->mismatch());
    EXPECT_FALSE(group_->world->hang());
  }

  std::vector<std::unique_ptr<Member>> members_;
  std::unique_ptr<FakeNcclGroup> group_;
};

// A plain level: every member's tensors become the weighted mean of the members', the same bits
// on every member; each contribution is fl(s_i x_i) of the tensors' dtype; the caller's tensors
// hold their values until the round has completed.
TEST_P(NcclPacedTest, PlainLevel_CudaTensors_WeightedMean) {
  const DType dtype = GetParam();
  Start(dtype);
  const std::vector<double> weights = {20, 29, 45};
  const Decision decision = PacedDecision(weights);
  std::vector<std::vector<std::vector<double>>> inputs;
  for (int r = 0; r < kMembers; ++r) inputs.push_back(Values(r));
  std::vector<std::vector<std::string>> copies;
  std::vector<bool> untouched;
  const std::vector<absl::Status> status = WeightedRound(
      decision, [&](int r) { return members_[r]->params.views; }, 0, &copies, &untouched);
  for (int r = 0; r < kMembers; ++r) {
    ASSERT_TRUE(status[r].ok()) << "member " << r << ": " << status[r];
  }
  ExpectNoDeviceFault();
  const double total = 20 + 29 + 45;
  for (int r = 0; r < kMembers; ++r) {
    EXPECT_TRUE(untouched[r]) << "member " << r << "'s tensors changed before Finish";
    ExpectWeightedCopy(copies[r], inputs[r], dtype, kMembers * weights[r] / total, r);
  }
  const std::vector<std::vector<double>> want = NaiveWeightedMean(inputs, weights);
  const double eps = Epsilon(dtype);
  for (int r = 0; r < kMembers; ++r) {
    const std::vector<std::vector<double>> got = Values(r);
    for (size_t t = 0; t < got.size(); ++t) {
      for (size_t j = 0; j < got[t].size(); ++j) {
        // Each contribution and the mean rounded to the dtype, the sum in float32 at least.
        double terms = 0;
        for (int i = 0; i < kMembers; ++i) terms += std::fabs(inputs[i][t][j]);
        ASSERT_NEAR(got[t][j], want[t][j], 4 * eps * (terms + std::fabs(want[t][j])) + 1e-30)
            << "member " << r << " tensor " << t << " element " << j;
      }
      EXPECT_EQ(std::memcmp(members_[r]->params.views[t].data, members_[0]->params.views[t].data,
                            members_[0]->params.views[t].nbytes()),
                0)
          << "member " << r << " differs from member 0 in tensor " << t;
    }
  }
  // Not a plain mean: the weights change the result well beyond the dtype's rounding.
  const std::vector<std::vector<double>> plain = NaiveWeightedMean(inputs, {1, 1, 1});
  const std::vector<std::vector<double>> got = Values(0);
  double apart = 0;
  double largest = 0;
  for (size_t t = 0; t < got.size(); ++t) {
    for (size_t j = 0; j < got[t].size(); ++j) {
      apart = std::max(apart, std::fabs(got[t][j] - plain[t][j]));
      largest = std::max(largest, std::fabs(plain[t][j]));
    }
  }
  EXPECT_GT(apart, 10 * eps * largest);
}

// An outer level (DiLoCo, lr 1, no momentum) on CUDA parameters: the level's first sync is the
// weighted mean of the parameters (the anchor A); at the next, each member moves away from A by
// its own amount, and the outer step makes every member's parameters A - sum_i w_i D_i / W with
// D_i = A - x_i in float32 (the state dtype), i.e. the weighted mean of the x_i, under this
// round's own weights.
TEST_P(NcclPacedTest, OuterLevel_CudaParameters_WeightedMeanOfThePseudoGradients) {
  const DType dtype = GetParam();
  Start(dtype);
  std::vector<std::unique_ptr<OuterLevelState>> states;
  std::vector<DeviceOuterState*> on_device(kMembers);
  for (int r = 0; r < kMembers; ++r) {
    states.push_back(std::make_unique<OuterLevelState>(0, OuterSgd{1.0, 0.0, false}));
    absl::StatusOr<DeviceOuterState*> s =
        members_[r]->device->StateOf(states[r].get(), Device::Cuda(0));
    ASSERT_TRUE(s.ok()) << s.status();
    on_device[r] = *s;
  }
  const int32_t code = StagingCodeOf(dtype);
  const double eps = Epsilon(dtype);
  const std::vector<std::vector<double>> weights = {{3, 1, 2}, {20, 29, 45}};
  std::vector<std::vector<double>> anchor;
  for (int sync = 0; sync < 2; ++sync) {
    SCOPED_TRACE(::testing::Message() << "sync " << sync);
    if (sync > 0) {
      // Each member's inner steps move it away from the anchor by its own amount.
      for (int r = 0; r < kMembers; ++r) {
        const Params& p = members_[r]->params;
        for (size_t t = 0; t < p.views.size(); ++t) {
          for (int64_t j = 0; j < p.views[t].numel; ++j) {
            StoreAs(p.views[t].data, code, j,
                    anchor[t][j] - 0.05 * (r + 1) * std::cos(0.11 * j + 0.3 * r + t));
          }
        }
      }
    }
    std::vector<std::vector<std::vector<double>>> inputs;
    for (int r = 0; r < kMembers; ++r) inputs.push_back(Values(r));
    const Decision decision = PacedDecision(weights[sync]);
    std::vector<absl::Status> status(kMembers);
    std::vector<std::thread> threads;
    for (int r = 0; r < kMembers; ++r) {
      threads.emplace_back([&, r] {
        Member& m = *members_[r];
        status[r] = RunDeviceOuterStep(
            on_device[r], m.device->gradient(), m.params.views, /*first_step=*/sync == 0,
            /*joining=*/false, [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
              // OuterLevel::Round's round: RoundRunner's weighted copy of these tensors.
              MODELAVG_ASSIGN_OR_RETURN(RoundWeight weight, WeightOf(decision, r));
              WeightedInput copy(m.device.get());
              MODELAVG_ASSIGN_OR_RETURN(std::vector<TensorView> views,
                                        copy.Fill(weight, tensors, nullptr));
              RoundOptions options;
              options.layout_signature = layout_signature;
              MODELAVG_RETURN_IF_ERROR(group_->cores[r]->Run(views, options, nullptr));
              return copy.Finish(tensors);
            });
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kMembers; ++r) {
      ASSERT_TRUE(status[r].ok()) << "member " << r << ": " << status[r];
    }
    ExpectNoDeviceFault();
    double total = 0;
    for (double w : weights[sync]) total += w;
    for (int r = 0; r < kMembers; ++r) {
      const std::vector<std::vector<double>> got = Values(r);
      for (size_t t = 0; t < got.size(); ++t) {
        for (size_t j = 0; j < got[t].size(); ++j) {
          double want = 0;
          double terms = 0;
          if (sync == 0) {
            for (int i = 0; i < kMembers; ++i) {
              want += weights[sync][i] * inputs[i][t][j] / total;
              terms += std::fabs(inputs[i][t][j]);
            }
          } else {
            double mean_d = 0;
            for (int i = 0; i < kMembers; ++i) {
              const double d = anchor[t][j] - inputs[i][t][j];
              mean_d += weights[sync][i] * d / total;
              terms += std::fabs(d);
            }
            want = anchor[t][j] - mean_d;
            terms += std::fabs(anchor[t][j]);
          }
          // The parameters round to the dtype, and so do the first sync's contributions; the
          // pseudo-gradient's contributions and the state are float32.
          const double per_term = sync == 0 ? 4 * eps : 8 * Epsilon(DType::kFloat32);
          ASSERT_NEAR(got[t][j], want, 4 * eps * std::fabs(want) + per_term * terms + 1e-30)
              << "member " << r << " tensor " << t << " element " << j;
        }
        EXPECT_EQ(std::memcmp(members_[r]->params.views[t].data, members_[0]->params.views[t].data,
                              members_[0]->params.views[t].nbytes()),
                  0)
            << "member " << r << " differs from member 0 in tensor " << t;
      }
    }
    anchor = Values(0);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclPacedTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

// What is still refused, clearly and before anything changes: CUDA tensors without the
// averager's device, and a level's own weighting (error feedback's fill) on CUDA tensors.
TEST(NcclPacedRefusals, CudaTensorsWithoutADeviceOrWithAFill_Unimplemented_TensorsUntouched) {
  Params p = Params::Separate({{DType::kFloat32, 4}});
  p.Fill(1.0);
  const std::string before(static_cast<const char*>(p.views[0].data), p.views[0].nbytes());
  absl::StatusOr<RoundWeight> w = WeightOf(PacedDecision({1, 2, 3}), 0);
  ASSERT_TRUE(w.ok()) << w.status();

  WeightedInput without_device;
  absl::StatusOr<std::vector<TensorView>> filled = without_device.Fill(*w, p.views, nullptr);
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(filled.status().message(), HasSubstr("cuda:0"));
  EXPECT_THAT(filled.status().message(), HasSubstr("CUDA device"));

  FakeOps* ops = nullptr;
  OuterDevice device(absl::Seconds(1), /*pinned_host=*/false, FakeLocalDevice(0, &ops));
  WeightedInput with_fill(&device);
  bool filled_called = false;
  filled = with_fill.Fill(*w, p.views, [&](double, absl::Span<const TensorView>) {
    filled_called = true;
    return absl::OkStatus();
  });
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(filled.status().message(), HasSubstr("error_feedback"));
  EXPECT_FALSE(filled_called);
  EXPECT_EQ(std::string(static_cast<const char*>(p.views[0].data), p.views[0].nbytes()), before);
}

// A build without CUDA: the device cannot open, and the error names the build option.
TEST(NcclPacedRefusals, NoCudaBuild_Unimplemented_NamingTheBuildOption) {
  Params p = Params::Separate({{DType::kBFloat16, 9}});
  p.Fill(2.0);
  absl::StatusOr<RoundWeight> w = WeightOf(PacedDecision({1, 2}), 1);
  ASSERT_TRUE(w.ok()) << w.status();
  OuterDevice device(absl::Seconds(1), /*pinned_host=*/false, nullptr);
  WeightedInput copy(&device);
  absl::StatusOr<std::vector<TensorView>> filled = copy.Fill(*w, p.views, nullptr);
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(filled.status().message(), HasSubstr("MODELAVG_WITH_CUDA=ON"));
}

}  // namespace
}  // namespace modelavg::client
