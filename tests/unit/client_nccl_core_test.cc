// The NCCL path's host logic (NcclCore, the staging layout) with simulated members as threads:
// a fake NcclDeviceOps keeps "device" memory on the host, flags any access outside a live
// allocation (an illegal address on a GPU), and matches the members' collectives the way NCCL
// needs them matched, reporting a mismatch (which NCCL would not detect: a hang or mixed data)
// or a member that never arrives (a hang). Its ncclAvg arithmetic is NCCL's: inputs are
// pre-multiplied by 1/n rounded to the reduction dtype. Runs without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/half.h"
#include "client/nccl_core.h"
#include "client/staging_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/staging_reference.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;
using Reduce = NcclDeviceOps::Reduce;

// Rounds to what `code` can hold.
double RoundTo(int32_t code, double v) {
  double out = 0;
  char buf[8];
  StoreAs(buf, code, 0, v);
  out = LoadAs(buf, code, 0);
  return out;
}

struct Post {
  Reduce op;
  size_t count;
  int32_t code;
  void* buffer;
};

// The members' collectives, matched by sequence number.
class FakeWorld {
 public:
  explicit FakeWorld(int n) : n_(n) {}

  absl::Status Collective(int member, int64_t seq, const Post& p) {
    absl::MutexLock l(&mu_);
    std::vector<std::optional<Post>>& posts = posts_[seq];
    posts.resize(n_);
    posts[member] = p;
    if (std::all_of(posts.begin(), posts.end(), [](const auto& x) { return x.has_value(); })) {
      results_[seq] = Reduce_(posts);
    }
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<std::map<int64_t, absl::Status>*, int64_t>* a) {
              return a->first->count(a->second) > 0;
            },
            new_pair(seq)),
        absl::Seconds(1));
    if (!done) {
      hang_ = true;
      return absl::DeadlineExceededError(absl::StrCat(
          "member ", member, ": collective #", seq, " never matched (a hang on a GPU)"));
    }
    return results_[seq];
  }

  bool mismatch() const {
    absl::MutexLock l(&mu_);
    return mismatch_;
  }
  bool hang() const {
    absl::MutexLock l(&mu_);
    return hang_;
  }

 private:
  std::pair<std::map<int64_t, absl::Status>*, int64_t>* new_pair(int64_t seq)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pairs_.push_back(std::make_unique<std::pair<std::map<int64_t, absl::Status>*, int64_t>>(
        &results_, seq));
    return pairs_.back().get();
  }

  absl::Status Reduce_(const std::vector<std::optional<Post>>& posts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Post& a = *posts[0];
    for (const auto& p : posts) {
      if (p->op != a.op || p->count != a.count || (a.op == Reduce::kAverage && p->code != a.code)) {
        mismatch_ = true;
        return absl::InternalError("mismatched collectives (NCCL would hang or mix data)");
      }
    }
    if (a.op == Reduce::kLayoutMax) {
      for (size_t i = 0; i < a.count; ++i) {
        int64_t m = static_cast<int64_t*>(posts[0]->buffer)[i];
        for (const auto& p : posts) m = std::max(m, static_cast<int64_t*>(p->buffer)[i]);
        for (const auto& p : posts) static_cast<int64_t*>(p->buffer)[i] = m;
      }
      return absl::OkStatus();
    }
    // ncclAvg as NCCL computes it: sum of x * (1/n rounded to the dtype), rounded per step.
    const double scale = RoundTo(a.code, 1.0 / n_);
    for (size_t i = 0; i < a.count; ++i) {
      double sum = 0;
      for (const auto& p : posts) {
        sum = RoundTo(a.code, sum + RoundTo(a.code, LoadAs(p->buffer, a.code, i) * scale));
      }
      for (const auto& p : posts) StoreAs(p->buffer, a.code, i, sum);
    }
    return absl::OkStatus();
  }

  const int n_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::vector<std::optional<Post>>> posts_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, absl::Status> results_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<std::pair<std::map<int64_t, absl::Status>*, int64_t>>> pairs_
      ABSL_GUARDED_BY(mu_);
  bool mismatch_ ABSL_GUARDED_BY(mu_) = false;
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
};

class FakeOps : public NcclDeviceOps {
 public:
  FakeOps(FakeWorld* world, int member) : world_(world), member_(member) {}
  ~FakeOps() override {
    for (auto& [p, n] : live_) std::free(p);
  }

