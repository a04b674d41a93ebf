// Floods against the coordinator as a process, with token auth on: many clients without a token
// sending big messages (refused, and the coordinator's memory stays bounded), many idle
// connections on the gRPC port, HeartbeatStreams opened without a token and held open.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

constexpr char kOperator[] = "operator-secret";

// The coordinator as a process with an operator token and `extra` flags.
class Daemon {
 public:
  explicit Daemon(const std::vector<std::string>& extra = {}) : dir_("flood") {
    {
      std::ofstream(dir_.path() + "/token") << kOperator << "\n";
    }
    const std::string port_file = dir_.path() + "/port";
    std::vector<std::string> args = {MODELAVG_COORDINATOR_BIN, "--listen=127.0.0.1:0",
                                     "--port_file=" + port_file,
                                     "--auth_token_file=" + dir_.path() + "/token"};
    args.insert(args.end(), extra.begin(), extra.end());
    process_ = std::make_unique<modelavg::testing::Process>(args, dir_.path() + "/coordinator");
    for (int i = 0; i < 3000 && address_.empty(); ++i) {
      absl::StatusOr<std::string> text = ReadFileToString(port_file);
      if (text.ok() && absl::EndsWith(*text, "\n")) {
        address_ = std::string(absl::StripSuffix(*text, "\n"));
      }
      if (process_->Wait(absl::ZeroDuration()).has_value()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  const std::string& address() const { return address_; }
  modelavg::testing::Process& process() { return *process_; }

  // A field of /proc/PID/status in kB (VmRSS, VmHWM), -1 if unreadable.
  int64_t StatusKb(const std::string& field) const {
    std::ifstream in(absl::StrCat("/proc/", process_->pid(), "/status"));
    std::string line;
    while (std::getline(in, line)) {
      if (!absl::StartsWith(line, field + ":")) continue;
      std::vector<std::string> parts =
          absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipWhitespace());
      int64_t kb = -1;
      if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb)) return kb;
    }
    return -1;
  }

 private:
  modelavg::testing::TempDir dir_;
  std::unique_ptr<modelavg::testing::Process> process_;
  std::string address_;
};

// A channel of its own (its own TCP connection), as a separate client would have.
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// `clients` clients on connections of their own, each making `calls` calls of `method` with a
// request of `bytes` bytes (and `token`, if any) at once; the number of calls answered with each
// code.
std::map<grpc::StatusCode, int> Flood(const std::string& address, const std::string& method,
                                      size_t bytes, const std::string& token, int clients,
                                      int calls) {
  const grpc::Slice payload(std::string(bytes, 'x'));
  absl::Mutex mu;
  std::map<grpc::StatusCode, int> codes;
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      grpc::GenericStub stub(OwnChannel(address));
      for (int i = 0; i < calls; ++i) {
        grpc::ByteBuffer request(&payload, 1);
        grpc::ByteBuffer reply;
        grpc::ClientContext ctx;
        if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        absl::Notification done;
        grpc::Status status;
        stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &reply, [&](grpc::Status s) {
          status = std::move(s);
          done.Notify();
        });
        done.WaitForNotification();
        absl::MutexLock lock(&mu);
        ++codes[status.error_code()];
      }
    });
  }
  for (auto& t : threads) t.join();
  return codes;
}

bool PingWithToken(const std::string& address, absl::Duration timeout) {
  auto stub = v1::Coordinator::NewStub(OwnChannel(address));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kOperator));
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  v1::PingResponse pong;
  return stub->Ping(&ctx, v1::PingRequest(), &pong).ok();
}

