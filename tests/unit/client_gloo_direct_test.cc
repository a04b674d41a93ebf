// The direct exchange behind GlooCommunicator (client/comm/gloo/gloo_exchange.h): every member
// sends its contribution to every other and each sums the members' pieces in member order, then
// divides. Checked on every member, element by element and bit for bit, against a naive
// restatement of that rule (and of the checked round's: each contribution divided before it is
// added); the finite check (a member's NaN or Inf: every member's call fails naming it, no
// tensor changes); and its failures: a link broken in the middle of the exchange (every
// member fails at once, its tensors exactly as they were) and between the data and the commit
// vote of a committed round (every voter holds the result and adopting it gives the mean).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gloo_link_proxy.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// Every size goes through the direct exchange.
GlooAlgorithms DirectAlways() {
  GlooAlgorithms a;
  a.direct_pairs = true;
  a.direct_max_bytes = int64_t{1} << 40;
  return a;
}

// Rounds of more than two members go through the scatter-gather exchange at every size.
GlooAlgorithms ScatterAlways() {
  GlooAlgorithms a;
  a.direct_max_bytes = 0;
  a.scatter_max_bytes = int64_t{1} << 40;
  return a;
}

enum class Layout {
  kOneF32,       // one float32 tensor: sent from where it is
  kOneF64,       // one float64 tensor
  kBackToBack,   // five float32 views of one allocation: one buffer too
  kSeparateF32,  // three float32 tensors: packed into the staging buffer
  kMixed,        // float32, float64, float16 and bfloat16 tensors: packed as float64
};

std::string LayoutName(Layout l) {
  switch (l) {
    case Layout::kOneF32:
      return "OneF32";
    case Layout::kOneF64:
      return "OneF64";
    case Layout::kBackToBack:
      return "BackToBack";
    case Layout::kSeparateF32:
      return "SeparateF32";
    case Layout::kMixed:
      return "Mixed";
  }
  return "?";
}

// One member's tensors: raw bytes per tensor, and the views over them.
struct Tensors {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<DType> dtypes;
  std::vector<int64_t> numels;
  // kBackToBack: every view lies in bytes[0].
  bool one_allocation = false;

  std::vector<TensorView> Views() {
    std::vector<TensorView> v;
    int64_t at = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (one_allocation) {
        v.push_back(TensorView{bytes[0].data() + at * 4, numels[i], DType::kFloat32});
        at += numels[i];
      } else {
        v.push_back(TensorView{bytes[i].data(), numels[i], dtypes[i]});
      }
    }
    return v;
  }
  // Sets element e of tensor t (a float32 or float64 tensor, or one view of one allocation).
  void Set(size_t t, int64_t e, double v) {
    uint8_t* base = one_allocation ? bytes[0].data() : bytes[t].data();
    int64_t offset = e;
    if (one_allocation) {
      for (size_t k = 0; k < t; ++k) offset += numels[k];
    }
    if (!one_allocation && dtypes[t] == DType::kFloat64) {
      std::memcpy(base + offset * 8, &v, 8);
    } else {
      const float f = static_cast<float>(v);
      std::memcpy(base + offset * 4, &f, 4);
    }
  }
  // Element e of tensor t, as a double.
  double Get(size_t t, int64_t e) const {
    const uint8_t* base = one_allocation ? bytes[0].data() : bytes[t].data();
    int64_t offset = e;
    if (one_allocation) {
      for (size_t k = 0; k < t; ++k) offset += numels[k];
    }
    switch (one_allocation ? DType::kFloat32 : dtypes[t]) {
      case DType::kFloat32: {
        float f;
        std::memcpy(&f, base + offset * 4, 4);
        return f;
      }
      case DType::kFloat64: {
        double d;
        std::memcpy(&d, base + offset * 8, 8);
        return d;
      }
      case DType::kFloat16: {
        uint16_t h;
        std::memcpy(&h, base + offset * 2, 2);
        return HalfToFloat(h);
      }
      case DType::kBFloat16: {
        uint16_t b;
        std::memcpy(&b, base + offset * 2, 2);
        return BFloat16ToFloat(b);
      }
    }
    return 0;
  }
};