  absl::Status Malloc(void** p, size_t bytes) override {
    *p = nullptr;
    if (fail_mallocs > 0 || fail_malloc_after == 0) {
      if (fail_mallocs > 0) --fail_mallocs;
      fail_malloc_after = -1;
      return absl::ResourceExhaustedError("cudaMalloc: out of memory (simulated)");
    }
    if (fail_malloc_after > 0) --fail_malloc_after;
    *p = std::malloc(bytes);
    std::memset(*p, 0x7f, bytes);  // garbage, as cudaMalloc gives
    live_[*p] = bytes;
    ++mallocs;
    return absl::OkStatus();
  }
  void Free(void* p) override {
    ASSERT_EQ(live_.erase(p), 1u) << "free of memory that is not a live allocation";
    std::free(p);
  }
  absl::Status MallocHost(void** p, size_t bytes) override { return Malloc(p, bytes); }
  void FreeHost(void* p) override { Free(p); }
  absl::Status Zero(void* p, size_t bytes, void*) override {
    if (!Live(p, bytes)) return Illegal("memset");
    std::memset(p, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes, void*) override {
    if (dst == nullptr || src == nullptr) return Illegal("memcpy");
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Gather(const StagingChunk* chunks, int64_t n, void* staging, int32_t code,
                      void*) override {
    if (fail_gathers > 0) {
      --fail_gathers;
      return absl::InternalError("gather launch failed (simulated)");
    }
    return Stage(chunks, n, staging, code, /*gather=*/true);
  }
  absl::Status Scatter(const StagingChunk* chunks, int64_t n, const void* staging, int32_t code,
                       void*) override {
    return Stage(chunks, n, const_cast<void*>(staging), code, /*gather=*/false);
  }
  absl::Status AllReduce(void* buffer, size_t count, Reduce op, int32_t code, void*) override {
    if (aborted) return absl::InternalError("communicator aborted");
    if (op == Reduce::kAverage && fail_averages > 0) {
      --fail_averages;
      return absl::InternalError("ncclAllReduce failed (simulated)");
    }
    ops.push_back(op == Reduce::kLayoutMax ? "check" : absl::StrCat("avg", count));
    return world_->Collective(member_, seq_++, Post{op, count, code, buffer});
  }
  absl::Status Wait(void*, const char*) override {
    return aborted ? absl::InternalError("communicator aborted") : absl::OkStatus();
  }
  void AbortCommunicator() override { aborted = true; }

  int fail_mallocs = 0;        // the next this many mallocs fail
  int fail_malloc_after = -1;  // the malloc after this many successful ones fails
  int fail_gathers = 0;
  int fail_averages = 0;
  int mallocs = 0;
  bool aborted = false;
  bool illegal = false;
  std::vector<std::string> ops;

 private:
  bool Live(const void* p, size_t bytes) const {
    for (const auto& [base, n] : live_) {
      const char* b = static_cast<const char*>(base);
      const char* q = static_cast<const char*>(p);
      if (q >= b && q + bytes <= b + n) return true;
    }
    return false;
  }
  absl::Status Illegal(const char* what) {
    illegal = true;
    return absl::InternalError(absl::StrCat(what, ": an illegal memory access"));
  }
  absl::Status Stage(const StagingChunk* chunks, int64_t n, void* staging, int32_t code,
                     bool gather) {
    if (!Live(chunks, n * sizeof(StagingChunk))) return Illegal("chunk table");
    for (int64_t c = 0; c < n; ++c) {
      const StagingChunk& ch = chunks[c];
      const size_t end = (ch.staging_offset + ch.numel) * StagingCodeSize(code);
      if (!Live(staging, end)) return Illegal("staging buffer");
      for (int64_t i = 0; i < ch.numel; ++i) {
        if (gather) {
          StoreAs(staging, code, ch.staging_offset + i, LoadAs(ch.tensor, ch.tensor_dtype, i));
        } else {
          StoreAs(ch.tensor, ch.tensor_dtype, i, LoadAs(staging, code, ch.staging_offset + i));
        }
      }
    }
    return absl::OkStatus();
  }

  FakeWorld* const world_;
  const int member_;
  int64_t seq_ = 0;
  std::map<void*, size_t> live_;
};

// Host memory standing in for one member's CUDA tensors.
struct Params {
  std::vector<std::vector<char>> storage;
  std::vector<TensorView> views;

  Params() = default;
  // A copy points its views into its own storage.
  Params(const Params& o) : storage(o.storage), views(o.views) {
    for (TensorView& v : views) {
      for (size_t k = 0; k < storage.size(); ++k) {
        const char* b = o.storage[k].data();
        const char* p = static_cast<const char*>(v.data);
        if (p >= b && p < b + o.storage[k].size()) {
          v.data = storage[k].data() + (p - b);
          break;
        }
      }
    }
  }
  Params& operator=(const Params& o) {
    Params copy(o);
    storage.swap(copy.storage);
    views.swap(copy.views);
    return *this;
  }

  // Separately allocated tensors (the staged path).
  static Params Separate(const std::vector<std::pair<DType, int64_t>>& spec) {
    Params p;
    p.storage.reserve(spec.size());
    for (const auto& [dtype, n] : spec) {
      p.storage.emplace_back(DTypeSize(dtype) * n + 64);
      // 16-byte aligned storage, like cudaMalloc's.
      char* base = p.storage.back().data();
      char* aligned = base + ((16 - reinterpret_cast<uintptr_t>(base) % 16) % 16);
      p.views.push_back(TensorView{aligned, n, dtype, Device::Cuda(0), nullptr});
    }
    return p;
  }
  // One buffer of one dtype (the zero-copy path).
  static Params Contiguous(DType dtype, const std::vector<int64_t>& numels) {
    Params p;
    int64_t total = 0;
    for (int64_t n : numels) total += n;
    p.storage.emplace_back(DTypeSize(dtype) * total + 16);
    char* at = p.storage.back().data();
    for (int64_t n : numels) {
      p.views.push_back(TensorView{at, n, dtype, Device::Cuda(0), nullptr});
      at += DTypeSize(dtype) * n;
    }
    return p;
  }
  void Fill(double base) {
    for (size_t t = 0; t < views.size(); ++t) {
      for (int64_t i = 0; i < views[t].numel; ++i) {
        StoreAs(views[t].data, StagingCodeOf(views[t].dtype), i, base + 0.37 * t + 0.011 * i);
      }
    }
  }
  double At(size_t t, int64_t i) const {
    return LoadAs(views[t].data, StagingCodeOf(views[t].dtype), i);
  }
};

class NcclCoreTest : public ::testing::Test {
 protected:
  void MakeWorld(int n) {
    world_ = std::make_unique<FakeWorld>(n);
    for (int m = 0; m < n; ++m) {
      ops_.push_back(std::make_unique<FakeOps>(world_.get(), m));
      cores_.push_back(std::make_unique<NcclCore>(ops_.back().get(), m, 0));
      ASSERT_TRUE(cores_.back()->Init().ok());
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

  std::unique_ptr<FakeWorld> world_;
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

TEST_F(NcclCoreTest, LayoutChangesOnOneMemberOnly_BothRunTheCheck_InvalidArgumentOnBoth) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 6}}),
                                Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 6}})};
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  // Member 0 passes one more element; member 1's layout is as before.
  std::vector<Params> changed = {
      Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 7}}),
      Params::Separate({{DType::kFloat32, 4}, {DType::kFloat32, 6}})};
  for (const absl::Status& s : RunAll(changed)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("different parameter layouts"));
  }
  ExpectNoHangMismatchOrIllegal();
  EXPECT_EQ(ops_[0]->ops, ops_[1]->ops) << "the members issued different collectives";
  // Back to the common layout: averaging works on both.
  FillAll(params);
  for (const absl::Status& s : RunAll(params)) EXPECT_TRUE(s.ok()) << s;
  ExpectNoHangMismatchOrIllegal();
  ExpectAveraged(params);
}

