// A paced round's weighted contribution through the client's own round code (RoundRunner and
// StreamingLevel, client/averaging/), against an in-process coordinator, ranks as threads. The
// coordinator does not plan paced rounds yet, so each rank takes its ordinary decision from the
// client and adds the weights (and round index) a paced decision would carry; everything after
// that is the client's: the weight check, the weighted copy, the Gloo round, the write-back.
// Checked against sum_i w_i x_i / W recomputed here in double: a plain level; an outer level
// with INT8 and error feedback over three syncs (the residual kept from the weighted U); and
// the caller's tensors untouched, bit for bit, when the weights are invalid or the round fails;
// and a streaming level's error feedback on CUDA parameters, still refused.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/averaging/round_runner.h"
#include "client/averaging/streaming_level.h"
#include "client/outer/outer_device.h"
#include "client/rpc/coordinator_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/client/client.h"
#include "server/coordinator_server.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/time_scale.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::Scaled;
using ::testing::HasSubstr;

constexpr int kWorld = 3;
const std::vector<double> kWeights = {20, 29, 45};

std::vector<float> Random(int seed, int64_t numel, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(numel);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<double> NaiveWeightedMean(const std::vector<std::vector<float>>& xs,
                                      const std::vector<double>& w) {
  std::vector<double> out(xs[0].size(), 0.0);
  double total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    total += w[i];
    for (size_t j = 0; j < out.size(); ++j) out[j] += w[i] * double{xs[i][j]};
  }
  for (double& v : out) v /= total;
  return out;
}

