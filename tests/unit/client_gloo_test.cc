// GlooCommunicator with ranks as threads over loopback, rendezvous through Gloo's in-memory
// HashStore (the coordinator-backed store is covered by client_coordinator_test).
#include "client/gloo_communicator.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/half.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// Runs fn(rank, communicator) on `size` threads after a rendezvous; returns each rank's status.
std::vector<absl::Status> RunRanks(int size, absl::Duration timeout,
                                   const std::function<absl::Status(int, GlooCommunicator&)>& fn) {
  gloo::rendezvous::HashStore store;
  std::vector<absl::Status> out(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto dev = CreateGlooDevice("127.0.0.1");
      if (!dev.ok()) {
        out[r] = dev.status();
        return;
      }
      auto comm = GlooCommunicator::Create(store, *dev, r, size, timeout);
      if (!comm.ok()) {
        out[r] = comm.status();
        return;
      }
      out[r] = fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(GlooCommunicatorTest, AllReduceAverage_FourRanks_EveryRankGetsTheMean) {
  std::vector<std::vector<float>> got(4);
  auto statuses = RunRanks(4, absl::Seconds(20), [&](int r, GlooCommunicator& c) {
    std::vector<float> v = {static_cast<float>(r), static_cast<float>(10 * r), 1.0f};
    TensorView t{v.data(), 3, DType::kFloat32};
    absl::Status s = c.AllReduceAverage({t});
    got[r] = v;
    return s;
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    EXPECT_THAT(got[r], ::testing::ElementsAre(1.5f, 15.0f, 1.0f));
  }
}

TEST(GlooCommunicatorTest, AllReduceAverage_ManyMixedTensors_OneCallAveragesAll) {
  struct Result {
    std::vector<float> a;
    std::vector<double> b;
    std::vector<uint16_t> h, bf;
  };
  std::vector<Result> res(2);
  auto statuses = RunRanks(2, absl::Seconds(20), [&](int r, GlooCommunicator& c) {
    Result& x = res[r];
    x.a.assign(1000, static_cast<float>(r + 1));
    x.b.assign(7, 1.0 / 3.0 + r);
    x.h.assign(5, FloatToHalf(2.0f * r));
    x.bf.assign(3, FloatToBFloat16(4.0f * r));
    std::vector<TensorView> views = {
        {x.a.data(), 1000, DType::kFloat32}, {nullptr, 0, DType::kFloat32},
        {x.b.data(), 7, DType::kFloat64},    {x.h.data(), 5, DType::kFloat16},
        {x.bf.data(), 3, DType::kBFloat16}};
    return c.AllReduceAverage(views);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    EXPECT_THAT(res[r].a, ::testing::Each(1.5f));
    EXPECT_THAT(res[r].b, ::testing::Each(::testing::DoubleNear(1.0 / 3.0 + 0.5, 1e-15)));
    for (uint16_t h : res[r].h) EXPECT_EQ(HalfToFloat(h), 1.0f);
    for (uint16_t b : res[r].bf) EXPECT_EQ(BFloat16ToFloat(b), 2.0f);
  }
}

TEST(GlooCommunicatorTest, AllReduceAverage_EmptyList_IsOk) {
  auto statuses = RunRanks(2, absl::Seconds(20), [&](int, GlooCommunicator& c) {
    absl::Status s = c.AllReduceAverage({});
    if (!s.ok()) return s;
    return c.AllReduceAverage({});
  });
  for (const auto& s : statuses) EXPECT_TRUE(s.ok()) << s;
}

TEST(GlooCommunicatorTest, AllReduceAverage_RepeatedCalls_ReuseTheMesh) {
  std::vector<float> last(3);
  auto statuses = RunRanks(3, absl::Seconds(20), [&](int r, GlooCommunicator& c) {
    std::vector<float> v(64, static_cast<float>(r));
    for (int i = 0; i < 5; ++i) {
      v.assign(64, static_cast<float>(r * 3 + i));
      TensorView t{v.data(), 64, DType::kFloat32};
      absl::Status s = c.AllReduceAverage({t});
      if (!s.ok()) return s;
    }
    last[r] = v[0];
    return absl::OkStatus();
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    EXPECT_FLOAT_EQ(last[r], 3.0f + 4.0f);  // mean of 3r + 4 over r = 0..2
  }
}

TEST(GlooCommunicatorTest, AllReduceAverage_MismatchedSizes_ClearErrorAndUntouched) {
  std::vector<std::vector<float>> vals(2);
  auto statuses = RunRanks(2, absl::Seconds(20), [&](int r, GlooCommunicator& c) {
    vals[r].assign(r == 0 ? 4 : 5, 7.0f);
    TensorView t{vals[r].data(), static_cast<int64_t>(vals[r].size()), DType::kFloat32};
    return c.AllReduceAverage({t});
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << statuses[r];
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr("range from 4 to 5"));
    EXPECT_THAT(vals[r], ::testing::Each(7.0f));
  }
}

TEST(GlooCommunicatorTest, AllReduceAverage_PeerNeverJoinsCollective_DeadlineAndUntouched) {
  std::vector<float> v0(16, 3.0f);
  auto statuses = RunRanks(2, absl::Seconds(1), [&](int r, GlooCommunicator& c) {
    if (r == 1) return absl::OkStatus();  // never takes part
    TensorView t{v0.data(), 16, DType::kFloat32};
    return c.AllReduceAverage({t});
  });
  EXPECT_FALSE(statuses[0].ok());
  EXPECT_THAT(statuses[0].code(), ::testing::AnyOf(absl::StatusCode::kDeadlineExceeded,
                                                   absl::StatusCode::kUnavailable));
  EXPECT_THAT(v0, ::testing::Each(3.0f));
}

TEST(GlooCommunicatorTest, Create_PeerNeverArrives_DeadlineExceeded) {
  gloo::rendezvous::HashStore store;
  auto dev = CreateGlooDevice("127.0.0.1");
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto comm = GlooCommunicator::Create(store, *dev, 0, 2, absl::Milliseconds(300));
  EXPECT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
}

TEST(GlooCommunicatorTest, Create_BadRank_InvalidArgument) {
  gloo::rendezvous::HashStore store;
  auto dev = CreateGlooDevice("127.0.0.1");
  ASSERT_TRUE(dev.ok());
  EXPECT_EQ(GlooCommunicator::Create(store, *dev, 2, 2, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GlooCommunicatorTest, AllReduceAverage_CudaTensor_InvalidArgument) {
  auto statuses = RunRanks(1, absl::Seconds(5), [&](int, GlooCommunicator& c) {
    float x = 1;
    TensorView t{&x, 1, DType::kFloat32, Device::Cuda(0)};
    return c.AllReduceAverage({t});
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInvalidArgument);
}

TEST(SoloCommunicatorTest, AverageOfOneIsIdentity) {
  SoloCommunicator c;
  std::vector<float> v = {1, 2};
  TensorView t{v.data(), 2, DType::kFloat32};
  EXPECT_TRUE(c.AllReduceAverage({t}).ok());
  EXPECT_THAT(v, ::testing::ElementsAre(1, 2));
}

}  // namespace
}  // namespace modelavg::client