// A value with an inexact mean in every dtype, different per member, tensor and element.
double Value(int member, size_t tensor, int64_t e) {
  return static_cast<double>((e * 7919 + member * 104729 + static_cast<int64_t>(tensor) * 31) %
                             2003) * 0.37 - 100.0 + member * 0.013;
}

Tensors MakeTensors(Layout layout, int member, int64_t numel) {
  Tensors t;
  auto add = [&](DType d, int64_t n) {
    t.dtypes.push_back(d);
    t.numels.push_back(n);
    t.bytes.emplace_back(static_cast<size_t>(n) * DTypeSize(d));
  };
  switch (layout) {
    case Layout::kOneF32:
      add(DType::kFloat32, numel);
      break;
    case Layout::kOneF64:
      add(DType::kFloat64, numel);
      break;
    case Layout::kBackToBack:
      t.one_allocation = true;
      t.bytes.emplace_back(static_cast<size_t>(numel) * 4);
      for (int i = 0; i < 5; ++i) {
        t.dtypes.push_back(DType::kFloat32);
        t.numels.push_back(i < 4 ? numel / 5 : numel - 4 * (numel / 5));
      }
      break;
    case Layout::kSeparateF32:
      add(DType::kFloat32, numel / 3);
      add(DType::kFloat32, numel / 3 + 1);
      add(DType::kFloat32, numel - 2 * (numel / 3) - 1);
      break;
    case Layout::kMixed:
      add(DType::kFloat32, numel / 4);
      add(DType::kFloat64, numel / 4 + 3);
      add(DType::kFloat16, numel / 4);
      add(DType::kBFloat16, numel - 3 * (numel / 4) - 3);
      break;
  }
  for (size_t k = 0; k < t.numels.size(); ++k) {
    for (int64_t e = 0; e < t.numels[k]; ++e) {
      const double v = Value(member, k, e);
      uint8_t* base = t.one_allocation ? t.bytes[0].data() : t.bytes[k].data();
      int64_t offset = e;
      if (t.one_allocation) {
        for (size_t j = 0; j < k; ++j) offset += t.numels[j];
      }
      switch (t.one_allocation ? DType::kFloat32 : t.dtypes[k]) {
        case DType::kFloat32: {
          const float f = static_cast<float>(v);
          std::memcpy(base + offset * 4, &f, 4);
          break;
        }
        case DType::kFloat64:
          std::memcpy(base + offset * 8, &v, 8);
          break;
        case DType::kFloat16: {
          const uint16_t h = FloatToHalf(static_cast<float>(v));
          std::memcpy(base + offset * 2, &h, 2);
          break;
        }
        case DType::kBFloat16: {
          const uint16_t b = FloatToBFloat16(static_cast<float>(v));
          std::memcpy(base + offset * 2, &b, 2);
          break;
        }
      }
    }
  }
  return t;
}

