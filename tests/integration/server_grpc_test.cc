// A real coordinator on 127.0.0.1, port 0, driven through the generated stub: N workers on
// threads, watch streams, hostile input, token auth, TLS, shutdown.
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"
#include "server/jobs_file.h"
#include "tests/testing/in_process_coordinator.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::modelavg::testing::CallContext;
using ::modelavg::testing::InProcessCoordinatorTest;
using ::modelavg::testing::SpecFromText;
using ::testing::HasSubstr;

std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout = absl::Seconds(20),
                                             const std::string& token = "") {
  return CallContext(timeout, token);
}

class ServerTest : public InProcessCoordinatorTest {
 protected:
  grpc::Status CreateJob(const std::string& text, v1::Job* job = nullptr) {
    v1::CreateJobRequest request;
    *request.mutable_spec() = SpecFromText(text);
    v1::Job ignored;
    return stub()->CreateJob(Context().get(), request, job != nullptr ? job : &ignored);
  }
};

// One simulated worker: Join, Steps, comm ids for every subgroup it averages in, heartbeats,
// Leave. Returns a description of the first failure, empty on success.
std::string RunWorker(v1::Coordinator::Stub* stub, int index, int steps,
                      std::atomic<int>* averages, std::vector<std::string>* credentials) {
  v1::JoinRequest join;
  join.set_job_id("train");
  join.set_worker_id(absl::StrCat("worker-", index));
  join.set_host("127.0.0.1");
  v1::JoinResponse joined;
  grpc::Status s = stub->Join(Context().get(), join, &joined);
  if (!s.ok()) return "Join: " + s.error_message();
  const int rank = joined.rank();
  const int64_t generation = joined.generation();
  // Each rank's credential: distinct elements per thread.
  (*credentials)[rank] = joined.credential();
  for (int step = 0; step < steps; ++step) {
    v1::StepRequest request;
    request.set_job_id("train");
    request.set_rank(rank);
    request.set_generation(generation);
    request.set_step(step);
    v1::StepDecision decision;
    s = stub->Step(Context().get(), request, &decision);
    if (!s.ok()) return absl::StrCat("Step ", step, ": ", s.error_message());
    if (decision.step() != step || decision.generation() != generation) return "bad decision";
    if (decision.action() != v1::AVERAGE) continue;
    ++*averages;
    // The subgroup's first rank publishes once per (level, subgroup); everyone fetches.
    const std::string blob = absl::StrCat("id-", decision.level(), "-", decision.subgroup());
    if (decision.ranks(0) == rank) {
      v1::PublishCommIdRequest publish;
      publish.set_job_id("train");
      publish.set_generation(generation);
      publish.set_level(decision.level());
      publish.set_subgroup(decision.subgroup());
      publish.set_rank(rank);
      publish.set_unique_id(blob);
      publish.set_credential(joined.credential());
      v1::PublishCommIdResponse published;
      s = stub->PublishCommId(Context().get(), publish, &published);
      if (!s.ok()) return "PublishCommId: " + s.error_message();
    }
    v1::GetCommIdRequest get;
    get.set_job_id("train");
    get.set_generation(generation);
    get.set_level(decision.level());
    get.set_subgroup(decision.subgroup());
    get.set_rank(rank);
    get.set_timeout_ms(10000);
    get.set_credential(joined.credential());
    v1::GetCommIdResponse got;
    s = stub->GetCommId(Context().get(), get, &got);
    if (!s.ok()) return "GetCommId: " + s.error_message();
    if (got.unique_id() != blob) return "GetCommId returned other bytes";
  }
  v1::HeartbeatRequest hb;
  hb.set_job_id("train");
  hb.set_rank(rank);
  hb.set_generation(generation);
  hb.set_step(steps);
  hb.set_credential(joined.credential());
  v1::HeartbeatResponse hb_reply;
  s = stub->Heartbeat(Context().get(), hb, &hb_reply);
  if (!s.ok()) return "Heartbeat: " + s.error_message();
  if (hb_reply.generation() != generation || hb_reply.state() != v1::RUNNING) {
    return "Heartbeat: generation moved";
  }
  return "";
}

