// modelavg-coordinator as a separate process: --port_file, --jobs_file, --auth_token_file,
// --metrics_listen, workers on threads over the wire, and SIGTERM → pending waits UNAVAILABLE,
// exit status 0.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/jobs_file.h"
#include "tests/tools/http_get.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = modelavg::testing::MakeTempDir("daemon");  // under $TMPDIR
    ASSERT_NE(dir_, "");
  }
  void TearDown() override {
    process_.reset();  // kills it if it still runs
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  std::string Write(const std::string& name, const std::string& contents) {
    const std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path) << contents;
    return path;
  }

  // Starts the daemon with `flags`; its output goes to dir_/coordinator.{out,err}.
  void Spawn(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {MODELAVG_COORDINATOR_BIN};
    args.insert(args.end(), flags.begin(), flags.end());
    process_.reset();
    process_ = std::make_unique<modelavg::testing::Process>(args, dir_ + "/coordinator");
    ASSERT_GT(process_->pid(), 0);
  }

  // Waits for the port file; "" if the daemon exited first or nothing came within 30 s.
  std::string WaitForAddress(const std::string& port_file) {
    for (int i = 0; i < 3000; ++i) {
      absl::StatusOr<std::string> text = ReadFileToString(port_file);
      if (text.ok() && absl::EndsWith(*text, "\n")) {
        return std::string(absl::StripSuffix(*text, "\n"));
      }
      if (process_->Wait(absl::ZeroDuration()).has_value()) return "";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "";
  }

  // Exit status (at most 30 s), -1 if it did not exit normally or in time.
  int WaitExit() {
    const std::optional<int> code = process_->Wait(absl::Seconds(30));
    return code.has_value() && *code < 128 ? *code : -1;
  }

  std::string Stderr() { return process_ ? process_->err() : ""; }

  std::string dir_;
  std::unique_ptr<modelavg::testing::Process> process_;
};