// 128 clients without a token, each sending three messages of just under 4 MiB to Ping (which
// takes an empty message) at once, took the coordinator's peak RSS from 21 MB to 310 MB (the
// issue saw 218 MB to 735 MB). Now each call is refused before its request is read (and no
// client may send far ahead of a read), so the peak grows by a few MB.
TEST(FloodTest, UnauthenticatedBigMessages_RefusedBeforeRead_MemoryBounded) {
  Daemon daemon;
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  ASSERT_TRUE(PingWithToken(daemon.address(), absl::Seconds(10)));
  const int64_t before_kb = daemon.StatusKb("VmHWM");
  ASSERT_GT(before_kb, 0);
  std::map<grpc::StatusCode, int> codes = Flood(
      daemon.address(), "/modelavg.v1.Coordinator/Ping", 4 * 1024 * 1024 - 64, "", 128, 3);
  const int64_t peak_kb = daemon.StatusKb("VmHWM");
  std::printf("coordinator peak RSS %.1f MB before, %.1f MB after 128 x 3 unauthenticated "
              "4 MiB messages\n",
              before_kb / 1024.0, peak_kb / 1024.0);
  EXPECT_EQ(codes[grpc::StatusCode::UNAUTHENTICATED], 128 * 3);
  EXPECT_LT(peak_kb - before_kb, 64 * 1024)
      << "peak RSS grew by " << (peak_kb - before_kb) / 1024 << " MB";
  EXPECT_TRUE(PingWithToken(daemon.address(), absl::Seconds(10)));
}

// With a token, a message bigger than the method takes is refused (RESOURCE_EXHAUSTED naming
// the bound) once read; many at once stay within the memory quota: gRPC closes connections
// (UNAVAILABLE, clients retry) rather than grow past it.
TEST(FloodTest, AuthenticatedBigMessages_RefusedWithinTheMemoryQuota) {
  Daemon daemon({"--rpc_memory_quota_mb=64"});
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  {
    grpc::GenericStub stub(OwnChannel(daemon.address()));
    const grpc::Slice payload(std::string(100 * 1024, 'x'));
    grpc::ByteBuffer request(&payload, 1), reply;
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kOperator));
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, "/modelavg.v1.Coordinator/Join", grpc::StubOptions(), &request, &reply,
                   [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(status.error_message(),
                HasSubstr("Join takes a request of at most 65536 bytes; this one has 102400"));
  }
  const int64_t before_kb = daemon.StatusKb("VmHWM");
  std::map<grpc::StatusCode, int> codes =
      Flood(daemon.address(), "/modelavg.v1.Coordinator/Ping", 4 * 1024 * 1024 - 64, kOperator,
            128, 3);
  const int64_t peak_kb = daemon.StatusKb("VmHWM");
  std::printf("coordinator peak RSS %.1f MB before, %.1f MB after 128 x 3 authenticated 4 MiB "
              "messages (quota 64 MiB); %d refused, %d connections closed\n",
              before_kb / 1024.0, peak_kb / 1024.0, codes[grpc::StatusCode::RESOURCE_EXHAUSTED],
              codes[grpc::StatusCode::UNAVAILABLE]);
  EXPECT_EQ(codes[grpc::StatusCode::RESOURCE_EXHAUSTED] + codes[grpc::StatusCode::UNAVAILABLE],
            128 * 3);
  // The quota and what gRPC holds outside it (its read slices, malloc's slack).
  EXPECT_LT(peak_kb - before_kb, 160 * 1024)
      << "peak RSS grew by " << (peak_kb - before_kb) / 1024 << " MB";
  EXPECT_TRUE(PingWithToken(daemon.address(), absl::Seconds(10)));
}

// Opens `n` TCP connections to 127.0.0.1:`port` that send nothing; their descriptors.
std::vector<int> IdleConnections(int port, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    fds.push_back(fd);
  }
  return fds;
}

int PortOf(const std::string& address) {
  int port = 0;
  return absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port) ? port : 0;
}

// Sets this process's soft limit on open files (children inherit it); the old limit.
rlimit SetOpenFileLimit(rlim_t soft) {
  rlimit old{};
  getrlimit(RLIMIT_NOFILE, &old);
  rlimit set = old;
  set.rlim_cur = std::min(soft, old.rlim_max);
  setrlimit(RLIMIT_NOFILE, &set);
  return old;
}