TEST_F(ServerTest, FullWorkerPath_EightThreads_JoinStepCommIdHeartbeatLeave) {
  Start();
  // Levels: pairs every 2 steps, the world every 4 (hierarchical).
  ASSERT_TRUE(CreateJob(R"pb(job_id: "train" world_size: 8 mode: HIERARCHICAL
                             levels { period: 2 group_size: 2 } levels { period: 4 group_size: 8 })pb")
                  .ok());
  constexpr int kWorkers = 8, kSteps = 12;
  std::vector<std::string> errors(kWorkers);
  std::atomic<int> averages{0};
  std::vector<std::string> credentials(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back(
        [&, i] { errors[i] = RunWorker(stub(), i, kSteps, &averages, &credentials); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) EXPECT_EQ(errors[i], "") << "worker " << i;
  EXPECT_EQ(averages.load(), kWorkers * 6);  // steps 0,2,4,6,8,10

  v1::GetJobRequest get;
  get.set_job_id("train");
  v1::Job job;
  ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.members_size(), kWorkers);
  EXPECT_EQ(job.min_step(), kSteps);
  EXPECT_EQ(job.max_step(), kSteps);

  // Everyone leaves: the first Leave bumps the generation, the last one finishes the job.
  for (int r = 0; r < kWorkers; ++r) {
    v1::LeaveRequest leave;
    leave.set_job_id("train");
    leave.set_rank(r);
    leave.set_generation(1);
    leave.set_reason("finished");
    leave.set_credential(credentials[r]);
    v1::LeaveResponse left;
    ASSERT_TRUE(stub()->Leave(Context().get(), leave, &left).ok());
    if (r == kWorkers - 1) EXPECT_EQ(left.state(), v1::FINISHED);
  }
  v1::ListJobsResponse list;
  ASSERT_TRUE(stub()->ListJobs(Context().get(), v1::ListJobsRequest(), &list).ok());
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).state(), v1::FINISHED);
}

TEST_F(ServerTest, HeartbeatTimeout_SurvivorsLearnNewGenerationAndRejoin) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "elastic" world_size: 3 mode: PERIODIC
                             heartbeat_timeout_ms: 1000 levels { period: 1 group_size: 3 })pb")
                  .ok());
  auto join_all = [&](const std::vector<std::string>& workers, std::vector<v1::JoinResponse>* out) {
    out->resize(workers.size());
    std::vector<std::thread> threads;
    for (size_t r = 0; r < workers.size(); ++r) {
      threads.emplace_back([&, r] {
        v1::JoinRequest join;
        join.set_job_id("elastic");
        join.set_worker_id(workers[r]);
        join.set_rank(static_cast<int>(r));
        EXPECT_TRUE(stub()->Join(Context().get(), join, &(*out)[r]).ok());
      });
    }
    for (auto& t : threads) t.join();
  };
  std::vector<v1::JoinResponse> joined;
  join_all({"a", "b", "c"}, &joined);
  ASSERT_EQ(joined[2].generation(), 1);
  // Ranks 0 and 1 heartbeat; rank 2 has died silently.
  v1::HeartbeatResponse reply;
  for (int i = 0; i < 400 && reply.generation() != 2; ++i) {
    for (int r = 0; r < 2; ++r) {
      v1::HeartbeatRequest hb;
      hb.set_job_id("elastic");
      hb.set_rank(r);
      hb.set_generation(1);
      hb.set_step(i);
      hb.set_credential(joined[r].credential());
      ASSERT_TRUE(stub()->Heartbeat(Context().get(), hb, &reply).ok());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(reply.generation(), 2);
  EXPECT_EQ(reply.state(), v1::PENDING);
  EXPECT_EQ(reply.last_change().rank(), 2);
  EXPECT_EQ(reply.last_change().reason(), "rank 2 heartbeat timeout");
  v1::StepRequest step;
  step.set_job_id("elastic");
  step.set_rank(0);
  step.set_generation(1);
  v1::StepDecision decision;
  grpc::Status stale = stub()->Step(Context().get(), step, &decision);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(stale.error_message(), HasSubstr("generation 1 is stale"));
  // The survivors keep their ranks; a replacement takes rank 2.
  join_all({"a", "b", "c-replacement"}, &joined);
  for (const auto& j : joined) EXPECT_EQ(j.generation(), 2);
  step.set_generation(2);
  EXPECT_TRUE(stub()->Step(Context().get(), step, &decision).ok());
}

TEST_F(ServerTest, WatchJob_StreamsSnapshotThenMembershipEvents) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "w" world_size: 2 mode: PERIODIC
                             levels { period: 1 group_size: 2 })pb")
                  .ok());
  v1::WatchJobRequest watch;
  watch.set_job_id("w");
  auto ctx = Context();
  auto reader = stub()->WatchJob(ctx.get(), watch);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::JobEvent::SNAPSHOT);
  EXPECT_EQ(event.job().state(), v1::PENDING);
  std::vector<std::thread> joiners;
  for (int r = 0; r < 2; ++r) {
    joiners.emplace_back([&, r] {
      v1::JoinRequest join;
      join.set_job_id("w");
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      v1::JoinResponse joined;
      EXPECT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
    });
  }
  for (auto& t : joiners) t.join();
  std::vector<v1::JobEvent::Kind> kinds;
  while (kinds.size() < 3 && reader->Read(&event)) kinds.push_back(event.kind());
  EXPECT_THAT(kinds, ::testing::ElementsAre(v1::JobEvent::MEMBER_JOINED,
                                            v1::JobEvent::MEMBER_JOINED,
                                            v1::JobEvent::WORLD_COMPLETE));
  // Deleting the job ends the stream with ABORTED after a JOB_DELETED event.
  v1::DeleteJobRequest del;
  del.set_job_id("w");
  v1::DeleteJobResponse deleted;
  ASSERT_TRUE(stub()->DeleteJob(Context().get(), del, &deleted).ok());
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::JobEvent::JOB_DELETED);
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::ABORTED);
}