// The rule, restated: the sum over the contributing members in member order, in the staging
// dtype (float64 if any tensor is float64, else float32), divided by their number, converted to
// the tensor's dtype. `contributes[m]` false: member m adds nothing.
// `divide_first` (the finite check's rounds): each member's value is divided before it is added.
Tensors Expected(const std::vector<Tensors>& before, const std::vector<bool>& contributes,
                 bool divide_first = false) {
  Tensors out = before[0];
  bool f64 = false;
  for (DType d : out.dtypes) f64 = f64 || d == DType::kFloat64;
  int divisor = 0;
  for (bool c : contributes) divisor += c ? 1 : 0;
  for (size_t k = 0; k < out.numels.size(); ++k) {
    for (int64_t e = 0; e < out.numels[k]; ++e) {
      double mean;
      if (divide_first && f64) {
        double s = (contributes[0] ? before[0].Get(k, e) : 0.0) / divisor;
        for (size_t m = 1; m < before.size(); ++m) {
          s = s + (contributes[m] ? before[m].Get(k, e) : 0.0) / divisor;
        }
        mean = s;
      } else if (divide_first) {
        const float d = static_cast<float>(divisor);
        float s = (contributes[0] ? static_cast<float>(before[0].Get(k, e)) : 0.0f) / d;
        for (size_t m = 1; m < before.size(); ++m) {
          s = s + (contributes[m] ? static_cast<float>(before[m].Get(k, e)) : 0.0f) / d;
        }
        mean = s;
      } else if (f64) {
        double s = contributes[0] ? before[0].Get(k, e) : 0.0;
        for (size_t m = 1; m < before.size(); ++m) s = s + (contributes[m] ? before[m].Get(k, e) : 0.0);
        mean = s / divisor;
      } else {
        float s = contributes[0] ? static_cast<float>(before[0].Get(k, e)) : 0.0f;
        for (size_t m = 1; m < before.size(); ++m) {
          s = s + (contributes[m] ? static_cast<float>(before[m].Get(k, e)) : 0.0f);
        }
        mean = s / static_cast<float>(divisor);
      }
      uint8_t* base = out.one_allocation ? out.bytes[0].data() : out.bytes[k].data();
      int64_t offset = e;
      if (out.one_allocation) {
        for (size_t j = 0; j < k; ++j) offset += out.numels[j];
      }
      switch (out.one_allocation ? DType::kFloat32 : out.dtypes[k]) {
        case DType::kFloat32: {
          const float f = static_cast<float>(mean);
          std::memcpy(base + offset * 4, &f, 4);
          break;
        }
        case DType::kFloat64:
          std::memcpy(base + offset * 8, &mean, 8);
          break;
        case DType::kFloat16: {
          const uint16_t h = FloatToHalf(static_cast<float>(mean));
          std::memcpy(base + offset * 2, &h, 2);
          break;
        }
        case DType::kBFloat16: {
          const uint16_t b = FloatToBFloat16(static_cast<float>(mean));
          std::memcpy(base + offset * 2, &b, 2);
          break;
        }
      }
    }
  }
  return out;
}

// The first tensor element whose bytes differ, or "" when none.
std::string FirstDifference(const Tensors& got, const Tensors& want) {
  for (size_t k = 0; k < got.bytes.size(); ++k) {
    if (got.bytes[k] == want.bytes[k]) continue;
    for (size_t i = 0; i < got.bytes[k].size(); ++i) {
      if (got.bytes[k][i] != want.bytes[k][i]) return absl::StrCat("buffer ", k, " byte ", i);
    }
  }
  return "";
}

struct Result {
  absl::Status status;
  RoundOutcome outcome = RoundOutcome::kCompleted;
};

// One round on every member in parallel.
std::vector<Result> RunRound(std::vector<std::unique_ptr<GlooCommunicator>>& mesh,
                             std::vector<Tensors>& t, const std::vector<RoundOptions>& options) {
  std::vector<Result> out(mesh.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < mesh.size(); ++r) {
    threads.emplace_back([&, r] {
      std::vector<TensorView> views = t[r].Views();
      out[r].status = mesh[r]->AllReduceAverage(views, options[r], &out[r].outcome);
    });
  }
  for (auto& th : threads) th.join();
  return out;
}

// 600,001 float32 elements (2.4 MB) are ten pieces of the exchange, the last one short, more
// than a window of them in flight.
constexpr int64_t kNumel = 600001;

struct Case {
  int size;
  Layout layout;
  bool commit;
  bool scatter = false;  // ScatterAlways (more than two members), else DirectAlways
};

class DirectAverageTest : public ::testing::TestWithParam<Case> {};