void OnRanks(const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

RoundRunner::Hooks NoHooks() {
  return RoundRunner::Hooks{
      [](const Decision&, Communicator*, absl::Span<const TensorView>) {
        return absl::OkStatus();
      },
      [](int64_t) {}};
}

class PacedRoundTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerOptions opts;
    opts.listen = "127.0.0.1:0";
    opts.defaults.heartbeat_timeout = Scaled(absl::Seconds(2));
    auto s = server::CoordinatorServer::Start(opts);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ConnectionOptions copts;
    copts.coordinator = server_->address();
    auto c = CoordinatorClient::Create(copts);
    ASSERT_TRUE(c.ok());
    admin_ = *std::move(c);
  }

  void Start(const v1::JobSpec& spec, absl::Duration collective_timeout) {
    auto job = admin_->CreateJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
    clients_.resize(kWorld);
    OnRanks([&](int r) {
      ClientOptions o;
      o.coordinator = server_->address();
      o.job_id = spec.job_id();
      o.rank = r;
      o.join_timeout = Scaled(absl::Seconds(20));
      o.collective_timeout = collective_timeout;
      o.rpc_timeout = Scaled(o.rpc_timeout);
      o.heartbeat_interval = absl::Milliseconds(50);
      o.tokens_per_step = 1 + r;
      auto c = Client::Connect(o);
      EXPECT_TRUE(c.ok()) << c.status();
      if (c.ok()) clients_[r] = *std::move(c);
    });
    for (auto& c : clients_) ASSERT_NE(c, nullptr);
  }

  // Rank r's decision at `step` with a paced round's index and weights.
  Decision Paced(int r, int64_t step, std::vector<double> weights) {
    absl::StatusOr<Decision> d = clients_[r]->DecisionAt(step);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return Decision{};
    EXPECT_TRUE(d->average);
    d->round = step;
    d->weights = std::move(weights);
    return *d;
  }

  // Per rank, as ModelAverager builds them: the averager's device, the pseudo-gradient buffer, a
  // RoundRunner and a StreamingLevel over them (freed in the reverse order).
  struct StreamingLevels {
    std::vector<Traffic> traffic = std::vector<Traffic>(kWorld);
    std::vector<std::unique_ptr<OuterDevice>> devices;
    std::vector<std::unique_ptr<OuterBuffer>> gradients;
    std::vector<std::unique_ptr<RoundRunner>> runners;
    std::vector<std::unique_ptr<StreamingLevel>> levels;
  };
  // `open(r)`: rank r's device factory (null: a build without CUDA).
  std::unique_ptr<StreamingLevels> MakeStreamingLevels(
      const std::function<LocalDeviceFactory(int r)>& open = nullptr) {
    auto out = std::make_unique<StreamingLevels>();
    for (int r = 0; r < kWorld; ++r) {
      out->devices.push_back(std::make_unique<OuterDevice>(absl::Seconds(10), false,
                                                           open ? open(r) : nullptr));
      out->gradients.push_back(std::make_unique<OuterBuffer>());
      out->runners.push_back(std::make_unique<RoundRunner>(
          clients_[r].get(), &out->traffic[r], out->devices[r].get(), NoHooks()));
      out->levels.push_back(std::make_unique<StreamingLevel>(
          clients_[r].get(), out->devices[r].get(), out->gradients[r].get(),
          out->runners[r].get(), &out->traffic[r]));
    }
    return out;
  }

  std::unique_ptr<server::CoordinatorServer> server_;
  std::unique_ptr<CoordinatorClient> admin_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_F(PacedRoundTest, PlainLevel_RoundRunner_WeightedMean_ThenFailures_LeaveTensorsUntouched) {
  Start(testing::MakeSpec("paced-plain", kWorld, v1::PERIODIC, {{1, kWorld}}, 0),
        Scaled(absl::Seconds(2)));
  const int64_t numel = 2500;
  std::vector<std::vector<float>> inputs, params(kWorld);
  for (int r = 0; r < kWorld; ++r) inputs.push_back(Random(20 + r, numel, 1.0f + r));
  std::vector<Traffic> traffic(kWorld);
  std::vector<std::unique_ptr<RoundRunner>> runners;
  for (int r = 0; r < kWorld; ++r) {
    runners.push_back(std::make_unique<RoundRunner>(clients_[r].get(), &traffic[r],
                                                    /*device=*/nullptr, NoHooks()));
  }
  const auto views = [&](int r) {
    return std::vector<TensorView>{
        TensorView{params[r].data(), 700, DType::kFloat32},
        TensorView{params[r].data() + 700, numel - 700, DType::kFloat32}};
  };
  std::vector<absl::Status> status(kWorld);

  // 1. A weighted round: the weighted mean.
  OnRanks([&](int r) {
    params[r] = inputs[r];
    status[r] = runners[r]->Run(Paced(r, 0, kWeights), Device::Host(), views(r), RoundWire{})
                    .status();
  });
  const std::vector<double> expected = NaiveWeightedMean(inputs, kWeights);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(std::memcmp(params[r].data(), params[0].data(), numel * sizeof(float)), 0);
    for (int64_t j = 0; j < numel; ++j) {
      double terms = 0;
      for (int i = 0; i < kWorld; ++i) terms += std::fabs(double{inputs[i][j]});
      ASSERT_NEAR(params[r][j], expected[j], 1e-6 * terms + 1e-30) << "rank " << r << " " << j;
    }
  }

  // 2. Invalid weights: INVALID_ARGUMENT on every rank before any collective, nothing written.
  const std::vector<std::vector<float>> after_first = params;
  for (const std::vector<double>& bad :
       std::vector<std::vector<double>>{{1, 2}, {1, -1, 1}, {0, 0, 0}, {1, NAN, 1}}) {
    OnRanks([&](int r) {
      status[r] =
          runners[r]->Run(Paced(r, 1, bad), Device::Host(), views(r), RoundWire{}).status();
    });
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument) << status[r];
      EXPECT_THAT(status[r].message(), HasSubstr("the weights of round 1"));
      EXPECT_EQ(params[r], after_first[r]) << "rank " << r;
    }
  }

  // 3. A weighted round that fails (rank 2 never comes): ranks 0 and 1 fail, their tensors as
  // they were, bit for bit (the weighted copy is what the round used).
  for (int r = 0; r < kWorld; ++r) {
    for (float& v : params[r]) v += 0.125f * (r + 1);
  }
  const std::vector<std::vector<float>> before_failure = params;
  std::vector<std::thread> two;
  for (int r = 0; r < 2; ++r) {
    two.emplace_back([&, r] {
      status[r] = runners[r]->Run(Paced(r, 1, kWeights), Device::Host(), views(r), RoundWire{})
                      .status();
    });
  }
  for (auto& t : two) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(status[r].ok()) << "rank " << r;
    EXPECT_EQ(std::memcmp(params[r].data(), before_failure[r].data(), numel * sizeof(float)), 0)
        << "rank " << r << "'s parameters changed in a failed round: " << status[r];
  }
}

