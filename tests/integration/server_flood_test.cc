// Floods against the coordinator as a process, with token auth on: many clients without a token
// sending big messages (refused, and the coordinator's memory stays bounded), many idle
// connections on the gRPC port, HeartbeatStreams opened without a token and held open.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <fstream>
#include <functional>
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
#include "tests/tools/http_get.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

constexpr char kOperator[] = "operator-secret";

// The coordinator as a process with an operator token and `extra` flags; with `open_files`,
// under that limit on open files (soft and hard: it cannot raise it).
class Daemon {
 public:
  explicit Daemon(const std::vector<std::string>& extra = {}, int open_files = 0)
      : dir_("flood") {
    {
      std::ofstream(dir_.path() + "/token") << kOperator << "\n";
    }
    const std::string port_file = dir_.path() + "/port";
    std::vector<std::string> args;
    if (open_files > 0) {
      args = {"/bin/sh", "-c", absl::StrCat("ulimit -n ", open_files, " && exec \"$0\" \"$@\"")};
    }
    for (const std::string& a : {std::string(MODELAVG_COORDINATOR_BIN),
                                 std::string("--listen=127.0.0.1:0"), "--port_file=" + port_file,
                                 "--auth_token_file=" + dir_.path() + "/token"}) {
      args.push_back(a);
    }
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

  // The descriptors the coordinator has open now, -1 if unreadable.
  int OpenFds() const {
    DIR* dir = opendir(absl::StrCat("/proc/", process_->pid(), "/fd").c_str());
    if (dir == nullptr) return -1;
    int n = 0;
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n;
  }

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

// One unary call of `method` on `channel` with `request` as its bytes (and `token`, if any, as
// the bearer); its status and answer.
std::pair<grpc::Status, grpc::ByteBuffer> GenericCall(const std::shared_ptr<grpc::Channel>& channel,
                                                      const std::string& method,
                                                      const grpc::Slice& request,
                                                      const std::string& token,
                                                      absl::Duration timeout = absl::Seconds(30)) {
  grpc::GenericStub stub(channel);
  grpc::ByteBuffer in(&request, 1), out;
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &in, &out, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return {status, std::move(out)};
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
      std::shared_ptr<grpc::Channel> channel = OwnChannel(address);
      for (int i = 0; i < calls; ++i) {
        const grpc::Status status = GenericCall(channel, method, payload, token).first;
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
    const grpc::Status status =
        GenericCall(OwnChannel(daemon.address()), "/modelavg.v1.Coordinator/Join",
                    grpc::Slice(std::string(100 * 1024, 'x')), kOperator, absl::Seconds(10))
            .first;
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

// Opens `n` TCP connections to 127.0.0.1:`port` that send nothing, from the loopback address
// `source` (0: the kernel's choice, 127.0.0.1); their descriptors.
std::vector<int> IdleConnections(int port, int n, uint32_t source = 0) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    if (source != 0) {
      sockaddr_in from{};
      from.sin_family = AF_INET;
      from.sin_addr.s_addr = htonl(source);
      if (bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
        close(fd);
        break;
      }
    }
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
  // From four addresses: one address may hold at most --rpc_max_connections_per_client.
  std::vector<int> idle;
  for (uint32_t source = 0x7f000002; source < 0x7f000006; ++source) {
    std::vector<int> fds = IdleConnections(PortOf(daemon.address()), 275, source);
    idle.insert(idle.end(), fds.begin(), fds.end());
  }
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

// The coordinator's count of open descriptors once it has stayed the same for `quiet` (it has
// accepted what it will), or after `timeout`; the largest count seen.
int SettledOpenFds(const Daemon& daemon, absl::Duration quiet, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int last = daemon.OpenFds(), peak = last;
  absl::Time since = absl::Now();
  while (absl::Now() < deadline && absl::Now() - since < quiet) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int now = daemon.OpenFds();
    peak = std::max(peak, now);
    if (now != last) {
      last = now;
      since = absl::Now();
    }
  }
  return peak;
}

// A call of `method` with the operator's token on a connection of its own that waits for the
// connection (up to `timeout`) instead of failing at once while none can be made.
grpc::Status CallWithToken(const std::string& address, absl::Duration timeout,
                           const std::function<grpc::Status(v1::Coordinator::Stub*,
                                                            grpc::ClientContext*)>& call) {
  auto stub = v1::Coordinator::NewStub(OwnChannel(address));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kOperator));
  ctx.set_wait_for_ready(true);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  return call(stub.get(), &ctx);
}

// About 20,000 bare TCP connections brought the coordinator to its limit on open files; gRPC's
// listener (1.51) stopped for good at accept4's EMFILE, and once every connection was closed the
// coordinator still accepted none (Ping timed out, new workers could not join). The same here
// under a limit of 256 open files, from four source addresses: once the connections are closed, a
// new client's Ping and Join succeed within seconds.
TEST(FloodTest, OpenFileLimitReached_AcceptsAgainOnceTheConnectionsClose) {
  constexpr int kLimit = 256;
  Daemon daemon({}, kLimit);
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  ASSERT_TRUE(PingWithToken(daemon.address(), absl::Seconds(10))) << daemon.process().err();
  grpc::Status created = CallWithToken(
      daemon.address(), absl::Seconds(10), [](v1::Coordinator::Stub* stub,
                                              grpc::ClientContext* ctx) {
        v1::CreateJobRequest request;
        request.mutable_spec()->set_job_id("after-flood");
        request.mutable_spec()->set_world_size(1);
        request.mutable_spec()->set_mode(v1::PERIODIC);
        v1::Level* level = request.mutable_spec()->add_levels();
        level->set_period(1);
        level->set_group_size(1);
        v1::Job job;
        return stub->CreateJob(ctx, request, &job);
      });
  ASSERT_TRUE(created.ok()) << created.error_message();

  const int before = daemon.OpenFds();
  std::vector<int> flood;
  for (uint32_t source = 0x7f000002; source < 0x7f000006; ++source) {
    std::vector<int> fds = IdleConnections(PortOf(daemon.address()), kLimit / 2, source);
    flood.insert(flood.end(), fds.begin(), fds.end());
  }
  EXPECT_EQ(flood.size(), 2u * kLimit) << "the listen queue took fewer connections";
  const int peak = SettledOpenFds(daemon, absl::Milliseconds(500), absl::Seconds(10));
  std::printf("coordinator: %d descriptors open before, %d at most with %zu connections made "
              "(limit %d)\n",
              before, peak, flood.size(), kLimit);
  EXPECT_LT(peak, kLimit) << "the coordinator reached its limit on open files";
  for (int fd : flood) close(fd);

  const absl::Time start = absl::Now();
  grpc::Status pinged = CallWithToken(
      daemon.address(), absl::Seconds(10),
      [](v1::Coordinator::Stub* stub, grpc::ClientContext* ctx) {
        v1::PingResponse pong;
        return stub->Ping(ctx, v1::PingRequest(), &pong);
      });
  EXPECT_TRUE(pinged.ok()) << "Ping after the connections closed: " << pinged.error_message();
  grpc::Status joined = CallWithToken(
      daemon.address(), absl::Seconds(10),
      [](v1::Coordinator::Stub* stub, grpc::ClientContext* ctx) {
        v1::JoinRequest request;
        request.set_job_id("after-flood");
        request.set_worker_id("w0");
        v1::JoinResponse reply;
        return stub->Join(ctx, request, &reply);
      });
  EXPECT_TRUE(joined.ok()) << "Join after the connections closed: " << joined.error_message();
  std::printf("Ping and Join answered %.2f s after the connections closed\n",
              absl::ToDoubleSeconds(absl::Now() - start));
}

// The standard health check's status on `channel` (an existing connection): 1 SERVING,
// 2 NOT_SERVING, -1 no answer.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  // HealthCheckRequest{service: ""}: no bytes.
  auto [status, reply] = GenericCall(channel, "/grpc.health.v1.Health/Check",
                                     grpc::Slice(std::string()), "", absl::Seconds(5));
  std::vector<grpc::Slice> slices;
  if (!status.ok() || !reply.Dump(&slices).ok()) return -1;
  std::string bytes;
  for (const grpc::Slice& slice : slices) bytes.append(slice.begin(), slice.end());
  // HealthCheckResponse{status = 1}: field 1, varint.
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

// The value of an unlabelled sample `name` in /metrics, -1 if absent.
double MetricValue(int http_port, const std::string& name) {
  const std::string text = modelavg::testing::HttpGet(http_port, "/metrics");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, name + " ")) continue;
    double value = -1;
    if (absl::SimpleAtod(line, &value)) return value;
  }
  return -1;
}