TEST_P(DirectAverageTest, EveryMemberGetsTheMemberOrderMean_BitForBit) {
  const Case c = GetParam();
  auto mesh = MakeGlooMesh(c.size, absl::Seconds(60), nullptr, false,
                           c.scatter ? ScatterAlways() : DirectAlways());
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<Tensors> t;
  for (int r = 0; r < c.size; ++r) t.push_back(MakeTensors(c.layout, r, kNumel));
  RoundOptions options;
  options.commit = c.commit;
  // Twice: the agreed first round and a round between agreements.
  for (int round = 0; round < 2; ++round) {
    const std::vector<Tensors> before = t;
    const Tensors want = Expected(before, std::vector<bool>(c.size, true));
    std::vector<Result> res = RunRound(mesh, t, std::vector<RoundOptions>(c.size, options));
    for (int r = 0; r < c.size; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << "member " << r << ": " << res[r].status;
      EXPECT_EQ(res[r].outcome, RoundOutcome::kCompleted);
      EXPECT_EQ(FirstDifference(t[r], want), "") << "member " << r << ", round " << round;
    }
  }
  // The direct exchange sends the whole buffer to every peer, once per round; the
  // scatter-gather one each peer's range (n - 1 of n ranges), then member 0's range (the
  // first floor(numel / n) elements) to each peer.
  const int64_t elem = c.layout == Layout::kMixed || c.layout == Layout::kOneF64 ? 8 : 4;
  int64_t numel = 0;
  for (int64_t n : t[0].numels) numel += n;
  const int64_t mine = numel / c.size;
  EXPECT_EQ(mesh[0]->bytes_sent(),
            2 * elem * (c.scatter ? numel + (c.size - 2) * mine : numel * (c.size - 1)));
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (int size : {2, 3, 4}) {
    for (Layout l : {Layout::kOneF32, Layout::kOneF64, Layout::kBackToBack, Layout::kSeparateF32,
                     Layout::kMixed}) {
      for (bool commit : {false, true}) {
        if (size == 4 && l != Layout::kMixed && l != Layout::kOneF32) continue;  // enough
        out.push_back(Case{size, l, commit});
        if (size > 2 && l != Layout::kOneF64 && l != Layout::kBackToBack) {
          out.push_back(Case{size, l, commit, /*scatter=*/true});
        }
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sizes, DirectAverageTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat("Members", info.param.size,
                                               info.param.scatter ? "ScatterGather" : "",
                                               LayoutName(info.param.layout),
                                               info.param.commit ? "Committed" : "Plain");
                         });

// In place (ClientOptions::gloo_in_place), a plain round keeps no backup: the same result.
TEST(DirectAverageTest, InPlace_SameMeanWithoutABackup) {
  auto mesh = MakeGlooMesh(2, absl::Seconds(60), nullptr, /*in_place=*/true, DirectAlways());
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<Tensors> t;
  for (int r = 0; r < 2; ++r) t.push_back(MakeTensors(Layout::kBackToBack, r, kNumel));
  const Tensors want = Expected(t, {true, true});
  std::vector<Result> res = RunRound(mesh, t, {RoundOptions{}, RoundOptions{}});
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].status.ok()) << res[r].status;
    EXPECT_EQ(FirstDifference(t[r], want), "") << "member " << r;
  }
}

// A member admitted at this round contributes nothing (it sends zeros) and receives the others'
// mean, the same bits as theirs.
TEST(DirectAverageTest, JoiningMember_ContributesNothingGetsTheOthersMean) {
  for (Layout layout : {Layout::kOneF32, Layout::kMixed}) {
   for (bool scatter : {false, true}) {
    SCOPED_TRACE(absl::StrCat(LayoutName(layout), scatter ? " scatter-gather" : " direct"));
    auto mesh = MakeGlooMesh(3, absl::Seconds(60), nullptr, false,
                             scatter ? ScatterAlways() : DirectAlways());
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    std::vector<Tensors> t;
    for (int r = 0; r < 3; ++r) t.push_back(MakeTensors(layout, r, kNumel));
    const Tensors want = Expected(t, {true, false, true});
    RoundOptions member;
    member.commit = true;
    member.contributors = 2;
    RoundOptions joining = member;
    joining.contribute = false;
    std::vector<Result> res = RunRound(mesh, t, {member, joining, member});
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << "member " << r << ": " << res[r].status;
      EXPECT_EQ(FirstDifference(t[r], want), "") << "member " << r;
    }
   }
  }
}