// An elastic job: every round is committed (RoundRunner::RunElastic), and the weighted copy is
// written back once the commit is confirmed.
TEST_F(PacedRoundTest, ElasticJob_CommittedRound_WeightedMean) {
  v1::JobSpec spec = testing::MakeSpec("paced-elastic", kWorld, v1::PERIODIC, {{1, kWorld}}, 0);
  spec.set_min_world_size(2);
  Start(spec, Scaled(absl::Seconds(20)));
  ASSERT_TRUE(clients_[0]->elastic());
  const int64_t numel = 1500;
  std::vector<std::vector<float>> inputs, params(kWorld);
  for (int r = 0; r < kWorld; ++r) inputs.push_back(Random(70 + r, numel, 2.0f));
  std::vector<Traffic> traffic(kWorld);
  std::vector<absl::Status> status(kWorld);
  OnRanks([&](int r) {
    RoundRunner runner(clients_[r].get(), &traffic[r], /*device=*/nullptr, NoHooks());
    params[r] = inputs[r];
    std::vector<TensorView> x = {TensorView{params[r].data(), numel, DType::kFloat32}};
    status[r] = runner.Run(Paced(r, 0, kWeights), Device::Host(), x, RoundWire{}).status();
  });
  const std::vector<double> expected = NaiveWeightedMean(inputs, kWeights);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t j = 0; j < numel; ++j) {
      double terms = 0;
      for (int i = 0; i < kWorld; ++i) terms += std::fabs(double{inputs[i][j]});
      ASSERT_NEAR(params[r][j], expected[j], 1e-6 * terms + 1e-30) << "rank " << r << " " << j;
    }
  }
}