TEST_F(ServerTest, HeartbeatStream_OneReplyPerBeat_ErrorsEndTheStream) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "hb" world_size: 1 mode: PERIODIC
                             levels { period: 1 group_size: 1 })pb")
                  .ok());
  v1::JoinRequest join;
  join.set_job_id("hb");
  join.set_worker_id("w");
  v1::JoinResponse joined;
  ASSERT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
  {
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    for (int step = 0; step < 5; ++step) {
      v1::HeartbeatRequest beat;
      beat.set_job_id("hb");
      beat.set_rank(0);
      beat.set_generation(1);
      beat.set_step(step * 10);
      beat.set_credential(joined.credential());
      ASSERT_TRUE(stream->Write(beat));
      v1::HeartbeatResponse reply;
      ASSERT_TRUE(stream->Read(&reply));
      EXPECT_EQ(reply.generation(), 1);
      EXPECT_EQ(reply.state(), v1::RUNNING);
    }
    // Another job on the same stream is refused, and ends it.
    v1::HeartbeatRequest other;
    other.set_job_id("other");
    ASSERT_TRUE(stream->Write(other));
    v1::HeartbeatResponse reply;
    EXPECT_FALSE(stream->Read(&reply));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  v1::GetJobRequest get;
  get.set_job_id("hb");
  v1::Job job;
  ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.members(0).last_step(), 40);
  {
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    v1::HeartbeatRequest beat;
    beat.set_job_id("ghost");
    ASSERT_TRUE(stream->Write(beat));
    v1::HeartbeatResponse reply;
    EXPECT_FALSE(stream->Read(&reply));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    ASSERT_TRUE(stream->WritesDone());  // a client that only half-closes: a clean end
    EXPECT_TRUE(stream->Finish().ok());
  }
}

