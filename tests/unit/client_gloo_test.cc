// GlooCommunicator with ranks as threads over loopback, rendezvous through Gloo's in-memory
// HashStore (the coordinator-backed store is covered by client_coordinator_test).
#include "client/gloo_communicator.h"

#include <cmath>
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
                                   const std::function<absl::Status(int, GlooCommunicator&)>& fn,
                                   bool in_place = false) {
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
      auto comm = GlooCommunicator::Create(store, *dev, r, size, timeout, nullptr, in_place);
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
    // This Gloo build's ring layout is the one the fused division expects.
    EXPECT_TRUE(c.fused());
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

// Many Gloo segments (1 MiB each), distinct values per element, a group size whose division is
// inexact: the fused single-buffer path must match PyTorch's divide-then-sum.
void CheckSingleBuffer(int size, bool in_place, int tensors) {
  const int64_t n = 600001;
  std::vector<std::vector<float>> got(size);
  auto statuses = RunRanks(
      size, absl::Seconds(30),
      [&](int r, GlooCommunicator& c) {
        std::vector<float>& v = got[r];
        v.resize(n);
        for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 1000) * (r + 1));
        // `tensors` back-to-back views of the one buffer.
        std::vector<TensorView> views;
        int64_t at = 0;
        for (int t = 0; t < tensors; ++t) {
          const int64_t len = t == tensors - 1 ? n - at : n / tensors;
          views.push_back(TensorView{v.data() + at, len, DType::kFloat32});
          at += len;
        }
        return c.AllReduceAverage(views);
      },
      in_place);
  for (int r = 0; r < size; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << statuses[r];
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int m = 0; m < size; ++m) want += static_cast<float>((i % 1000) * (m + 1)) / size;
      ASSERT_NEAR(got[r][i], want, 1e-6f * std::abs(want)) << "rank " << r << " element " << i;
    }
  }
}

TEST(GlooCommunicatorTest, AllReduceAverage_OneBufferStaged_ManySegments_MatchesPyTorch) {
  CheckSingleBuffer(3, /*in_place=*/false, /*tensors=*/1);
}

TEST(GlooCommunicatorTest, AllReduceAverage_BackToBackTensorsInPlace_MatchesPyTorch) {
  CheckSingleBuffer(2, /*in_place=*/true, /*tensors=*/7);
}

TEST(GlooCommunicatorTest, AllReduceAverage_PeerDiesMidPackedCall_Untouched) {
  std::vector<float> f(8, 3.0f);
  std::vector<double> d(4, 5.0);
  auto statuses = RunRanks(2, absl::Seconds(1), [&](int r, GlooCommunicator& c) {
    if (r == 1) return absl::OkStatus();
    std::vector<TensorView> views = {{f.data(), 8, DType::kFloat32},
                                     {d.data(), 4, DType::kFloat64}};
    return c.AllReduceAverage(views);
  });
  EXPECT_FALSE(statuses[0].ok());
  EXPECT_THAT(f, ::testing::Each(3.0f));
  EXPECT_THAT(d, ::testing::Each(5.0));
}

// A failure after part of the buffer has been reduced in place: the backup restores it.
TEST(GlooCommunicatorTest, AllReduceAverage_FailsMidRing_OneBufferRestoredExactly) {
  const int64_t n = 3000000;  // many segments
  std::vector<std::vector<float>> vals(2);
  auto statuses = RunRanks(2, absl::Seconds(2), [&](int r, GlooCommunicator& c) {
    vals[r].resize(n);
    for (int64_t i = 0; i < n; ++i) vals[r][i] = static_cast<float>(i % 977 + r);
    if (r == 0) c.InjectFailureAfterReductionsForTesting(3);
    return c.AllReduceAverage({TensorView{vals[r].data(), n, DType::kFloat32}});
  });
  ASSERT_FALSE(statuses[0].ok());
  EXPECT_THAT(std::string(statuses[0].message()), HasSubstr("injected"));
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(vals[0][i], static_cast<float>(i % 977)) << "element " << i;
  }
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