// An outer level with INT8 and error feedback (a streaming outer level: its payload), lr 1 and
// no momentum, so that x := A - mean(U): sync 0 is a weighted plain average (the anchor), sync
// 1 the weighted mean of the members' parameters within the INT8 bound, sync 2 A - mean(U) with
// U = beta E + s D, E each member's residual from sync 1.
TEST_F(PacedRoundTest, OuterInt8ErrorFeedback_StreamingLevel_WeightedMean) {
  v1::JobSpec spec = testing::MakeSpec("paced-outer", kWorld, v1::PERIODIC, {{1, kWorld}}, 0);
  testing::SetOuter(&spec, 0, 1.0, 0.0, false);
  spec.mutable_levels(0)->set_payload(v1::INT8);
  spec.mutable_levels(0)->set_error_feedback(0.5);
  Start(spec, Scaled(absl::Seconds(20)));
  const int64_t numel = 2 * 1024 + 77;
  const double beta = 0.5;
  const std::unique_ptr<StreamingLevels> parts = MakeStreamingLevels();
  const std::vector<std::unique_ptr<StreamingLevel>>& levels = parts->levels;
  std::vector<std::vector<float>> params(kWorld);
  for (int r = 0; r < kWorld; ++r) params[r] = Random(40 + r, numel, 1.0f);
  const std::vector<std::vector<double>> weights = {{3, 1, 2}, {20, 29, 45}, {20, 31, 40}};
  std::vector<float> anchor;
  for (int64_t step = 0; step < 3; ++step) {
    SCOPED_TRACE(::testing::Message() << "sync " << step);
    std::vector<std::vector<float>> before = params;
    if (step > 0) {
      // Each member's inner steps move it away from the common anchor by its own amount.
      for (int r = 0; r < kWorld; ++r) {
        const std::vector<float> delta = Random(100 * step + r, numel, 0.05f * (r + 1));
        for (int64_t j = 0; j < numel; ++j) before[r][j] = anchor[j] - delta[j];
      }
    }
    std::vector<std::vector<float>> residual_before(kWorld, std::vector<float>(numel, 0.0f));
    for (int r = 0; r < kWorld && step > 0; ++r) {
      const OuterLevelState& s = *levels[r]->states()[0][0];
      if (!s.has_residual()) continue;
      std::vector<StateTensor> e = s.ResidualTensors();
      std::memcpy(residual_before[r].data(), e[0].bytes.data(), numel * sizeof(float));
    }
    std::vector<absl::Status> status(kWorld);
    OnRanks([&](int r) {
      params[r] = before[r];
      std::vector<TensorView> x = {TensorView{params[r].data(), numel, DType::kFloat32}};
      status[r] = levels[r]
                      ->Round(Paced(r, step, weights[step]), Device::Host(), x, 0)
                      .status();
    });
    double total = 0;
    for (double w : weights[step]) total += w;
    std::vector<double> want(numel, 0.0);
    double bound = 0;
    if (step == 0) {
      want = NaiveWeightedMean(before, weights[step]);
    } else {
      // mean(U) with U = fl32(beta E + fl32(s D)), D = A - x; the outer step x := A - mean(U).
      std::vector<double> mean_u(numel, 0.0);
      double big = 0;
      for (int r = 0; r < kWorld; ++r) {
        const double s = kWorld * weights[step][r] / total;
        for (int64_t j = 0; j < numel; ++j) {
          const float d = anchor[j] - before[r][j];
          const float u = static_cast<float>(beta * double{residual_before[r][j]} +
                                             double{static_cast<float>(s * double{d})});
          mean_u[j] += double{u} / kWorld;
          big = std::max(big, double{std::fabs(u)});
        }
      }
      for (int64_t j = 0; j < numel; ++j) want[j] = double{anchor[j]} - mean_u[j];
      // INT8 (docs/streaming.md): 2 max_i M_i / 254 per element, bounded by the largest |U|.
      bound = 2 * big / 254 * 1.001;
      if (step == 1) {
        // No residual yet: A - mean(U) is the weighted mean of the parameters.
        const std::vector<double> weighted = NaiveWeightedMean(before, weights[step]);
        for (int64_t j = 0; j < numel; ++j) {
          ASSERT_NEAR(want[j], weighted[j], 1e-6 * (1 + std::fabs(weighted[j]))) << j;
        }
      }
    }
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
      EXPECT_EQ(std::memcmp(params[r].data(), params[0].data(), numel * sizeof(float)), 0)
          << "rank " << r;
      for (int64_t j = 0; j < numel; ++j) {
        ASSERT_NEAR(params[r][j], want[j], bound + 1e-6 * (1 + std::fabs(want[j])))
            << "rank " << r << " element " << j;
      }
      if (step > 0) {
        EXPECT_TRUE(levels[r]->states()[0][0]->has_residual()) << "rank " << r;
      }
    }
    anchor = params[0];
  }
}