// An elastic job: a HeartbeatStream that the worker drops without saying it closes (its
// process died: the call is cancelled) gets the member declared dead after half the heartbeat
// timeout (3 s), for "connection lost"; a stream cancelled just the same after a closing beat
// does not (that member, silent since, is still alive when the first one is declared dead).
TEST_F(ServerTest, HeartbeatStream_Dropped_ElasticMemberDeadForConnectionLost_ClosingIsNot) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "drop" world_size: 3 mode: PERIODIC min_world_size: 1
                             heartbeat_timeout_ms: 6000 levels { period: 1 group_size: 3 })pb")
                  .ok());
  std::vector<v1::JoinResponse> joined(3);
  {
    std::vector<std::thread> joins;
    for (int r = 0; r < 3; ++r) {
      joins.emplace_back([&, r] {
        v1::JoinRequest join;
        join.set_job_id("drop");
        join.set_worker_id(absl::StrCat("w", r));
        join.set_rank(r);
        EXPECT_TRUE(stub()->Join(Context().get(), join, &joined[r]).ok()) << r;
      });
    }
    for (auto& t : joins) t.join();
  }
  const auto beat = [&](int r, bool closing) {
    v1::HeartbeatRequest b;
    b.set_job_id("drop");
    b.set_rank(r);
    b.set_generation(1);
    b.set_step(1);
    b.set_credential(joined[r].credential());
    b.set_closing(closing);
    return b;
  };
  // Rank 2 beats (unary) until the end.
  std::atomic<bool> stop{false};
  std::thread beats([&] {
    while (!stop) {
      v1::HeartbeatResponse reply;
      stub()->Heartbeat(Context().get(), beat(2, false), &reply);
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  {  // Rank 1: a stream ended on purpose (the closing beat), then cancelled.
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(stream->Write(beat(1, false)));
    ASSERT_TRUE(stream->Read(&reply));
    ASSERT_TRUE(stream->Write(beat(1, true)));
    ASSERT_TRUE(stream->Read(&reply));
    ctx->TryCancel();
    stream->Finish();
  }
  {  // Rank 0: a stream that breaks.
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(stream->Write(beat(0, false)));
    ASSERT_TRUE(stream->Read(&reply));
    ctx->TryCancel();
    stream->Finish();
  }
  v1::Job job;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    v1::GetJobRequest get;
    get.set_job_id("drop");
    job.Clear();
    ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
    if (job.generation() > 1) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  stop = true;
  beats.join();
  ASSERT_EQ(job.generation(), 2) << job.DebugString();
  EXPECT_THAT(job.last_change().reason(), HasSubstr("rank 0 connection lost"));
  EXPECT_THAT(job.vacant_ranks(), ::testing::ElementsAre(0));
  EXPECT_EQ(job.state(), v1::RUNNING);
}

// With reply_interval_ms, beats are written back to back and answered only with news.
TEST_F(ServerTest, HeartbeatStream_ReplyInterval_AnswersOnlyTheFirstBeatAndChanges) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "news" world_size: 2 mode: PERIODIC
                             levels { period: 1 group_size: 2 }
                             heartbeat_timeout_ms: 600000)pb")
                  .ok());
  std::vector<std::thread> joins;
  std::vector<std::string> credentials(2);
  for (int r = 0; r < 2; ++r) {
    joins.emplace_back([&, r] {
      v1::JoinRequest join;
      join.set_job_id("news");
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      v1::JoinResponse joined;
      EXPECT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
      credentials[r] = joined.credential();
    });
  }
  for (auto& t : joins) t.join();

  auto ctx = Context();
  auto stream = stub()->HeartbeatStream(ctx.get());
  auto beat = [&](int64_t step) {
    v1::HeartbeatRequest b;
    b.set_job_id("news");
    b.set_rank(0);
    b.set_generation(1);
    b.set_step(step);
    b.set_credential(credentials[0]);
    if (step == 0) b.set_reply_interval_ms(60000);
    return stream->Write(b);
  };
  ASSERT_TRUE(beat(0));
  v1::HeartbeatResponse reply;
  ASSERT_TRUE(stream->Read(&reply));  // the first beat is always answered
  EXPECT_EQ(reply.generation(), 1);
  EXPECT_EQ(reply.state(), v1::RUNNING);
  for (int64_t step = 1; step <= 5; ++step) ASSERT_TRUE(beat(step));
  // Unanswered beats still count: the step arrives.
  v1::GetJobRequest get;
  get.set_job_id("news");
  v1::Job job;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
  } while (job.members(0).last_step() != 5 && absl::Now() < deadline);
  EXPECT_EQ(job.members(0).last_step(), 5);

  // Rank 1 leaves: the next beat brings generation 2. Had beats 1..5 been answered, this read
  // would return one of their (generation 1) replies instead.
  v1::LeaveRequest leave;
  leave.set_job_id("news");
  leave.set_rank(1);
  leave.set_generation(1);
  leave.set_reason("done");
  leave.set_credential(credentials[1]);
  v1::LeaveResponse left;
  ASSERT_TRUE(stub()->Leave(Context().get(), leave, &left).ok());
  ASSERT_TRUE(beat(6));
  ASSERT_TRUE(stream->Read(&reply));
  EXPECT_EQ(reply.generation(), 2);
  EXPECT_EQ(reply.state(), v1::PENDING);
  EXPECT_EQ(reply.last_change().rank(), 1);
  // Nothing new after that: no reply until the stream ends.
  ASSERT_TRUE(beat(7));
  ASSERT_TRUE(beat(8));
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_FALSE(stream->Read(&reply));
  EXPECT_TRUE(stream->Finish().ok());
}