TEST_F(NcclCoreTest, DTypeChangesOnOneMemberOnly_InvalidArgumentOnBoth) {
  MakeWorld(2);
  std::vector<Params> params = {Params::Contiguous(DType::kFloat32, {8}),
                                Params::Contiguous(DType::kFloat32, {8})};
  for (const absl::Status& s : RunAll(params)) ASSERT_TRUE(s.ok()) << s;
  params[0] = Params::Contiguous(DType::kFloat64, {8});
  for (const absl::Status& s : RunAll(params)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  ExpectNoHangMismatchOrIllegal();
}

TEST_F(NcclCoreTest, StagingMallocFailsOnOneMember_EveryMemberErrsWithoutHang_NextCallAverages) {
  MakeWorld(2);
  std::vector<Params> small = {Params::Separate({{DType::kFloat32, 3}, {DType::kFloat32, 5}}),
                               Params::Separate({{DType::kFloat32, 3}, {DType::kFloat32, 5}})};
  FillAll(small);
  for (const absl::Status& s : RunAll(small)) ASSERT_TRUE(s.ok()) << s;
  // A larger layout needs a larger staging buffer: member 1's cudaMalloc fails.
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

TEST(DecideLayoutTest, SameOnEveryMember) {
  // Two members: counts 12 and 10 padded, totals 9 and 9, same dtype.
  LayoutSignature a = EncodeLayout(12, kStageF32, 9, false, 0);
  LayoutSignature b = EncodeLayout(9, kStageF32, 9, false, 1);
  LayoutSignature r;
  for (int i = 0; i < kLayoutWords; ++i) r[i] = std::max(a[i], b[i]);
  const LayoutDecision da = DecideLayout(r, 12, 9, absl::OkStatus());
  const LayoutDecision db = DecideLayout(r, 9, 9, absl::OkStatus());
  EXPECT_TRUE(da.status.ok());
  EXPECT_TRUE(da.unpadded);
  EXPECT_TRUE(db.unpadded);
  // A local failure of member 1 reaches member 0.
  b = EncodeLayout(9, kStageF32, 9, true, 1);
  for (int i = 0; i < kLayoutWords; ++i) r[i] = std::max(a[i], b[i]);
  EXPECT_EQ(DecideLayout(r, 12, 9, absl::OkStatus()).status.code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(DecideLayout(r, 9, 9, absl::UnavailableError("x")).status.code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace modelavg::client
