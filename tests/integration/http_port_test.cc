// The coordinator's HTTP port (--metrics_listen) as a separate process: idle connections do not
// hold up other requests, SIGTERM stops it at once (well inside the shutdown deadline), and the
// status page answers beside /metrics, behind the operator token when auth is on.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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
#include "gtest/gtest.h"
#include "tests/tools/http_get.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class HttpPortTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = modelavg::testing::MakeTempDir("http-port");
    ASSERT_NE(dir_, "");
  }
  void TearDown() override {
    for (int fd : idle_) close(fd);
    process_.reset();  // kills it if it still runs
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  // Starts the coordinator with an HTTP port and `extra` flags; returns the HTTP port (0 if it
  // did not come up).
  int Spawn(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {MODELAVG_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0",
                                     "--metrics_port_file=" + dir_ + "/http_port",
                                     "--port_file=" + dir_ + "/port"};
    args.insert(args.end(), extra.begin(), extra.end());
    process_ = std::make_unique<modelavg::testing::Process>(args, dir_ + "/coordinator");
    // --port_file is written after --metrics_port_file.
    for (int i = 0; i < 3000; ++i) {
      absl::StatusOr<std::string> text = ReadFileToString(dir_ + "/port");
      if (text.ok() && absl::EndsWith(*text, "\n")) break;
      if (process_->Wait(absl::ZeroDuration()).has_value()) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    absl::StatusOr<std::string> http = ReadFileToString(dir_ + "/http_port");
    int port = 0;
    if (!http.ok()) return 0;
    const std::string address(absl::StripSuffix(*http, "\n"));
    if (!absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port)) return 0;
    return port;
  }

  // Opens a TCP connection that sends nothing.
  void OpenIdleConnection(int port) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    idle_.push_back(fd);
  }

  std::string Stderr() { return process_ ? process_->err() : ""; }

  // Exit status (at most 30 s), -1 if it did not exit normally or in time.
  int WaitExit() {
    const std::optional<int> code = process_->Wait(absl::Seconds(30));
    return code.has_value() && *code < 128 ? *code : -1;
  }

  std::string dir_;
  std::unique_ptr<modelavg::testing::Process> process_;
  std::vector<int> idle_;
};

using ::modelavg::testing::HttpGet;

TEST_F(HttpPortTest, IdleConnections_MetricsStillAnswer) {
  const int port = Spawn({});
  ASSERT_GT(port, 0) << Stderr();
  ASSERT_THAT(HttpGet(port, "/metrics"), HasSubstr("modelavg_jobs")) << Stderr();
  // More idle connections than a thread-per-connection server has threads.
  for (int i = 0; i < 8; ++i) OpenIdleConnection(port);
  for (int i = 0; i < 3; ++i) {
    const std::string reply = HttpGet(port, "/metrics");
    EXPECT_THAT(reply, HasSubstr("200 OK")) << "request " << i << " while " << idle_.size()
                                           << " idle connections are open";
    EXPECT_THAT(reply, HasSubstr("modelavg_rpcs_total"));
  }
  EXPECT_THAT(HttpGet(port, "/"), HasSubstr("<h1>Jobs</h1>"));
}

TEST_F(HttpPortTest, Sigterm_WithHttpPortAndIdleConnections_StopsWithinTheDeadline) {
  const int port = Spawn({"--log_level=debug"});
  ASSERT_GT(port, 0) << Stderr();
  ASSERT_THAT(HttpGet(port, "/metrics"), HasSubstr("200 OK"));
  OpenIdleConnection(port);
  OpenIdleConnection(port);
  ASSERT_EQ(kill(process_->pid(), SIGTERM), 0);
  EXPECT_EQ(WaitExit(), 0) << Stderr();
  const std::string log = Stderr();
  EXPECT_THAT(log, HasSubstr("received SIGTERM"));
  // The process-wide deadline did not have to end it.
  EXPECT_THAT(log, Not(HasSubstr("deadline; exiting with calls still in flight"))) << log;
  EXPECT_THAT(log, HasSubstr("coordinator stopped")) << log;
}

TEST_F(HttpPortTest, StatusPage_WithAuth_NeedsTheOperatorToken) {
  {
    std::ofstream(dir_ + "/token") << "s3cret-token\n";
  }
  const int port = Spawn({"--auth_token_file=" + dir_ + "/token"});
  ASSERT_GT(port, 0) << Stderr();
  const std::string denied = HttpGet(port, "/");
  EXPECT_THAT(denied, HasSubstr("401"));
  EXPECT_THAT(denied, HasSubstr("<form class=\"login\""));
  EXPECT_THAT(denied, Not(HasSubstr("s3cret-token")));
  EXPECT_THAT(HttpGet(port, "/", "Authorization: Bearer wrong\r\n"), HasSubstr("401"));
  const std::string page = HttpGet(port, "/", "Authorization: Bearer s3cret-token\r\n");
  EXPECT_THAT(page, HasSubstr("200 OK"));
  EXPECT_THAT(page, HasSubstr("<h1>Jobs</h1>"));
  EXPECT_THAT(page, Not(HasSubstr("s3cret-token")));
  // The metrics stay open to Prometheus as before.
  EXPECT_THAT(HttpGet(port, "/metrics"), HasSubstr("200 OK"));
}

}  // namespace
}  // namespace modelavg::server