// Nothing new, but reply_interval_ms has passed since the last reply: the beat is answered.
TEST_F(ServerTest, HeartbeatStream_ReplyInterval_AnswersAtLeastThatOften) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "alive" world_size: 1 mode: PERIODIC
                             levels { period: 1 group_size: 1 })pb")
                  .ok());
  v1::JoinRequest join;
  join.set_job_id("alive");
  join.set_worker_id("w");
  v1::JoinResponse joined;
  ASSERT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
  auto ctx = Context();
  auto stream = stub()->HeartbeatStream(ctx.get());
  for (int step = 0; step < 3; ++step) {
    v1::HeartbeatRequest beat;
    beat.set_job_id("alive");
    beat.set_rank(0);
    beat.set_generation(1);
    beat.set_step(step);
    beat.set_credential(joined.credential());
    beat.set_reply_interval_ms(1);
    if (step > 0) absl::SleepFor(absl::Milliseconds(5));  // more than reply_interval_ms
    ASSERT_TRUE(stream->Write(beat));
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(stream->Read(&reply)) << "beat " << step;
    EXPECT_EQ(reply.generation(), 1);
  }
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerTest, HeartbeatStream_BadReplyInterval_InvalidArgument) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "bad" world_size: 1 mode: PERIODIC
                             levels { period: 1 group_size: 1 })pb")
                  .ok());
  for (int64_t interval : {-1, 60001}) {
    auto ctx = Context();
    auto stream = stub()->HeartbeatStream(ctx.get());
    v1::HeartbeatRequest beat;
    beat.set_job_id("bad");
    beat.set_reply_interval_ms(interval);
    ASSERT_TRUE(stream->Write(beat));
    v1::HeartbeatResponse reply;
    EXPECT_FALSE(stream->Read(&reply));
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << interval;
    EXPECT_THAT(s.error_message(), HasSubstr("reply_interval_ms")) << interval;
  }
}

