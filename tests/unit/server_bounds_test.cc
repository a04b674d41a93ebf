// Bounds on what a client can make the coordinator core hold and compute: spec size, ListJobs
// pages, GetSchedule cancellation, the expected world size of a Join. Fake clock, no gRPC.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Hierarchical(const std::string& id, int32_t world, int levels) {
  v1::JobSpec spec;
  spec.set_job_id(id);
  spec.set_world_size(world);
  spec.set_mode(v1::HIERARCHICAL);
  for (int i = 0; i < levels; ++i) {
    v1::Level* l = spec.add_levels();
    l->set_period(i + 1);
    l->set_group_size(world);
  }
  return spec;
}

class BoundsTest : public ::testing::Test {
 protected:
  BoundsTest() {
    // Tens of thousands of joins below: their info lines say nothing here.
    spdlog::set_level(spdlog::level::warn);
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    registry_ = std::make_unique<JobRegistry>(options);
  }

  std::shared_ptr<Job> Create(const v1::JobSpec& spec) {
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok()) << spec.job_id();
    return *registry_->Find(spec.job_id());
  }

  FakeClock clock_;
  std::unique_ptr<JobRegistry> registry_;
};

// The probe's 240,000-level HIERARCHICAL job (a 1.9 MB CreateJob) was accepted; GetSchedule on it
// then took seconds of CPU. Now the spec is refused, naming the bound.
TEST_F(BoundsTest, CreateJob_240000Levels_InvalidArgumentNamingTheBound) {
  const absl::Status s = registry_->CreateJob(Hierarchical("many", 1, 240000), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("at most 16 levels, got 240000"));
  EXPECT_EQ(registry_->Find("many").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry_->CreateJob(Hierarchical("max", 1, kMaxLevels), nullptr).ok());
}

TEST_F(BoundsTest, CreateJob_HugePeriodOrWarmup_InvalidArgument) {
  v1::JobSpec spec = Hierarchical("p", 2, 1);
  spec.mutable_levels(0)->set_period(INT64_MAX);
  EXPECT_THAT(std::string(registry_->CreateJob(spec, nullptr).message()),
              HasSubstr("levels[0].period must be in [1, 1000000000000]"));
  spec = Hierarchical("w", 2, 1);
  spec.set_warmup_steps(INT64_MAX);
  EXPECT_THAT(std::string(registry_->CreateJob(spec, nullptr).message()),
              HasSubstr("warmup_steps must be in [0, 1000000000000]"));
}

// Unknown fields of a spec are not kept: a job costs what its known fields say.
TEST_F(BoundsTest, CreateJob_UnknownFields_NotKept) {
  v1::JobSpec spec = Hierarchical("unknown", 2, 1);
  spec.GetReflection()->MutableUnknownFields(&spec)->AddLengthDelimited(999, std::string(1 << 20, 'x'));
  ASSERT_GT(spec.ByteSizeLong(), 1u << 20);
  std::shared_ptr<Job> job = Create(spec);
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_LT(proto.ByteSizeLong(), 1024u);
}

// Thirty such jobs made one ListJobs reply of 57 MB that no client could read. Now replies come
// in pages of page_size jobs, each under kMaxJobReplyBytes, and a walk over next_page_token sees
// every job exactly once, in job_id order.
TEST_F(BoundsTest, ListJobs_Pages_EveryJobOnceInOrder) {
  std::vector<std::string> ids;
  for (int i = 0; i < 25; ++i) {
    ids.push_back(absl::StrCat("job-", i < 10 ? "0" : "", i));
    Create(Hierarchical(ids.back(), 2, 2));
  }
  std::vector<std::string> seen;
  v1::ListJobsRequest request;
  request.set_page_size(7);
  int pages = 0;
  do {
    v1::ListJobsResponse response;
    ASSERT_TRUE(registry_->ListJobsPage(request, &response).ok());
    EXPECT_LE(response.jobs_size(), 7);
    for (const v1::Job& job : response.jobs()) seen.push_back(job.spec().job_id());
    request.set_page_token(response.next_page_token());
    ++pages;
  } while (!request.page_token().empty() && pages < 100);
  EXPECT_EQ(pages, 4);
  EXPECT_EQ(seen, ids);

  // Default page size: all 25 fit in one page of 100.
  v1::ListJobsResponse all;
  ASSERT_TRUE(registry_->ListJobsPage(v1::ListJobsRequest(), &all).ok());
  EXPECT_EQ(all.jobs_size(), 25);
  EXPECT_TRUE(all.next_page_token().empty());
}

TEST_F(BoundsTest, ListJobs_BadPageSizeOrToken_InvalidArgument) {
  v1::ListJobsRequest request;
  v1::ListJobsResponse response;
  request.set_page_size(-1);
  EXPECT_THAT(std::string(registry_->ListJobsPage(request, &response).message()),
              HasSubstr("page_size must be in [0, 1000]"));
  request.set_page_size(1001);
  EXPECT_EQ(registry_->ListJobsPage(request, &response).code(),
            absl::StatusCode::kInvalidArgument);
  request.set_page_size(0);
  request.set_page_token(std::string(3, '\0'));
  EXPECT_THAT(std::string(registry_->ListJobsPage(request, &response).message()),
              HasSubstr("page_token is not one this coordinator handed out"));
}