// Rounds of up to GlooAlgorithms::direct_max_bytes go through the direct exchange (n - 1 times
// the buffer sent), larger ones up to scatter_max_bytes through the scatter-gather exchange
// (2 (n - 1) / n times, the same mean bit for bit), larger ones through Gloo's ring (2 (n - 1)
// / n times, its own order of sums); two members always through the direct exchange.
TEST(DirectAverageTest, AlgorithmBySize_DirectThenScatterGatherThenRing) {
  GlooAlgorithms a;
  a.direct_max_bytes = 64 * 1024;
  a.scatter_max_bytes = 128 * 1024;
  for (int64_t numel : {int64_t{16 * 1024}, int64_t{32 * 1024}, int64_t{64 * 1024}}) {
    // A communicator agrees on one layout: one mesh per size.
    auto mesh = MakeGlooMesh(4, absl::Seconds(60), nullptr, false, a);
    for (const auto& m : mesh) ASSERT_NE(m, nullptr);
    std::vector<Tensors> t;
    for (int r = 0; r < 4; ++r) t.push_back(MakeTensors(Layout::kOneF32, r, numel));
    const Tensors want = Expected(t, std::vector<bool>(4, true));
    const int64_t sent = mesh[0]->bytes_sent();
    std::vector<Result> res = RunRound(mesh, t, std::vector<RoundOptions>(4, RoundOptions{}));
    for (int r = 0; r < 4; ++r) ASSERT_TRUE(res[r].status.ok()) << res[r].status;
    const int64_t bytes = numel * 4;
    if (bytes <= a.direct_max_bytes) {
      EXPECT_EQ(mesh[0]->bytes_sent() - sent, 3 * bytes);
      EXPECT_EQ(FirstDifference(t[1], want), "");
    } else if (bytes <= a.scatter_max_bytes) {
      EXPECT_EQ(mesh[0]->bytes_sent() - sent, 3 * bytes / 2);
      for (int r = 0; r < 4; ++r) EXPECT_EQ(FirstDifference(t[r], want), "") << "member " << r;
    } else {
      EXPECT_EQ(mesh[0]->bytes_sent() - sent, 3 * bytes / 2);
      // The ring's sums run in another order: the mean to rounding.
      for (int64_t e = 0; e < numel; e += 101) {
        EXPECT_NEAR(t[1].Get(0, e), want.Get(0, e), 1e-5 * std::abs(want.Get(0, e)) + 1e-5);
      }
    }
  }
}

// A mesh whose member 1 reaches its peers through proxies (tests/testing/gloo_link_proxy.h).
struct ProxiedMesh {
  modelavg::testing::DroppingStore::Shared shared;
  std::vector<std::unique_ptr<modelavg::testing::DroppingStore>> stores;
  std::vector<std::unique_ptr<GlooCommunicator>> mesh;

  ProxiedMesh(int size, absl::Duration timeout, GlooAlgorithms algorithms = DirectAlways()) {
    shared.size = size;
    shared.silent = 1;
    for (int r = 0; r < size; ++r) {
      stores.push_back(std::make_unique<modelavg::testing::DroppingStore>(&shared, r));
    }
    mesh = MakeGlooMesh(size, timeout, [&](int r) { return stores[r].get(); }, false,
                        algorithms);
  }
  std::vector<modelavg::testing::LinkProxy*> links() { return stores[0]->proxies(); }
  // Bytes each link carried so far.
  std::vector<int64_t> Forwarded() {
    std::vector<int64_t> out;
    for (auto* l : links()) out.push_back(l->forwarded());
    return out;
  }
};

std::vector<Tensors> MakeAll(Layout layout, int size) {
  std::vector<Tensors> t;
  for (int r = 0; r < size; ++r) t.push_back(MakeTensors(layout, r, kNumel));
  return t;
}

// Member 1's links close halfway through the exchange (as when its process dies there): every
// member fails at once, well before the timeout, without the result, its tensors exactly as they
// were — in a plain and in a committed round, one buffer and packed.
TEST(DirectAverageTest, LinkBrokenMidExchange_EveryMemberFailsAtOnceUntouched) {
  constexpr absl::Duration kTimeout = absl::Seconds(30);
  for (int size : {2, 3, -3}) {  // -3: three members, the scatter-gather exchange
    const bool scatter = size < 0;
    size = std::abs(size);
    for (Layout layout : {Layout::kOneF32, Layout::kSeparateF32}) {
      for (bool commit : {false, true}) {
        SCOPED_TRACE(absl::StrCat(size, " members, ", LayoutName(layout),
                                  commit ? ", committed" : ", plain",
                                  scatter ? ", scatter-gather" : ""));
        ProxiedMesh p(size, kTimeout, scatter ? ScatterAlways() : DirectAlways());
        for (const auto& m : p.mesh) ASSERT_NE(m, nullptr);
        ASSERT_EQ(p.links().size(), static_cast<size_t>(size - 1));
        RoundOptions options;
        options.commit = commit;
        const std::vector<RoundOptions> all(size, options);
        std::vector<Tensors> t = MakeAll(layout, size);
        for (const Result& r : RunRound(p.mesh, t, all)) ASSERT_TRUE(r.status.ok()) << r.status;
        const std::vector<int64_t> start = p.Forwarded();
        t = MakeAll(layout, size);
        for (const Result& r : RunRound(p.mesh, t, all)) ASSERT_TRUE(r.status.ok()) << r.status;
        const std::vector<int64_t> end = p.Forwarded();
        for (size_t k = 0; k < start.size(); ++k) p.links()[k]->DropAfter((end[k] - start[k]) / 2);
        t = MakeAll(layout, size);
        const std::vector<Tensors> before = t;
        const absl::Time began = absl::Now();
        std::vector<Result> res = RunRound(p.mesh, t, all);
        EXPECT_LT(absl::Now() - began, kTimeout / 3);
        for (int r = 0; r < size; ++r) {
          EXPECT_EQ(res[r].status.code(), absl::StatusCode::kUnavailable)
              << "member " << r << ": " << res[r].status;
          EXPECT_EQ(res[r].outcome, RoundOutcome::kFailedWithoutResult) << "member " << r;
          EXPECT_EQ(FirstDifference(t[r], before[r]), "") << "member " << r;
        }
      }
    }
  }
}

