// The NCCL path's host logic (NcclCore, the staging layout) with simulated members as threads
// on the fake device of tests/testing/fake_nccl_device.h. Covers the layout agreed once per
// communicator (no collective on later calls; a member whose layout changed fails alone and asks
// for a new generation), the staged path's pipeline (buckets gathered on their own stream, each
// reduced after its own gather), and the rounds of an elastic job: the step and divisor
// agreement, members that contribute nothing, the zero-copy path's backup, the commit and a lost
// commit's kept result. Runs without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/communicator.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/payload/staging_layout.h"
#include "common/status_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_nccl_device.h"
#include "tests/reference/naive_payload.h"
#include "tests/reference/staging_reference.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::NaivePayloadRoundTrip;
using ::testing::HasSubstr;
using Reduce = DeviceOps::Reduce;

class NcclCoreTest : public ::testing::Test {
 protected:
  void MakeWorld(int n, size_t bucket_bytes = kStagingBucketBytes,
                 FakeOps::Policy policy = FakeOps::Policy::kCallerFirst) {
    cores_.clear();
    ops_.clear();
    {
      absl::MutexLock l(&requests_mu_);
      requests_.clear();
    }
    world_ = std::make_unique<FakeWorld>(n);
    for (int m = 0; m < n; ++m) {
      ops_.push_back(std::make_unique<FakeOps>(world_.get(), m));
      ops_.back()->policy = policy;
      cores_.push_back(std::make_unique<NcclCore>(ops_.back().get(), m, n, 0, bucket_bytes));
      ASSERT_TRUE(cores_.back()->Init().ok());
      // A member that asks for a new generation gets it: the peers' collectives are aborted.
      cores_.back()->SetNewGenerationRequest([this, m](const absl::Status& why) {
        {
          absl::MutexLock l(&requests_mu_);
          requests_.emplace_back(m, why);
        }
        world_->Abort(absl::AbortedError(
            absl::StrCat("the job moved to a new generation: member ", m, " failed out")));
      });
    }
  }
  // One call on every member at once; returns their results.
  std::vector<absl::Status> RunAll(std::vector<Params>& params) {
    std::vector<absl::Status> out(cores_.size());
    std::vector<std::thread> threads;
    for (size_t m = 0; m < cores_.size(); ++m) {
      threads.emplace_back([&, m] { out[m] = cores_[m]->Run(params[m].views); });
    }
    for (auto& t : threads) t.join();
    return out;
  }
  void ExpectNoHangMismatchOrIllegal() {
    EXPECT_FALSE(world_->mismatch()) << "the members issued different collectives";
    EXPECT_FALSE(world_->hang()) << "a member waited on a collective its peers never issued";
    for (size_t m = 0; m < ops_.size(); ++m) EXPECT_FALSE(ops_[m]->illegal) << "member " << m;
  }
  // Every member's tensors hold the mean of the members' initial values (fills base + m).
  void ExpectAveraged(const std::vector<Params>& params, double tolerance_ulps = 1) {
    const int n = static_cast<int>(params.size());
    for (int m = 0; m < n; ++m) {
      for (size_t t = 0; t < params[m].views.size(); ++t) {
        const int32_t code = StagingCodeOf(params[m].views[t].dtype);
        for (int64_t i = 0; i < params[m].views[t].numel; ++i) {
          double mean = 0;
          for (int k = 0; k < n; ++k) mean += RoundTo(code, 10.0 * k + 0.37 * t + 0.011 * i);
          mean = RoundTo(code, mean / n);
          const double ulp = std::abs(mean) * (code == kStageF64   ? 0x1p-52
                                               : code == kStageF32 ? 0x1p-23
                                               : code == kStageF16 ? 0x1p-10
                                                                   : 0x1p-7);
          ASSERT_NEAR(params[m].At(t, i), mean, tolerance_ulps * ulp + 1e-300)
              << "member " << m << " tensor " << t << " element " << i;
        }
      }
    }
  }
  static void FillAll(std::vector<Params>& params) {
    for (size_t m = 0; m < params.size(); ++m) params[m].Fill(10.0 * m);
  }

  struct Result {
    absl::Status status;
    RoundOutcome outcome = RoundOutcome::kCompleted;
  };
  // One round on every member at once, member m with options[m].
  std::vector<Result> RunRound(std::vector<Params>& params,
                               const std::vector<RoundOptions>& options) {
    std::vector<Result> out(cores_.size());
    std::vector<std::thread> threads;
    for (size_t m = 0; m < cores_.size(); ++m) {
      threads.emplace_back(
          [&, m] { out[m].status = cores_[m]->Run(params[m].views, options[m], &out[m].outcome); });
    }
    for (auto& t : threads) t.join();
    return out;
  }
  std::vector<Result> RunRound(std::vector<Params>& params, const RoundOptions& options) {
    return RunRound(params, std::vector<RoundOptions>(params.size(), options));
  }
  // Every member's tensors hold the mean of the initial values (fills 10 * k) of the members in
  // `contributors`.
  static void ExpectMeanOf(const std::vector<Params>& params, const std::vector<int>& contributors,
                           double tolerance_ulps) {
    for (size_t m = 0; m < params.size(); ++m) {
      for (size_t t = 0; t < params[m].views.size(); ++t) {
        const int32_t code = StagingCodeOf(params[m].views[t].dtype);
        for (int64_t i = 0; i < params[m].views[t].numel; ++i) {
          double mean = 0;
          for (int k : contributors) mean += RoundTo(code, 10.0 * k + 0.37 * t + 0.011 * i);
          mean /= static_cast<double>(contributors.size());
          const double ulp = std::abs(mean) * (code == kStageF64   ? 0x1p-52
                                               : code == kStageF32 ? 0x1p-23
                                               : code == kStageF16 ? 0x1p-10
                                                                   : 0x1p-7);
          ASSERT_NEAR(params[m].At(t, i), mean, tolerance_ulps * ulp + 1e-300)
              << "member " << m << " tensor " << t << " element " << i;
        }
      }
    }
  }
  // The bytes of a member's tensors.
  static std::vector<std::string> Bytes(const Params& p) {
    std::vector<std::string> out;
    for (const TensorView& v : p.views) {
      out.emplace_back(static_cast<const char*>(v.data), v.nbytes());
    }
    return out;
  }

  // The members' requests for a new generation: (member, why).
  std::vector<std::pair<int, absl::Status>> requests() {
    absl::MutexLock l(&requests_mu_);
    return requests_;
  }

  std::unique_ptr<FakeWorld> world_;
  absl::Mutex requests_mu_;
  std::vector<std::pair<int, absl::Status>> requests_ ABSL_GUARDED_BY(requests_mu_);
  std::vector<std::unique_ptr<FakeOps>> ops_;
  std::vector<std::unique_ptr<NcclCore>> cores_;
};

const std::vector<std::pair<DType, int64_t>> kMixed = {
    {DType::kFloat32, 1},  {DType::kFloat16, 7},  {DType::kBFloat16, 9},
    {DType::kFloat32, 33}, {DType::kFloat64, 3}, {DType::kFloat16, kStagingChunkElems + 5}};

TEST(StagingLayoutTest, PaddedLayout_EveryTensorAndChunkStartsOn16Bytes) {
  std::vector<TensorView> tensors;
  std::vector<char> dummy(16);
  for (const auto& [dtype, n] : kMixed) {
    tensors.push_back(TensorView{dummy.data(), n, dtype, Device::Cuda(0)});
  }
  for (int32_t code : {kStageF32, kStageF64, kStageF16}) {
    const StagingLayout padded = BuildStagingLayout(tensors, code, /*pad=*/true);
    int64_t need = 0;
    for (const StagingChunk& c : padded.chunks) {
      EXPECT_EQ(c.staging_offset * StagingCodeSize(code) % kStagingAlignBytes, 0u)
          << "code " << code << " offset " << c.staging_offset;
      need = std::max(need, c.staging_offset + c.numel);
    }
    EXPECT_EQ(padded.elems, need);
    // Unpadded: back to back, exactly the total.
    const StagingLayout flat = BuildStagingLayout(tensors, code, /*pad=*/false);
    int64_t total = 0;
    for (const auto& t : tensors) total += t.numel;
    EXPECT_EQ(flat.elems, total);
    EXPECT_EQ(flat.chunks.size(), padded.chunks.size());
  }
}

