// A paced round's weighted contribution (client/averaging/round_weights.h), ranks as threads over
// a Gloo mesh: each member weighs its contribution as RoundRunner does (WeightOf, then the round
// on WeightedInput's copy, the result written back by Finish) with a crafted paced Decision,
// since the coordinator does not plan paced rounds yet. The result is checked against the
// weighted mean sum_i w_i x_i / sum_i w_i recomputed here in double: on a plain level (FP32),
// and on an outer level with INT8 and error feedback (the streaming level's WeighWithFeedback,
// then the outer step), where the residual is also checked against the naive codec.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "client/averaging/round_weights.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/outer/outer_state.h"
#include "client/payload/payload_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/paced_decision.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::PacedDecision;
using ::testing::HasSubstr;

void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::vector<float> Random(int seed, int64_t numel, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(numel);
  for (float& v : x) v = normal(rng);
  return x;
}


// sum_i w_i x_i[j] / sum_i w_i over the contributing members, in double.
std::vector<double> NaiveWeightedMean(const std::vector<std::vector<float>>& xs,
                                      const std::vector<double>& w,
                                      const std::vector<bool>& contributes) {
  std::vector<double> out(xs[0].size(), 0.0);
  double total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!contributes[i]) continue;
    total += w[i];
    for (size_t j = 0; j < out.size(); ++j) out[j] += w[i] * double{xs[i][j]};
  }
  for (double& v : out) v /= total;
  return out;
}

TEST(RoundWeights, ScaleIsCountTimesShare) {
  const Decision d = PacedDecision({20, 29, 45});
  for (int32_t r = 0; r < 3; ++r) {
    absl::StatusOr<RoundWeight> w = WeightOf(d, r);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->weighted);
    EXPECT_EQ(w->contributors, 3);
    EXPECT_DOUBLE_EQ(w->total, 94);
    EXPECT_DOUBLE_EQ(w->weight, d.weights[r]);
    EXPECT_DOUBLE_EQ(w->scale, 3 * d.weights[r] / 94);
  }
  // No weights: nothing to apply (the round is today's).
  Decision plain = d;
  plain.weights.clear();
  absl::StatusOr<RoundWeight> none = WeightOf(plain, 1);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->weighted);
  EXPECT_EQ(none->scale, 1);
}

TEST(RoundWeights, JoiningMemberIsNoPartOfTheTotal) {
  Decision d = PacedDecision({20, 0, 45});
  d.joining = {1};
  absl::StatusOr<RoundWeight> joining = WeightOf(d, 1);
  ASSERT_TRUE(joining.ok()) << joining.status();
  EXPECT_EQ(joining->scale, 0);
  EXPECT_EQ(joining->contributors, 2);
  EXPECT_DOUBLE_EQ(joining->total, 65);
  absl::StatusOr<RoundWeight> other = WeightOf(d, 2);
  ASSERT_TRUE(other.ok());
  EXPECT_DOUBLE_EQ(other->scale, 2 * 45.0 / 65);
}

TEST(RoundWeights, InvalidWeightsAreRefused) {
  struct Case {
    std::vector<double> weights;
    const char* says;
  } cases[] = {
      {{1, 2}, "2 weights for 3 members"},
      {{1, 2, 3, 4}, "4 weights for 3 members"},
      {{1, std::nan(""), 3}, "rank 1's weight is nan"},
      {{1, INFINITY, 3}, "rank 1's weight is inf"},
      {{1, -2, 3}, "rank 1's weight is -2"},
      {{0, 0, 0}, "sum to 0"},
      {{1e308, 1e308, 1e308}, "sum to inf"},
  };
  for (const Case& c : cases) {
    Decision d = PacedDecision({1, 1, 1});  // ranks 0, 1, 2
    d.weights = c.weights;
    absl::StatusOr<RoundWeight> w = WeightOf(d, 0);
    ASSERT_FALSE(w.ok()) << c.says;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
    EXPECT_THAT(w.status().message(), HasSubstr(c.says));
  }
  absl::StatusOr<RoundWeight> stranger = WeightOf(PacedDecision({1, 2, 3}), 7);
  ASSERT_FALSE(stranger.ok());
  EXPECT_THAT(stranger.status().message(), HasSubstr("rank 7 is not among"));
}