// Member 1 averages without a vote (a plain round) while the others commit theirs, and its
// links close once all of its data has been delivered: every other member holds every
// contribution but misses member 1's vote, so it fails in the commit, keeps its tensors, holds
// the result aside, and adopting it gives exactly the mean (as when a member dies between the
// data and the vote).
TEST(DirectAverageTest, VoteMissingAfterTheData_EveryVoterHoldsAndAdoptsTheMean) {
  for (int size : {2, 3, -3}) {  // -3: three members, the scatter-gather exchange
    const bool scatter = size < 0;
    size = std::abs(size);
    for (Layout layout : {Layout::kBackToBack, Layout::kMixed}) {
      SCOPED_TRACE(absl::StrCat(size, " members, ", LayoutName(layout),
                                scatter ? ", scatter-gather" : ""));
      ProxiedMesh p(size, absl::Seconds(30), scatter ? ScatterAlways() : DirectAlways());
      for (const auto& m : p.mesh) ASSERT_NE(m, nullptr);
      RoundOptions plain, committed;
      committed.commit = true;
      std::vector<Tensors> t = MakeAll(layout, size);
      for (int round = 0; round < 2; ++round) {
        for (const Result& r : RunRound(p.mesh, t, std::vector<RoundOptions>(size, plain))) {
          ASSERT_TRUE(r.status.ok()) << r.status;
        }
      }
      // What a plain round carries on each of member 1's links.
      const std::vector<int64_t> a = p.Forwarded();
      for (const Result& r : RunRound(p.mesh, t, std::vector<RoundOptions>(size, plain))) {
        ASSERT_TRUE(r.status.ok()) << r.status;
      }
      const std::vector<int64_t> b = p.Forwarded();
      t = MakeAll(layout, size);
      const std::vector<Tensors> before = t;
      const Tensors want = Expected(before, std::vector<bool>(size, true));
      std::vector<RoundOptions> options(size, committed);
      options[1] = plain;
      std::vector<Result> res(size);
      std::vector<std::thread> threads;
      for (int r = 0; r < size; ++r) {
        threads.emplace_back([&, r] {
          std::vector<TensorView> views = t[r].Views();
          res[r].status = p.mesh[r]->AllReduceAverage(views, options[r], &res[r].outcome);
          if (r != 1) return;
          if (!res[r].status.ok()) {  // reported below; no more bytes to wait for
            for (auto* link : p.links()) link->DropAfter(0);
            return;
          }
          // Member 1 is done: once its links have carried a plain round's bytes (its data
          // delivered both ways), they close.
          const absl::Time deadline = absl::Now() + absl::Seconds(20);
          for (size_t k = 0; k < a.size(); ++k) {
            while (p.links()[k]->forwarded() - b[k] < b[k] - a[k] && absl::Now() < deadline) {
              absl::SleepFor(absl::Milliseconds(1));
            }
            p.links()[k]->DropAfter(0);
          }
        });
      }
      for (auto& th : threads) th.join();
      ASSERT_TRUE(res[1].status.ok()) << res[1].status;
      EXPECT_EQ(FirstDifference(t[1], want), "") << "member 1";
      for (int r = 0; r < size; ++r) {
        if (r == 1) continue;
        SCOPED_TRACE(absl::StrCat("member ", r, ": ", res[r].status.ToString()));
        EXPECT_EQ(res[r].status.code(), absl::StatusCode::kUnavailable);
        EXPECT_THAT(res[r].status.message(), HasSubstr("commit"));
        EXPECT_EQ(res[r].outcome, RoundOutcome::kFailedHoldingResult);
        EXPECT_EQ(FirstDifference(t[r], before[r]), "") << "changed before the vote";
        std::vector<TensorView> views = t[r].Views();
        ASSERT_TRUE(p.mesh[r]->AdoptPendingResult(views).ok());
        EXPECT_EQ(FirstDifference(t[r], want), "") << "the adopted result";
      }
    }
  }
}