TEST(StagingLayoutTest, BFloat16IsReducedInFloat32AndNeverInPlace) {
  std::vector<uint16_t> b(8);
  std::vector<TensorView> one = {TensorView{b.data(), 4, DType::kBFloat16, Device::Cuda(0)},
                                 TensorView{b.data() + 4, 4, DType::kBFloat16, Device::Cuda(0)}};
  EXPECT_EQ(StagingCode(one), kStageF32);
  EXPECT_FALSE(IsZeroCopy(one));
  one[0].dtype = one[1].dtype = DType::kFloat16;
  EXPECT_EQ(StagingCode(one), kStageF16);
  EXPECT_TRUE(IsZeroCopy(one));
}

TEST(GrowableBufferTest, FailedGrowthHoldsNothing_NextReserveAllocatesAgain) {
  FakeWorld world(1);
  FakeOps ops(&world, 0);
  GrowableBuffer b;
  ASSERT_TRUE(b.Reserve(ops, 64).ok());
  EXPECT_EQ(b.capacity(), 64u);
  ops.fail_mallocs = 1;
  EXPECT_EQ(b.Reserve(ops, 128).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.capacity(), 0u) << "a freed buffer must not keep its old size";
  // Even a request the old size covered allocates again.
  bool grown = false;
  ASSERT_TRUE(b.Reserve(ops, 32, &grown).ok());
  EXPECT_TRUE(grown);
  EXPECT_NE(b.data(), nullptr);
  b.Release(ops);
}

TEST_F(NcclCoreTest, MixedDTypes_ThreeMembers_StagedAverageMatchesHostReference) {
  MakeWorld(3);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed),
                                Params::Separate(kMixed)};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  EXPECT_FALSE(cores_[0]->last_was_zero_copy());
}

TEST_F(NcclCoreTest, SameLayoutAgain_NoAgreementCollective_OnlyTheDataAllReduce) {
  MakeWorld(3);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed),
                                Params::Separate(kMixed)};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  for (int m = 0; m < 3; ++m) {
    EXPECT_TRUE(cores_[m]->layout_agreed());
    EXPECT_EQ(ops_[m]->ops.front(), "check") << "the first call agrees";
    ops_[m]->ops.clear();
  }
  // The same layout in other buffers (a fresh copy): compared locally, no collective but the
  // data's.
  for (int call = 0; call < 3; ++call) {
    std::vector<Params> again = {Params::Separate(kMixed), Params::Separate(kMixed),
                                 Params::Separate(kMixed)};
    FillAll(again);
    for (const absl::Status& s : RunAll(again)) ASSERT_TRUE(s.ok()) << s;
    ExpectAveraged(again);
  }
  ExpectNoHangMismatchOrIllegal();
  for (int m = 0; m < 3; ++m) {
    EXPECT_FALSE(ops_[m]->ops.empty());
    for (const std::string& op : ops_[m]->ops) {
      EXPECT_EQ(op.rfind("avg", 0), 0u) << "member " << m << " issued " << op;
    }
  }
  EXPECT_TRUE(requests().empty());
}

// A member whose layout changed after the agreement: it fails loudly, asks for a new
// generation, and never enters a collective its peers do not; the peers' data all-reduce is
// aborted (by the generation move), not left hanging or mixed.
struct LayoutChange {
  const char* name;
  std::function<Params()> before;
  std::function<Params()> after;
};

class NcclCoreLayoutChangeTest : public NcclCoreTest,
                                 public ::testing::WithParamInterface<LayoutChange> {};

TEST_P(NcclCoreLayoutChangeTest, OnOneMember_ItFailsWithLayoutMismatchAndAsksForANewGeneration) {
  const LayoutChange& c = GetParam();
  MakeWorld(3);
  std::vector<Params> params = {c.before(), c.before(), c.before()};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  for (auto& o : ops_) o->ops.clear();
  std::vector<Params> changed = {c.before(), c.after(), c.before()};
  FillAll(changed);
  std::vector<std::vector<std::string>> before;
  for (const Params& p : changed) before.push_back(Bytes(p));
  const std::vector<absl::Status> r = RunAll(changed);
  EXPECT_EQ(r[1].code(), absl::StatusCode::kInvalidArgument) << r[1];
  EXPECT_EQ(ErrorKindOf(r[1]), ErrorKind::kLayoutMismatch) << r[1];
  EXPECT_THAT(std::string(r[1].message()), HasSubstr("layout changed after"));
  EXPECT_TRUE(ops_[1]->ops.empty()) << "the changed member entered a collective";
  EXPECT_TRUE(ops_[1]->aborted) << "its communicator is aborted";
  const auto req = requests();
  ASSERT_EQ(req.size(), 1u) << "exactly one request for a new generation";
  EXPECT_EQ(req[0].first, 1);
  EXPECT_EQ(ErrorKindOf(req[0].second), ErrorKind::kLayoutMismatch);
  for (int m : {0, 2}) {
    EXPECT_EQ(r[m].code(), absl::StatusCode::kAborted) << "member " << m << ": " << r[m];
    EXPECT_THAT(std::string(r[m].message()), HasSubstr("new generation"));
    EXPECT_EQ(ops_[m]->ops.size(), 1u) << "member " << m << ": only the data all-reduce";
    EXPECT_FALSE(cores_[m]->broken().ok());
    if (!cores_[m]->last_was_zero_copy()) {
      EXPECT_EQ(Bytes(changed[m]), before[m]) << "member " << m << ": staged tensors untouched";
    }
  }
  EXPECT_FALSE(world_->mismatch()) << "the members issued different collectives";
  EXPECT_FALSE(world_->hang()) << "a peer was left waiting instead of aborted";
  EXPECT_EQ(cores_[1]->Run(changed[1].views).code(), absl::StatusCode::kInvalidArgument)
      << "the changed member's communicator stays failed";
}

INSTANTIATE_TEST_SUITE_P(
    Changes, NcclCoreLayoutChangeTest,
    ::testing::Values(
        LayoutChange{"OneMoreElement",
                     [] { return Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 6}}); },
                     [] { return Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 7}}); }},
        LayoutChange{"SameTotalOtherSizes",
                     [] { return Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 6}}); },
                     [] { return Params::Separate({{DType::kFloat32, 5}, {DType::kFloat32, 5}}); }},
        LayoutChange{"ZeroCopyDTypeChanges",
                     [] { return Params::Contiguous(DType::kFloat32, {8}); },
                     [] { return Params::Contiguous(DType::kFloat64, {8}); }},
        LayoutChange{"StagedDTypeChangesSameStagingCode",
                     [] { return Params::Separate({{DType::kFloat16, 8}, {DType::kFloat32, 8}}); },
                     [] { return Params::Separate({{DType::kBFloat16, 8}, {DType::kFloat32, 8}}); }},
        LayoutChange{"OneTensorFewer", [] { return Params::Separate(kMixed); },
                     [] {
                       auto fewer = kMixed;
                       fewer.pop_back();
                       return Params::Separate(fewer);
                     }}),
    [](const ::testing::TestParamInfo<LayoutChange>& i) { return std::string(i.param.name); });

TEST_F(NcclCoreTest, LocalFailureAfterTheAgreement_FailsAloneAndAsksForANewGeneration) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate({{DType::kFloat32, 4}}),
                                Params::Separate({{DType::kFloat32, 4}})};
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  params[0].views[0].device = Device::Host();
  const std::vector<absl::Status> r = RunAll(params);
  EXPECT_EQ(r[0].code(), absl::StatusCode::kInvalidArgument) << r[0];
  EXPECT_THAT(std::string(r[0].message()), HasSubstr("tensor 0 is on host"));
  EXPECT_EQ(r[1].code(), absl::StatusCode::kAborted) << r[1];
  ASSERT_EQ(requests().size(), 1u);
  EXPECT_EQ(requests()[0].first, 0);
  EXPECT_FALSE(world_->mismatch());
  EXPECT_FALSE(world_->hang());
}