// CUDA tensors are weighted on the averager's device (client_nccl_paced_test.cc); a copy made
// without one refuses them, saying what is missing, and leaves them as they were.
TEST(RoundWeights, DeviceTensorsWithoutADeviceAreRefusedClearly) {
  std::vector<float> x(4, 1.0f);
  TensorView t{x.data(), 4, DType::kFloat32, Device::Cuda(0)};
  WeightedInput copy;
  absl::StatusOr<RoundWeight> w = WeightOf(PacedDecision({1, 2, 3}), 0);
  ASSERT_TRUE(w.ok());
  absl::StatusOr<std::vector<TensorView>> filled = copy.Fill(*w, {t}, nullptr);
  ASSERT_FALSE(filled.ok());
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(filled.status().message(), HasSubstr("CUDA device"));
  EXPECT_EQ(x[0], 1.0f);
}

TEST(RoundWeights, BudgetSpentAtTheLastRoundOfTheLastPacedLevel) {
  std::vector<ScheduleLevel> levels(2);
  levels[0].period = 2;
  levels[0].group_size = 2;
  levels[1].period = 20;
  levels[1].group_size = 4;
  levels[1].paced = true;
  levels[1].rounds = 5;
  Decision d = PacedDecision({1, 2, 3, 4});
  d.level = 1;
  for (int64_t r = 0; r < 4; ++r) {
    d.round = r;
    EXPECT_FALSE(CompletesPacedBudget(levels, d)) << "round " << r;
  }
  d.round = 4;  // rounds - 1: the job's last round
  EXPECT_TRUE(CompletesPacedBudget(levels, d));
  d.round = 6;
  EXPECT_TRUE(CompletesPacedBudget(levels, d));
  // Not the paced level, not a paced decision, a skip, an unbounded or unpaced last level.
  Decision lower = d;
  lower.level = 0;
  EXPECT_FALSE(CompletesPacedBudget(levels, lower));
  Decision unpaced = d;
  unpaced.round = -1;
  EXPECT_FALSE(CompletesPacedBudget(levels, unpaced));
  Decision skip = d;
  skip.average = false;
  EXPECT_FALSE(CompletesPacedBudget(levels, skip));
  std::vector<ScheduleLevel> unbounded = levels;
  unbounded[1].rounds = 0;
  EXPECT_FALSE(CompletesPacedBudget(unbounded, d));
  std::vector<ScheduleLevel> step_locked = levels;
  step_locked[1].paced = false;
  EXPECT_FALSE(CompletesPacedBudget(step_locked, d));
}

// A plain level: the members' parameters become their weighted mean; the copy is what the
// round writes, so the parameters hold the caller's values until Finish.
TEST(PacedGlooRound, PlainLevelIsTheWeightedMean) {
  const int n = 3;
  const int64_t numel = 3000;
  const std::vector<double> weights = {20, 29, 45};
  const Decision decision = PacedDecision(weights);
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> inputs, params(n);
  for (int r = 0; r < n; ++r) inputs.push_back(Random(10 + r, numel, 1.0f + r));
  std::vector<absl::Status> status(n);
  std::vector<bool> untouched_during_round(n, false);
  OnRanks(n, [&](int r) {
    params[r] = inputs[r];
    // Two tensors, so that the copy has the same list layout as the caller's.
    std::vector<TensorView> t = {TensorView{params[r].data(), 1000, DType::kFloat32},
                                 TensorView{params[r].data() + 1000, numel - 1000,
                                            DType::kFloat32}};
    absl::StatusOr<RoundWeight> w = WeightOf(decision, r);
    if (!w.ok()) {
      status[r] = w.status();
      return;
    }
    WeightedInput copy;
    absl::StatusOr<std::vector<TensorView>> round = copy.Fill(*w, t, nullptr);
    if (!round.ok()) {
      status[r] = round.status();
      return;
    }
    RoundOptions o;
    o.contributors = w->contributors;
    status[r] = mesh[r]->AllReduceAverage(*round, o, nullptr);
    untouched_during_round[r] = params[r] == inputs[r];
    if (status[r].ok()) status[r] = copy.Finish(t);
  });
  const std::vector<double> expected =
      NaiveWeightedMean(inputs, weights, std::vector<bool>(n, true));
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_TRUE(untouched_during_round[r]) << "rank " << r;
    EXPECT_EQ(std::memcmp(params[r].data(), params[0].data(), numel * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
    for (int64_t j = 0; j < numel; ++j) {
      // float32: each product rounded once, the sum of three in float32, one division.
      double scale_of_terms = 0;
      for (int i = 0; i < n; ++i) scale_of_terms += std::fabs(double{inputs[i][j]});
      ASSERT_NEAR(params[r][j], expected[j], 1e-6 * scale_of_terms + 1e-30)
          << "rank " << r << " element " << j;
    }
  }
  // Not the unweighted mean: the weights changed the result.
  double max_diff = 0;
  for (int64_t j = 0; j < numel; ++j) {
    const double plain = (double{inputs[0][j]} + inputs[1][j] + inputs[2][j]) / 3;
    max_diff = std::max(max_diff, std::fabs(params[0][j] - plain));
  }
  EXPECT_GT(max_diff, 0.1);
}

// A joining member contributes nothing and receives the weighted mean of the others.
TEST(PacedGlooRound, JoiningMemberReceivesTheOthersWeightedMean) {
  const int n = 3;
  const int64_t numel = 777;
  const std::vector<double> weights = {5, 0, 15};
  Decision decision = PacedDecision(weights);
  decision.joining = {1};
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<std::vector<float>> inputs, params(n);
  for (int r = 0; r < n; ++r) inputs.push_back(Random(50 + r, numel, 2.0f));
  std::vector<absl::Status> status(n);
  OnRanks(n, [&](int r) {
    params[r] = inputs[r];
    std::vector<TensorView> t = {TensorView{params[r].data(), numel, DType::kFloat32}};
    absl::StatusOr<RoundWeight> w = WeightOf(decision, r);
    if (!w.ok()) {
      status[r] = w.status();
      return;
    }
    WeightedInput copy;
    absl::StatusOr<std::vector<TensorView>> round = copy.Fill(*w, t, nullptr);
    if (!round.ok()) {
      status[r] = round.status();
      return;
    }
    RoundOptions o;
    o.contributors = w->contributors;
    o.contribute = r != 1;
    status[r] = mesh[r]->AllReduceAverage(*round, o, nullptr);
    if (status[r].ok()) status[r] = copy.Finish(t);
  });
  const std::vector<double> expected = NaiveWeightedMean(inputs, weights, {true, false, true});
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    for (int64_t j = 0; j < numel; ++j) {
      ASSERT_NEAR(params[r][j], expected[j],
                  1e-6 * (std::fabs(inputs[0][j]) + std::fabs(inputs[2][j])) + 1e-30)
          << "rank " << r << " element " << j;
    }
  }
}

