// Hostile and misbehaving clients against a real coordinator on 127.0.0.1 (port 0): bytes that
// are no request on every RPC and stream, operator and worker roles on every RPC, ListJobs pages
// that any client can read, a Join for the wrong world size, and SIGTERM while calls are in
// flight (the daemon as a process).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/testing/in_process_coordinator.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::modelavg::testing::CallContext;
using ::modelavg::testing::InProcessCoordinatorTest;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kOperator[] = "operator-secret";
constexpr char kWorker[] = "worker-secret";

std::unique_ptr<grpc::ClientContext> Context(const std::string& token = "",
                                             absl::Duration timeout = absl::Seconds(20)) {
  return CallContext(timeout, token);
}

v1::JobSpec Spec(const std::string& id, int32_t world) {
  return ::modelavg::testing::MakeSpec(id, world, v1::PERIODIC, {{2, world}}, 0);
}

// Bytes that no protobuf parser accepts: a varint that never ends.
grpc::ByteBuffer Garbage() {
  grpc::Slice slice(std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
  return grpc::ByteBuffer(&slice, 1);
}

// A streaming call that writes `messages` raw, half-closes and reads until the end; its status.
class RawStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RawStream(grpc::GenericStub* stub, const std::string& method, std::vector<grpc::ByteBuffer> out,
            const std::string& token = "")
      : out_(std::move(out)), ctx_(Context(token)) {
    stub->PrepareBidiStreamingCall(ctx_.get(), method, grpc::StubOptions(), this);
    StartRead(&in_);
    Next();
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok) Next();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++replies_;
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    status_ = s;
    done_.Notify();
  }
  grpc::Status Wait() {
    done_.WaitForNotification();
    return status_;
  }
  int replies() const { return replies_; }

 private:
  void Next() {
    if (next_ < out_.size()) {
      StartWrite(&out_[next_++]);
    } else {
      StartWritesDone();
    }
  }
  std::vector<grpc::ByteBuffer> out_;
  size_t next_ = 0;
  std::unique_ptr<grpc::ClientContext> ctx_;
  grpc::ByteBuffer in_;
  int replies_ = 0;
  grpc::Status status_;
  absl::Notification done_;
};

grpc::ByteBuffer Bytes(const google::protobuf::Message& m) {
  const std::string s = m.SerializeAsString();
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

class HostileTest : public InProcessCoordinatorTest {
 protected:
  grpc::Status RawUnary(const std::string& rpc, const grpc::ByteBuffer& request,
                        const std::string& token = "") {
    grpc::ByteBuffer reply;
    absl::Notification done;
    grpc::Status status;
    auto ctx = Context(token);
    generic()->UnaryCall(ctx.get(), "/modelavg.v1.Coordinator/" + rpc, grpc::StubOptions(),
                        &request, &reply, [&](grpc::Status s) {
                          status = std::move(s);
                          done.Notify();
                        });
    done.WaitForNotification();
    return status;
  }
};

constexpr const char* kUnary[] = {"CreateJob",     "GetJob",    "ListJobs", "DeleteJob",
                                  "Join",          "Heartbeat", "Step",     "GetSchedule",
                                  "PublishCommId", "GetCommId", "Leave",    "Ping"};

// Garbage bytes as a request body got UNIMPLEMENTED with an empty message. Now every RPC answers
// INVALID_ARGUMENT saying it could not parse the request, and the server keeps serving.
TEST_F(HostileTest, GarbageRequest_EveryUnaryRpc_InvalidArgumentWithMessage) {
  Start();
  for (const char* rpc : kUnary) {
    const grpc::Status s = RawUnary(rpc, Garbage());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << rpc;
    EXPECT_THAT(s.error_message(), HasSubstr("could not parse the request")) << rpc;
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat(rpc, " takes a modelavg.v1."))) << rpc;
  }
  v1::PingResponse pong;
  EXPECT_TRUE(stub()->Ping(Context().get(), v1::PingRequest(), &pong).ok());
}