// The finite check (RoundOptions::check_finite) on the direct exchange: one member's NaN or Inf,
// late in its buffer (in the last piece, after pieces whose means a careless exchange would
// already have written): every member's call fails alike, INVALID_ARGUMENT of kind kNonFinite
// naming that member, its tensor and the value, without a result, and not one bit of any
// member's tensors changes. The member repairs its value and the next checked round averages by
// the checked rule restated (each contribution divided, then added in member order), bit for bit.
struct FiniteCase {
  int size;
  int64_t numel;
  Layout layout;
  bool commit;
  int bad_member;
  double bad;
  const char* value;
  bool scatter = false;  // ScatterAlways, else DirectAlways
};

void PrintTo(const FiniteCase& c, std::ostream* os) {
  *os << c.size << " members, " << c.numel << " elements, " << LayoutName(c.layout)
      << (c.commit ? ", committed" : ", plain") << ", " << c.value << " from member "
      << c.bad_member << (c.scatter ? ", scatter-gather" : "");
}

class DirectFiniteCheckTest : public ::testing::TestWithParam<FiniteCase> {};

TEST_P(DirectFiniteCheckTest, OneMemberNonFinite_EveryMemberFailsNamingItNothingChanges) {
  const FiniteCase c = GetParam();
  auto mesh = MakeGlooMesh(c.size, absl::Seconds(60), nullptr, false,
                           c.scatter ? ScatterAlways() : DirectAlways());
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<Tensors> t;
  for (int r = 0; r < c.size; ++r) t.push_back(MakeTensors(c.layout, r, c.numel));
  // The last float32/float64 tensor (Mixed: the float64 one), near its end.
  size_t bad_tensor = t[0].numels.size() - 1;
  if (c.layout == Layout::kMixed) bad_tensor = 1;
  const int64_t bad_element = t[0].numels[bad_tensor] - 2;
  const double good = t[c.bad_member].Get(bad_tensor, bad_element);
  t[c.bad_member].Set(bad_tensor, bad_element, c.bad);
  const std::vector<Tensors> before = t;
  RoundOptions options;
  options.check_finite = true;
  options.commit = c.commit;
  options.step = 41;
  // Twice: the round that agrees on the layout, and one between agreements.
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::vector<Result> res = RunRound(mesh, t, std::vector<RoundOptions>(c.size, options));
    for (int r = 0; r < c.size; ++r) {
      SCOPED_TRACE(absl::StrCat("member ", r, ": ", res[r].status.ToString()));
      ASSERT_EQ(res[r].status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(ErrorKindOf(res[r].status), ErrorKind::kNonFinite);
      EXPECT_EQ(ErrorPeerOf(res[r].status), c.bad_member);
      std::optional<NonFiniteDetail> d = NonFiniteDetailOf(res[r].status);
      ASSERT_TRUE(d.has_value());
      EXPECT_EQ(d->tensor, static_cast<int32_t>(bad_tensor));
      EXPECT_EQ(d->value, c.value);
      EXPECT_EQ(d->step, 41);
      EXPECT_THAT(std::string(res[r].status.message()),
                  HasSubstr(absl::StrCat("member ", c.bad_member,
                                         " of this subgroup contributed non-finite values: ",
                                         c.value, " in tensor ", bad_tensor)));
      EXPECT_EQ(res[r].outcome, RoundOutcome::kFailedWithoutResult);
      EXPECT_EQ(FirstDifference(t[r], before[r]), "") << "a refused round changed the tensors";
    }
  }
  // Repaired: the communicator is still usable, and averages by the checked rule.
  t[c.bad_member].Set(bad_tensor, bad_element, good);
  const Tensors want = Expected(t, std::vector<bool>(c.size, true), /*divide_first=*/true);
  std::vector<Result> res = RunRound(mesh, t, std::vector<RoundOptions>(c.size, options));
  for (int r = 0; r < c.size; ++r) {
    ASSERT_TRUE(res[r].status.ok()) << "member " << r << ": " << res[r].status;
    EXPECT_EQ(FirstDifference(t[r], want), "") << "member " << r;
  }
}

