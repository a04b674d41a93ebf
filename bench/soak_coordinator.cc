// modelavg-soak-coordinator: a coordinator under churn and abuse for minutes.
//
//   modelavg-soak-coordinator --coordinator_bin=PATH --jobs=30 --world=10 --seconds=180
//
// Starts the daemon (a child process, port 0), then for --seconds:
//  * jobs x world simulated workers (one thread each) join, heartbeat with their credential,
//    and at random die (stop beating: the coordinator declares them dead), leave, or restart
//    under a new worker id; survivors re-join every new generation; a finished job is deleted
//    and created again;
//  * a hostile thread mixes in garbage request bytes, oversize specs, forged heartbeats, joins
//    and leaves without credentials, full-size GetSchedule and ListJobs calls, deletes of
//    unknown jobs;
//  * a Ping every 10 ms on a channel of its own.
// Every --window seconds it prints a JSON line (coordinator RSS, Ping p50/p99, counts); at the
// end a summary line comparing the first and the last window. A Join that the coordinator
// leaves unanswered past its join timeout plus 5 s counts as a stuck wait. Asserts nothing.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"

ABSL_FLAG(std::string, coordinator_bin, "", "The modelavg-coordinator binary to soak.");
ABSL_FLAG(int, jobs, 30, "Jobs, each with --world workers.");
ABSL_FLAG(int, world, 10, "World size of each job.");
ABSL_FLAG(double, seconds, 180, "How long the soak runs.");
ABSL_FLAG(double, window, 15, "Seconds per reported window.");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 1000, "The jobs' heartbeat timeout.");
ABSL_FLAG(int64_t, join_timeout_ms, 8000, "The jobs' join timeout.");

namespace modelavg {
namespace {

using Stub = v1::Coordinator::Stub;

std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  return ctx;
}

v1::JobSpec Spec(const std::string& id) {
  v1::JobSpec spec;
  spec.set_job_id(id);
  spec.set_world_size(absl::GetFlag(FLAGS_world));
  spec.set_mode(v1::PERIODIC);
  spec.set_heartbeat_timeout_ms(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  spec.set_join_timeout_ms(absl::GetFlag(FLAGS_join_timeout_ms));
  v1::Level* level = spec.add_levels();
  level->set_period(4);
  level->set_group_size(absl::GetFlag(FLAGS_world));
  return spec;
}

int64_t RssKb(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      return std::strtoll(line.c_str() + 6, nullptr, 10);
    }
  }
  return -1;
}

struct Counters {
  std::atomic<int64_t> joins{0}, deaths{0}, leaves{0}, restarts{0}, generations_seen{0};
  std::atomic<int64_t> recreated{0}, hostile{0}, hostile_unexpected{0}, stuck{0}, errors{0};
};

std::atomic<bool> g_stop{false};

// One simulated worker of `job`: join, beat, and now and then die, leave or restart.
void Worker(Stub* stub, const std::string& job, int index, Counters* c) {
  std::mt19937_64 rng(std::hash<std::string>()(job) + index);
  const absl::Duration hb_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  const absl::Duration join_wait =
      absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms)) + absl::Seconds(5);
  int incarnation = 0;
  while (!g_stop) {
    v1::JoinRequest join;
    join.set_job_id(job);
    join.set_worker_id(absl::StrCat(job, "-w", index, "-", incarnation));
    join.set_host("soak");
    join.set_world_size(absl::GetFlag(FLAGS_world));
    v1::JoinResponse joined;
    const grpc::Status s = stub->Join(Context(join_wait).get(), join, &joined);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
          !absl::StrContains(s.error_message(), "timed out")) {
        ++c->stuck;  // the coordinator never answered
      } else if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
                 absl::StrContains(s.error_message(), "FINISHED")) {
        v1::DeleteJobRequest del;
        del.set_job_id(job);
        v1::DeleteJobResponse deleted;
        stub->DeleteJob(Context(absl::Seconds(5)).get(), del, &deleted);
        v1::CreateJobRequest create;
        *create.mutable_spec() = Spec(job);
        v1::Job created;
        if (stub->CreateJob(Context(absl::Seconds(5)).get(), create, &created).ok()) {
          ++c->recreated;
        }
      } else if (s.error_code() != grpc::StatusCode::ABORTED &&
                 s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
                 s.error_code() != grpc::StatusCode::NOT_FOUND &&
                 s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
        ++c->errors;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 100));
      continue;
    }
    ++c->joins;
    // Beat until the generation moves on, or a fate strikes.
    const absl::Time until = absl::Now() + absl::Milliseconds(1000 + rng() % 4000);
    const int fate = static_cast<int>(rng() % 10);  // 0: die, 1: leave, 2: restart, else live
    while (!g_stop) {
      v1::HeartbeatRequest beat;
      beat.set_job_id(job);
      beat.set_rank(joined.rank());
      beat.set_generation(joined.generation());
      beat.set_step(1);
      beat.set_credential(joined.credential());
      v1::HeartbeatResponse reply;
      if (!stub->Heartbeat(Context(absl::Seconds(5)).get(), beat, &reply).ok()) break;
      if (reply.generation() != joined.generation()) {
        ++c->generations_seen;
        break;
      }
      if (fate <= 2 && absl::Now() > until) {
        if (fate == 0) {
          ++c->deaths;
          absl::SleepFor(hb_timeout * 2);
          ++incarnation;  // a new process takes its place
        } else if (fate == 1) {
          v1::LeaveRequest leave;
          leave.set_job_id(job);
          leave.set_rank(joined.rank());
          leave.set_generation(joined.generation());
          leave.set_reason("soak");
          leave.set_credential(joined.credential());
          v1::LeaveResponse left;
          if (stub->Leave(Context(absl::Seconds(5)).get(), leave, &left).ok()) ++c->leaves;
          ++incarnation;
        } else {
          ++c->restarts;  // re-joins at once with its credential (a fast restart)
          break;
        }
        break;
      }
      absl::SleepFor(hb_timeout / 5);
    }
  }
}

