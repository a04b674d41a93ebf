// GlooCommunicator with ranks as threads over loopback, rendezvous through Gloo's in-memory
// HashStore (the coordinator-backed store is covered by client_coordinator_test). Silent and
// broken links go through tests/testing/gloo_link_proxy.h.
#include "client/comm/gloo/gloo_communicator.h"
#include "client/comm/solo_communicator.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/base/half.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gloo_link_proxy.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// Threads meet here; every wait is bounded (a test never hangs on a broken peer).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  // False if the others did not arrive within `timeout`.
  bool Wait(absl::Duration timeout = absl::Seconds(60)) {
    absl::MutexLock l(&mu_);
    const int round = round_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++round_;
      return true;
    }
    auto next = [&] { return round_ != round; };
    return mu_.AwaitWithTimeout(absl::Condition(&next), timeout);
  }

 private:
  absl::Mutex mu_;
  const int n_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int round_ ABSL_GUARDED_BY(mu_) = 0;
};

using StoreFor = std::function<gloo::rendezvous::Store*(int rank)>;

// Runs fn(rank, communicator) on `size` threads after a rendezvous; returns each rank's status.
// `store_for`: each rank's rendezvous store (default: one shared in-memory store). `hold`: every
// rank keeps its communicator (so its sockets stay open) until every rank's fn has returned,
// so that no rank's failure comes from another rank closing its connections.
std::vector<absl::Status> RunRanks(int size, absl::Duration timeout,
                                   const std::function<absl::Status(int, GlooCommunicator&)>& fn,
                                   bool in_place = false, const StoreFor& store_for = nullptr,
                                   bool hold = false) {
  gloo::rendezvous::HashStore store;
  std::vector<absl::Status> out(size);
  std::vector<std::thread> threads;
  Barrier all_returned(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<GlooCommunicator> comm;  // destroyed last: closes this rank's sockets
      out[r] = [&]() -> absl::Status {
        auto dev = CreateGlooDevice("127.0.0.1");
        if (!dev.ok()) return dev.status();
        gloo::rendezvous::Store& s = store_for ? *store_for(r) : store;
        auto created = GlooCommunicator::Create(s, *dev, r, size, timeout, nullptr, in_place);
        if (!created.ok()) return created.status();
        comm = *std::move(created);
        return fn(r, *comm);
      }();
      if (hold) all_returned.Wait();
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

// Fault bounds below: Gloo's timeout bounds each wait of the ring, and every wait starts after
// the call does, so a silent peer ends the call no sooner than `timeout` after it began and, on
// loopback, well within `timeout` + kSlack (the transfer before the silence plus scheduling).
constexpr absl::Duration kSilentTimeout = absl::Seconds(1);
constexpr absl::Duration kSlack = absl::Milliseconds(1500);

// After a silent link, the members time out within moments of each other, and a member whose
// collective fails closes its mesh so that the others fail at once: each member ends with
// DEADLINE_EXCEEDED, or UNAVAILABLE when a peer's own deadline came first. At least one deadline
// ran, and nobody failed before the timeout (nothing was closed or reset before it).
void ExpectSilentLinkOutcome(const std::vector<absl::Status>& statuses,
                             const std::vector<absl::Duration>& took) {
  bool any_deadline = false;
  for (size_t r = 0; r < statuses.size(); ++r) {
    const absl::StatusCode code = statuses[r].code();
    any_deadline = any_deadline || code == absl::StatusCode::kDeadlineExceeded;
    EXPECT_THAT(code, ::testing::AnyOf(absl::StatusCode::kDeadlineExceeded,
                                       absl::StatusCode::kUnavailable))
        << "rank " << r << ": " << statuses[r];
    ::testing::Test::RecordProperty(absl::StrCat("rank", r, "_took_ms"),
                                    absl::ToInt64Milliseconds(took[r]));
    EXPECT_GE(took[r], kSilentTimeout) << "rank " << r << ": " << statuses[r];
    EXPECT_LE(took[r], kSilentTimeout + kSlack) << "rank " << r << ": " << statuses[r];
  }
  EXPECT_TRUE(any_deadline) << "no member waited out the collective timeout";
}

// A peer that is alive (its sockets open, nothing closed or reset) but never enters the call:
// the caller must wait out the collective timeout — DEADLINE_EXCEEDED — and keep its values.
TEST(GlooCommunicatorTest, AllReduceAverage_PeerSilentBetweenCalls_DeadlineAfterTimeoutUntouched) {
  std::vector<float> v0(16, 3.0f);
  absl::Duration took;
  auto statuses = RunRanks(
      2, kSilentTimeout,
      [&](int r, GlooCommunicator& c) {
        if (r == 1) return absl::OkStatus();  // never takes part; holds its communicator
        TensorView t{v0.data(), 16, DType::kFloat32};
        const absl::Time start = absl::Now();
        absl::Status s = c.AllReduceAverage({t});
        took = absl::Now() - start;
        return s;
      },
      /*in_place=*/false, /*store_for=*/nullptr, /*hold=*/true);
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kDeadlineExceeded) << statuses[0];
  EXPECT_THAT(std::string(statuses[0].message()), HasSubstr("did not take part in time"));
  RecordProperty("took_ms", absl::ToInt64Milliseconds(took));
  EXPECT_GE(took, kSilentTimeout);
  EXPECT_LE(took, kSilentTimeout + kSlack);
  EXPECT_THAT(v0, ::testing::Each(3.0f));
}

// A peer whose communicator is gone (its process died: the kernel closes its sockets): the
// caller learns it from the closed connection — UNAVAILABLE, long before the timeout.
TEST(GlooCommunicatorTest, AllReduceAverage_PeerGoneMidPackedCall_UnavailableAtOnceUntouched) {
  const absl::Duration timeout = absl::Seconds(20);
  std::vector<float> f(8, 3.0f);
  std::vector<double> d(4, 5.0);
  absl::Duration took;
  auto statuses = RunRanks(2, timeout, [&](int r, GlooCommunicator& c) {
    if (r == 1) return absl::OkStatus();  // returns at once: its communicator is destroyed
    std::vector<TensorView> views = {{f.data(), 8, DType::kFloat32},
                                     {d.data(), 4, DType::kFloat64}};
    const absl::Time start = absl::Now();
    absl::Status s = c.AllReduceAverage(views);
    took = absl::Now() - start;
    return s;
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kUnavailable) << statuses[0];
  EXPECT_THAT(std::string(statuses[0].message()), HasSubstr("connection broke"));
  RecordProperty("took_ms", absl::ToInt64Milliseconds(took));
  EXPECT_LT(took, timeout / 4);
  EXPECT_THAT(f, ::testing::Each(3.0f));
  EXPECT_THAT(d, ::testing::Each(5.0));
}

// Every link of rank 2 goes through a proxy that stops forwarding between two calls (no close,
// no reset: a dropped route or a stopped host). The first call proves the links carry data; the
// second must end for every member after the timeout (ExpectSilentLinkOutcome), values untouched.
TEST(GlooCommunicatorTest, AllReduceAverage_LinkDroppedBetweenCalls_EveryMemberEndsAfterTimeoutUntouched) {
  constexpr int kSize = 3;
  modelavg::testing::DroppingStore::Shared shared;
  shared.size = kSize;
  shared.silent = 2;
  std::vector<std::unique_ptr<modelavg::testing::DroppingStore>> stores;
  for (int r = 0; r < kSize; ++r) {
    stores.push_back(std::make_unique<modelavg::testing::DroppingStore>(&shared, r));
  }
  Barrier barrier(kSize);
  std::vector<std::vector<float>> vals(kSize);
  std::vector<absl::Duration> took(kSize);
  auto statuses = RunRanks(
      kSize, kSilentTimeout,
      [&](int r, GlooCommunicator& c) -> absl::Status {
        vals[r].assign(1000, static_cast<float>(r));
        absl::Status s = c.AllReduceAverage({TensorView{vals[r].data(), 1000, DType::kFloat32}});
        if (!s.ok()) return absl::InternalError(absl::StrCat("first call: ", s.ToString()));
        if (vals[r][999] != 1.0f) return absl::InternalError("first call: wrong mean");
        for (float& x : vals[r]) x = 10.0f * (r + 1);
        if (!barrier.Wait()) return absl::InternalError("barrier");
        if (r == 0) {
          for (auto* p : stores[0]->proxies()) p->StallAfter(0);
        }
        if (!barrier.Wait()) return absl::InternalError("barrier");
        const absl::Time start = absl::Now();
        s = c.AllReduceAverage({TensorView{vals[r].data(), 1000, DType::kFloat32}});
        took[r] = absl::Now() - start;
        return s;
      },
      /*in_place=*/false, [&](int r) { return stores[r].get(); }, /*hold=*/true);
  ASSERT_EQ(stores[0]->proxies().size(), 2u) << "both links of rank 2 must pass the proxies";
  ExpectSilentLinkOutcome(statuses, took);
  for (int r = 0; r < kSize; ++r) {
    EXPECT_THAT(vals[r], ::testing::Each(10.0f * (r + 1))) << "rank " << r;
  }
}

// The link goes silent in the middle of the ring (after a fixed number of bytes of a 12 MB
// in-place all-reduce): both members end after the timeout and restore their buffers exactly.
TEST(GlooCommunicatorTest, AllReduceAverage_LinkDroppedMidRing_BothEndAfterTimeoutRestoredExactly) {
  constexpr int64_t kN = 3000000;
  constexpr int64_t kStallAfter = 4 << 20;  // of about 2 x 12 MB that the ring moves
  modelavg::testing::DroppingStore::Shared shared;
  shared.size = 2;
  shared.silent = 1;
  modelavg::testing::DroppingStore s0(&shared, 0), s1(&shared, 1);
  Barrier barrier(2);
  std::vector<std::vector<float>> vals(2);
  std::vector<absl::Duration> took(2);
  int64_t forwarded_before = 0;
  auto statuses = RunRanks(
      2, kSilentTimeout,
      [&](int r, GlooCommunicator& c) -> absl::Status {
        vals[r].assign(kN, 0.0f);
        TensorView t{vals[r].data(), kN, DType::kFloat32};
        absl::Status s = c.AllReduceAverage({t});  // checks the layout; moves data both ways
        if (!s.ok()) return absl::InternalError(absl::StrCat("first call: ", s.ToString()));
        for (int64_t i = 0; i < kN; ++i) vals[r][i] = static_cast<float>(i % 977 + r);
        if (!barrier.Wait()) return absl::InternalError("barrier");
        if (r == 0) {
          auto proxies = s0.proxies();
          if (proxies.size() != 1) return absl::InternalError("expected one proxied link");
          forwarded_before = proxies[0]->forwarded();
          proxies[0]->StallAfter(kStallAfter);
        }
        if (!barrier.Wait()) return absl::InternalError("barrier");
        const absl::Time start = absl::Now();
        s = c.AllReduceAverage({t});
        took[r] = absl::Now() - start;
        return s;
      },
      /*in_place=*/false, [&](int r) { return r == 0 ? &s0 : &s1; }, /*hold=*/true);
  ASSERT_EQ(s0.proxies().size(), 1u);
  // The silence began inside the ring: exactly kStallAfter bytes of it passed.
  EXPECT_TRUE(s0.proxies()[0]->stalled());
  EXPECT_EQ(s0.proxies()[0]->forwarded() - forwarded_before, kStallAfter);
  ExpectSilentLinkOutcome(statuses, took);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(vals[r][i], static_cast<float>(i % 977 + r)) << "rank " << r << " element " << i;
    }
  }
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

// The connection breaks after part of the buffer has been reduced in place (after a fixed number
// of bytes of a 12 MB all-reduce): both members fail at once, and the backup restores it exactly.
TEST(GlooCommunicatorTest, AllReduceAverage_ConnectionBrokenMidRing_UnavailableAtOnceRestoredExactly) {
  const int64_t n = 3000000;  // many segments
  constexpr int64_t kDropAfter = 4 << 20;  // of about 2 x 12 MB that the ring moves
  modelavg::testing::DroppingStore::Shared shared;
  shared.size = 2;
  shared.silent = 0;
  modelavg::testing::DroppingStore s0(&shared, 0), s1(&shared, 1);
  Barrier barrier(2);
  std::vector<std::vector<float>> vals(2);
  std::vector<absl::Duration> took(2);
  auto statuses = RunRanks(
      2, absl::Seconds(20),
      [&](int r, GlooCommunicator& c) -> absl::Status {
        vals[r].resize(n);
        for (int64_t i = 0; i < n; ++i) vals[r][i] = static_cast<float>(i % 977 + r);
        if (r == 0) {
          auto proxies = s0.proxies();
          if (proxies.size() != 1) return absl::InternalError("expected one proxied link");
          proxies[0]->DropAfter(kDropAfter);
        }
        if (!barrier.Wait()) return absl::InternalError("barrier");
        const absl::Time start = absl::Now();
        absl::Status s = c.AllReduceAverage({TensorView{vals[r].data(), n, DType::kFloat32}});
        took[r] = absl::Now() - start;
        return s;
      },
      /*in_place=*/false, [&](int r) { return r == 0 ? &s0 : &s1; }, /*hold=*/true);
  ASSERT_EQ(s0.proxies().size(), 1u);
  EXPECT_TRUE(s0.proxies()[0]->dropped());
  for (int r = 0; r < 2; ++r) {
    // The peer's connection broke: not a timeout, and well before it.
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kUnavailable) << statuses[r];
    EXPECT_THAT(std::string(statuses[r].message()), HasSubstr("connection broke"));
    EXPECT_LT(took[r], absl::Seconds(10)) << "rank " << r;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(vals[r][i], static_cast<float>(i % 977 + r)) << "rank " << r << " element " << i;
    }
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