TEST_F(NcclCoreTest, WorldOfOne_LayoutChanges_AgreesAgainAndStaysUsable) {
  MakeWorld(1);
  std::vector<Params> a = {Params::Separate({{DType::kFloat32, 4}})};
  std::vector<Params> b = {Params::Separate({{DType::kFloat32, 4}, {DType::kFloat16, 9}})};
  for (int call = 0; call < 2; ++call) {
    FillAll(a);
    FillAll(b);
    for (const absl::Status& s : RunAll(a)) ASSERT_TRUE(s.ok()) << s;
    for (const absl::Status& s : RunAll(b)) ASSERT_TRUE(s.ok()) << s;
    ExpectAveraged(a);
    ExpectAveraged(b);
  }
  // A local error is carried in the agreement, as at a first call: still usable.
  std::vector<Params> bad = a;
  bad[0].views[0].device = Device::Host();
  EXPECT_EQ(RunAll(bad)[0].code(), absl::StatusCode::kInvalidArgument);
  for (const absl::Status& s : RunAll(a)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(requests().empty());
  EXPECT_TRUE(cores_[0]->broken().ok());
}

TEST_F(NcclCoreTest, StagingMallocFailsOnOneMember_EveryMemberErrsWithoutHang_NextCallAverages) {
  MakeWorld(2);
  // At the first call (the agreement): member 1's cudaMalloc of the staging buffer fails.
  const std::vector<std::pair<DType, int64_t>> big = {{DType::kFloat32, 1000},
                                                      {DType::kFloat32, 3000}};
  std::vector<Params> params = {Params::Separate(big), Params::Separate(big)};
  FillAll(params);
  ops_[1]->fail_mallocs = 1;
  const std::vector<absl::Status> r = RunAll(params);
  EXPECT_EQ(r[1].code(), absl::StatusCode::kResourceExhausted) << r[1];
  EXPECT_EQ(r[0].code(), absl::StatusCode::kAborted) << r[0];
  EXPECT_THAT(std::string(r[0].message()), HasSubstr("member 1"));
  ExpectNoHangMismatchOrIllegal();
  EXPECT_EQ(cores_[1]->staging().data(), nullptr);
  EXPECT_EQ(cores_[1]->staging().capacity(), 0u);
  // Nobody is a collective behind and nothing points at freed memory: the next call averages.
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) EXPECT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  EXPECT_TRUE(cores_[0]->broken().ok());
  EXPECT_TRUE(cores_[1]->broken().ok());
}

TEST_F(NcclCoreTest, GatherOrChunkTableMallocFailsOnOneMember_CarriedInTheCheck) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed)};
  FillAll(params);
  ops_[0]->fail_gathers = 1;
  std::vector<absl::Status> r = RunAll(params);
  EXPECT_EQ(r[0].code(), absl::StatusCode::kInternal) << r[0];
  EXPECT_EQ(r[1].code(), absl::StatusCode::kAborted) << r[1];
  ExpectNoHangMismatchOrIllegal();
  // One more tensor: both buffers grow; member 1's staging buffer allocates, its chunk table
  // does not.
  std::vector<std::pair<DType, int64_t>> more = kMixed;
  more.push_back({DType::kFloat64, 100});
  params = {Params::Separate(more), Params::Separate(more)};
  FillAll(params);
  ops_[1]->fail_malloc_after = 1;
  r = RunAll(params);
  EXPECT_EQ(r[1].code(), absl::StatusCode::kResourceExhausted) << r[1];
  EXPECT_EQ(r[0].code(), absl::StatusCode::kAborted) << r[0];
  ExpectNoHangMismatchOrIllegal();
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) EXPECT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
}

TEST_F(NcclCoreTest, InvalidTensorOnOneMember_CarriedInTheCheck_NoHang) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate({{DType::kFloat32, 4}}),
                                Params::Separate({{DType::kFloat32, 4}})};
  params[0].views[0].device = Device::Host();
  const std::vector<absl::Status> r = RunAll(params);
  EXPECT_EQ(r[0].code(), absl::StatusCode::kInvalidArgument) << r[0];
  EXPECT_THAT(std::string(r[0].message()), HasSubstr("tensor 0 is on host"));
  EXPECT_EQ(r[1].code(), absl::StatusCode::kAborted) << r[1];
  ExpectNoHangMismatchOrIllegal();
}

TEST_F(NcclCoreTest, DataCollectiveFails_CommunicatorBrokenAfterwards) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate({{DType::kFloat32, 4}}),
                                Params::Separate({{DType::kFloat32, 4}})};
  ops_[0]->fail_averages = 1;
  const std::vector<absl::Status> r = RunAll(params);
  EXPECT_FALSE(r[0].ok());
  EXPECT_FALSE(r[1].ok());  // its peer never arrived: aborted after the deadline
  EXPECT_TRUE(ops_[0]->aborted);
  EXPECT_TRUE(ops_[1]->aborted);
  EXPECT_EQ(cores_[0]->Run(params[0].views), r[0]) << "a broken communicator stays broken";
  EXPECT_FALSE(world_->mismatch());
}

TEST_F(NcclCoreTest, BFloat16_ThreeMembersOfEqualValues_AverageIsExactlyThatValue) {
  MakeWorld(3);
  // Every bfloat16 in [1, 2) and [256, 512): with NCCL's bfloat16 ncclAvg (x * 0.333984 summed
  // three times) many of them come back one ulp high.
  std::vector<Params> params;
  for (int m = 0; m < 3; ++m) {
    params.push_back(Params::Contiguous(DType::kBFloat16, {128, 128}));
    for (int i = 0; i < 128; ++i) {
      StoreAs(params[m].views[0].data, kStageBF16, i, 1.0 + i / 128.0);
      StoreAs(params[m].views[1].data, kStageBF16, i, 256.0 + 2.0 * i);
    }
  }
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  for (int m = 0; m < 3; ++m) {
    for (int i = 0; i < 128; ++i) {
      ASSERT_EQ(params[m].At(0, i), 1.0 + i / 128.0) << "member " << m << " element " << i;
      ASSERT_EQ(params[m].At(1, i), 256.0 + 2.0 * i) << "member " << m << " element " << i;
    }
  }
}

TEST_F(NcclCoreTest, InPlaceMemberAndStagedMember_FallBackToTheUnpaddedLayout) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Separate({{DType::kFloat32, 1},
                                                  {DType::kFloat32, 3},
                                                  {DType::kFloat32, 5},
                                                  {DType::kFloat32, 70}})};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  EXPECT_TRUE(cores_[0]->last_was_zero_copy());
  EXPECT_FALSE(cores_[1]->last_was_zero_copy());
  EXPECT_EQ(ops_[0]->ops, (std::vector<std::string>{"check", "avg79"}));
  EXPECT_EQ(ops_[1]->ops, ops_[0]->ops);
}

TEST_F(NcclCoreTest, EmptyListOnEveryMember_RunsTheCheckOnly) {
  MakeWorld(2);
  std::vector<Params> params(2);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  EXPECT_EQ(ops_[0]->ops, std::vector<std::string>{"check"});
}

// ---- Rounds (RoundOptions): the step and divisor agreement, members that do not contribute,
// ---- the backup of the zero-copy path and the commit.

RoundOptions Committed(int64_t step) {
  RoundOptions o;
  o.step = step;
  o.commit = true;
  return o;
}

// The operations of one call, as the fake device logs them (collectives, copies with their
// bytes, kernels, host waits).
const std::vector<std::string> kPlainZeroCopyOps = {"copy120", "check", "copy120", "wait",
                                                    "avg79", "wait"};

TEST_F(NcclCoreTest, PlainRound_CostsWhatItCostBefore_NoBackupNoCommit) {
  MakeWorld(2);
  // Zero copy: the signature out and back, its all-reduce, the data all-reduce, two waits. The
  // same as before rounds had options, but for the signature's size (120 bytes with the
  // fragment split's and the finite check's words, was 64).
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Contiguous(DType::kFloat32, {1, 3, 5, 70})};
  FillAll(params);
  for (const Result& r : RunRound(params, RoundOptions{})) {
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.outcome, RoundOutcome::kCompleted);
  }
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  for (int m = 0; m < 2; ++m) {
    EXPECT_EQ(ops_[m]->log, kPlainZeroCopyOps) << "member " << m;
    EXPECT_EQ(cores_[m]->backup().data(), nullptr) << "a plain round allocates no backup";
    ops_[m]->log.clear();
  }
  // Once agreed, a call is the data all-reduce and its wait: nothing else.
  FillAll(params);
  for (const Result& r : RunRound(params, RoundOptions{})) ASSERT_TRUE(r.status.ok()) << r.status;
  for (int m = 0; m < 2; ++m) {
    EXPECT_EQ(ops_[m]->log, (std::vector<std::string>{"avg79", "wait"})) << "member " << m;
  }
  ExpectAveraged(params);
  // Staged (a new communicator), same layout as its first call: the gather, the all-reduce,
  // the scatter.
  MakeWorld(2);
  std::vector<Params> staged = {
      Params::Separate({{DType::kFloat32, 3}, {DType::kFloat16, 5}}),
      Params::Separate({{DType::kFloat32, 3}, {DType::kFloat16, 5}})};
  FillAll(staged);
  RunRound(staged, RoundOptions{});
  const int mallocs = ops_[0]->mallocs;
  ops_[0]->log.clear();
  FillAll(staged);
  for (const Result& r : RunRound(staged, RoundOptions{})) ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ops_[0]->log,
            (std::vector<std::string>{"gather", "avg9", "wait", "scatter", "wait"}));
  EXPECT_EQ(ops_[0]->mallocs, mallocs);
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(staged);
}