TEST_F(ServerTest, WatchJob_UnknownJob_NotFound) {
  Start();
  v1::WatchJobRequest watch;
  watch.set_job_id("nope");
  auto ctx = Context();
  auto reader = stub()->WatchJob(ctx.get(), watch);
  v1::JobEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, HostileInput_EachGetsItsCodeAndServerKeepsServing) {
  Start();
  // Bad specs.
  EXPECT_EQ(CreateJob(R"pb(job_id: "x" world_size: 2147483647 mode: PERIODIC
                           levels { period: 1 group_size: 2147483647 })pb")
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(CreateJob(R"pb(job_id: "../etc/passwd" world_size: 1 mode: PERIODIC
                           levels { period: 1 group_size: 1 })pb")
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(CreateJob(R"pb(job_id: "y" world_size: 2 mode: PERIODIC
                           levels { period: -9223372036854775807 group_size: 2 })pb")
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(CreateJob(R"pb(job_id: "j" world_size: 2 mode: PERIODIC
                             levels { period: 1 group_size: 2 })pb")
                  .ok());
  EXPECT_EQ(CreateJob(R"pb(job_id: "j" world_size: 2 mode: PERIODIC
                           levels { period: 1 group_size: 2 })pb")
                .error_code(),
            grpc::StatusCode::ALREADY_EXISTS);

  // Unknown job on every RPC that names one.
  {
    v1::GetJobRequest r;
    r.set_job_id("ghost");
    v1::Job out;
    EXPECT_EQ(stub()->GetJob(Context().get(), r, &out).error_code(), grpc::StatusCode::NOT_FOUND);
    v1::StepRequest step;
    step.set_job_id("ghost");
    v1::StepDecision d;
    EXPECT_EQ(stub()->Step(Context().get(), step, &d).error_code(), grpc::StatusCode::NOT_FOUND);
    v1::JoinRequest join;
    join.set_job_id("ghost");
    join.set_worker_id("w");
    v1::JoinResponse joined;
    EXPECT_EQ(stub()->Join(Context().get(), join, &joined).error_code(),
              grpc::StatusCode::NOT_FOUND);
    v1::HeartbeatRequest hb;
    hb.set_job_id("ghost");
    v1::HeartbeatResponse hbr;
    EXPECT_EQ(stub()->Heartbeat(Context().get(), hb, &hbr).error_code(),
              grpc::StatusCode::NOT_FOUND);
    v1::GetCommIdRequest get;
    get.set_job_id("ghost");
    v1::GetCommIdResponse got;
    EXPECT_EQ(stub()->GetCommId(Context().get(), get, &got).error_code(),
              grpc::StatusCode::NOT_FOUND);
    v1::DeleteJobRequest del;
    del.set_job_id(std::string(10000, 'g'));
    v1::DeleteJobResponse deleted;
    EXPECT_EQ(stub()->DeleteJob(Context().get(), del, &deleted).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  // Huge counts and negative steps.
  {
    v1::GetScheduleRequest r;
    r.set_job_id("j");
    r.set_count(int64_t{1} << 62);
    v1::GetScheduleResponse out;
    grpc::Status s = stub()->GetSchedule(Context().get(), r, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("count must be in [1, 100000]"));
    r.set_count(10);
    r.set_from_step(-1);
    EXPECT_EQ(stub()->GetSchedule(Context().get(), r, &out).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    r.set_from_step(0);
    r.set_rank(1 << 30);
    EXPECT_EQ(stub()->GetSchedule(Context().get(), r, &out).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::StepRequest step;
    step.set_job_id("j");
    step.set_step(-5);
    v1::StepDecision d;
    EXPECT_EQ(stub()->Step(Context().get(), step, &d).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Oversize comm id (the job must be running for the id to reach the size check's peers).
  {
    std::vector<std::thread> joiners;
    for (int r = 0; r < 2; ++r) {
      joiners.emplace_back([&, r] {
        v1::JoinRequest join;
        join.set_job_id("j");
        join.set_worker_id(absl::StrCat("w", r));
        v1::JoinResponse joined;
        EXPECT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
      });
    }
    for (auto& t : joiners) t.join();
    v1::PublishCommIdRequest publish;
    publish.set_job_id("j");
    publish.set_generation(1);
    publish.set_unique_id(std::string(8192, 'x'));
    v1::PublishCommIdResponse published;
    grpc::Status s = stub()->PublishCommId(Context().get(), publish, &published);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("at most 4096"));
  }
  // A message past gRPC's receive limit (1 MiB), one past the method's bound (64 KiB), and a
  // worker id past ours.
  {
    v1::PublishCommIdRequest publish;
    publish.set_job_id("j");
    publish.set_unique_id(std::string(5 << 20, 'x'));
    v1::PublishCommIdResponse published;
    EXPECT_EQ(stub()->PublishCommId(Context().get(), publish, &published).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    v1::JoinRequest join;
    join.set_job_id("j");
    join.set_worker_id(std::string(100000, 'w'));
    v1::JoinResponse joined;
    grpc::Status s = stub()->Join(Context().get(), join, &joined);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(s.error_message(), HasSubstr("Join takes a request of at most 65536 bytes"));
    join.set_worker_id(std::string(10000, 'w'));
    EXPECT_EQ(stub()->Join(Context().get(), join, &joined).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Bytes that are not a protobuf message at all.
  {
    grpc::GenericStub generic(channel());
    grpc::ByteBuffer garbage, reply;
    grpc::Slice slice(std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
    garbage = grpc::ByteBuffer(&slice, 1);
    std::atomic<bool> done{false};
    grpc::Status status;
    auto ctx = Context();
    generic.UnaryCall(ctx.get(), "/modelavg.v1.Coordinator/CreateJob", grpc::StubOptions(),
                      &garbage, &reply, [&](grpc::Status s) {
                        status = s;
                        done = true;
                      });
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_FALSE(status.ok());
  }
  // Still serving.
  v1::PingResponse pong;
  EXPECT_TRUE(stub()->Ping(Context().get(), v1::PingRequest(), &pong).ok());
  EXPECT_GT(pong.unix_ms(), 0);
}

TEST_F(ServerTest, Join_ClientDeadline_DeadlineExceededAndRankFreed) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "j" world_size: 2 mode: PERIODIC
                             levels { period: 1 group_size: 2 })pb")
                  .ok());
  v1::JoinRequest join;
  join.set_job_id("j");
  join.set_worker_id("impatient");
  join.set_rank(0);
  v1::JoinResponse joined;
  EXPECT_EQ(stub()->Join(Context(absl::Milliseconds(200)).get(), join, &joined).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server sees the expiry on its own (its deadline timer or the staleness thread), a little
  // after the client: wait until the rank is released.
  for (int i = 0; i < 2000; ++i) {
    v1::GetJobRequest get;
    get.set_job_id("j");
    v1::Job job;
    ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
    if (job.members_size() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Rank 0 is free again: another worker may take it (no ALREADY_EXISTS).
  std::thread other([&] {
    v1::JoinRequest j2 = join;
    j2.set_worker_id("other");
    v1::JoinResponse r;
    EXPECT_TRUE(stub()->Join(Context().get(), j2, &r).ok());
  });
  v1::JoinRequest j1 = join;
  j1.set_worker_id("second");
  j1.set_rank(1);
  EXPECT_TRUE(stub()->Join(Context().get(), j1, &joined).ok());
  other.join();
}

TEST_F(ServerTest, Shutdown_PendingWaits_Unavailable) {
  Start();
  ASSERT_TRUE(CreateJob(R"pb(job_id: "j" world_size: 2 mode: PERIODIC
                             levels { period: 1 group_size: 2 })pb")
                  .ok());
  grpc::Status status;
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    v1::JoinRequest join;
    join.set_job_id("j");
    join.set_worker_id("w");
    v1::JoinResponse joined;
    status = stub()->Join(Context().get(), join, &joined);
    returned = true;
  });
  // Wait until the Join is registered, then stop the server under it.
  v1::Job job;
  for (int i = 0; i < 2000; ++i) {
    v1::GetJobRequest get;
    get.set_job_id("j");
    ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
    if (job.members_size() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The Join is pending: its member is registered and the call has not returned (a Join sent
  // after the shutdown would also get UNAVAILABLE, but from the transport, not this message).
  ASSERT_EQ(job.members_size(), 1) << "the Join never registered";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_FALSE(returned) << "the Join returned before the shutdown: " << status.error_message();
  server()->Shutdown();
  waiter.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("the coordinator is shutting down"));
}

TEST_F(ServerTest, Health_DefaultService_Serving) {
  Start();
  grpc::Slice empty("");  // an empty HealthCheckRequest: the whole server
  grpc::ByteBuffer request(&empty, 1), reply;
  grpc::GenericStub generic(channel());
  std::atomic<bool> done{false};
  grpc::Status status;
  auto ctx = Context();
  generic.UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                    &reply, [&](grpc::Status s) {
                      status = s;
                      done = true;
                    });
  while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(reply.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING
}

// ------------------------------------------------------------------------------ Token auth

TEST_F(ServerTest, TokenAuth_RightTokenAccepted_MissingOrWrongRefused) {
  ServerOptions options;
  options.auth_token = "s3cret-token";
  Start(options);
  v1::PingResponse pong;
  grpc::Status none = stub()->Ping(Context().get(), v1::PingRequest(), &pong);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(none.error_message(), HasSubstr("authorization: Bearer"));
  EXPECT_EQ(stub()->Ping(Context(absl::Seconds(20), "wrong").get(), v1::PingRequest(), &pong)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(stub()->Ping(Context(absl::Seconds(20), "s3cret-token-longer").get(),
                        v1::PingRequest(), &pong)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(
      stub()->Ping(Context(absl::Seconds(20), "s3cret-token").get(), v1::PingRequest(), &pong)
          .ok());
  v1::ListJobsResponse list;
  EXPECT_EQ(stub()->ListJobs(Context().get(), v1::ListJobsRequest(), &list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(stub()->ListJobs(Context(absl::Seconds(20), "s3cret-token").get(),
                              v1::ListJobsRequest(), &list)
                  .ok());
  v1::WatchJobRequest watch;
  watch.set_job_id("any");
  auto ctx = Context();
  auto reader = stub()->WatchJob(ctx.get(), watch);
  v1::JobEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// ------------------------------------------------------------------------------------- TLS

// A throwaway CA-less self-signed certificate for localhost / 127.0.0.1, made with openssl.
class TlsTest : public ServerTest {
 protected:
  void SetUp() override {
    dir_ = modelavg::testing::MakeTempDir("tls");  // under $TMPDIR
    ASSERT_NE(dir_, "");
    for (const char* name : {"server", "client"}) {
      const std::string cmd = absl::StrCat(
          "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=localhost "
          "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout ",
          dir_, "/", name, ".key -out ", dir_, "/", name, ".crt >/dev/null 2>&1");
      ASSERT_EQ(std::system(cmd.c_str()), 0)
          << "making a test certificate with openssl failed (deploy/install_deps.sh installs it)";
    }
  }
  void TearDown() override {
    StopServer();
    if (!dir_.empty()) std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }
  std::string File(const std::string& name) {
    absl::StatusOr<std::string> s = ReadFileToString(absl::StrCat(dir_, "/", name));
    EXPECT_TRUE(s.ok());
    return s.ok() ? *s : "";
  }
  // A self-signed client certificate NAME.crt / NAME.key with `subject` and `san`.
  void MakeClientCert(const std::string& name, const std::string& subject,
                      const std::string& san) {
    const std::string cmd = absl::StrCat(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj ", subject,
        " -addext subjectAltName=", san, " -keyout ", dir_, "/", name, ".key -out ", dir_, "/",
        name, ".crt >/dev/null 2>&1");
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  std::unique_ptr<v1::Coordinator::Stub> TlsStub(bool with_client_cert,
                                                 const std::string& client = "client") {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = File("server.crt");
    if (with_client_cert) {
      ssl.pem_private_key = File(client + ".key");
      ssl.pem_cert_chain = File(client + ".crt");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    return v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(server()->address(), grpc::SslCredentials(ssl), args));
  }
  ServerOptions TlsOptions(bool mutual) {
    ServerOptions options;
    options.tls_cert_file = dir_ + "/server.crt";
    options.tls_key_file = dir_ + "/server.key";
    if (mutual) options.tls_client_ca_file = dir_ + "/client.crt";
    return options;
  }
  std::string dir_;
};

TEST_F(TlsTest, Tls_TrustedClientAccepted_PlaintextRefused) {
  Start(TlsOptions(false));
  v1::PingResponse pong;
  EXPECT_TRUE(TlsStub(false)->Ping(Context().get(), v1::PingRequest(), &pong).ok());
  // stub() is a plaintext channel: the TLS port does not speak it.
  EXPECT_FALSE(stub()->Ping(Context(absl::Seconds(3)).get(), v1::PingRequest(), &pong).ok());
}

TEST_F(TlsTest, MutualTls_ClientCertRequired) {
  Start(TlsOptions(true));
  v1::PingResponse pong;
  EXPECT_TRUE(TlsStub(true)->Ping(Context().get(), v1::PingRequest(), &pong).ok());
  EXPECT_FALSE(TlsStub(false)->Ping(Context(absl::Seconds(3)).get(), v1::PingRequest(), &pong)
                   .ok());
}

// The mTLS role mapping (--tls_operator_names): a verified client certificate whose common name
// or subject alternative name is listed is an operator; any other verified one is a worker,
// refused the operator RPCs with PERMISSION_DENIED naming both roles.
TEST_F(TlsTest, MutualTls_OperatorNames_MapCertificatesToRoles) {
  MakeClientCert("by_cn", "/CN=ops-admin", "DNS:ops-admin.example");
  MakeClientCert("by_san", "/CN=someone", "DNS:ops-by-san");
  MakeClientCert("trainer", "/CN=trainer-7", "DNS:trainer-7");
  MakeClientCert("prefix", "/CN=ops-admin-not", "DNS:ops-by-san.evil");
  {
    std::ofstream bundle(dir_ + "/clients.pem");
    for (const char* name : {"by_cn", "by_san", "trainer", "prefix"}) {
      bundle << File(absl::StrCat(name, ".crt"));
    }
  }
  ServerOptions options = TlsOptions(false);
  options.tls_client_ca_file = dir_ + "/clients.pem";
  options.operator_cert_names = {"ops-admin", "ops-by-san"};
  Start(options);
  struct Case {
    const char* cert;
    bool is_operator;
  };
  for (const Case& c : {Case{"by_cn", true}, Case{"by_san", true}, Case{"trainer", false},
                        Case{"prefix", false}}) {
    SCOPED_TRACE(c.cert);
    std::unique_ptr<v1::Coordinator::Stub> stub = TlsStub(true, c.cert);
    v1::CreateJobRequest create;
    *create.mutable_spec() = SpecFromText(absl::StrCat(
        "job_id: \"role-", c.cert, "\" mode: PERIODIC world_size: 1 levels { period: 1 "
        "group_size: 1 }"));
    v1::Job job;
    grpc::Status s = stub->CreateJob(Context().get(), create, &job);
    if (c.is_operator) {
      EXPECT_TRUE(s.ok()) << s.error_message();
      continue;
    }
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("needs the operator role"));
    EXPECT_THAT(s.error_message(), HasSubstr("has the worker role"));
    // A worker may do what workers do: join a job an operator made.
    v1::JoinRequest join;
    join.set_job_id("role-by_cn");
    join.set_worker_id(c.cert);
    v1::JoinResponse joined;
    s = stub->Join(Context().get(), join, &joined);
    EXPECT_NE(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
}

TEST_F(TlsTest, Start_MissingKeyFile_Error) {
  ServerOptions options = TlsOptions(false);
  options.tls_key_file = dir_ + "/missing.key";
  EXPECT_EQ(CoordinatorServer::Start(options).status().code(), absl::StatusCode::kNotFound);
  options.tls_key_file = "";
  EXPECT_EQ(CoordinatorServer::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ServerStartTest, Start_BadListenAddress_InvalidArgument) {
  ServerOptions options;
  options.listen = "127.0.0.1:99999";
  EXPECT_EQ(CoordinatorServer::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.listen = "no-port";
  EXPECT_EQ(CoordinatorServer::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace modelavg::server