// A HeartbeatStream that received garbage ended with status OK and dropped the next beats
// silently. Now it ends with INVALID_ARGUMENT; so does a WatchJob given garbage.
TEST_F(HostileTest, GarbageOnStreams_EndWithInvalidArgument) {
  Start();
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("s", 1);
  v1::Job job;
  ASSERT_TRUE(stub()->CreateJob(Context().get(), create, &job).ok());
  v1::JoinRequest join;
  join.set_job_id("s");
  join.set_worker_id("w");
  v1::JoinResponse joined;
  ASSERT_TRUE(stub()->Join(Context().get(), join, &joined).ok());
  v1::HeartbeatRequest beat;
  beat.set_job_id("s");
  beat.set_generation(1);
  beat.set_credential(joined.credential());
  {
    RawStream stream(generic(), "/modelavg.v1.Coordinator/HeartbeatStream",
                     {Bytes(beat), Garbage(), Bytes(beat)});
    const grpc::Status s = stream.Wait();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("HeartbeatStream takes a modelavg.v1.HeartbeatRequest"));
    EXPECT_EQ(stream.replies(), 1);  // the first beat's reply, nothing after the garbage
  }
  {
    v1::HostHeartbeatRequest host;
    *host.add_beats() = beat;
    host.set_reply_interval_ms(1000);
    RawStream stream(generic(), "/modelavg.v1.Coordinator/HostHeartbeatStream",
                     {Bytes(host), Garbage(), Bytes(host)});
    const grpc::Status s = stream.Wait();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(),
                HasSubstr("HostHeartbeatStream takes a modelavg.v1.HostHeartbeatRequest"));
    EXPECT_EQ(stream.replies(), 1);
  }
  {
    RawStream stream(generic(), "/modelavg.v1.Coordinator/WatchJob", {Garbage()});
    const grpc::Status s = stream.Wait();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("WatchJob takes a modelavg.v1.WatchJobRequest"));
  }
}