std::unique_ptr<grpc::ClientContext> Context(const std::string& token = "tok") {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

using ::modelavg::testing::HttpGet;

TEST_F(DaemonTest, Daemon_JobsFileWorkersAndSigterm_PendingJoinsUnavailableExitZero) {
  const std::string jobs = Write("jobs.json", R"({"jobs": [
    {"job_id": "from-file", "world_size": 3, "mode": "PERIODIC",
     "levels": [{"period": 2, "group_size": 3}]}]})");
  const std::string token = Write("token", "tok\n");
  const std::string port_file = absl::StrCat(dir_, "/port");
  const std::string metrics_port_file = absl::StrCat(dir_, "/metrics_port");
  Spawn({"--listen=127.0.0.1:0", "--port_file=" + port_file, "--jobs_file=" + jobs,
         "--auth_token_file=" + token, "--metrics_listen=127.0.0.1:0",
         "--metrics_port_file=" + metrics_port_file, "--log_level=debug"});
  const std::string address = WaitForAddress(port_file);
  ASSERT_NE(address, "") << Stderr();
  // Written before --port_file: present now.
  const std::string metrics_address = WaitForAddress(metrics_port_file);
  int metrics_port = 0;
  ASSERT_TRUE(absl::StartsWith(metrics_address, "127.0.0.1:") &&
              absl::SimpleAtoi(metrics_address.substr(10), &metrics_port) && metrics_port > 0)
      << "--metrics_port_file says '" << metrics_address << "'";
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));

  v1::GetJobRequest get;
  get.set_job_id("from-file");
  v1::Job job;
  ASSERT_TRUE(stub->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.spec().world_size(), 3);
  EXPECT_EQ(stub->GetJob(Context("").get(), get, &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // Two of three workers join and wait; SIGTERM must release them with UNAVAILABLE.
  std::vector<grpc::Status> statuses(2);
  std::vector<std::thread> workers;
  for (int r = 0; r < 2; ++r) {
    workers.emplace_back([&, r] {
      v1::JoinRequest join;
      join.set_job_id("from-file");
      join.set_worker_id(absl::StrCat("w", r));
      v1::JoinResponse joined;
      statuses[r] = stub->Join(Context().get(), join, &joined);
    });
  }
  for (int i = 0; i < 2000; ++i) {
    ASSERT_TRUE(stub->GetJob(Context().get(), get, &job).ok());
    if (job.members_size() == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(job.members_size(), 2);

  const std::string metrics = HttpGet(metrics_port, "/metrics");
  EXPECT_THAT(metrics, HasSubstr("modelavg_job_workers{job=\"from-file\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("modelavg_rpcs_total{code=\"UNAUTHENTICATED\",method=\"GetJob\"} 1"));

  ASSERT_EQ(kill(process_->pid(), SIGTERM), 0);
  EXPECT_EQ(WaitExit(), 0) << Stderr();
  for (auto& t : workers) t.join();
  for (const grpc::Status& s : statuses) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  const std::string log = Stderr();
  EXPECT_THAT(log, HasSubstr("job from-file: created")) << log;
  EXPECT_THAT(log, HasSubstr("joined as rank 1"));
  EXPECT_THAT(log, HasSubstr("received SIGTERM"));
}

// Elastic regrow through the daemon: a member dies, a replacement's Join is answered at once
// with its admission step, a WatchJob stream sees MEMBER_ADMITTED then GENERATION_CHANGED, and
// GetJob, the metrics and the log show it.
TEST_F(DaemonTest, Daemon_ElasticReplacement_WatchMetricsAndLog) {
  const std::string port_file = absl::StrCat(dir_, "/port");
  const std::string metrics_port_file = absl::StrCat(dir_, "/metrics_port");
  Spawn({"--listen=127.0.0.1:0", "--port_file=" + port_file, "--metrics_listen=127.0.0.1:0",
         "--metrics_port_file=" + metrics_port_file});
  const std::string address = WaitForAddress(port_file);
  ASSERT_NE(address, "") << Stderr();
  int metrics_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(WaitForAddress(metrics_port_file).substr(10), &metrics_port));
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  v1::CreateJobRequest create;
  create.mutable_spec()->set_job_id("e");
  create.mutable_spec()->set_world_size(2);
  create.mutable_spec()->set_min_world_size(1);
  create.mutable_spec()->set_mode(v1::PERIODIC);
  create.mutable_spec()->set_heartbeat_timeout_ms(500);
  v1::Level* level = create.mutable_spec()->add_levels();
  level->set_period(1);
  level->set_group_size(2);
  v1::Job job;
  ASSERT_TRUE(stub->CreateJob(Context().get(), create, &job).ok());

  std::vector<v1::JoinResponse> joined(2);
  std::vector<std::thread> joiners;
  for (int r = 0; r < 2; ++r) {
    joiners.emplace_back([&, r] {
      v1::JoinRequest join;
      join.set_job_id("e");
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      EXPECT_TRUE(stub->Join(Context().get(), join, &joined[r]).ok());
    });
  }
  for (auto& t : joiners) t.join();
  v1::WatchJobRequest watch;
  watch.set_job_id("e");
  auto watch_ctx = Context();
  auto reader = stub->WatchJob(watch_ctx.get(), watch);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_EQ(event.kind(), v1::JobEvent::SNAPSHOT);

  // Rank 0 beats at step 40; rank 1 is silent and dies after 500 ms: the job shrinks.
  v1::GetJobRequest get;
  get.set_job_id("e");
  v1::HeartbeatRequest beat;
  beat.set_job_id("e");
  beat.set_rank(0);
  beat.set_step(40);
  beat.set_credential(joined[0].credential());
  for (int i = 0; i < 400; ++i) {
    beat.set_generation(job.generation() > 0 ? job.generation() : 1);
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(stub->Heartbeat(Context().get(), beat, &reply).ok());
    ASSERT_TRUE(stub->GetJob(Context().get(), get, &job).ok());
    if (job.generation() == 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(job.generation(), 2);
  ASSERT_THAT(job.vacant_ranks(), ::testing::ElementsAre(1));
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::JobEvent::GENERATION_CHANGED);

  v1::JoinRequest replacement;
  replacement.set_job_id("e");
  replacement.set_worker_id("replacement");
  v1::JoinResponse admitted;
  ASSERT_TRUE(stub->Join(Context().get(), replacement, &admitted).ok());
  EXPECT_EQ(admitted.rank(), 1);
  EXPECT_EQ(admitted.generation(), 3);
  EXPECT_GE(admitted.admission_step(), 42);
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::JobEvent::MEMBER_ADMITTED);
  EXPECT_EQ(event.rank(), 1);
  EXPECT_THAT(event.message(), HasSubstr(absl::StrCat("at step ", admitted.admission_step())));
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.kind(), v1::JobEvent::GENERATION_CHANGED);
  EXPECT_EQ(event.job().generation(), 3);

  ASSERT_TRUE(stub->GetJob(Context().get(), get, &job).ok());
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(job.deaths(), 1);
  EXPECT_EQ(job.admissions(), 1);
  ASSERT_EQ(job.members_size(), 2);
  EXPECT_EQ(job.members(0).admitted_step(), -1);
  EXPECT_EQ(job.members(1).admitted_step(), admitted.admission_step());
  const std::string metrics = HttpGet(metrics_port, "/metrics");
  EXPECT_THAT(metrics, HasSubstr("modelavg_job_admissions{job=\"e\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("modelavg_job_deaths{job=\"e\"} 1"));
  watch_ctx->TryCancel();
  ASSERT_EQ(kill(process_->pid(), SIGTERM), 0);
  EXPECT_EQ(WaitExit(), 0) << Stderr();
  const std::string log = Stderr();
  EXPECT_THAT(log, HasSubstr(absl::StrCat("worker \"replacement\" () admitted as rank 1 in "
                                          "generation 3 at step ",
                                          admitted.admission_step(), " (floor ")))
      << log;
}

TEST_F(DaemonTest, Daemon_JobsFileWithWrongType_ExitsNonZeroNamingTheFile) {
  const std::string jobs =
      Write("bad.json", R"({"jobs": [{"job_id": "a", "world_size": "lots"}]})");
  Spawn({"--listen=127.0.0.1:0", "--jobs_file=" + jobs});
  EXPECT_EQ(WaitExit(), 2);
  EXPECT_THAT(Stderr(), HasSubstr("bad.json"));
}

TEST_F(DaemonTest, Daemon_BadFlags_ExitNonZeroWithReason) {
  Spawn({"--listen=127.0.0.1:0", "--log_level=loud"});
  EXPECT_EQ(WaitExit(), 2);
  EXPECT_THAT(Stderr(), HasSubstr("unknown log level"));
  Spawn({"--listen=127.0.0.1:0", "--auth_token_file=" + dir_ + "/missing"});
  EXPECT_EQ(WaitExit(), 2);
  EXPECT_THAT(Stderr(), HasSubstr("auth_token_file"));
  Spawn({"--listen=127.0.0.1:0", "--metrics_port_file=" + dir_ + "/metrics_port"});
  EXPECT_EQ(WaitExit(), 2);
  EXPECT_THAT(Stderr(), HasSubstr("--metrics_port_file needs --metrics_listen"));
}

}  // namespace
}  // namespace modelavg::server