// Requests a buggy or hostile client sends; each must get its error, never a crash or a hang.
void Hostile(const std::shared_ptr<grpc::Channel>& channel, int jobs, Counters* c) {
  auto stub = v1::Coordinator::NewStub(channel);
  grpc::GenericStub generic(channel);
  std::mt19937_64 rng(7);
  const char* rpcs[] = {"CreateJob", "Join", "Heartbeat", "GetSchedule", "ListJobs", "Leave"};
  while (!g_stop) {
    const std::string job = absl::StrCat("soak-", rng() % jobs);
    grpc::StatusCode got = grpc::StatusCode::OK;
    bool expected = true;
    switch (rng() % 7) {
      case 0: {  // garbage bytes
        grpc::Slice slice(std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11));
        grpc::ByteBuffer request(&slice, 1), reply;
        absl::Notification done;
        auto ctx = Context(absl::Seconds(5));
        generic.UnaryCall(ctx.get(), absl::StrCat("/modelavg.v1.Coordinator/", rpcs[rng() % 6]),
                          grpc::StubOptions(), &request, &reply, [&](grpc::Status s) {
                            got = s.error_code();
                            done.Notify();
                          });
        done.WaitForNotification();
        expected = got == grpc::StatusCode::INVALID_ARGUMENT;
        break;
      }
      case 1: {  // a spec far past the bounds
        v1::CreateJobRequest create;
        *create.mutable_spec() = Spec("hostile-big");
        for (int i = 0; i < 20000; ++i) create.mutable_spec()->add_levels()->set_period(i + 5);
        v1::Job job_out;
        got = stub->CreateJob(Context(absl::Seconds(5)).get(), create, &job_out).error_code();
        expected = got == grpc::StatusCode::INVALID_ARGUMENT;
        break;
      }
      case 2: {  // a forged heartbeat keeping a rank alive
        v1::HeartbeatRequest beat;
        beat.set_job_id(job);
        beat.set_rank(static_cast<int32_t>(rng() % 4));
        beat.set_generation(1);
        beat.set_credential("0123456789abcdef0123456789abcdef");
        v1::HeartbeatResponse reply;
        got = stub->Heartbeat(Context(absl::Seconds(5)).get(), beat, &reply).error_code();
        expected = got == grpc::StatusCode::PERMISSION_DENIED || got == grpc::StatusCode::NOT_FOUND;
        break;
      }
      case 3: {  // someone else's Leave
        v1::LeaveRequest leave;
        leave.set_job_id(job);
        leave.set_rank(static_cast<int32_t>(rng() % 4));
        v1::LeaveResponse left;
        got = stub->Leave(Context(absl::Seconds(5)).get(), leave, &left).error_code();
        expected = got == grpc::StatusCode::PERMISSION_DENIED || got == grpc::StatusCode::NOT_FOUND;
        break;
      }
      case 4: {  // the largest schedule window
        v1::GetScheduleRequest request;
        request.set_job_id(job);
        request.set_count(100000);
        v1::GetScheduleResponse reply;
        got = stub->GetSchedule(Context(absl::Seconds(5)).get(), request, &reply).error_code();
        expected = got == grpc::StatusCode::OK || got == grpc::StatusCode::NOT_FOUND ||
                   got == grpc::StatusCode::INVALID_ARGUMENT;
        break;
      }
      case 5: {  // every page of ListJobs
        v1::ListJobsRequest request;
        request.set_page_size(7);
        do {
          v1::ListJobsResponse reply;
          got = stub->ListJobs(Context(absl::Seconds(5)).get(), request, &reply).error_code();
          request.set_page_token(reply.next_page_token());
        } while (got == grpc::StatusCode::OK && !request.page_token().empty());
        expected = got == grpc::StatusCode::OK;
        break;
      }
      default: {  // a Join taking a live rank by force
        v1::JoinRequest join;
        join.set_job_id(job);
        join.set_worker_id("intruder");
        join.set_rank(0);
        v1::JoinResponse joined;
        // Short: when the round is assembling the intruder would wait like anyone.
        got = stub->Join(Context(absl::Milliseconds(200)).get(), join, &joined).error_code();
        expected = got != grpc::StatusCode::INTERNAL && got != grpc::StatusCode::UNKNOWN;
        break;
      }
    }
    ++c->hostile;
    if (!expected) ++c->hostile_unexpected;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

struct Window {
  std::vector<int64_t> ping_us;
  int64_t rss_kb = 0;
};

int64_t Percentile(std::vector<int64_t> v, double p) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

int Run() {
  const std::string bin = absl::GetFlag(FLAGS_coordinator_bin);
  if (bin.empty()) {
    std::fprintf(stderr, "--coordinator_bin is required\n");
    return 2;
  }
  char tmpl[] = "/tmp/modelavg_soak_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 2;
  const std::string dir = tmpl, port_file = dir + "/port";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open((dir + "/log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    const std::string port_flag = "--port_file=" + port_file;
    execl(bin.c_str(), bin.c_str(), "--listen=127.0.0.1:0", port_flag.c_str(),
          "--log_level=warn", static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string address;
  for (int i = 0; i < 3000 && address.empty(); ++i) {
    std::ifstream in(port_file);
    std::string line;
    if (std::getline(in, line) && !line.empty() && in.eof() == false) address = line;
    if (address.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (address.empty()) {
    std::fprintf(stderr, "the coordinator did not start (log in %s)\n", dir.c_str());
    kill(pid, SIGKILL);
    return 1;
  }
  const int jobs = absl::GetFlag(FLAGS_jobs), world = absl::GetFlag(FLAGS_world);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<Stub>> stubs;
  for (int i = 0; i < 4; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("modelavg.soak.channel", i);  // distinct channels, distinct connections
    channels.push_back(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    stubs.push_back(v1::Coordinator::NewStub(channels.back()));
  }
  grpc::ChannelArguments ping_args;
  ping_args.SetInt("modelavg.soak.channel", 99);
  auto ping_stub = v1::Coordinator::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), ping_args));

  absl::Mutex mu;
  std::vector<int64_t> pings;
  std::thread pinger([&] {
    while (!g_stop) {
      const absl::Time start = absl::Now();
      v1::PingResponse pong;
      if (ping_stub->Ping(Context(absl::Seconds(5)).get(), v1::PingRequest(), &pong).ok()) {
        absl::MutexLock lock(&mu);
        pings.push_back(absl::ToInt64Microseconds(absl::Now() - start));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  // An idle window first: the baseline.
  const absl::Duration window = absl::Seconds(absl::GetFlag(FLAGS_window));
  absl::SleepFor(window);
  Window idle;
  {
    absl::MutexLock lock(&mu);
    idle.ping_us.swap(pings);
  }
  idle.rss_kb = RssKb(pid);
  std::printf("{\"window\": \"idle\", \"rss_kb\": %lld, \"ping_p50_us\": %lld, "
              "\"ping_p99_us\": %lld}\n",
              static_cast<long long>(idle.rss_kb),
              static_cast<long long>(Percentile(idle.ping_us, 0.5)),
              static_cast<long long>(Percentile(idle.ping_us, 0.99)));
  std::fflush(stdout);

  Counters c;
  for (int j = 0; j < jobs; ++j) {
    v1::CreateJobRequest create;
    *create.mutable_spec() = Spec(absl::StrCat("soak-", j));
    v1::Job job;
    stubs[0]->CreateJob(Context(absl::Seconds(5)).get(), create, &job);
  }
  std::vector<std::thread> threads;
  for (int j = 0; j < jobs; ++j) {
    for (int w = 0; w < world; ++w) {
      threads.emplace_back(Worker, stubs[(j * world + w) % stubs.size()].get(),
                           absl::StrCat("soak-", j), w, &c);
    }
  }
  threads.emplace_back(Hostile, channels[0], jobs, &c);

  std::vector<Window> windows;
  const absl::Time end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  while (absl::Now() < end) {
    absl::SleepFor(std::min(window, end - absl::Now()));
    Window w;
    {
      absl::MutexLock lock(&mu);
      w.ping_us.swap(pings);
    }
    w.rss_kb = RssKb(pid);
    std::printf("{\"window\": %zu, \"rss_kb\": %lld, \"ping_p50_us\": %lld, \"ping_p99_us\": "
                "%lld, \"joins\": %lld, \"deaths\": %lld, \"leaves\": %lld, \"restarts\": %lld, "
                "\"generations_seen\": %lld, \"recreated\": %lld, \"hostile\": %lld, "
                "\"hostile_unexpected\": %lld, \"stuck_waits\": %lld, \"errors\": %lld}\n",
                windows.size(), static_cast<long long>(w.rss_kb),
                static_cast<long long>(Percentile(w.ping_us, 0.5)),
                static_cast<long long>(Percentile(w.ping_us, 0.99)),
                static_cast<long long>(c.joins.load()), static_cast<long long>(c.deaths.load()),
                static_cast<long long>(c.leaves.load()),
                static_cast<long long>(c.restarts.load()),
                static_cast<long long>(c.generations_seen.load()),
                static_cast<long long>(c.recreated.load()),
                static_cast<long long>(c.hostile.load()),
                static_cast<long long>(c.hostile_unexpected.load()),
                static_cast<long long>(c.stuck.load()), static_cast<long long>(c.errors.load()));
    std::fflush(stdout);
    windows.push_back(std::move(w));
  }
  g_stop = true;
  for (auto& t : threads) t.join();
  pinger.join();
  // Every job deleted: the coordinator must give their memory back.
  for (int j = 0; j < jobs; ++j) {
    v1::DeleteJobRequest del;
    del.set_job_id(absl::StrCat("soak-", j));
    v1::DeleteJobResponse deleted;
    ping_stub->DeleteJob(Context(absl::Seconds(5)).get(), del, &deleted);
  }
  absl::SleepFor(absl::Seconds(1));
  const int64_t rss_after_delete_kb = RssKb(pid);
  const absl::Time term = absl::Now();
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  const int64_t exit_ms = absl::ToInt64Milliseconds(absl::Now() - term);
  if (!windows.empty()) {
    const Window& first = windows.front();
    const Window& last = windows.back();
    std::printf("{\"summary\": true, \"workers\": %d, \"seconds\": %.0f, \"rss_idle_kb\": %lld, "
                "\"rss_first_window_kb\": %lld, \"rss_last_window_kb\": %lld, "
                "\"rss_after_delete_kb\": %lld, "
                "\"ping_p99_idle_us\": %lld, \"ping_p99_first_window_us\": %lld, "
                "\"ping_p99_last_window_us\": %lld, \"stuck_waits\": %lld, "
                "\"hostile_unexpected\": %lld, \"sigterm_exit_ms\": %lld, \"exit_status\": %d}\n",
                jobs * world, absl::GetFlag(FLAGS_seconds),
                static_cast<long long>(idle.rss_kb), static_cast<long long>(first.rss_kb),
                static_cast<long long>(last.rss_kb), static_cast<long long>(rss_after_delete_kb),
                static_cast<long long>(Percentile(idle.ping_us, 0.99)),
                static_cast<long long>(Percentile(first.ping_us, 0.99)),
                static_cast<long long>(Percentile(last.ping_us, 0.99)),
                static_cast<long long>(c.stuck.load()),
                static_cast<long long>(c.hostile_unexpected.load()),
                static_cast<long long>(exit_ms), WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  std::system(absl::StrCat("rm -rf ", dir).c_str());
  return 0;
}

}  // namespace
}  // namespace modelavg

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  return modelavg::Run();
}