TEST_F(NcclCoreTest, CommittedRound_CostsOneBackupCopyAndOneOneWordAllReduce) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Contiguous(DType::kFloat32, {1, 3, 5, 70})};
  FillAll(params);
  for (const Result& r : RunRound(params, Committed(3))) {
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.outcome, RoundOutcome::kCompleted);
  }
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  // Beyond a plain round: the backup (79 float32, enqueued before the check, no wait of its
  // own) and the commit (8 bytes out, the all-reduce, 8 bytes back, one wait).
  EXPECT_EQ(ops_[0]->log,
            (std::vector<std::string>{"copy316", "copy120", "check", "copy120", "wait", "avg79",
                                      "wait", "copy8", "commit", "copy8", "wait"}));
  EXPECT_EQ(ops_[0]->ops, (std::vector<std::string>{"check", "avg79", "commit"}));
  EXPECT_EQ(ops_[1]->ops, ops_[0]->ops);
  EXPECT_GE(cores_[0]->backup().capacity(), 316u);
  // Staged (a new communicator): no backup (the tensors are only written on success), the
  // commit only.
  MakeWorld(2);
  std::vector<Params> staged = {
      Params::Separate({{DType::kFloat32, 3}, {DType::kFloat16, 5}}),
      Params::Separate({{DType::kFloat32, 3}, {DType::kFloat16, 5}})};
  FillAll(staged);
  RunRound(staged, Committed(4));
  ops_[0]->log.clear();
  FillAll(staged);
  for (const Result& r : RunRound(staged, Committed(5))) {
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.outcome, RoundOutcome::kCompleted);
  }
  EXPECT_EQ(ops_[0]->log,
            (std::vector<std::string>{"gather", "avg9", "wait", "copy8", "commit", "copy8", "wait",
                                      "scatter", "wait_local"}));
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(staged);
}

class NcclCoreRoundTest : public NcclCoreTest, public ::testing::WithParamInterface<bool> {
 protected:
  // The zero-copy path (one buffer) or the staged one (separate tensors of two dtypes).
  Params Make() const {
    return GetParam() ? Params::Contiguous(DType::kFloat32, {3, 40, 7})
                      : Params::Separate({{DType::kFloat32, 3}, {DType::kFloat16, 40},
                                          {DType::kBFloat16, 7}});
  }
};

TEST_P(NcclCoreRoundTest, LostCommitOnOneMember_OthersComplete_ItHoldsTheResultAndAdoptsIt) {
  MakeWorld(3);
  std::vector<Params> params = {Make(), Make(), Make()};
  FillAll(params);
  const std::vector<std::string> before = Bytes(params[1]);
  ops_[1]->lose_commits = 1;
  const std::vector<Result> r = RunRound(params, Committed(12));
  ExpectNoHangMismatchOrIllegal();
  EXPECT_TRUE(r[0].status.ok()) << r[0].status;
  EXPECT_TRUE(r[2].status.ok()) << r[2].status;
  EXPECT_EQ(r[0].outcome, RoundOutcome::kCompleted);
  EXPECT_EQ(r[2].outcome, RoundOutcome::kCompleted);
  EXPECT_EQ(r[1].status.code(), absl::StatusCode::kUnavailable) << r[1].status;
  EXPECT_EQ(r[1].outcome, RoundOutcome::kFailedHoldingResult);
  EXPECT_EQ(Bytes(params[1]), before) << "a failed round must leave the parameters untouched";
  EXPECT_TRUE(cores_[1]->has_pending_result());
  EXPECT_FALSE(cores_[1]->broken().ok()) << "the communicator is aborted after a lost commit";
  EXPECT_TRUE(ops_[1]->aborted);
  // Adopting: exactly the result its peers completed with, on the aborted communicator.
  ASSERT_TRUE(cores_[1]->Adopt(params[1].views).ok());
  EXPECT_EQ(Bytes(params[1]), Bytes(params[0]));
  EXPECT_EQ(Bytes(params[2]), Bytes(params[0]));
  ExpectAveraged(params);
  EXPECT_FALSE(cores_[1]->has_pending_result());
  EXPECT_EQ(cores_[1]->Adopt(params[1].views).code(), absl::StatusCode::kFailedPrecondition)
      << "a kept result is adopted once";
  // The completed members keep nothing.
  EXPECT_EQ(cores_[0]->Adopt(params[0].views).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(NcclCoreRoundTest, AdoptWithAnotherLayout_InvalidArgument_ResultStillKept) {
  MakeWorld(2);
  std::vector<Params> params = {Make(), Make()};
  FillAll(params);
  ops_[0]->lose_commits = 1;
  const std::vector<Result> r = RunRound(params, Committed(1));
  ASSERT_EQ(r[0].outcome, RoundOutcome::kFailedHoldingResult);
  Params other = Params::Contiguous(DType::kFloat32, {11});
  EXPECT_EQ(cores_[0]->Adopt(other.views).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cores_[0]->Adopt(params[0].views).ok());
  EXPECT_EQ(Bytes(params[0]), Bytes(params[1]));
}

TEST_P(NcclCoreRoundTest, FailureMidCollective_ParametersExactlyAsBefore_PeersHoldTheResult) {
  MakeWorld(3);
  std::vector<Params> params = {Make(), Make(), Make()};
  FillAll(params);
  std::vector<std::vector<std::string>> before;
  for (const Params& p : params) before.push_back(Bytes(p));
  // Member 0's all-reduce fails after running, leaving its buffer (the caller's, on the
  // zero-copy path) partly reduced; it never confirms, so its peers' commit never completes.
  ops_[0]->fail_average_waits = 1;
  const std::vector<Result> r = RunRound(params, Committed(40));
  EXPECT_FALSE(world_->mismatch());
  for (int m = 0; m < 3; ++m) {
    EXPECT_FALSE(ops_[m]->illegal) << "member " << m;
    EXPECT_FALSE(r[m].status.ok()) << "member " << m;
    EXPECT_EQ(Bytes(params[m]), before[m])
        << "member " << m << ": a failed round must leave the parameters exactly as before";
    EXPECT_FALSE(cores_[m]->broken().ok());
  }
  EXPECT_EQ(r[0].outcome, RoundOutcome::kFailedWithoutResult);
  EXPECT_EQ(r[1].outcome, RoundOutcome::kFailedHoldingResult);
  EXPECT_EQ(r[2].outcome, RoundOutcome::kFailedHoldingResult);
  EXPECT_EQ(cores_[0]->Adopt(params[0].views).code(), absl::StatusCode::kFailedPrecondition);
  // The members that had the result can still take it (if a peer had completed).
  ASSERT_TRUE(cores_[1]->Adopt(params[1].views).ok());
  ASSERT_TRUE(cores_[2]->Adopt(params[2].views).ok());
  EXPECT_EQ(Bytes(params[1]), Bytes(params[2]));
}

INSTANTIATE_TEST_SUITE_P(ZeroCopyAndStaged, NcclCoreRoundTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("ZeroCopy") : std::string("Staged");
                         });

TEST_F(NcclCoreTest, LostCommit_UnpaddedFallback_AdoptedIntoOtherBuffersOfTheSameLayout) {
  // Member 0 reduces in place, member 1 stages: both use the unpadded layout. Member 1's commit
  // is lost; it adopts the kept result into other tensors of the same layout (the chunk table
  // is uploaded again, the staging buffer that holds the result is not touched).
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Separate({{DType::kFloat32, 1},
                                                  {DType::kFloat32, 3},
                                                  {DType::kFloat32, 5},
                                                  {DType::kFloat32, 70}})};
  FillAll(params);
  const std::vector<std::string> before = Bytes(params[1]);
  ops_[1]->lose_commits = 1;
  const std::vector<Result> r = RunRound(params, Committed(2));
  ExpectNoHangMismatchOrIllegal();
  ASSERT_TRUE(r[0].status.ok()) << r[0].status;
  ASSERT_EQ(r[1].outcome, RoundOutcome::kFailedHoldingResult);
  EXPECT_EQ(ops_[0]->ops, (std::vector<std::string>{"check", "avg79", "commit"}));
  EXPECT_EQ(Bytes(params[1]), before);
  Params elsewhere = Params::Separate({{DType::kFloat32, 1},
                                       {DType::kFloat32, 3},
                                       {DType::kFloat32, 5},
                                       {DType::kFloat32, 70}});
  ASSERT_TRUE(cores_[1]->Adopt(elsewhere.views).ok());
  EXPECT_FALSE(ops_[1]->illegal);
  EXPECT_EQ(Bytes(params[1]), before) << "the round's own tensors are not written";
  for (size_t t = 0; t < elsewhere.views.size(); ++t) {
    for (int64_t i = 0; i < elsewhere.views[t].numel; ++i) {
      ASSERT_EQ(elsewhere.At(t, i), params[0].At(t, i)) << "tensor " << t << " element " << i;
    }
  }
}