std::vector<FiniteCase> FiniteCases() {
  const double nan = std::nan(""), inf = HUGE_VAL;
  return {
      // Two members at a size of ten pieces: one buffer, packed, mixed dtypes; plain and
      // committed; either member.
      {2, kNumel, Layout::kOneF32, false, 1, nan, "NaN"},
      {2, kNumel, Layout::kOneF32, true, 0, inf, "+Inf"},
      {2, kNumel, Layout::kSeparateF32, false, 0, -inf, "-Inf"},
      {2, kNumel, Layout::kBackToBack, true, 1, nan, "NaN"},
      {2, kNumel, Layout::kMixed, true, 1, nan, "NaN"},
      // More members, small (what GlooAlgorithms sends direct).
      {3, 3001, Layout::kOneF32, false, 2, nan, "NaN"},
      {3, 3001, Layout::kSeparateF32, true, 1, inf, "+Inf"},
      {4, 1000, Layout::kMixed, false, 3, -inf, "-Inf"},
      {4, 1000, Layout::kOneF64, true, 0, nan, "NaN"},
      // The scatter-gather exchange: the value in the last member's range, or in another's.
      {3, kNumel, Layout::kOneF32, true, 2, nan, "NaN", true},
      {4, kNumel, Layout::kMixed, false, 1, inf, "+Inf", true},
      {4, 1000, Layout::kSeparateF32, true, 3, nan, "NaN", true},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, DirectFiniteCheckTest, ::testing::ValuesIn(FiniteCases()),
                         [](const ::testing::TestParamInfo<FiniteCase>& info) {
                           return absl::StrCat("Members", info.param.size,
                                               info.param.scatter ? "ScatterGather" : "",
                                               LayoutName(info.param.layout),
                                               info.param.commit ? "Committed" : "Plain",
                                               "Member", info.param.bad_member);
                         });

// Two members that both contribute a NaN: every member names the lower one.
TEST(DirectFiniteCheckTest, TwoMembersNonFinite_EveryMemberNamesTheLowest) {
  auto mesh = MakeGlooMesh(3, absl::Seconds(60), nullptr, false, DirectAlways());
  for (const auto& m : mesh) ASSERT_NE(m, nullptr);
  std::vector<Tensors> t = {MakeTensors(Layout::kSeparateF32, 0, 900),
                            MakeTensors(Layout::kSeparateF32, 1, 900),
                            MakeTensors(Layout::kSeparateF32, 2, 900)};
  t[2].Set(0, 3, std::nan(""));
  t[1].Set(2, 100, -HUGE_VAL);
  const std::vector<Tensors> before = t;
  RoundOptions options;
  options.check_finite = true;
  std::vector<Result> res = RunRound(mesh, t, {options, options, options});
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(absl::StrCat("member ", r, ": ", res[r].status.ToString()));
    EXPECT_EQ(ErrorKindOf(res[r].status), ErrorKind::kNonFinite);
    EXPECT_EQ(ErrorPeerOf(res[r].status), 1);
    ASSERT_TRUE(NonFiniteDetailOf(res[r].status).has_value());
    EXPECT_EQ(NonFiniteDetailOf(res[r].status)->tensor, 2);
    EXPECT_EQ(NonFiniteDetailOf(res[r].status)->value, "-Inf");
    EXPECT_EQ(FirstDifference(t[r], before[r]), "");
  }
}

}  // namespace
}  // namespace modelavg::client