// sync_delay 1 (strict job): the background sync started at a paced step averages the buffer
// weighted at its start, and the call one step later applies it: sync 0 the weighted mean of
// the parameters, sync 1 (INT8, lr 1, no momentum) within the INT8 bound of it.
TEST_F(PacedRoundTest, DelayedSync_StrictJob_AppliesTheWeightedMean) {
  v1::JobSpec spec = testing::MakeSpec("paced-delayed", kWorld, v1::PERIODIC, {{2, kWorld}}, 0);
  testing::SetOuter(&spec, 0, 1.0, 0.0, false);
  spec.mutable_levels(0)->set_payload(v1::INT8);
  spec.mutable_levels(0)->set_sync_delay(1);
  Start(spec, Scaled(absl::Seconds(20)));
  const int64_t numel = 1024 + 300;
  const std::unique_ptr<StreamingLevels> parts = MakeStreamingLevels();
  const std::vector<std::unique_ptr<StreamingLevel>>& levels = parts->levels;
  std::vector<std::vector<float>> params(kWorld);
  for (int r = 0; r < kWorld; ++r) params[r] = Random(90 + r, numel, 1.0f);
  std::vector<float> anchor;
  for (int64_t sync = 0; sync < 2; ++sync) {
    SCOPED_TRACE(::testing::Message() << "sync " << sync);
    const int64_t step = 2 * sync;
    std::vector<std::vector<float>> before = params;
    if (sync > 0) {
      for (int r = 0; r < kWorld; ++r) {
        const std::vector<float> delta = Random(300 + r, numel, 0.05f * (r + 1));
        for (int64_t j = 0; j < numel; ++j) before[r][j] = anchor[j] - delta[j];
      }
    }
    std::vector<absl::Status> status(kWorld);
    OnRanks([&](int r) {
      params[r] = before[r];
      std::vector<TensorView> x = {TensorView{params[r].data(), numel, DType::kFloat32}};
      status[r] = levels[r]->Round(Paced(r, step, kWeights), Device::Host(), x, 0).status();
      if (!status[r].ok()) return;
      // The parameters are untouched until the apply step's call.
      if (params[r] != before[r]) status[r] = absl::InternalError("written before its apply step");
      if (status[r].ok()) status[r] = levels[r]->ApplyDue(step + 1, x, step + 2);
    });
    const std::vector<double> want = NaiveWeightedMean(before, kWeights);
    double bound = 0;
    if (sync > 0) {
      double total = 0;
      for (double w : kWeights) total += w;
      for (int r = 0; r < kWorld; ++r) {
        for (int64_t j = 0; j < numel; ++j) {
          const double u = kWorld * kWeights[r] / total * (double{anchor[j]} - before[r][j]);
          bound = std::max(bound, std::fabs(u));
        }
      }
      bound = 2 * bound / 254 * 1.01;
    }
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
      for (int64_t j = 0; j < numel; ++j) {
        ASSERT_NEAR(params[r][j], want[j], bound + 2e-6 * (1 + std::fabs(want[j])))
            << "rank " << r << " element " << j;
      }
    }
    anchor = params[0];
  }
}

// A streaming level with error feedback on CUDA parameters: the device adds beta E to the
// unscaled pseudo-gradient, so a paced round there is refused, naming the field, before any
// round runs or anything of the parameters changes (the device is the simulated one).
TEST_F(PacedRoundTest, ErrorFeedbackOnCudaParameters_Unimplemented_ParametersUntouched) {
  v1::JobSpec spec = testing::MakeSpec("paced-feedback-cuda", kWorld, v1::PERIODIC,
                                       {{1, kWorld}}, 0);
  testing::SetOuter(&spec, 0, 1.0, 0.0, false);
  spec.mutable_levels(0)->set_payload(v1::INT8);
  spec.mutable_levels(0)->set_error_feedback(0.5);
  Start(spec, Scaled(absl::Seconds(5)));
  std::vector<FakeOps*> opened(kWorld, nullptr);
  const std::unique_ptr<StreamingLevels> parts =
      MakeStreamingLevels([&](int r) { return FakeLocalDevice(r, &opened[r]); });
  const std::vector<std::unique_ptr<StreamingLevel>>& levels = parts->levels;
  for (int r = 0; r < kWorld; ++r) {
    Params p = Params::Separate({{DType::kFloat32, 64}});
    p.Fill(r);
    const std::string before(static_cast<const char*>(p.views[0].data), p.views[0].nbytes());
    const absl::Status s =
        levels[r]->Round(Paced(r, 0, kWeights), Device::Cuda(0), p.views, 0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_THAT(s.message(), HasSubstr("error_feedback"));
    EXPECT_THAT(s.message(), HasSubstr("cuda:0"));
    EXPECT_EQ(std::string(static_cast<const char*>(p.views[0].data), p.views[0].nbytes()),
              before);
    ASSERT_NE(opened[r], nullptr);
    EXPECT_TRUE(opened[r]->ops.empty()) << "rank " << r << " ran a collective";
  }
}

}  // namespace
}  // namespace modelavg::client