TEST_F(NcclCoreTest, PlainRound_FailureMidCollective_ZeroCopyBufferIsUndefined) {
  // The weak point a committed round removes: without the backup, the failed member's buffer
  // is what NCCL left in it (this also shows that the fake failure does touch the buffer).
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {8}),
                                Params::Contiguous(DType::kFloat32, {8})};
  FillAll(params);
  const std::vector<std::string> before = Bytes(params[0]);
  ops_[0]->fail_average_waits = 1;
  const std::vector<Result> r = RunRound(params, RoundOptions{});
  EXPECT_FALSE(r[0].status.ok());
  EXPECT_NE(Bytes(params[0]), before);
}

TEST_F(NcclCoreTest, JoiningMember_ReceivesTheAverageOfTheOthers) {
  for (bool zero_copy : {true, false}) {
    SCOPED_TRACE(zero_copy ? "zero copy" : "staged");
    cores_.clear();  // before the fake devices they free into
    ops_.clear();
    MakeWorld(4);
    std::vector<Params> params;
    for (int m = 0; m < 4; ++m) {
      params.push_back(zero_copy ? Params::Contiguous(DType::kFloat32, {5, 300})
                                 : Params::Separate({{DType::kFloat32, 5},
                                                     {DType::kFloat64, 300}}));
    }
    FillAll(params);
    // Member 3 was admitted at this step: whatever its tensors hold, it contributes nothing.
    params[3].Fill(1e6);
    ops_[3]->SetParams(params[3].storage[0].data(), params[3].storage[0].size());
    std::vector<RoundOptions> options(4, Committed(100));
    for (RoundOptions& o : options) o.contributors = 3;
    options[3].contribute = false;
    for (const Result& r : RunRound(params, options)) {
      ASSERT_TRUE(r.status.ok()) << r.status;
      EXPECT_EQ(r.outcome, RoundOutcome::kCompleted);
    }
    ExpectNoHangMismatchOrIllegal();
    // Sums of x * (1/3 rounded to the dtype): within 2 ulps of the mean of members 0..2.
    ExpectMeanOf(params, {0, 1, 2}, 2);
    EXPECT_EQ(Bytes(params[3]), Bytes(params[0]));
    EXPECT_EQ(ops_[3]->ops, ops_[0]->ops) << "the joining member issues the same collectives";
  }
}

TEST_F(NcclCoreTest, JoiningMember_FailureMidCollective_ItsParametersAreNotZeroed) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {16}),
                                Params::Contiguous(DType::kFloat32, {16})};
  FillAll(params);
  ops_[1]->SetParams(params[1].storage[0].data(), params[1].storage[0].size());
  const std::vector<std::string> before = Bytes(params[1]);
  std::vector<RoundOptions> options(2, Committed(9));
  for (RoundOptions& o : options) o.contributors = 1;
  options[1].contribute = false;
  ops_[1]->fail_average_waits = 1;
  const std::vector<Result> r = RunRound(params, options);
  EXPECT_FALSE(r[1].status.ok());
  EXPECT_EQ(r[1].outcome, RoundOutcome::kFailedWithoutResult);
  EXPECT_EQ(Bytes(params[1]), before) << "its own values come back, not zeros";
  EXPECT_FALSE(ops_[1]->illegal);
}

TEST_F(NcclCoreTest, StepMismatch_EveryMemberFailsWithoutADataCollective_CommunicatorUsable) {
  MakeWorld(3);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {6}),
                                Params::Contiguous(DType::kFloat32, {6}),
                                Params::Contiguous(DType::kFloat32, {6})};
  FillAll(params);
  std::vector<std::vector<std::string>> before;
  for (const Params& p : params) before.push_back(Bytes(p));
  std::vector<RoundOptions> options = {Committed(7), Committed(8), Committed(7)};
  for (const Result& r : RunRound(params, options)) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("averaging different rounds"));
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("steps range from 7 to 8"));
    EXPECT_EQ(r.outcome, RoundOutcome::kFailedWithoutResult);
  }
  ExpectNoHangMismatchOrIllegal();
  for (int m = 0; m < 3; ++m) {
    EXPECT_EQ(ops_[m]->ops, std::vector<std::string>{"check"}) << "member " << m;
    EXPECT_EQ(Bytes(params[m]), before[m]);
    EXPECT_TRUE(cores_[m]->broken().ok());
  }
  // Different divisors: the same.
  options = {Committed(9), Committed(9), Committed(9)};
  options[2].contributors = 2;
  for (const Result& r : RunRound(params, options)) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("averaging different rounds"));
  }
  // A member that passes no step (-1) agrees with any; the round averages.
  options = {Committed(10), Committed(10), Committed(-1)};
  for (const Result& r : RunRound(params, options)) EXPECT_TRUE(r.status.ok()) << r.status;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
}

TEST_F(NcclCoreTest, InvalidDivisorOnOneMember_CarriedInTheCheck_NoHang) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {4}),
                                Params::Contiguous(DType::kFloat32, {4})};
  std::vector<RoundOptions> options(2);
  options[0].contributors = 3;
  const std::vector<Result> r = RunRound(params, options);
  EXPECT_EQ(r[0].status.code(), absl::StatusCode::kInvalidArgument) << r[0].status;
  EXPECT_THAT(std::string(r[0].status.message()), HasSubstr("no valid divisor"));
  EXPECT_EQ(r[1].status.code(), absl::StatusCode::kAborted) << r[1].status;
  ExpectNoHangMismatchOrIllegal();
}

TEST_F(NcclCoreTest, BackupAllocationFails_CarriedInTheCheck_NobodyAverages) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {64}),
                                Params::Contiguous(DType::kFloat32, {64})};
  FillAll(params);
  const std::vector<std::string> before = Bytes(params[1]);
  ops_[1]->fail_mallocs = 1;
  const std::vector<Result> r = RunRound(params, Committed(0));
  EXPECT_EQ(r[1].status.code(), absl::StatusCode::kResourceExhausted) << r[1].status;
  EXPECT_THAT(std::string(r[1].status.message()), HasSubstr("backing up the parameters"));
  EXPECT_EQ(r[0].status.code(), absl::StatusCode::kAborted) << r[0].status;
  EXPECT_EQ(ops_[0]->ops, std::vector<std::string>{"check"});
  EXPECT_EQ(Bytes(params[1]), before);
  ExpectNoHangMismatchOrIllegal();
  // The next committed round averages.
  for (const Result& r2 : RunRound(params, Committed(1))) EXPECT_TRUE(r2.status.ok()) << r2.status;
  ExpectAveraged(params);
}

TEST_F(NcclCoreTest, MemberThatNeverConfirms_EveryOtherMemberHoldsTheResult_NoneCompletes) {
  MakeWorld(3);
  std::vector<Params> params = {Params::Separate({{DType::kFloat32, 10}}),
                                Params::Separate({{DType::kFloat32, 10}}),
                                Params::Separate({{DType::kFloat32, 10}})};
  FillAll(params);
  std::vector<std::vector<std::string>> before;
  for (const Params& p : params) before.push_back(Bytes(p));
  ops_[2]->skip_commits = 1;  // dies right after its data all-reduce
  const std::vector<Result> r = RunRound(params, Committed(5));
  EXPECT_FALSE(world_->mismatch());
  for (int m = 0; m < 3; ++m) {
    EXPECT_FALSE(r[m].status.ok()) << "member " << m;
    EXPECT_EQ(r[m].outcome, RoundOutcome::kFailedHoldingResult) << "member " << m;
    EXPECT_EQ(Bytes(params[m]), before[m]) << "member " << m;
  }
}

// ---- The staged path's pipeline: gathers bucket by bucket on a stream of their own, each
// ---- bucket's all-reduce after its own gather only.