// A coordinator started with the common soft limit of 1024 open files (a systemd service's,
// a shell's) stopped accepting connections once ~1,000 were open: 1,100 idle TCP connections
// from one client kept every worker and operator out. Now it raises its soft limit to the hard
// one at start, and answers.
TEST(FloodTest, IdleConnectionsPastTheSoftFileLimit_CoordinatorStillAnswers) {
  const rlimit old = SetOpenFileLimit(1024);
  if (old.rlim_max < 4096) {
    GTEST_FAIL() << "the hard limit on open files is " << old.rlim_max
                 << "; this test needs 4096 (ulimit -Hn)";
  }
  Daemon daemon;
  SetOpenFileLimit(old.rlim_max);  // this process opens the 1,100
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  std::vector<int> idle = IdleConnections(PortOf(daemon.address()), 1100);
  EXPECT_EQ(idle.size(), 1100u);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the coordinator accepts them
  EXPECT_TRUE(PingWithToken(daemon.address(), absl::Seconds(5)))
      << "no answer with " << idle.size() << " idle connections open";
  for (int fd : idle) close(fd);
}

// A connection that never starts its HTTP/2 (or TLS) handshake was held for gRPC's default
// 120 s. Now it is closed after --rpc_handshake_timeout_ms.
TEST(FloodTest, IdleConnections_ClosedAfterTheHandshakeTimeout) {
  Daemon daemon({"--rpc_handshake_timeout_ms=500"});
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  std::vector<int> idle = IdleConnections(PortOf(daemon.address()), 20);
  ASSERT_EQ(idle.size(), 20u);
  // (The coordinator sends its HTTP/2 settings first; then, at the timeout, the end.)
  const absl::Time start = absl::Now();
  int closed = 0;
  for (int fd : idle) {
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[256];
    ssize_t got;
    while ((got = read(fd, buf, sizeof(buf))) > 0) {
    }
    if (got == 0) ++closed;  // the coordinator closed it (EOF)
    close(fd);
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_EQ(closed, 20);
}

// A HeartbeatStream opened without a token and held open (nothing sent, never half-closed).
class SilentStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  SilentStream(grpc::GenericStub* stub, const std::string& method) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stub->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartRead(&in_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (ok) StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    status_ = s;
    done_.Notify();
  }
  // The stream's status, or DEADLINE_EXCEEDED if it has not ended within `timeout`.
  grpc::Status Wait(absl::Duration timeout) {
    if (!done_.WaitForNotificationWithTimeout(timeout)) {
      ctx_.TryCancel();
      done_.WaitForNotification();
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "still open");
    }
    return status_;
  }

 private:
  grpc::ClientContext ctx_;
  grpc::ByteBuffer in_;
  grpc::Status status_;
  absl::Notification done_;
};

// Streams opened without a token and held open silently cost nothing: each is ended
// UNAUTHENTICATED when it opens, before any message (this held before as well).
TEST(FloodTest, UnauthenticatedStreamsHeldOpen_EndedAtOnce) {
  Daemon daemon;
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  grpc::GenericStub stub(OwnChannel(daemon.address()));
  std::vector<std::unique_ptr<SilentStream>> streams;
  for (int i = 0; i < 100; ++i) {
    for (const char* method : {"/modelavg.v1.Coordinator/HeartbeatStream",
                               "/modelavg.v1.Coordinator/HostHeartbeatStream",
                               "/modelavg.v1.Coordinator/WatchJob"}) {
      streams.push_back(std::make_unique<SilentStream>(&stub, method));
    }
  }
  for (auto& stream : streams) {
    const grpc::Status s = stream->Wait(absl::Seconds(5));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  }
}

}  // namespace
}  // namespace modelavg::server