// An outer level with INT8 and error feedback, two rounds. Outer SGD with lr 1 and no momentum
// makes the outer step x := A - mean(U) (A the common anchor), so with no residual yet (round 0)
// the result is the weighted mean of the members' parameters sum_i w_i x_i / W, within the INT8
// bound; in round 1 it is A - (1/k) sum_i U_i with U_i = beta E_i + s_i D_i, the residual E_i
// each member kept from round 0. Checked here: each member's U against that rule restated, its
// new residual within INT8's rounding of U, and the result against the naive mean.
TEST(PacedGlooRound, OuterLevelInt8WithErrorFeedbackIsTheWeightedMean) {
  const int n = 3;
  const int64_t numel = 2 * kInt8Block + 100;
  const double beta = 0.9;
  const WireFormat format(Payload::kInt8);
  auto mesh = MakeGlooMesh(n, absl::Seconds(30));
  for (auto& c : mesh) ASSERT_NE(c, nullptr);
  std::vector<float> anchor = Random(7, numel, 1.0f);
  std::vector<std::unique_ptr<OuterLevelState>> states;
  for (int r = 0; r < n; ++r) {
    states.push_back(std::make_unique<OuterLevelState>(0, OuterSgd{1.0, 0.0, false}));
    std::vector<float> a = anchor;
    ASSERT_TRUE(states[r]->SetAnchor({TensorView{a.data(), numel, DType::kFloat32}}).ok());
  }
  const std::vector<std::vector<double>> round_weights = {{20, 29, 45}, {20, 31, 40}};
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const std::vector<double>& weights = round_weights[round];
    const Decision decision = PacedDecision(weights);
    std::vector<std::vector<float>> before(n), params(n), residual_before(n), sent(n);
    for (int r = 0; r < n; ++r) {
      // Each member's inner steps moved it from the anchor by its own amount.
      const std::vector<float> delta = Random(100 * round + r, numel, 0.05f * (r + 1));
      before[r] = anchor;
      for (int64_t j = 0; j < numel; ++j) before[r][j] -= delta[j];
      residual_before[r].assign(numel, 0.0f);
      if (states[r]->has_residual()) {
        std::vector<StateTensor> e = states[r]->ResidualTensors();
        std::memcpy(residual_before[r].data(), e[0].bytes.data(), numel * sizeof(float));
      }
    }
    std::vector<absl::Status> status(n);
    OnRanks(n, [&](int r) {
      params[r] = before[r];
      std::vector<TensorView> x = {TensorView{params[r].data(), numel, DType::kFloat32}};
      OuterBuffer d_buf;
      d_buf.Shape(x);
      std::vector<TensorView> d = d_buf.Views();
      status[r] = states[r]->PseudoGradient(0, x, d);
      if (!status[r].ok()) return;
      absl::StatusOr<RoundWeight> w = WeightOf(decision, r);
      if (!w.ok()) {
        status[r] = w.status();
        return;
      }
      OuterBuffer residual;
      WeightedInput copy;
      absl::StatusOr<std::vector<TensorView>> u =
          copy.Fill(*w, d, [&](double scale, absl::Span<const TensorView> out) {
            return WeighWithFeedback(*states[r], beta, format, d, scale, out, &residual);
          });
      if (!u.ok()) {
        status[r] = u.status();
        return;
      }
      const float* sent_data = static_cast<const float*>((*u)[0].data);
      sent[r].assign(sent_data, sent_data + numel);
      RoundOptions o;
      o.payload = Payload::kInt8;
      o.contributors = w->contributors;
      status[r] = mesh[r]->AllReduceAverage(*u, o, nullptr);
      if (!status[r].ok()) return;
      status[r] = copy.Finish(d);
      if (!status[r].ok()) return;
      states[r]->SwapResidual(std::move(residual), true);
      status[r] = states[r]->Step(0, d, x);
    });
    double total = 0;
    for (double w : weights) total += w;
    std::vector<double> expected(numel, 0.0);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
      const double s = n * weights[r] / total;
      // U = fl32(beta E + fl32(s D)), D = fl32(A - x): the rule, bit for bit.
      for (int64_t j = 0; j < numel; ++j) {
        const float d = anchor[j] - before[r][j];
        const float sd = static_cast<float>(s * double{d});
        const float u = static_cast<float>(beta * double{residual_before[r][j]} + double{sd});
        ASSERT_EQ(sent[r][j], u) << "rank " << r << " element " << j;
        expected[j] += double{u} / n;
      }
      // The residual it keeps: U - decode(encode(U)), INT8's rounding of U (half a step of
      // max|U| / 127 per block of 1024) and not all zero.
      std::vector<StateTensor> e = states[r]->ResidualTensors();
      ASSERT_EQ(e.size(), 1u);
      const float* residual = reinterpret_cast<const float*>(e[0].bytes.data());
      double residual_norm = 0;
      for (int64_t lo = 0; lo < numel; lo += kInt8Block) {
        const int64_t hi = std::min<int64_t>(numel, lo + kInt8Block);
        float big = 0;
        for (int64_t j = lo; j < hi; ++j) big = std::max(big, std::fabs(sent[r][j]));
        for (int64_t j = lo; j < hi; ++j) {
          ASSERT_LE(std::fabs(residual[j]), big / 254 * 1.001 + 1e-12)
              << "rank " << r << " element " << j;
          residual_norm += std::fabs(residual[j]);
        }
      }
      EXPECT_GT(residual_norm, 0) << "rank " << r;
    }
    if (round == 0) {
      // No residual yet: mean(U) = sum_i w_i D_i / W, so A - mean(U) = sum_i w_i x_i / W.
      const std::vector<double> weighted =
          NaiveWeightedMean(before, weights, std::vector<bool>(n, true));
      for (int64_t j = 0; j < numel; ++j) {
        ASSERT_NEAR(double{anchor[j]} - expected[j], weighted[j], 1e-6 * (1 + std::fabs(weighted[j])))
            << "element " << j;
      }
    }
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(std::memcmp(params[r].data(), params[0].data(), numel * sizeof(float)), 0)
          << "rank " << r << " differs from rank 0";
      for (int64_t lo = 0; lo < numel; lo += kInt8Block) {
        const int64_t hi = std::min<int64_t>(numel, lo + kInt8Block);
        // The INT8 bound of an averaged element (docs/streaming.md): 2 max_i M_i / 254, M_i
        // member i's largest |U| in the block.
        double big = 0;
        for (int i = 0; i < n; ++i) {
          for (int64_t j = lo; j < hi; ++j) big = std::max(big, double{std::fabs(sent[i][j])});
        }
        for (int64_t j = lo; j < hi; ++j) {
          const double want = double{anchor[j]} - expected[j];
          ASSERT_NEAR(params[r][j], want, 2 * big / 254 * 1.001 + 1e-6 * (1 + std::fabs(want)))
              << "rank " << r << " element " << j;
        }
      }
    }
    // Every member's anchor is the result (lr 1): the next round starts from it.
    anchor = params[0];
  }
}

}  // namespace
}  // namespace modelavg::client