// 256 tensors of mixed sizes (1 to ~3 buckets each at a 4 KiB bucket) in `dtypes`, in turn.
std::vector<std::pair<DType, int64_t>> ManyTensors(const std::vector<DType>& dtypes) {
  std::vector<std::pair<DType, int64_t>> out;
  for (int t = 0; t < 256; ++t) {
    const int64_t n = 1 + (t * 37) % 97 + (t % 16 == 0 ? 3000 : 0);
    out.emplace_back(dtypes[t % dtypes.size()], n);
  }
  return out;
}

struct PipelineCase {
  const char* name;
  std::vector<DType> dtypes;
  FakeOps::Policy policy;
};

class NcclCorePipelineTest : public NcclCoreTest,
                             public ::testing::WithParamInterface<PipelineCase> {};

TEST_P(NcclCorePipelineTest, ManyMisalignedTensors_EveryCall_MatchesTheReference) {
  const PipelineCase& c = GetParam();
  MakeWorld(3, /*bucket_bytes=*/4096, c.policy);
  const auto spec = ManyTensors(c.dtypes);
  const bool sixteen = c.dtypes.size() == 1 && c.dtypes[0] == DType::kFloat16;
  for (int call = 0; call < 3; ++call) {
    std::vector<Params> params = {Params::Misaligned(spec), Params::Misaligned(spec),
                                  Params::Misaligned(spec)};
    FillAll(params);
    for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
    ExpectNoHangMismatchOrIllegal();
    // NCCL's ncclAvg multiplies each input by a rounded 1/3 and rounds the sum per member: a
    // few ulps of the reduction dtype (float16 for float16, float32 otherwise).
    ExpectAveraged(params, sixteen ? 4 : 2);
  }
  for (int m = 0; m < 3; ++m) {
    EXPECT_FALSE(ops_[m]->deadlock);
    int gathers_on_own_stream = 0;
    for (const std::string& op : ops_[m]->exec) {
      if (op.rfind("gather@", 0) == 0) {
        EXPECT_EQ(op, "gather@s1") << "a gather on the caller's stream";
        ++gathers_on_own_stream;
      }
    }
    EXPECT_GT(gathers_on_own_stream, 3 * 10) << "more than ten buckets a call";
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypesAndOrders, NcclCorePipelineTest,
    ::testing::Values(
        PipelineCase{"Float32CallerFirst", {DType::kFloat32}, FakeOps::Policy::kCallerFirst},
        PipelineCase{"Float32OthersFirst", {DType::kFloat32}, FakeOps::Policy::kOthersFirst},
        PipelineCase{"BFloat16CallerFirst", {DType::kBFloat16}, FakeOps::Policy::kCallerFirst},
        PipelineCase{"BFloat16OthersFirst", {DType::kBFloat16}, FakeOps::Policy::kOthersFirst},
        PipelineCase{"Float16CallerFirst", {DType::kFloat16}, FakeOps::Policy::kCallerFirst},
        PipelineCase{"Float16OthersFirst", {DType::kFloat16}, FakeOps::Policy::kOthersFirst},
        PipelineCase{"MixedCallerFirst",
                     {DType::kFloat32, DType::kBFloat16, DType::kFloat16},
                     FakeOps::Policy::kCallerFirst},
        PipelineCase{"MixedOthersFirst",
                     {DType::kFloat32, DType::kBFloat16, DType::kFloat16},
                     FakeOps::Policy::kOthersFirst}),
    [](const ::testing::TestParamInfo<PipelineCase>& i) { return std::string(i.param.name); });

TEST_F(NcclCoreTest, StagedPipeline_BucketKPlusOneIsGatheredWhileBucketKIsReduced) {
  MakeWorld(2, /*bucket_bytes=*/1024);
  // 8 float32 tensors of 1000: 32000 bytes in 32 buckets of (at most) 256 elements.
  const std::vector<std::pair<DType, int64_t>> spec(8, {DType::kFloat32, 1000});
  std::vector<Params> params = {Params::Separate(spec), Params::Separate(spec)};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  for (auto& o : ops_) {
    o->exec.clear();
    o->log.clear();
  }
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  const std::vector<std::string>& exec = ops_[0]->exec;
  std::vector<std::string> expected;
  // The caller's stream runs as soon as it may: bucket k's all-reduce waits for bucket k's
  // gather and nothing else, so the two streams alternate (on a GPU: they overlap).
  for (int k = 0; k < 32; ++k) {
    expected.push_back("gather@s1");
    expected.push_back("record");
    expected.push_back(k < 31 ? "avg256@caller" : "avg64@caller");  // 8000 = 31 * 256 + 64
  }
  expected.insert(expected.begin(), "record");  // the gathers start after the caller's work
  expected.push_back("scatter@caller");
  EXPECT_EQ(exec, expected);
  EXPECT_EQ(ops_[0]->ops, ops_[1]->ops);
  EXPECT_EQ(std::count(ops_[0]->log.begin(), ops_[0]->log.end(), "wait"), 2)
      << "one host wait for the reduction, one for the scatter";
  // The streams and events go with the core.
  cores_.clear();
  EXPECT_EQ(ops_[0]->destroyed_streams, 1);
  EXPECT_EQ(ops_[0]->destroyed_events, 33);
}

TEST_F(NcclCoreTest, StagedPipeline_ZeroCopyAndStagedMembers_IssueTheSameBuckets) {
  MakeWorld(2, /*bucket_bytes=*/64);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Separate({{DType::kFloat32, 1},
                                                  {DType::kFloat32, 3},
                                                  {DType::kFloat32, 5},
                                                  {DType::kFloat32, 70}})};
  for (int call = 0; call < 2; ++call) {
    FillAll(params);
    for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
    ExpectNoHangMismatchOrIllegal();
    ExpectAveraged(params);
  }
  // 79 elements, unpadded, in buckets of 16: 16, 16, 16, 16, 15, every call.
  const std::vector<std::string> call = {"avg16", "avg16", "avg16", "avg16", "avg15"};
  std::vector<std::string> expected = {"check"};
  expected.insert(expected.end(), call.begin(), call.end());
  expected.insert(expected.end(), call.begin(), call.end());
  EXPECT_EQ(ops_[0]->ops, expected);
  EXPECT_EQ(ops_[1]->ops, expected);
}

TEST_F(NcclCoreTest, StagedPipeline_JoiningMember_ReducesZerosWithoutGathers) {
  MakeWorld(3, /*bucket_bytes=*/256);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed),
                                Params::Separate(kMixed)};
  FillAll(params);
  std::vector<RoundOptions> options(3);
  for (RoundOptions& o : options) o.contributors = 2;
  options[2].contribute = false;
  for (const Result& r : RunRound(params, options)) ASSERT_TRUE(r.status.ok()) << r.status;
  ExpectNoHangMismatchOrIllegal();
  ExpectMeanOf(params, {0, 1}, 2);
  EXPECT_EQ(ops_[2]->gathers, 0);
  EXPECT_GT(ops_[0]->gathers, 1);
}

// The finite check (RoundOptions::check_finite) on the NCCL path: CheckFinite after each
// bucket's gather, the member's code in slots after the data, the verdict before the commit and
// the scatter.
constexpr double kNaNValue = std::numeric_limits<double>::quiet_NaN();
constexpr double kInfValue = std::numeric_limits<double>::infinity();

void ExpectNonFiniteNaming(const absl::Status& s, int member, int tensor, const char* value,
                           int64_t step) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ErrorKindOf(s), ErrorKind::kNonFinite) << s;
  EXPECT_EQ(ErrorPeerOf(s), member) << s;
  std::optional<NonFiniteDetail> d = NonFiniteDetailOf(s);
  ASSERT_TRUE(d.has_value()) << s;
  EXPECT_EQ(d->tensor, tensor) << s;
  EXPECT_EQ(d->value, value) << s;
  EXPECT_EQ(d->step, step) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("member ", member, " of this subgroup contributed non-finite "
                                     "values: ", value, " in tensor ", tensor)));
}