// Jobs whose members fill megabytes: each page stays under the bound; a job too big alone comes
// without its members, flagged.
TEST_F(BoundsTest, ListJobs_BigJobs_EveryReplyUnderTheBound) {
  constexpr int32_t kWorld = 16384;
  for (int j = 0; j < 3; ++j) {
    std::shared_ptr<Job> job = Create(Hierarchical(absl::StrCat("big-", j), kWorld, 1));
    for (int32_t r = 0; r < kWorld; ++r) {
      v1::JoinRequest join;
      join.set_job_id(job->id());
      join.set_worker_id(absl::StrCat(std::string(200, 'w'), r));
      join.set_host(std::string(200, 'h'));
      join.set_rank(r);
      job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(), [](auto) {});
    }
  }
  v1::ListJobsRequest request;
  int jobs = 0;
  for (int pages = 0; pages < 10; ++pages) {
    v1::ListJobsResponse response;
    ASSERT_TRUE(registry_->ListJobsPage(request, &response).ok());
    EXPECT_LT(static_cast<int64_t>(response.ByteSizeLong()), 4 * 1024 * 1024);
    for (const v1::Job& job : response.jobs()) {
      EXPECT_TRUE(job.members_omitted());
      EXPECT_EQ(job.members_size(), 0);
      ++jobs;
    }
    request.set_page_token(response.next_page_token());
    if (request.page_token().empty()) break;
  }
  EXPECT_EQ(jobs, 3);
  v1::Job one;
  (*registry_->Find("big-0"))->ToProto(&one);
  EXPECT_TRUE(one.members_omitted());
  EXPECT_LT(static_cast<int64_t>(one.ByteSizeLong()), 4 * 1024 * 1024);
}

// A GetSchedule whose caller is gone stops computing: it polls its cancellation while it works.
TEST_F(BoundsTest, GetSchedule_CallerGone_StopsWithCancelled) {
  std::shared_ptr<Job> job = Create(Hierarchical("sched", 1, kMaxLevels));
  v1::GetScheduleRequest request;
  request.set_job_id("sched");
  request.set_count(kMaxScheduleCount);
  request.set_rank(0);
  int polls = 0;
  v1::GetScheduleResponse response;
  const absl::Status s = job->GetSchedule(request, &response, [&] { return ++polls >= 3; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(polls, 3);
  EXPECT_EQ(response.decisions_size(), 0);

  // A caller that stays gets the whole window.
  ASSERT_TRUE(job->GetSchedule(request, &response, [] { return false; }).ok());
  EXPECT_EQ(response.decisions_size(), kMaxScheduleCount);
}

// A worker started for world 8 joining a 4-rank job as rank 0 waited silently until its own
// timeout. Now the Join fails at once, naming both sizes, and takes no rank.
TEST_F(BoundsTest, Join_WrongExpectedWorldSize_InvalidArgumentNamingBoth) {
  std::shared_ptr<Job> job = Create(Hierarchical("four", 4, 1));
  v1::JoinRequest join;
  join.set_job_id("four");
  join.set_worker_id("w0");
  join.set_rank(0);
  join.set_world_size(8);
  // Shared with the callbacks: a wait still pending at teardown completes after this body.
  auto result = std::make_shared<std::optional<absl::Status>>();
  auto callback = [result](absl::StatusOr<v1::JoinResponse> r) { *result = r.status(); };
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(), callback);
  ASSERT_TRUE(result->has_value());
  EXPECT_EQ((*result)->code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string((*result)->message()),
              HasSubstr("expects world_size 8 but job four has world_size 4"));
  EXPECT_EQ(job->GetStats().workers, 0);

  // The right size (or none) is accepted.
  join.set_world_size(4);
  result->reset();
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(), callback);
  EXPECT_FALSE(result->has_value());  // waiting for the other three
  EXPECT_EQ(job->GetStats().workers, 1);
}

// Distinct keys under the per-generation count let a worker make the coordinator hold (and
// write) about 285 MB per job; the bytes are bounded per job, with a clear RESOURCE_EXHAUSTED.
TEST_F(BoundsTest, PublishCommId_EverNewKeys_ResourceExhaustedAtTheByteBound) {
  std::shared_ptr<Job> job = Create(Hierarchical("ids", 1, 1));
  v1::JoinRequest join;
  join.set_job_id("ids");
  join.set_worker_id("w0");
  auto credential = std::make_shared<std::string>();
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(),
            [credential](absl::StatusOr<v1::JoinResponse> r) {
              if (r.ok()) *credential = r->credential();
            });
  ASSERT_FALSE(credential->empty());
  v1::PublishCommIdRequest publish;
  publish.set_job_id("ids");
  publish.set_generation(1);
  publish.set_credential(*credential);
  publish.set_unique_id(std::string(kMaxCommIdBytes, 'x'));
  absl::Status s;
  size_t published = 0;
  for (; published < kMaxCommIdsPerGeneration; ++published) {
    publish.set_key(absl::StrCat("k", published));
    s = job->PublishCommId(publish);
    if (!s.ok()) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("bytes per job"));
  EXPECT_LE(published * kMaxCommIdBytes, kMaxCommIdBytesPerJob);
  EXPECT_GT((published + 1) * (kMaxCommIdBytes + 8), kMaxCommIdBytesPerJob);
  // A retried publish of an id already there still answers OK.
  publish.set_key("k0");
  EXPECT_TRUE(job->PublishCommId(publish).ok());
}

}  // namespace
}  // namespace modelavg::server