// Each role on each RPC: the worker token may do everything but CreateJob and DeleteJob
// (PERMISSION_DENIED naming the role); the operator token everything; other tokens nothing.
TEST_F(HostileTest, Roles_EachRoleOnEachRpc) {
  ServerOptions options;
  options.auth_token = kOperator;
  options.worker_token = kWorker;
  Start(options);
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("r", 1);
  v1::Job job;
  grpc::Status s = stub()->CreateJob(Context(kWorker).get(), create, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("CreateJob needs the operator role"));
  EXPECT_THAT(s.error_message(), HasSubstr("has the worker role"));
  ASSERT_TRUE(stub()->CreateJob(Context(kOperator).get(), create, &job).ok());

  // Every RPC with a request that names the job: with the worker token none is refused for its
  // role but CreateJob and DeleteJob; without a token or with a wrong one all are.
  auto requests = [] {
    std::vector<std::pair<std::string, grpc::ByteBuffer>> r;
    v1::CreateJobRequest create;
    *create.mutable_spec() = Spec("r2", 1);
    r.emplace_back("CreateJob", Bytes(create));
    v1::GetJobRequest get;
    get.set_job_id("r");
    r.emplace_back("GetJob", Bytes(get));
    r.emplace_back("ListJobs", Bytes(v1::ListJobsRequest()));
    v1::JoinRequest join;
    join.set_job_id("r");
    join.set_worker_id("w");
    r.emplace_back("Join", Bytes(join));
    v1::HeartbeatRequest beat;
    beat.set_job_id("r");
    beat.set_generation(1);
    r.emplace_back("Heartbeat", Bytes(beat));
    v1::StepRequest step;
    step.set_job_id("r");
    step.set_generation(1);
    r.emplace_back("Step", Bytes(step));
    v1::GetScheduleRequest schedule;
    schedule.set_job_id("r");
    schedule.set_count(4);
    r.emplace_back("GetSchedule", Bytes(schedule));
    v1::PublishCommIdRequest publish;
    publish.set_job_id("r");
    publish.set_generation(1);
    publish.set_unique_id("id");
    r.emplace_back("PublishCommId", Bytes(publish));
    v1::GetCommIdRequest fetch;
    fetch.set_job_id("r");
    fetch.set_generation(1);
    fetch.set_timeout_ms(1);
    r.emplace_back("GetCommId", Bytes(fetch));
    v1::LeaveRequest leave;
    leave.set_job_id("r");
    leave.set_generation(1);
    r.emplace_back("Leave", Bytes(leave));
    r.emplace_back("Ping", Bytes(v1::PingRequest()));
    v1::DeleteJobRequest del;
    del.set_job_id("r");
    r.emplace_back("DeleteJob", Bytes(del));
    v1::UpdateJobRequest update;
    update.set_job_id("r");
    r.emplace_back("UpdateJob", Bytes(update));
    return r;
  };
  for (const auto& [rpc, bytes] : requests()) {
    const grpc::Status worker = RawUnary(rpc, bytes, kWorker);
    if (rpc == "CreateJob" || rpc == "DeleteJob" || rpc == "UpdateJob") {
      EXPECT_EQ(worker.error_code(), grpc::StatusCode::PERMISSION_DENIED) << rpc;
      EXPECT_THAT(worker.error_message(), HasSubstr("needs the operator role")) << rpc;
    } else {
      // Rank-scoped calls without a member's credential are refused for that reason, not for
      // the role.
      EXPECT_THAT(worker.error_message(), Not(HasSubstr("role"))) << rpc;
      EXPECT_NE(worker.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc;
    }
    EXPECT_EQ(RawUnary(rpc, bytes).error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc;
    EXPECT_EQ(RawUnary(rpc, bytes, "wrong").error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << rpc;
  }
  // The operator may do all of it (DeleteJob last: it removes the job).
  for (const auto& [rpc, bytes] : requests()) {
    const grpc::Status op = RawUnary(rpc, bytes, kOperator);
    EXPECT_THAT(op.error_message(), Not(HasSubstr("role"))) << rpc;
    EXPECT_NE(op.error_code(), grpc::StatusCode::UNAUTHENTICATED) << rpc;
  }
  EXPECT_EQ(stub()->GetJob(Context(kOperator).get(), v1::GetJobRequest(), &job).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Streams: the worker role may heartbeat and watch.
  v1::HeartbeatRequest beat;
  beat.set_job_id("r2");
  beat.set_generation(1);
  RawStream stream(generic(), "/modelavg.v1.Coordinator/HeartbeatStream", {Bytes(beat)},
                   kWorker);
  const grpc::Status streamed = stream.Wait();
  EXPECT_THAT(streamed.error_message(), Not(HasSubstr("role")));
  EXPECT_NE(streamed.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::HostHeartbeatRequest host;
  *host.add_beats() = beat;
  host.set_reply_interval_ms(1000);
  RawStream shared(generic(), "/modelavg.v1.Coordinator/HostHeartbeatStream",
                   {Bytes(host)}, kWorker);
  const grpc::Status host_streamed = shared.Wait();
  EXPECT_THAT(host_streamed.error_message(), Not(HasSubstr("role")));
  EXPECT_NE(host_streamed.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  RawStream anonymous(generic(), "/modelavg.v1.Coordinator/HostHeartbeatStream",
                      {Bytes(host)});
  EXPECT_EQ(anonymous.Wait().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(HostileTest, Roles_WorkerTokenWithoutOperatorToken_Refused) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.worker_token = kWorker;
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("needs an operator token"));
  options.auth_token = kWorker;
  server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("are the same"));
}

// Thirty 1.9 MB jobs made one ListJobs reply of 57 MB that no client could read (4 MiB default
// limit). Now a client with default limits walks every page; each reply stays under 4 MiB.
TEST_F(HostileTest, ListJobs_ManyBigJobs_EveryPageReadableWithDefaultLimits) {
  Start();
  constexpr int kJobs = 6;
  constexpr int32_t kWorld = 8192;
  for (int j = 0; j < kJobs; ++j) {
    v1::CreateJobRequest create;
    *create.mutable_spec() = Spec(absl::StrCat("big-", j), kWorld);
    v1::Job job;
    ASSERT_TRUE(stub()->CreateJob(Context().get(), create, &job).ok());
  }
  // Fill the members of one job with long worker ids and hosts through the wire (Join waits;
  // the calls are cancelled at teardown, which frees their ranks).
  std::vector<std::unique_ptr<grpc::ClientContext>> joins;
  std::vector<v1::JoinResponse> replies(kWorld);
  std::atomic<int> finished{0};
  for (int32_t r = 0; r < kWorld; ++r) {
    v1::JoinRequest join;
    join.set_job_id("big-0");
    join.set_worker_id(absl::StrCat(std::string(240, 'w'), r));
    join.set_host(std::string(250, 'h'));
    join.set_rank(r);
    joins.push_back(Context("", absl::Seconds(60)));
    stub()->async()->Join(joins.back().get(), &join, &replies[r],
                         [&finished](grpc::Status) { ++finished; });
  }
  // Wait until the coordinator holds them all.
  v1::GetJobRequest get;
  get.set_job_id("big-0");
  v1::Job big;
  for (int i = 0; i < 600; ++i) {
    big.Clear();
    ASSERT_TRUE(stub()->GetJob(Context().get(), get, &big).ok());
    if (big.members_omitted()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(big.members_omitted());
  int seen = 0;
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  for (int page = 0; page < 20; ++page) {
    v1::ListJobsResponse response;
    const grpc::Status s = stub()->ListJobs(Context().get(), request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LT(response.ByteSizeLong(), 4u * 1024 * 1024);
    seen += response.jobs_size();
    request.set_page_token(response.next_page_token());
    if (request.page_token().empty()) break;
  }
  EXPECT_EQ(seen, kJobs);
  for (auto& ctx : joins) ctx->TryCancel();
  // The contexts and replies outlive every call.
  for (int i = 0; i < 3000 && finished < kWorld; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(finished, kWorld);
}

// A worker started for world 8 joining a 4-rank job waited silently until its own timeout. Now
// it is refused at once, naming both sizes.
TEST_F(HostileTest, Join_WrongWorldSize_RefusedAtOnce) {
  Start();
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("four", 4);
  v1::Job job;
  ASSERT_TRUE(stub()->CreateJob(Context().get(), create, &job).ok());
  v1::JoinRequest join;
  join.set_job_id("four");
  join.set_worker_id("w");
  join.set_rank(0);
  join.set_world_size(8);
  v1::JoinResponse joined;
  const grpc::Status s = stub()->Join(Context("", absl::Seconds(30)).get(), join, &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expects world_size 8 but job four has world_size 4"));
}

// The probe's rank-scoped calls over the wire, with the operator token but without the rank's
// credential: each is refused with PERMISSION_DENIED and changes nothing; with the credential
// each works; and no credential ever appears in the coordinator's log (debug level included).
TEST_F(HostileTest, Credentials_RankScopedCallsNeedThem_NeverLogged) {
  auto log = std::make_shared<std::ostringstream>();
  auto previous = spdlog::default_logger();
  auto capture = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(*log));
  capture->set_level(spdlog::level::trace);
  spdlog::set_default_logger(capture);
  ServerOptions options;
  options.auth_token = kOperator;
  Start(options);
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("two", 2);
  create.mutable_spec()->set_heartbeat_timeout_ms(60000);
  v1::Job job;
  ASSERT_TRUE(stub()->CreateJob(Context(kOperator).get(), create, &job).ok());
  std::vector<v1::JoinResponse> joined(2);
  std::vector<std::thread> joins;
  for (int r = 0; r < 2; ++r) {
    joins.emplace_back([&, r] {
      v1::JoinRequest join;
      join.set_job_id("two");
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      EXPECT_TRUE(stub()->Join(Context(kOperator).get(), join, &joined[r]).ok());
    });
  }
  for (auto& t : joins) t.join();
  ASSERT_FALSE(joined[0].credential().empty());

  // Heartbeat for the other rank (step 777): refused, last_step unchanged.
  v1::HeartbeatRequest beat;
  beat.set_job_id("two");
  beat.set_rank(1);
  beat.set_generation(1);
  beat.set_step(777);
  v1::HeartbeatResponse beat_reply;
  for (const std::string& wrong : {std::string(), joined[0].credential()}) {
    beat.set_credential(wrong);
    EXPECT_EQ(stub()->Heartbeat(Context(kOperator).get(), beat, &beat_reply).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // The same on a stream: it ends with PERMISSION_DENIED.
  {
    beat.set_credential("");
    RawStream stream(generic(), "/modelavg.v1.Coordinator/HeartbeatStream", {Bytes(beat)},
                     kOperator);
    EXPECT_EQ(stream.Wait().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // PublishCommId "EVIL" as rank 0: refused; the leader's own publish then works and rank 1
  // fetches the leader's bytes.
  v1::PublishCommIdRequest publish;
  publish.set_job_id("two");
  publish.set_generation(1);
  publish.set_rank(0);
  publish.set_unique_id("EVIL");
  v1::PublishCommIdResponse published;
  EXPECT_EQ(stub()->PublishCommId(Context(kOperator).get(), publish, &published).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  publish.set_unique_id("leader-id");
  publish.set_credential(joined[0].credential());
  ASSERT_TRUE(stub()->PublishCommId(Context(kOperator).get(), publish, &published).ok());
  v1::GetCommIdRequest fetch;
  fetch.set_job_id("two");
  fetch.set_generation(1);
  fetch.set_rank(1);
  v1::GetCommIdResponse fetched;
  EXPECT_EQ(stub()->GetCommId(Context(kOperator).get(), fetch, &fetched).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  fetch.set_credential(joined[1].credential());
  ASSERT_TRUE(stub()->GetCommId(Context(kOperator).get(), fetch, &fetched).ok());
  EXPECT_EQ(fetched.unique_id(), "leader-id");
  // Leave for the other rank: refused, no new generation.
  v1::LeaveRequest leave;
  leave.set_job_id("two");
  leave.set_rank(1);
  leave.set_generation(1);
  v1::LeaveResponse left;
  EXPECT_EQ(stub()->Leave(Context(kOperator).get(), leave, &left).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Join of the live rank 1 by another worker: ALREADY_EXISTS naming the holder.
  v1::JoinRequest intruder;
  intruder.set_job_id("two");
  intruder.set_worker_id("intruder");
  intruder.set_rank(1);
  v1::JoinResponse none;
  const grpc::Status taken = stub()->Join(Context(kOperator).get(), intruder, &none);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(taken.error_message(), HasSubstr("held by worker \"w1\""));
  v1::GetJobRequest get;
  get.set_job_id("two");
  ASSERT_TRUE(stub()->GetJob(Context(kOperator).get(), get, &job).ok());
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.members(1).last_step(), -1);
  // With the credential each call works.
  beat.set_credential(joined[1].credential());
  ASSERT_TRUE(stub()->Heartbeat(Context(kOperator).get(), beat, &beat_reply).ok());
  leave.set_credential(joined[1].credential());
  ASSERT_TRUE(stub()->Leave(Context(kOperator).get(), leave, &left).ok());
  EXPECT_EQ(left.generation(), 2);

  StopServer();
  spdlog::set_default_logger(previous);
  const std::string text = log->str();
  EXPECT_THAT(text, HasSubstr("joined as rank 1"));  // the capture did see the coordinator
  for (const auto& j : joined) EXPECT_THAT(text, Not(HasSubstr(j.credential())));
}

// worker_id and host took ESC, CR and NUL, which the modelavg CLI then printed raw into an
// operator's terminal (retitle it, clear it, forge lines) and the coordinator into its log.
// Now Join refuses a control character in either with INVALID_ARGUMENT naming the field; the
// job is unchanged.
TEST_F(HostileTest, Join_ControlCharactersInNames_RefusedNamingTheField) {
  Start();
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("names", 1);
  v1::Job job;
  ASSERT_TRUE(stub()->CreateJob(Context().get(), create, &job).ok());
  struct Case {
    std::string worker_id, host, field;
  };
  const std::vector<Case> cases = {
      {"w\x1b]0;owned\x07", "h", "worker_id"},
      {"w\x1b[2J\x1b[H", "h", "worker_id"},
      {std::string("w\0x", 3), "h", "worker_id"},
      {"w\x7f", "h", "worker_id"},
      {"w\xc2\x9b" "31m", "h", "worker_id"},  // C1 CSI in UTF-8
      {"w", "h\r\n[info] job names: all ranks joined", "host"},
      {"w", "h\tx", "host"},
  };
  for (const Case& c : cases) {
    v1::JoinRequest join;
    join.set_job_id("names");
    join.set_worker_id(c.worker_id);
    join.set_host(c.host);
    v1::JoinResponse joined;
    const grpc::Status s = stub()->Join(Context("", absl::Seconds(5)).get(), join, &joined);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(s.error_message(), HasSubstr(c.field + " \"")) << c.field;
    EXPECT_THAT(s.error_message(), HasSubstr("control character")) << c.field;
    // The message shows the value escaped, never raw.
    EXPECT_EQ(s.error_message().find_first_of(std::string("\x1b\r\n\x07\0", 5)), std::string::npos)
        << s.error_message();
  }
  v1::GetJobRequest get;
  get.set_job_id("names");
  ASSERT_TRUE(stub()->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.state(), v1::PENDING);
  EXPECT_EQ(job.members_size(), 0);
  // Printable names, UTF-8 included, are taken.
  v1::JoinRequest join;
  join.set_job_id("names");
  join.set_worker_id("trainer-\xc3\xa9t\xc3\xa9:42");
  join.set_host("node-7.example");
  v1::JoinResponse joined;
  const grpc::Status s = stub()->Join(Context().get(), join, &joined);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// The daemon started with `flags` (and --listen, --port_file) in `dir`; its address once it
// serves, "" if it did not start.
std::string StartDaemon(const std::string& dir, const std::vector<std::string>& flags,
                        std::unique_ptr<modelavg::testing::Process>* daemon) {
  const std::string port_file = dir + "/port";
  std::vector<std::string> args = {MODELAVG_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                   "--port_file=" + port_file};
  args.insert(args.end(), flags.begin(), flags.end());
  *daemon = std::make_unique<modelavg::testing::Process>(args, dir + "/coordinator");
  for (int i = 0; i < 3000; ++i) {
    absl::StatusOr<std::string> text = ReadFileToString(port_file);
    if (text.ok() && absl::EndsWith(*text, "\n")) {
      return std::string(absl::StripSuffix(*text, "\n"));
    }
    if ((*daemon)->Wait(absl::ZeroDuration()).has_value()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "";
}

// One worker token for every job let anyone who held it take a free rank of any job. Now each
// line of --worker_token_file may list the jobs its token may use (ids, or prefixes ending in
// '*'): a call of such a token that names another job is refused PERMISSION_DENIED naming the
// job (Join and every other worker call), and ListJobs shows it only its jobs; a token alone on
// its line (the old file) may use every job.
TEST(HostileDaemonTest, WorkerTokenLimitedToJobA_RefusedOnJobB) {
  modelavg::testing::TempDir dir("worker-tokens");
  ASSERT_NE(dir.path(), "");
  {
    std::ofstream(dir.path() + "/operator") << kOperator << "\n";
    std::ofstream(dir.path() + "/workers") << "# the trainers' tokens\n"
                                           << "token-a  job-a\n"
                                           << "token-b  job-b, team-*\n"
                                           << "token-all\n";
  }
  std::unique_ptr<modelavg::testing::Process> daemon;
  const std::string address =
      StartDaemon(dir.path(),
                  {"--auth_token_file=" + dir.path() + "/operator",
                   "--worker_token_file=" + dir.path() + "/workers"},
                  &daemon);
  ASSERT_FALSE(address.empty()) << daemon->err();
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  grpc::GenericStub generic(channel);
  for (const char* id : {"job-a", "job-b", "team-x"}) {
    v1::CreateJobRequest create;
    *create.mutable_spec() = Spec(id, 2);
    create.mutable_spec()->set_heartbeat_timeout_ms(60000);
    v1::Job job;
    ASSERT_TRUE(stub->CreateJob(Context(kOperator).get(), create, &job).ok());
  }
  auto join = [&](const std::string& token, const std::string& job, v1::JoinResponse* joined) {
    v1::JoinRequest request;
    request.set_job_id(job);
    request.set_worker_id("w");
    return stub->Join(Context(token, absl::Milliseconds(300)).get(), request, joined);
  };
  v1::JoinResponse joined;
  // Job A's token on job B: refused at once, naming the job.
  grpc::Status s = join("token-a", "job-b", &joined);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("Join of job job-b"));
  EXPECT_THAT(s.error_message(), HasSubstr("limited to job(s) job-a"));
  // On its own job it is a worker (the Join waits for the second rank: its deadline passes).
  EXPECT_EQ(join("token-a", "job-a", &joined).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // A prefix, and the token without jobs.
  EXPECT_EQ(join("token-b", "team-x", &joined).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(join("token-b", "job-a", &joined).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  for (const char* job : {"job-a", "job-b", "team-x"}) {
    EXPECT_EQ(join("token-all", job, &joined).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << job;
  }

  // Every other worker call that names job B.
  std::vector<std::pair<std::string, grpc::ByteBuffer>> calls;
  {
    v1::GetJobRequest get;
    get.set_job_id("job-b");
    calls.emplace_back("GetJob", Bytes(get));
    v1::HeartbeatRequest beat;
    beat.set_job_id("job-b");
    calls.emplace_back("Heartbeat", Bytes(beat));
    v1::StepRequest step;
    step.set_job_id("job-b");
    calls.emplace_back("Step", Bytes(step));
    v1::GetScheduleRequest schedule;
    schedule.set_job_id("job-b");
    schedule.set_count(4);
    calls.emplace_back("GetSchedule", Bytes(schedule));
    v1::PublishCommIdRequest publish;
    publish.set_job_id("job-b");
    publish.set_unique_id("id");
    calls.emplace_back("PublishCommId", Bytes(publish));
    v1::GetCommIdRequest fetch;
    fetch.set_job_id("job-b");
    calls.emplace_back("GetCommId", Bytes(fetch));
    v1::LeaveRequest leave;
    leave.set_job_id("job-b");
    calls.emplace_back("Leave", Bytes(leave));
    v1::ReportPeerFailureRequest report;
    report.set_job_id("job-b");
    calls.emplace_back("ReportPeerFailure", Bytes(report));
  }
  for (const auto& [rpc, bytes] : calls) {
    grpc::ByteBuffer reply;
    absl::Notification done;
    grpc::Status status;
    auto ctx = Context("token-a");
    generic.UnaryCall(ctx.get(), "/modelavg.v1.Coordinator/" + rpc, grpc::StubOptions(), &bytes,
                      &reply, [&](grpc::Status st) {
                        status = std::move(st);
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << rpc;
    EXPECT_THAT(status.error_message(), HasSubstr(rpc + " of job job-b")) << rpc;
  }
  {
    v1::WatchJobRequest watch;
    watch.set_job_id("job-b");
    RawStream stream(&generic, "/modelavg.v1.Coordinator/WatchJob", {Bytes(watch)}, "token-a");
    const grpc::Status st = stream.Wait();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), HasSubstr("WatchJob of job job-b"));
  }
  v1::HeartbeatRequest beat;
  beat.set_job_id("job-b");
  {
    RawStream stream(&generic, "/modelavg.v1.Coordinator/HeartbeatStream", {Bytes(beat)},
                     "token-a");
    const grpc::Status st = stream.Wait();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), HasSubstr("HeartbeatStream of job job-b"));
  }
  {
    // A host's stream: the member of job B is answered with its error; the stream goes on.
    v1::HostHeartbeatRequest host;
    *host.add_beats() = beat;
    host.set_reply_interval_ms(1000);
    auto ctx = Context("token-a");
    auto stream = v1::Coordinator::NewStub(channel)->HostHeartbeatStream(ctx.get());
    ASSERT_TRUE(stream->Write(host));
    v1::HostHeartbeatResponse reply;
    ASSERT_TRUE(stream->Read(&reply));
    ASSERT_EQ(reply.members_size(), 1);
    EXPECT_EQ(reply.members(0).job_id(), "job-b");
    EXPECT_EQ(reply.members(0).error_code(), static_cast<int>(grpc::StatusCode::PERMISSION_DENIED));
    EXPECT_THAT(reply.members(0).error_message(), HasSubstr("HostHeartbeatStream of job job-b"));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  // ListJobs shows a limited token only its jobs.
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub->ListJobs(Context("token-b").get(), v1::ListJobsRequest(), &listed).ok());
  std::vector<std::string> ids;
  for (const v1::Job& j : listed.jobs()) ids.push_back(j.spec().job_id());
  EXPECT_THAT(ids, ::testing::ElementsAre("job-b", "team-x"));
  ASSERT_TRUE(stub->ListJobs(Context("token-all").get(), v1::ListJobsRequest(), &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 3);
}

// A worker token file that is not one: refused at start naming the file and the line.
TEST(HostileDaemonTest, WorkerTokenFile_BadJob_RefusedAtStart) {
  modelavg::testing::TempDir dir("worker-tokens-bad");
  ASSERT_NE(dir.path(), "");
  {
    std::ofstream(dir.path() + "/operator") << kOperator << "\n";
    std::ofstream(dir.path() + "/workers") << "token-a job-a\ntoken-b job/b\n";
  }
  std::unique_ptr<modelavg::testing::Process> daemon;
  EXPECT_EQ(StartDaemon(dir.path(),
                        {"--auth_token_file=" + dir.path() + "/operator",
                         "--worker_token_file=" + dir.path() + "/workers"},
                        &daemon),
            "");
  EXPECT_EQ(daemon->Wait(absl::Seconds(10)), std::optional<int>(2));
  EXPECT_THAT(daemon->err(), HasSubstr("/workers line 2: \"job/b\" is neither a job id"));
}

// SIGTERM took 15.8 s while a heavy GetSchedule ran. Now the daemon exits within about a second
// whatever is in flight: here GetSchedule calls in a loop on four threads and a pending Join.
TEST(HostileDaemonTest, Sigterm_WithCallsInFlight_ExitsPromptly) {
  modelavg::testing::TempDir dir("hostile");
  ASSERT_NE(dir.path(), "");
  const std::string port_file = dir.path() + "/port";
  modelavg::testing::Process daemon(
      {MODELAVG_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--port_file=" + port_file},
      dir.path() + "/coordinator");
  ASSERT_GT(daemon.pid(), 0);
  std::string address;
  for (int i = 0; i < 3000 && address.empty(); ++i) {
    absl::StatusOr<std::string> text = ReadFileToString(port_file);
    if (text.ok() && absl::EndsWith(*text, "\n")) {
      address = std::string(absl::StripSuffix(*text, "\n"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(address.empty()) << "the daemon did not start";
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  v1::CreateJobRequest create;
  *create.mutable_spec() = Spec("sched", 65536);
  create.mutable_spec()->mutable_levels(0)->set_period(1);
  v1::Job job;
  ASSERT_TRUE(stub->CreateJob(Context().get(), create, &job).ok());
  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      while (!stop) {
        v1::GetScheduleRequest request;
        request.set_job_id("sched");
        request.set_count(100000);
        v1::GetScheduleResponse response;
        stub->GetSchedule(Context("", absl::Seconds(5)).get(), request, &response);
      }
    });
  }
  v1::JoinRequest join;
  join.set_job_id("sched");
  join.set_worker_id("w");
  v1::JoinResponse joined;
  auto join_ctx = Context("", absl::Seconds(30));
  absl::Notification join_done;
  stub->async()->Join(join_ctx.get(), &join, &joined, [&](grpc::Status) { join_done.Notify(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const absl::Time sent = absl::Now();
  ASSERT_EQ(kill(daemon.pid(), SIGTERM), 0);
  const std::optional<int> code = daemon.Wait(absl::Seconds(10));
  const absl::Duration took = absl::Now() - sent;
  stop = true;
  for (auto& t : callers) t.join();
  join_done.WaitForNotificationWithTimeout(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << "still running 10 s after SIGTERM";  // ~Process kills it
  EXPECT_EQ(*code, 0) << daemon.err();
  // The daemon's deadline is 1 s; this bound is generous for a loaded CI machine (it was 15.8 s).
  EXPECT_LT(took, absl::Seconds(5)) << absl::FormatDuration(took);
}

}  // namespace
}  // namespace modelavg::server