TEST_F(NcclCoreTest, FiniteCheck_OneMemberNonFinite_EveryMemberFailsNamingIt_NothingChanges) {
  struct Case {
    int tensor;  // in kMixed: 2 bfloat16, 4 float64, 5 float16 (two chunks)
    int64_t element;
    double bad;
    const char* value;
    bool commit;
  };
  for (const Case& c : {Case{4, 2, kNaNValue, "NaN", false},
                        Case{2, 8, kInfValue, "+Inf", true},
                        Case{5, kStagingChunkElems + 2, -kInfValue, "-Inf", false},
                        Case{0, 0, kNaNValue, "NaN", true}}) {
    SCOPED_TRACE(absl::StrCat("tensor ", c.tensor, " ", c.value, c.commit ? " committed" : ""));
    // Small buckets: the slots ride with the last of several.
    MakeWorld(3, /*bucket_bytes=*/256);
    std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed),
                                  Params::Separate(kMixed)};
    FillAll(params);
    const TensorView& v = params[1].views[c.tensor];
    StoreAs(v.data, StagingCodeOf(v.dtype), c.element, c.bad);
    std::vector<std::vector<std::string>> before;
    for (const Params& p : params) before.push_back(Bytes(p));
    RoundOptions o;
    o.check_finite = true;
    o.commit = c.commit;
    o.step = 30;
    for (const Result& r : RunRound(params, o)) {
      ExpectNonFiniteNaming(r.status, 1, c.tensor, c.value, 30);
      EXPECT_EQ(r.outcome, RoundOutcome::kFailedWithoutResult);
    }
    ExpectNoHangMismatchOrIllegal();
    for (int m = 0; m < 3; ++m) EXPECT_EQ(Bytes(params[m]), before[m]) << "member " << m;
    EXPECT_TRUE(requests().empty()) << "a non-finite member asks for no new generation";
    // Repaired, the next round on the same communicators averages exactly.
    FillAll(params);
    for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
    ExpectNoHangMismatchOrIllegal();
    ExpectAveraged(params);
  }
}

TEST_F(NcclCoreTest, FiniteCheck_Float16Staging_CodesOfThreeDigitsSurviveTheAverage) {
  // Float16 staging holds a code in three base-256 digits: tensor 69's NaN is code 277.
  MakeWorld(4, /*bucket_bytes=*/512);
  const std::vector<std::pair<DType, int64_t>> spec(70, {DType::kFloat16, 9});
  std::vector<Params> params(4, Params::Separate(spec));
  FillAll(params);
  StoreAs(params[2].views[69].data, kStageF16, 8, kNaNValue);
  StoreAs(params[3].views[69].data, kStageF16, 0, kInfValue);
  RoundOptions o;
  o.check_finite = true;
  o.step = 7;
  std::vector<Result> out = RunRound(params, o);
  for (const Result& r : out) ExpectNonFiniteNaming(r.status, 2, 69, "NaN", 7);
  EXPECT_THAT(std::string(out[0].status.message()), HasSubstr("1 more member(s)"));
  ExpectNoHangMismatchOrIllegal();
}

TEST_F(NcclCoreTest, FiniteCheck_NoExtraCollective_OneScanPerBucketOnTheGatherStream) {
  MakeWorld(2, /*bucket_bytes=*/1024);
  const std::vector<std::pair<DType, int64_t>> spec(8, {DType::kFloat32, 1000});
  std::vector<Params> params = {Params::Separate(spec), Params::Separate(spec)};
  RoundOptions o;
  o.check_finite = true;
  FillAll(params);
  for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
  for (auto& f : ops_) {
    f->exec.clear();
    f->log.clear();
    f->ops.clear();
  }
  FillAll(params);
  for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  // The same 32 bucket all-reduces as without the check; the last carries the two slots.
  std::vector<std::string> collectives(31, "avg256");
  collectives.push_back("avg66");
  EXPECT_EQ(ops_[0]->ops, collectives);
  EXPECT_EQ(ops_[1]->ops, collectives);
  const std::vector<std::string>& log = ops_[0]->log;
  EXPECT_EQ(std::count(log.begin(), log.end(), "check_finite"), 32) << "one scan per bucket";
  EXPECT_EQ(std::count(log.begin(), log.end(), "finite_slots"), 1);
  EXPECT_EQ(std::count(log.begin(), log.end(), "wait"), 2)
      << "no host wait of its own: the slots come back with the reduction's";
  // Each bucket's scan runs on the gather stream right after its gather, the slots before the
  // last bucket's event.
  const std::vector<std::string>& exec = ops_[0]->exec;
  int scans = 0;
  for (size_t i = 0; i + 1 < exec.size(); ++i) {
    if (exec[i] == "gather@s1") {
      EXPECT_EQ(exec[i + 1], "check_finite@s1") << "at " << i;
      ++scans;
    }
  }
  EXPECT_EQ(scans, 32);
  const auto slots = std::find(exec.begin(), exec.end(), "finite_slots@s1");
  const auto last = std::find(exec.begin(), exec.end(), "avg66@caller");
  ASSERT_NE(slots, exec.end());
  EXPECT_LT(slots - exec.begin(), last - exec.begin());
}

TEST_F(NcclCoreTest, FiniteCheck_ZeroCopyCandidates_AreStagedAndAveraged) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {1, 3, 5, 70}),
                                Params::Contiguous(DType::kFloat32, {1, 3, 5, 70})};
  RoundOptions o;
  o.check_finite = true;
  o.commit = true;
  o.step = 3;
  FillAll(params);
  for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
  EXPECT_FALSE(cores_[0]->last_was_zero_copy()) << "the slots ride after the data, staged";
  FillAll(params);
  StoreAs(params[0].views[3].data, kStageF32, 69, -kInfValue);
  const std::vector<std::string> before = Bytes(params[1]);
  for (const Result& r : RunRound(params, o)) ExpectNonFiniteNaming(r.status, 0, 3, "-Inf", 3);
  EXPECT_EQ(Bytes(params[1]), before);
}

TEST_F(NcclCoreTest, FiniteCheck_CompressedPayloads_ANaNFailsEveryMemberThenTheyAverage) {
  for (Payload payload : {Payload::kInt8, Payload::kBf16}) {
    SCOPED_TRACE(PayloadName(payload));
    MakeWorld(3);
    const std::vector<std::pair<DType, int64_t>> spec = {{DType::kFloat32, 1000},
                                                         {DType::kFloat32, 3001}};
    std::vector<Params> params(3, Params::Separate(spec));
    FillAll(params);
    StoreAs(params[2].views[1].data, kStageF32, 3000, kNaNValue);
    std::vector<std::vector<std::string>> before;
    for (const Params& p : params) before.push_back(Bytes(p));
    RoundOptions o;
    o.check_finite = true;
    o.payload = payload;
    o.step = 4;
    for (const Result& r : RunRound(params, o)) ExpectNonFiniteNaming(r.status, 2, 1, "NaN", 4);
    ExpectNoHangMismatchOrIllegal();
    for (int m = 0; m < 3; ++m) EXPECT_EQ(Bytes(params[m]), before[m]) << "member " << m;
    FillAll(params);
    for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
    ExpectNoHangMismatchOrIllegal();
    for (int m = 0; m < 3; ++m) {
      EXPECT_EQ(Bytes(params[m]), Bytes(params[0])) << "member " << m;
      // Within the payloads' bound of the mean (10 + 0.37 t + 0.011 i, at most about 44).
      EXPECT_NEAR(params[m].At(1, 3000), 10 + 0.37 + 33.0, 0.5);
    }
  }
}

TEST_F(NcclCoreTest, FiniteCheck_JoiningMemberWithNaN_ContributesNothingAndIsNotFlagged) {
  MakeWorld(3, /*bucket_bytes=*/256);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed),
                                Params::Separate(kMixed)};
  FillAll(params);
  for (size_t t = 0; t < params[2].views.size(); ++t) {
    const TensorView& v = params[2].views[t];
    for (int64_t i = 0; i < v.numel; ++i) StoreAs(v.data, StagingCodeOf(v.dtype), i, kNaNValue);
  }
  std::vector<RoundOptions> options(3);
  for (RoundOptions& o : options) {
    o.check_finite = true;
    o.contributors = 2;
  }
  options[2].contribute = false;
  for (const Result& r : RunRound(params, options)) ASSERT_TRUE(r.status.ok()) << r.status;
  ExpectNoHangMismatchOrIllegal();
  ExpectMeanOf(params, {0, 1}, 2);
}