// Polls `probe` until it returns true or `timeout` passes; whether it did.
bool Eventually(const std::function<bool()>& probe, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (probe()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return probe();
}

// A coordinator whose gRPC port takes no new connection (every slot held by bare connections
// from other addresses) still answered health checks SERVING on connections made earlier, and
// its /metrics, so that nothing watching it noticed. Now its self-probe, a new connection to its
// own port, finds it full: health says NOT_SERVING and modelavg_grpc_accepting is 0 (which
// ModelavgCoordinatorDown alerts on), and both recover once the connections close. One address
// holds at most --rpc_max_connections_per_client.
TEST(FloodTest, GrpcPortFull_HealthAndMetricsSayNotAccepting) {
  modelavg::testing::TempDir dir("flood-probe");
  Daemon daemon({"--rpc_max_connections=24", "--rpc_max_connections_per_client=10",
                 "--rpc_accept_probe_interval_ms=200", "--rpc_handshake_timeout_ms=600000",
                 "--metrics_listen=127.0.0.1:0",
                 "--metrics_port_file=" + dir.path() + "/http_port"});
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  absl::StatusOr<std::string> http = ReadFileToString(dir.path() + "/http_port");
  ASSERT_TRUE(http.ok());
  const int http_port = PortOf(std::string(absl::StripSuffix(*http, "\n")));
  std::shared_ptr<grpc::Channel> earlier = OwnChannel(daemon.address());
  ASSERT_EQ(HealthStatus(earlier), 1);
  EXPECT_EQ(MetricValue(http_port, "modelavg_grpc_accepting"), 1);
  EXPECT_EQ(MetricValue(http_port, "modelavg_grpc_connections_max"), 24);

  // Eleven from one address: the eleventh is closed at once.
  std::vector<int> held = IdleConnections(PortOf(daemon.address()), 11, 0x7f000002);
  ASSERT_EQ(held.size(), 11u);
  EXPECT_TRUE(Eventually([&] {
    return modelavg::testing::HttpGet(http_port, "/metrics")
               .find("modelavg_grpc_connections_refused_total{reason=\"per_client\"} 1") !=
           std::string::npos;
  }, absl::Seconds(10))) << modelavg::testing::HttpGet(http_port, "/metrics");
  for (uint32_t source = 0x7f000003; source < 0x7f000005; ++source) {
    std::vector<int> fds = IdleConnections(PortOf(daemon.address()), 10, source);
    held.insert(held.end(), fds.begin(), fds.end());
  }
  EXPECT_TRUE(Eventually([&] { return MetricValue(http_port, "modelavg_grpc_accepting") == 0; },
                         absl::Seconds(10)))
      << modelavg::testing::HttpGet(http_port, "/metrics");
  EXPECT_EQ(HealthStatus(earlier), 2) << "health on an earlier connection, port full";
  for (int fd : held) close(fd);
  EXPECT_TRUE(Eventually([&] { return MetricValue(http_port, "modelavg_grpc_accepting") == 1; },
                         absl::Seconds(10)))
      << modelavg::testing::HttpGet(http_port, "/metrics");
  EXPECT_EQ(HealthStatus(earlier), 1);
  EXPECT_TRUE(PingWithToken(daemon.address(), absl::Seconds(10)));
}

// A call of `method` whose answer this client never reads: beyond the stream's flow-control
// window (64 KiB, no bandwidth probing) the answer stays in the coordinator until it is sent.
class UnreadCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  UnreadCall(grpc::GenericStub* stub, const std::string& method, const std::string& request) {
    ctx_.AddMetadata("authorization", absl::StrCat("Bearer ", kOperator));
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const grpc::Slice slice(request);
    request_ = grpc::ByteBuffer(&slice, 1);
    stub->PrepareBidiStreamingCall(&ctx_, method, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartCall();
  }
  ~UnreadCall() override {
    ctx_.TryCancel();
    done_.WaitForNotification();
  }
  void OnReadInitialMetadataDone(bool) override { headers_.Notify(); }
  void OnDone(const grpc::Status&) override {
    // The last callback: the headers' (if any) came before it.
    if (!headers_.HasBeenNotified()) headers_.Notify();
    done_.Notify();
  }
  // Whether the coordinator is sending the answer (held: its headers came, the call goes on),
  // rather than refused it (the call ended) or not answered in `timeout`.
  bool Held(absl::Duration timeout) {
    if (!headers_.WaitForNotificationWithTimeout(timeout)) return false;
    // A refusal's status follows its headers at once.
    return !done_.WaitForNotificationWithTimeout(absl::Milliseconds(300));
  }

 private:
  grpc::ClientContext ctx_;
  grpc::ByteBuffer request_;
  absl::Notification headers_;
  absl::Notification done_;
};

// A unary call of `method` with the operator's token on `channel`; its status and the answer's
// size.
std::pair<grpc::Status, size_t> RawCall(const std::shared_ptr<grpc::Channel>& channel,
                                        const std::string& method, const std::string& request) {
  auto [status, out] = GenericCall(channel, method, grpc::Slice(request), kOperator);
  return {status, out.Length()};
}

// A hundred GetSchedule calls of the largest window at once pushed the coordinator's RSS to
// 1.69 GB, held until each answer was sent. The answers one client address has in flight are
// bounded now (--rpc_schedule_bytes_per_client): with one ~3 MB answer held (never read), the
// next is refused RESOURCE_EXHAUSTED naming the bound, and once the first is gone it is answered.
TEST(FloodTest, ScheduleAnswersInFlight_BoundedPerClient) {
  Daemon daemon({"--rpc_schedule_bytes_per_client=4177920"});
  ASSERT_FALSE(daemon.address().empty()) << daemon.process().err();
  grpc::Status created = CallWithToken(
      daemon.address(), absl::Seconds(10), [](v1::Coordinator::Stub* stub,
                                              grpc::ClientContext* ctx) {
        v1::CreateJobRequest request;
        v1::JobSpec* spec = request.mutable_spec();
        spec->set_job_id("wide");
        spec->set_world_size(4096);
        spec->set_mode(v1::HIERARCHICAL);
        v1::Level* pairs = spec->add_levels();
        pairs->set_period(1);
        pairs->set_group_size(2);
        v1::Level* world = spec->add_levels();
        world->set_period(2);
        world->set_group_size(4096);
        v1::Job job;
        return stub->CreateJob(ctx, request, &job);
      });
  ASSERT_TRUE(created.ok()) << created.error_message();
  v1::GetScheduleRequest window;
  window.set_job_id("wide");
  window.set_from_step(1);
  window.set_count(90);
  const std::string request = window.SerializeAsString();
  const std::string method = "/modelavg.v1.Coordinator/GetSchedule";
  std::shared_ptr<grpc::Channel> channel = OwnChannel(daemon.address());
  const auto [alone, bytes] = RawCall(channel, method, request);
  ASSERT_TRUE(alone.ok()) << alone.error_message();
  ASSERT_GT(bytes, 4177920u / 2) << "the window's answer is too small for the test";
  std::printf("one GetSchedule answer: %zu bytes\n", bytes);
  // The held answer on a connection of its own whose windows never grow (no bandwidth probing,
  // a small window per stream): nothing read there, nothing more is sent.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 * 1024);
  args.SetMaxReceiveMessageSize(-1);
  grpc::GenericStub stub(grpc::CreateCustomChannel(
      daemon.address(), grpc::InsecureChannelCredentials(), args));
  // The held call may itself be refused while the answer before it still counts (the
  // coordinator lets an answer go a moment after its client has read it): asked again until the
  // coordinator is sending it, and only then is the second call made.
  std::unique_ptr<UnreadCall> held;
  grpc::Status refused;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    held = std::make_unique<UnreadCall>(&stub, method, request);
    if (!held->Held(absl::Seconds(10))) continue;
    refused = RawCall(channel, method, request).first;
    if (refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "a second answer while one is held: " << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("--rpc_schedule_bytes_per_client"));
  held.reset();  // cancelled: its answer is dropped
  const grpc::Status again = [&] {
    grpc::Status last;
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (absl::Now() < until) {
      last = RawCall(channel, method, request).first;
      if (last.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return last;
  }();
  EXPECT_TRUE(again.ok()) << again.error_message();
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