TEST_F(NcclCoreTest, FiniteCheck_EdgeFiniteValues_NeverFlagged) {
  MakeWorld(3);
  const std::vector<double> edge = {std::numeric_limits<float>::max() / 4,
                                    -std::numeric_limits<float>::max() / 4,
                                    std::numeric_limits<float>::denorm_min(),
                                    -std::numeric_limits<float>::denorm_min(),
                                    0.0,
                                    -0.0,
                                    std::numeric_limits<float>::min(),
                                    65504.0};
  std::vector<Params> params(3, Params::Separate({{DType::kFloat32, 8}, {DType::kFloat16, 8}}));
  for (Params& p : params) {
    for (size_t i = 0; i < edge.size(); ++i) {
      StoreAs(p.views[0].data, kStageF32, i, edge[i]);
      StoreAs(p.views[1].data, kStageF16, i, i == 7 ? 65504.0 : (i < 2 ? 1.0 : 0.0));
    }
  }
  RoundOptions o;
  o.check_finite = true;
  for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
  for (int m = 0; m < 3; ++m) {
    EXPECT_NEAR(params[m].At(0, 0) / edge[0], 1.0, 1e-6) << "member " << m;
    EXPECT_NEAR(params[m].At(0, 7), 65504.0, 0.01);
    EXPECT_NEAR(params[m].At(1, 7), 65504.0, 32.0) << "float16's largest value";
  }
}

TEST_F(NcclCoreTest, FiniteCheck_MembersThatDiffer_LayoutMismatchEverywhere) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate(kMixed), Params::Separate(kMixed)};
  FillAll(params);
  std::vector<RoundOptions> options(2);
  options[0].check_finite = true;
  for (const Result& r : RunRound(params, options)) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_EQ(ErrorKindOf(r.status), ErrorKind::kLayoutMismatch) << r.status;
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("finite check"));
  }
  ExpectNoHangMismatchOrIllegal();
}

// Member m's element e: magnitudes that differ by block and member, many ties (quarters), +0
// and -0, signs mixed.
float RuleValue(int m, int64_t e) {
  if ((e / 90 + m) % 11 == 4) return e % 2 == 0 ? 0.0f : -0.0f;
  const float q = std::round(4.0f * std::sin(0.37f * static_cast<float>(e) + 1.3f * m)) / 4.0f;
  return std::ldexp(q + 0.001f * static_cast<float>(e % 7), static_cast<int>((e / 700) % 5) - 2);
}

// INT4 and TOPK rounds (k = 1, 21, 1024) of 2 and 3 members, staged (separate tensors, with the
// finite check) and in place: every member's result is bit-identical to the rule computed
// naively on the host: U_m = decode(encode(x_m)) of member m's whole buffer; the mean
// fl32(sum over m in order of U_m) * fl32(1 / n); sent back as decode(encode(mean)), TOPK with
// min(1024, n k) entries a block.
TEST_F(NcclCoreTest, Int4AndTopk_EveryMemberEqualsTheRuleOnTheHost) {
  struct Format {
    Payload payload;
    int32_t topk;
  };
  const std::vector<int64_t> sizes = {1000, 1, 3071, 2050, 5};  // 6127: a short last block
  for (const Format f : {Format{Payload::kInt4, 0}, Format{Payload::kTopk, 1},
                         Format{Payload::kTopk, 21}, Format{Payload::kTopk, 1024}}) {
    for (int n : {2, 3}) {
      for (bool staged : {true, false}) {
        SCOPED_TRACE(absl::StrCat(PayloadName(f.payload), " k ", f.topk, " members ", n,
                                  staged ? " staged" : " in place"));
        MakeWorld(n);
        std::vector<std::pair<DType, int64_t>> spec;
        for (int64_t k : sizes) spec.emplace_back(DType::kFloat32, k);
        std::vector<Params> params;
        std::vector<std::vector<float>> inputs(n);
        for (int m = 0; m < n; ++m) {
          params.push_back(staged ? Params::Separate(spec)
                                  : Params::Contiguous(DType::kFloat32, sizes));
          int64_t e = 0;
          for (const TensorView& v : params[m].views) {
            for (int64_t i = 0; i < v.numel; ++i, ++e) {
              static_cast<float*>(v.data)[i] = RuleValue(m, e);
              inputs[m].push_back(RuleValue(m, e));
            }
          }
        }
        // Two rounds in a row: the second one without the agreement.
        for (int round = 0; round < 2; ++round) {
          RoundOptions o;
          o.payload = f.payload;
          o.topk = f.topk;
          o.check_finite = staged;
          o.step = round;
          for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
          ExpectNoHangMismatchOrIllegal();
          const size_t total = inputs[0].size();
          std::vector<float> sum(total, 0.0f);
          for (int m = 0; m < n; ++m) {
            const std::vector<float> u = NaivePayloadRoundTrip(f.payload, f.topk, inputs[m]);
            for (size_t i = 0; i < total; ++i) sum[i] += u[i];
          }
          const float inv = 1.0f / static_cast<float>(n);
          for (float& v : sum) v *= inv;
          const int32_t gather_k = std::min(1024, n * f.topk);
          const std::vector<float> want = NaivePayloadRoundTrip(f.payload, gather_k, sum);
          for (int m = 0; m < n; ++m) {
            int64_t e = 0;
            for (const TensorView& v : params[m].views) {
              for (int64_t i = 0; i < v.numel; ++i, ++e) {
                const float got = static_cast<const float*>(v.data)[i];
                ASSERT_EQ(std::memcmp(&got, &want[e], sizeof(float)), 0)
                    << "round " << round << " member " << m << " element " << e << ": " << got
                    << " where the rule gives " << want[e];
              }
            }
          }
          for (int m = 0; m < n; ++m) inputs[m] = want;  // the next round averages the result
        }
        EXPECT_EQ(cores_[0]->last_was_zero_copy(), !staged);
      }
    }
  }
}

TEST_F(NcclCoreTest, Topk_OutOfRangeEntries_InvalidArgumentOnEveryMember) {
  MakeWorld(2);
  std::vector<Params> params(2, Params::Contiguous(DType::kFloat32, {3000}));
  FillAll(params);
  RoundOptions o;
  o.payload = Payload::kTopk;
  o.topk = 0;
  for (const Result& r : RunRound(params, o)) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_THAT(std::string(r.status.message()), HasSubstr("TOPK"));
  }
  ExpectNoHangMismatchOrIllegal();
}

// An FP32 round after a compressed one on the same tensors (and back): the padding rule
// changed, so the members agree afresh rather than fail on a changed count.
TEST_F(NcclCoreTest, Fp32AfterCompressed_SameTensors_AgreeAfreshAndAverage) {
  MakeWorld(2);
  const std::vector<std::pair<DType, int64_t>> spec = {{DType::kFloat32, 5}, {DType::kFloat32, 7}};
  std::vector<Params> params(2, Params::Separate(spec));
  for (Payload payload : {Payload::kFp32, Payload::kInt8, Payload::kFp32, Payload::kInt4}) {
    SCOPED_TRACE(PayloadName(payload));
    FillAll(params);
    RoundOptions o;
    o.payload = payload;
    for (const Result& r : RunRound(params, o)) ASSERT_TRUE(r.status.ok()) << r.status;
    ExpectNoHangMismatchOrIllegal();
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(Bytes(params[1])[t], Bytes(params[0])[t]);
      EXPECT_NEAR(params[0].At(t, 3), 5 + 0.37 * t + 0.033, 1.5);
    }
  }
}

TEST(StagingBucketsTest, SplitAtBucketBoundaries_EveryElementOnceInItsBucket) {
  std::vector<char> dummy(16);
  std::vector<TensorView> tensors;
  for (const auto& [dtype, n] : kMixed) {
    tensors.push_back(TensorView{dummy.data(), n, dtype, Device::Cuda(0)});
  }
  StagingLayout layout = BuildStagingLayout(tensors, kStageF32, /*pad=*/true);
  const int64_t elems = layout.elems;
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel;
  SplitIntoBuckets(&layout, 1000);
  ASSERT_EQ(layout.buckets.size(), static_cast<size_t>((elems + 999) / 1000));
  int64_t covered = 0;
  for (size_t k = 0; k < layout.buckets.size(); ++k) {
    const StagingBucket& b = layout.buckets[k];
    EXPECT_EQ(b.begin, static_cast<int64_t>(k) * 1000);
    EXPECT_EQ(b.end, std::min<int64_t>(elems, b.begin + 1000));
    for (int64_t c = b.first_chunk; c < b.first_chunk + b.num_chunks; ++c) {
      const StagingChunk& ch = layout.chunks[c];
      EXPECT_GE(ch.staging_offset, b.begin);
      EXPECT_LE(ch.staging_offset + ch.numel, b.end);
      covered += ch.numel;
    }
  }
  EXPECT_EQ(covered, total) << "every tensor element gathered exactly once";
  EXPECT_EQ(BucketRanges(10, 0), (std::vector<std::pair<int64_t, int64_t>>{{0, 10}}));
  EXPECT_TRUE(BucketRanges(0, 4).empty());
}

}  // namespace
}  // namespace modelavg::client
