// modelavg-bench-coordinator: load on the coordinator from N simulated workers.
//
//   modelavg-bench-coordinator --workers=N --seconds=S [--coordinator=HOST:PORT]
//
// Starts a coordinator (in a child process of its own, so that its CPU time is measured apart
// from the load generator's) unless --coordinator names one. N workers join one job (or
// --jobs=K jobs of N/K ranks each: a world past one job's world_size bound on one coordinator),
// then:
//   1. --heartbeat_seconds of heartbeats only (10 Hz per worker): the coordinator's idle cost
//      (unary calls, or one HeartbeatStream per worker answered only with news: --heartbeat);
//   2. --seconds of heartbeats plus Step RPCs as fast as the server answers (each worker keeps
//      one Step in flight), with Ping (the trivial RPC) measured on the same channels meanwhile.
// Calls are asynchronous (callback API) over a few channels, not one thread per worker.
// Then --latency_jobs times CreateJob and Join (a world-1 job, so the Join completes at once:
// each is one hard-state write) one after the other.
// With --state_dir=DIR, all of it runs twice in the same run, against a coordinator with its
// state in memory and against one with --state_dir=DIR/<run> (SQLite), one JSON line each
// ("state": "memory" / "sqlite"): the durable state must cost nothing on the step and heartbeat
// path. With --etcd_endpoints=HOST:PORT,..., also against a coordinator on etcd ("state":
// "etcd", a fresh --etcd_prefix per run; it is elected before the run starts), and the time
// from the first run's coordinator start to its serving as leader (leader_elected_s).
// Each line also says how long the whole world took to join (join_all_s: every Join sent at once,
// until the last answer; join_all_cpu_s: the coordinator's CPU meanwhile) and the coordinator's
// resident memory with the world joined (coordinator_rss_mb; its peak, coordinator_peak_rss_mb).
// Prints one JSON line per run; asserts nothing about speed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/flags/connection_flags.h"
#include "client/rpc/connection.h"
#include "common/heartbeat_keepalive.h"
#include "common/logging.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"

ABSL_FLAG(int, workers, 64, "Simulated workers (the job's world size).");
ABSL_FLAG(int, jobs, 1,
          "Jobs the workers are split into, evenly (--workers a multiple of it): the ranks of "
          "one coordinator past one job's world_size bound (65536).");
ABSL_FLAG(double, seconds, 5, "Length of the Step load phase.");
ABSL_FLAG(double, heartbeat_seconds, 2, "Length of the heartbeat-only phase before it.");
// --coordinator (or $MODELAVG_COORDINATOR): a running coordinator, reached with the connection
// flags of every modelavg program (client/flags/connection_flags.h: TLS, no token); none given:
// one started for the run.
ABSL_FLAG(int, coordinator_pid, 0,
          "With --coordinator: its process id, to report its CPU (0: not reported).");
ABSL_FLAG(int, max_inflight_steps, 0,
          "Steps in flight at once over all workers (0: one per worker). With K, K lanes each "
          "step workers i, i+K, i+2K, ... in turn.");
ABSL_FLAG(int, channels, 4, "gRPC channels (TCP connections) the workers share.");
ABSL_FLAG(double, heartbeat_hz, 10, "Heartbeats per second per worker.");
ABSL_FLAG(std::string, heartbeat, "stream",
          "How workers heartbeat: 'unary' (one Heartbeat call per beat), 'stream' (default: one "
          "HeartbeatStream per worker, as the client library does), or 'host' (one "
          "HostHeartbeatStream per --ranks_per_stream workers, each message carrying all their "
          "beats, as the client library does for the ranks of one process with "
          "share_heartbeat_stream).");
ABSL_FLAG(int, ranks_per_stream, 8,
          "With --heartbeat=host: the workers (one host's ranks) whose beats share one stream.");
ABSL_FLAG(std::string, state_dir, "",
          "Also run against a coordinator with --state_dir under this directory (a fresh "
          "subdirectory), after the in-memory run; empty: in memory only.");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "Also run against a coordinator with its state in etcd at these endpoints (under a "
          "fresh prefix).");
ABSL_FLAG(int, latency_jobs, 200,
          "CreateJob + Join pairs timed one after the other (0: none).");
ABSL_FLAG(int64_t, reply_interval_ms, -1,
          "With --heartbeat=stream or host: the streams' reply_interval_ms (the coordinator answers "
          "only news, and otherwise at most this often; beats are written without waiting). "
          "0: one reply per beat, each awaited before the next beat. -1: what the client "
          "library asks for the job's heartbeat timeout and --heartbeat_hz "
          "(common/heartbeat_keepalive.h).");
ABSL_FLAG(bool, join_with_rank, true,
          "Each worker's Join names its rank (false: none, the coordinator picks the lowest free "
          "one).");
ABSL_FLAG(bool, subgroup_ranks_from_spec, true,
          "Joins ask for replies without their subgroups' ranks, as the client library does "
          "(JoinRequest.subgroup_ranks_from_spec); false: each reply lists them (the whole world "
          "at the top level).");
ABSL_FLAG(int64_t, heartbeat_timeout_ms, 600000,
          "The job's heartbeat_timeout_ms (long by default, so that no worker is declared dead "
          "under load).");

namespace modelavg {
namespace {

using Stub = v1::Coordinator::Stub;

constexpr int kMaxWorkers = 1 << 20;

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// CPU seconds (user + system, all threads) of a process, from /proc.
double ProcessCpuSeconds(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return -1;
  std::vector<std::string> fields;
  std::string field;
  for (size_t i = paren + 2; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ' ') {
      fields.push_back(field);
      field.clear();
    } else {
      field += text[i];
    }
  }
  // Fields after the command: state(0) ... utime(11) stime(12).
  if (fields.size() < 13) return -1;
  return (std::stod(fields[11]) + std::stod(fields[12])) / sysconf(_SC_CLK_TCK);
}

// A "Vm...:" figure of /proc/PID/status (kB there), in MiB; -1 if absent.
double ProcessStatusMb(int pid, const char* field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0) return std::stod(line.substr(n)) / 1024;
  }
  return -1;
}

// Latencies in microseconds: 1 µs buckets below 100 ms, 100 µs buckets up to 100 s. Lock-free.
class Histogram {
 public:
  Histogram() : buckets_(kBuckets) {}
  void Add(double seconds) {
    const int64_t us = static_cast<int64_t>(seconds * 1e6);
    const int64_t i = us < kFine ? us : std::min(kFine + (us - kFine) / 100, kBuckets - 1);
    buckets_[i].fetch_add(1, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  int64_t count() const { return count_.load(); }
  double Percentile(double p) const {
    const int64_t total = count_.load();
    if (total == 0) return -1;
    const int64_t target = static_cast<int64_t>(p * (total - 1)) + 1;
    int64_t seen = 0;
    for (int64_t i = 0; i < kBuckets; ++i) {
      seen += buckets_[i].load(std::memory_order_relaxed);
      if (seen >= target) return static_cast<double>(i < kFine ? i : kFine + (i - kFine) * 100);
    }
    return -1;
  }

 private:
  static constexpr int64_t kFine = 100'000;
  static constexpr int64_t kBuckets = kFine + 1'000'000;
  std::vector<std::atomic<int64_t>> buckets_;
  std::atomic<int64_t> count_{0};
};

class HeartbeatStreamClient;

struct Worker {
  Stub* stub = nullptr;
  HeartbeatStreamClient* stream = nullptr;
  // The worker's job (one of Load's) and its index over all jobs' workers.
  const std::string* job_id = nullptr;
  int index = 0;
  // Its rank asked for in the job (index within the job).
  int job_rank = 0;
  int32_t rank = -1;
  int64_t generation = 0;
  // The membership's credential (JoinResponse.credential), sent with every beat and Step.
  std::string credential;
  std::atomic<int64_t> step{0};
  // A unary heartbeat is in flight: like a real worker's heartbeat thread, the next beat waits.
  std::atomic<bool> heartbeat_busy{false};
};

// What both kinds of heartbeat stream here share: at most one write in flight (busy_; a beat due
// meanwhile is skipped and counted), a hold until Close, and the stream's end.
template <typename Request, typename Response>
class BenchStream : public grpc::ClientBidiReactor<Request, Response> {
 public:
  // Half-closes once nothing is in flight; Wait() returns when the server has ended the stream.
  void Close() {
    while (busy_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    this->StartWritesDone();
    this->RemoveHold();
  }
  void Wait() { done_.WaitForNotification(); }
  int64_t skipped() const { return skipped_.load(); }
  void OnDone(const grpc::Status& s) override {
    if (!s.ok() && errors_->fetch_add(1) == 0) {
      std::fprintf(stderr, "%s failed: %s\n", rpc_, s.error_message().c_str());
    }
    done_.Notify();
  }

 protected:
  BenchStream(const char* rpc, std::atomic<int64_t>* beats, std::atomic<int64_t>* replies,
              std::atomic<int64_t>* errors)
      : rpc_(rpc), beats_(beats), replies_(replies), errors_(errors) {}
  // After the RPC is started on ctx_ and the first read posted.
  void Begin() {
    this->AddHold();  // until Close: no OnDone while beats may still be written
    this->StartCall();
  }

  const char* const rpc_;
  grpc::ClientContext ctx_;
  std::atomic<bool> busy_{false};
  std::atomic<int64_t> skipped_{0};
  std::atomic<int64_t>* beats_;
  std::atomic<int64_t>* replies_;
  std::atomic<int64_t>* errors_;
  absl::Notification done_;
};

// One worker's HeartbeatStream. With reply_interval_ms > 0, as the client library: beats are
// written without waiting for replies (at most one write in flight; a beat due meanwhile is
// skipped and counted), a read is always outstanding, and a beat counts once written. With 0:
// one reply per beat, and a beat due while the previous one is unanswered is skipped.
class HeartbeatStreamClient final
    : public BenchStream<v1::HeartbeatRequest, v1::HeartbeatResponse> {
 public:
  HeartbeatStreamClient(Stub* stub, int64_t reply_interval_ms, std::atomic<int64_t>* beats,
                        std::atomic<int64_t>* replies, std::atomic<int64_t>* errors)
      : BenchStream("HeartbeatStream", beats, replies, errors),
        reply_interval_ms_(reply_interval_ms) {
    stub->async()->HeartbeatStream(&ctx_, this);
    if (!per_beat()) StartRead(&response_);
    Begin();
  }
  // Called from one thread only (the heartbeat thread).
  void Beat(const std::string& job_id, int32_t rank, int64_t generation, int64_t step,
            const std::string& credential) {
    if (busy_.exchange(true)) {
      skipped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    request_.set_job_id(job_id);
    request_.set_rank(rank);
    request_.set_generation(generation);
    request_.set_step(step);
    request_.set_credential(credential);
    if (first_) request_.set_reply_interval_ms(reply_interval_ms_);
    first_ = false;
    if (per_beat()) StartRead(&response_);
    StartWrite(&request_);
  }

  void OnWriteDone(bool ok) override {
    if (per_beat()) return;
    if (ok) beats_->fetch_add(1, std::memory_order_relaxed);
    busy_ = false;
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      if (per_beat()) busy_ = false;
      return;
    }
    replies_->fetch_add(1, std::memory_order_relaxed);
    if (per_beat()) {
      beats_->fetch_add(1, std::memory_order_relaxed);
      busy_ = false;
    } else {
      StartRead(&response_);
    }
  }

 private:
  bool per_beat() const { return reply_interval_ms_ == 0; }

  const int64_t reply_interval_ms_;
  v1::HeartbeatRequest request_;
  v1::HeartbeatResponse response_;
  bool first_ = true;
};

// One host's HostHeartbeatStream: each Beat writes the beats of all its workers in one message
// (at most one write in flight; a beat due meanwhile is skipped and counted), a read is always
// outstanding, and the beats count once written.
class HostStreamClient final
    : public BenchStream<v1::HostHeartbeatRequest, v1::HostHeartbeatResponse> {
 public:
  HostStreamClient(Stub* stub, std::vector<Worker*> workers, int64_t reply_interval_ms,
                   std::atomic<int64_t>* beats, std::atomic<int64_t>* replies,
                   std::atomic<int64_t>* errors)
      : BenchStream("HostHeartbeatStream", beats, replies, errors), workers_(std::move(workers)) {
    request_.set_reply_interval_ms(std::max<int64_t>(1, reply_interval_ms));
    stub->async()->HostHeartbeatStream(&ctx_, this);
    StartRead(&response_);
    Begin();
  }
  // Called from one thread only (the heartbeat thread).
  void Beat() {
    if (busy_.exchange(true)) {
      skipped_.fetch_add(static_cast<int64_t>(workers_.size()), std::memory_order_relaxed);
      return;
    }
    request_.clear_beats();
    for (const Worker* w : workers_) {
      v1::HeartbeatRequest* b = request_.add_beats();
      b->set_job_id(*w->job_id);
      b->set_rank(w->rank);
      b->set_generation(w->generation);
      b->set_step(w->step.load());
      b->set_credential(w->credential);
    }
    StartWrite(&request_);
  }

  void OnWriteDone(bool ok) override {
    if (ok) beats_->fetch_add(request_.beats_size(), std::memory_order_relaxed);
    busy_ = false;
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    for (const v1::MemberHeartbeatReply& m : response_.members()) {
      if (m.error_code() != 0 && errors_->fetch_add(1) == 0) {
        std::fprintf(stderr, "a beat on a HostHeartbeatStream failed: %s\n",
                     m.error_message().c_str());
      }
    }
    replies_->fetch_add(response_.members_size(), std::memory_order_relaxed);
    StartRead(&response_);
  }

 private:
  const std::vector<Worker*> workers_;
  v1::HostHeartbeatRequest request_;
  v1::HostHeartbeatResponse response_;
};

class Load {
 public:
  Stub* stub() { return stubs_[0].get(); }
  // `workers` split evenly over `job_ids` (workers % job_ids.size() == 0): worker i is rank
  // i % (workers / jobs) of job i / (workers / jobs).
  Load(std::vector<std::unique_ptr<Stub>> stubs, std::vector<std::string> job_ids, int workers)
      : stubs_(std::move(stubs)), job_ids_(std::move(job_ids)), workers_(workers) {
    // (std::vector<Worker>(n): Worker holds atomics, so it is built in place.)
    const int per_job = workers / static_cast<int>(job_ids_.size());
    for (int i = 0; i < workers; ++i) {
      workers_[i].stub = stubs_[i % stubs_.size()].get();
      workers_[i].index = i;
      workers_[i].job_id = &job_ids_[i / per_job];
      workers_[i].job_rank = i % per_job;
    }
  }

  // Every worker joins; returns false (with a message on stderr) on failure.
  bool JoinAll() {
    std::atomic<int> left{static_cast<int>(workers_.size())};
    std::atomic<int> failed{0};
    absl::Notification done;
    struct Call {
      grpc::ClientContext ctx;
      v1::JoinRequest request;
      v1::JoinResponse response;
    };
    for (Worker& w : workers_) {
      auto* call = new Call;
      call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      call->request.set_job_id(*w.job_id);
      call->request.set_worker_id(absl::StrCat("bench-", w.job_rank));
      if (absl::GetFlag(FLAGS_join_with_rank)) call->request.set_rank(w.job_rank);
      call->request.set_subgroup_ranks_from_spec(absl::GetFlag(FLAGS_subgroup_ranks_from_spec));
      w.stub->async()->Join(&call->ctx, &call->request, &call->response,
                            [&, call, worker = &w](grpc::Status s) {
                              if (s.ok()) {
                                worker->rank = call->response.rank();
                                worker->generation = call->response.generation();
                                worker->credential = call->response.credential();
                              } else if (failed.fetch_add(1) == 0) {
                                std::fprintf(stderr, "Join failed: %s\n",
                                             s.error_message().c_str());
                              }
                              delete call;
                              if (left.fetch_sub(1) == 1) done.Notify();
                            });
    }
    done.WaitForNotification();
    return failed.load() == 0;
  }

  // Heartbeats for every worker at `hz`, spread evenly, until StopHeartbeats(): `mode` is
  // "unary", "stream" or "host" (see --heartbeat).
  void StartHeartbeats(double hz, const std::string& mode, int64_t reply_interval_ms,
                       int ranks_per_stream) {
    if (mode == "stream") {
      for (Worker& w : workers_) {
        streams_.push_back(std::make_unique<HeartbeatStreamClient>(
            w.stub, reply_interval_ms, &heartbeats_, &heartbeat_replies_, &errors_));
        w.stream = streams_.back().get();
      }
    }
    if (mode == "host") {
      for (size_t first = 0; first < workers_.size(); first += ranks_per_stream) {
        std::vector<Worker*> host;
        for (size_t i = first; i < std::min(workers_.size(), first + ranks_per_stream); ++i) {
          host.push_back(&workers_[i]);
        }
        Stub* stub = stubs_[hosts_.size() % stubs_.size()].get();
        hosts_.push_back(std::make_unique<HostStreamClient>(
            stub, std::move(host), reply_interval_ms, &heartbeats_,
            &heartbeat_replies_, &errors_));
      }
    }
    heartbeat_thread_ = std::thread([this, hz] {
      constexpr double kTick = 0.01;
      // What beats at once: a worker, or a host's workers together.
      const size_t units = hosts_.empty() ? workers_.size() : hosts_.size();
      const double per_tick = units * hz * kTick;
      double owed = 0;
      size_t next = 0;
      double t = SteadySeconds();
      while (!stop_heartbeats_.load()) {
        owed += per_tick;
        for (; owed >= 1; owed -= 1) {
          if (hosts_.empty()) {
            Heartbeat(&workers_[next]);
          } else {
            hosts_[next]->Beat();
          }
          next = (next + 1) % units;
        }
        t += kTick;
        const double sleep = t - SteadySeconds();
        if (sleep > 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep));
      }
    });
  }
  void StopHeartbeats() {
    stop_heartbeats_ = true;
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    for (auto& s : streams_) s->Close();
    for (auto& h : hosts_) h->Close();
    for (auto& s : streams_) s->Wait();
    for (auto& h : hosts_) h->Wait();
  }
  int64_t skipped_beats() const {
    int64_t n = skipped_unary_.load();
    for (const auto& s : streams_) n += s->skipped();
    for (const auto& h : hosts_) n += h->skipped();
    return n;
  }

  // Every worker keeps one Step in flight; each channel one Ping.
  void StartSteps(int max_inflight) {
    lanes_ = max_inflight > 0 ? std::min<int>(max_inflight, workers_.size()) : workers_.size();
    for (int i = 0; i < lanes_; ++i) IssueStep(&workers_[i]);
    for (auto& stub : stubs_) IssuePing(stub.get());
  }
  void StopSteps() {
    stop_steps_ = true;
    // Calls in flight finish on their own; wait for them so nothing outlives the stubs.
    while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  void WaitHeartbeatsDrained() {
    while (heartbeats_inflight_.load() > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void SetMeasuring(bool on) { measuring_ = on; }
  int64_t decisions() const { return decisions_.load(); }
  int64_t heartbeats() const { return heartbeats_.load(); }
  // Heartbeat replies received (a unary beat is one call, so only streams count here).
  int64_t heartbeat_replies() const { return heartbeat_replies_.load(); }
  int64_t errors() const { return errors_.load(); }
  const Histogram& step_latency() const { return step_latency_; }
  const Histogram& ping_latency() const { return ping_latency_; }

 private:
  struct StepCall {
    Worker* worker;
    double start;
    grpc::ClientContext ctx;
    v1::StepRequest request;
    v1::StepDecision response;
  };
  struct PingCall {
    Stub* stub;
    double start;
    grpc::ClientContext ctx;
    v1::PingRequest request;
    v1::PingResponse response;
  };
  struct HeartbeatCall {
    grpc::ClientContext ctx;
    v1::HeartbeatRequest request;
    v1::HeartbeatResponse response;
  };

  void IssueStep(Worker* w) {
    inflight_.fetch_add(1);
    auto* call = new StepCall;
    call->worker = w;
    call->request.set_job_id(*w->job_id);
    call->request.set_rank(w->rank);
    call->request.set_generation(w->generation);
    call->request.set_step(w->step.load());
    call->request.set_credential(w->credential);
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call->start = SteadySeconds();
    w->stub->async()->Step(&call->ctx, &call->request, &call->response,
                           [this, call](grpc::Status s) { OnStep(call, s); });
  }
  void OnStep(StepCall* call, const grpc::Status& s) {
    const double latency = SteadySeconds() - call->start;
    Worker* w = call->worker;
    delete call;
    if (s.ok()) {
      if (measuring_.load(std::memory_order_relaxed)) {
        decisions_.fetch_add(1, std::memory_order_relaxed);
        step_latency_.Add(latency);
      }
      ++w->step;
    } else if (errors_.fetch_add(1) == 0) {
      std::fprintf(stderr, "Step failed: %s\n", s.error_message().c_str());
    }
    if (!stop_steps_.load() && s.ok()) {
      size_t next = w->index + lanes_;
      if (next >= workers_.size()) next = w->index % lanes_;
      IssueStep(&workers_[next]);
    }
    inflight_.fetch_sub(1);
  }

  void IssuePing(Stub* stub) {
    inflight_.fetch_add(1);
    auto* call = new PingCall;
    call->stub = stub;
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call->start = SteadySeconds();
    stub->async()->Ping(&call->ctx, &call->request, &call->response,
                        [this, call](grpc::Status s) {
                          const double latency = SteadySeconds() - call->start;
                          Stub* stub = call->stub;
                          delete call;
                          if (s.ok() && measuring_.load(std::memory_order_relaxed)) {
                            ping_latency_.Add(latency);
                          }
                          if (!stop_steps_.load() && s.ok()) IssuePing(stub);
                          inflight_.fetch_sub(1);
                        });
  }

  void Heartbeat(Worker* w) {
    if (w->stream != nullptr) {
      w->stream->Beat(*w->job_id, w->rank, w->generation, w->step.load(), w->credential);
      return;
    }
    if (w->heartbeat_busy.exchange(true)) {
      skipped_unary_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    heartbeats_inflight_.fetch_add(1);
    auto* call = new HeartbeatCall;
    call->request.set_job_id(*w->job_id);
    call->request.set_rank(w->rank);
    call->request.set_generation(w->generation);
    call->request.set_step(w->step.load());
    call->request.set_credential(w->credential);
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    w->stub->async()->Heartbeat(&call->ctx, &call->request, &call->response,
                                [this, call, w](grpc::Status s) {
                                  delete call;
                                  w->heartbeat_busy = false;
                                  if (s.ok()) {
                                    heartbeats_.fetch_add(1, std::memory_order_relaxed);
                                  } else if (errors_.fetch_add(1) == 0) {
                                    std::fprintf(stderr, "Heartbeat failed: %s\n",
                                                 s.error_message().c_str());
                                  }
                                  heartbeats_inflight_.fetch_sub(1);
                                });
  }

  std::vector<std::unique_ptr<Stub>> stubs_;
  const std::vector<std::string> job_ids_;
  std::vector<Worker> workers_;
  int lanes_ = 0;
  std::thread heartbeat_thread_;
  std::vector<std::unique_ptr<HeartbeatStreamClient>> streams_;
  std::vector<std::unique_ptr<HostStreamClient>> hosts_;
  std::atomic<bool> stop_heartbeats_{false};
  std::atomic<bool> stop_steps_{false};
  std::atomic<bool> measuring_{false};
  std::atomic<int64_t> inflight_{0};
  std::atomic<int64_t> heartbeats_inflight_{0};
  std::atomic<int64_t> skipped_unary_{0};
  std::atomic<int64_t> decisions_{0};
  std::atomic<int64_t> heartbeats_{0};
  std::atomic<int64_t> heartbeat_replies_{0};
  std::atomic<int64_t> errors_{0};
  Histogram step_latency_;
  Histogram ping_latency_;
};

// Runs a coordinator in a child process; returns its pid and writes its address.
int StartChildCoordinator(std::string* address, const std::string& state_dir,
                          const std::string& etcd_endpoints = "") {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const int pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    close(fds[0]);
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    (void)InitLogging("warn", "bench-coordinator");
    // As the daemon does (server/main.cc): no lock-order cycle detection on the hot path.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    server::ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.state_dir = state_dir;
    options.etcd_endpoints = etcd_endpoints;
    options.etcd_prefix = absl::StrCat("/modelavg-bench-", getpid(), "/");
    auto server = server::CoordinatorServer::Start(options);
    if (!server.ok()) std::fprintf(stderr, "coordinator: %s\n", server.status().ToString().c_str());
    const std::string line = server.ok() ? (*server)->address() : "";
    (void)!write(fds[1], line.data(), line.size());
    close(fds[1]);
    if (!server.ok()) _exit(1);
    int sig;
    sigwait(&signals, &sig);
    (*server)->Shutdown();
    _exit(0);
  }
  close(fds[1]);
  char buf[256];
  const ssize_t n = read(fds[0], buf, sizeof(buf));
  close(fds[0]);
  if (n <= 0) return -1;
  address->assign(buf, n);
  return pid;
}

// CreateJob and Join latency: `count` world-1 jobs, one after the other.
void TimeCreateAndJoin(Stub* stub, int count, Histogram* create, Histogram* join) {
  for (int i = 0; i < count; ++i) {
    const std::string id = absl::StrCat("lat-", getpid(), "-", i);
    v1::CreateJobRequest request;
    request.mutable_spec()->set_job_id(id);
    request.mutable_spec()->set_world_size(1);
    request.mutable_spec()->set_mode(v1::PERIODIC);
    v1::Level* l = request.mutable_spec()->add_levels();
    l->set_period(4);
    l->set_group_size(1);
    v1::Job job;
    grpc::ClientContext create_ctx;
    double t = SteadySeconds();
    grpc::Status s = stub->CreateJob(&create_ctx, request, &job);
    create->Add(SteadySeconds() - t);
    if (!s.ok()) {
      std::fprintf(stderr, "CreateJob failed: %s\n", s.error_message().c_str());
      return;
    }
    v1::JoinRequest join_request;
    join_request.set_job_id(id);
    join_request.set_worker_id("latency");
    join_request.set_rank(0);
    v1::JoinResponse joined;
    grpc::ClientContext join_ctx;
    t = SteadySeconds();
    s = stub->Join(&join_ctx, join_request, &joined);
    join->Add(SteadySeconds() - t);
    if (!s.ok()) {
      std::fprintf(stderr, "Join failed: %s\n", s.error_message().c_str());
      return;
    }
    v1::DeleteJobRequest del;
    del.set_job_id(id);
    v1::DeleteJobResponse deleted;
    grpc::ClientContext del_ctx;
    (void)stub->DeleteJob(&del_ctx, del, &deleted);
  }
}

// One measurement against the coordinator at `address` (process `pid`, 0: unknown), labelled
// `state` in the JSON line, over channels with `creds`.
int RunOnce(const std::string& address, int pid, const std::string& state,
            const std::shared_ptr<grpc::ChannelCredentials>& creds =
                grpc::InsecureChannelCredentials()) {
  const int n = absl::GetFlag(FLAGS_workers);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const double hb_seconds = absl::GetFlag(FLAGS_heartbeat_seconds);
  const int channels = std::max(1, absl::GetFlag(FLAGS_channels));
  auto stop_child = [] {};
  std::vector<std::unique_ptr<Stub>> stubs;
  for (int i = 0; i < channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("modelavg.bench_channel", i);  // distinct args: a connection per channel
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(address, creds, args)));
  }
  // Pairs average every 4 steps, the whole world every 64 (a realistic hierarchy whose
  // decisions mostly list a few ranks); with --jobs, each job's world.
  const int jobs = absl::GetFlag(FLAGS_jobs);
  const int per_job = n / jobs;
  std::vector<std::string> job_ids;
  for (int j = 0; j < jobs; ++j) {
    job_ids.push_back(jobs == 1 ? absl::StrCat("bench-", getpid(), "-", n)
                                : absl::StrCat("bench-", getpid(), "-", n, "-", j));
    v1::CreateJobRequest request;
    v1::JobSpec* spec = request.mutable_spec();
    spec->set_job_id(job_ids.back());
    spec->set_world_size(per_job);
    spec->set_mode(v1::HIERARCHICAL);
    const int group = per_job % 8 == 0 ? 8 : 1;
    if (group < per_job) {
      v1::Level* l = spec->add_levels();
      l->set_period(4);
      l->set_group_size(group);
    }
    v1::Level* top = spec->add_levels();
    top->set_period(64);
    top->set_group_size(per_job);
    spec->set_heartbeat_timeout_ms(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
    spec->set_join_timeout_ms(120000);
    grpc::ClientContext ctx;
    v1::Job job;
    grpc::Status s = stubs[0]->CreateJob(&ctx, request, &job);
    if (!s.ok()) {
      std::fprintf(stderr, "CreateJob failed: %s\n", s.error_message().c_str());
      stop_child();
      return 1;
    }
  }
  Load load(std::move(stubs), job_ids, n);
  const double join_t0 = SteadySeconds();
  const double join_cpu0 = pid > 0 ? ProcessCpuSeconds(pid) : 0;
  if (!load.JoinAll()) {
    stop_child();
    return 1;
  }
  // Every worker's Join sent at once, until the last answer: the rendezvous of the whole world.
  const double join_s = SteadySeconds() - join_t0;
  const double join_cpu_s = pid > 0 ? ProcessCpuSeconds(pid) - join_cpu0 : -1;
  std::fprintf(stderr, "join: %d workers (%d jobs) in %.3f s (coordinator %.3f CPU s)\n", n,
               jobs, join_s, join_cpu_s);

  const std::string heartbeat_mode = absl::GetFlag(FLAGS_heartbeat);
  const int ranks_per_stream = absl::GetFlag(FLAGS_ranks_per_stream);
  if (heartbeat_mode != "unary" && heartbeat_mode != "stream" && heartbeat_mode != "host") {
    std::fprintf(stderr, "--heartbeat must be unary, stream or host\n");
    stop_child();
    return 2;
  }
  if (ranks_per_stream < 1 || ranks_per_stream > 4096) {
    std::fprintf(stderr, "--ranks_per_stream must be in [1, 4096]\n");
    stop_child();
    return 2;
  }
  int64_t reply_interval_ms = absl::GetFlag(FLAGS_reply_interval_ms);
  if (reply_interval_ms == -1) {
    reply_interval_ms = StreamReplyIntervalMs(
        absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms)),
        absl::Seconds(1 / std::max(1e-3, absl::GetFlag(FLAGS_heartbeat_hz))));
  }
  if (reply_interval_ms < 0 || reply_interval_ms > kMaxReplyIntervalMs) {
    std::fprintf(stderr, "--reply_interval_ms must be -1 or in [0, 60000]\n");
    stop_child();
    return 2;
  }
  load.StartHeartbeats(absl::GetFlag(FLAGS_heartbeat_hz), heartbeat_mode, reply_interval_ms,
                       ranks_per_stream);
  double hb_cores = -1;
  double hb_us = -1;  // coordinator CPU per heartbeat
  double hb_rate = 0;  // heartbeats/s delivered in the heartbeat-only phase
  double hb_reply_rate = 0;  // of which answered on a stream
  double hb_load_cores = -1;  // this process's (the load generator's) CPU meanwhile
  if (hb_seconds > 0) {
    // Settle: every worker has sent its first beat (a stream's first beat, which opens it and
    // is always answered, costs far more than a steady one), and 300 ms more.
    std::this_thread::sleep_for(std::chrono::duration<double>(
        0.3 + 1 / std::max(1e-3, absl::GetFlag(FLAGS_heartbeat_hz))));
    const double cpu0 = pid > 0 ? ProcessCpuSeconds(pid) : 0;
    const double self0 = ProcessCpuSeconds(getpid());
    const int64_t beats0 = load.heartbeats();
    const int64_t replies0 = load.heartbeat_replies();
    const double t0 = SteadySeconds();
    std::this_thread::sleep_for(std::chrono::duration<double>(hb_seconds));
    const double wall = SteadySeconds() - t0;
    if (pid > 0) hb_cores = (ProcessCpuSeconds(pid) - cpu0) / wall;
    hb_load_cores = (ProcessCpuSeconds(getpid()) - self0) / wall;
    const double rate = (load.heartbeats() - beats0) / wall;
    hb_rate = rate;
    hb_reply_rate = (load.heartbeat_replies() - replies0) / wall;
    if (rate > 0 && hb_cores >= 0) hb_us = hb_cores / rate * 1e6;
    std::fprintf(stderr,
                 "heartbeat-only: %.0f heartbeats/s (%.0f replies/s), coordinator %.3f cores "
                 "(%.1f us/beat), load generator %.3f cores\n",
                 rate, hb_reply_rate, hb_cores, hb_us, hb_load_cores);
  }

  load.StartSteps(absl::GetFlag(FLAGS_max_inflight_steps));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // warm up
  load.SetMeasuring(true);
  const double cpu0 = pid > 0 ? ProcessCpuSeconds(pid) : 0;
  const int64_t beats0 = load.heartbeats();
  const double t0 = SteadySeconds();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  load.SetMeasuring(false);
  const double wall = SteadySeconds() - t0;
  const double cores = pid > 0 ? (ProcessCpuSeconds(pid) - cpu0) / wall : -1;
  const int64_t decisions = load.decisions();
  const int64_t beats = load.heartbeats() - beats0;
  const int64_t rpcs = decisions + beats + load.ping_latency().count();
  // The coordinator's CPU per RPC, and the decisions/s one fully used core would give: figures
  // that do not depend on how much CPU the load generator (same machine) left over.
  const double cpu_us_per_rpc = cores > 0 ? cores * wall / rpcs * 1e6 : -1;
  load.StopSteps();
  load.StopHeartbeats();
  load.WaitHeartbeatsDrained();

  // The coordinator's memory with the whole world joined and beating (before the latency jobs).
  const double rss_mb = pid > 0 ? ProcessStatusMb(pid, "VmRSS:") : -1;
  const double peak_rss_mb = pid > 0 ? ProcessStatusMb(pid, "VmHWM:") : -1;
  Histogram create_latency, join_latency;
  TimeCreateAndJoin(load.stub(), absl::GetFlag(FLAGS_latency_jobs), &create_latency,
                    &join_latency);

  const double step_p99 = load.step_latency().Percentile(0.99);
  const double ping_p99 = load.ping_latency().Percentile(0.99);
  std::printf(
      "{\"workers\": %d, \"jobs\": %d, \"seconds\": %.2f, \"decisions_per_s\": %.0f, "
      "\"step_p50_us\": %.0f, "
      "\"step_p99_us\": %.0f, \"trivial_p50_us\": %.0f, \"trivial_p99_us\": %.0f, "
      "\"step_p99_over_trivial_p99\": %.2f, \"coordinator_cpu_cores\": %.3f, "
      "\"heartbeats_per_s\": %.0f, \"heartbeat_only_cpu_cores\": %.3f, \"pings\": %lld, "
      "\"errors\": %lld, \"channels\": %d, \"coordinator_cpu_us_per_rpc\": %.1f, "
      "\"heartbeat_cpu_us\": %.1f, \"heartbeat\": \"%s\", \"skipped_beats\": %lld, "
      "\"max_inflight_steps\": %d, \"heartbeat_only_per_s\": %.0f, "
      "\"heartbeat_only_replies_per_s\": %.0f, \"heartbeat_only_load_cpu_cores\": %.3f, "
      "\"reply_interval_ms\": %lld, \"ranks_per_stream\": %d, "
      "\"state\": \"%s\", \"create_job_p50_us\": %.0f, \"create_job_p99_us\": %.0f, "
      "\"join_p50_us\": %.0f, \"join_p99_us\": %.0f, \"latency_jobs\": %lld, "
      "\"join_all_s\": %.3f, \"join_all_cpu_s\": %.3f, \"coordinator_rss_mb\": %.1f, "
      "\"coordinator_peak_rss_mb\": %.1f}\n",
      n, jobs, wall, decisions / wall, load.step_latency().Percentile(0.5), step_p99,
      load.ping_latency().Percentile(0.5), ping_p99, ping_p99 > 0 ? step_p99 / ping_p99 : -1,
      cores, beats / wall, hb_cores, static_cast<long long>(load.ping_latency().count()),
      static_cast<long long>(load.errors()), channels, cpu_us_per_rpc, hb_us,
      heartbeat_mode.c_str(), static_cast<long long>(load.skipped_beats()),
      absl::GetFlag(FLAGS_max_inflight_steps), hb_rate, hb_reply_rate, hb_load_cores,
      static_cast<long long>(heartbeat_mode != "unary" ? reply_interval_ms : 0),
      heartbeat_mode == "host" ? ranks_per_stream : 1,
      state.c_str(),
      create_latency.Percentile(0.5), create_latency.Percentile(0.99),
      join_latency.Percentile(0.5), join_latency.Percentile(0.99),
      static_cast<long long>(create_latency.count()), join_s, join_cpu_s, rss_mb, peak_rss_mb);
  std::fflush(stdout);
  stop_child();
  return load.errors() == 0 ? 0 : 1;
}

int Main() {
  const int n = absl::GetFlag(FLAGS_workers);
  if (n < 1 || n > kMaxWorkers || absl::GetFlag(FLAGS_seconds) <= 0 ||
      absl::GetFlag(FLAGS_heartbeat_seconds) < 0) {
    std::fprintf(stderr, "--workers must be in [1, %d], --seconds > 0, "
                         "--heartbeat_seconds >= 0\n", kMaxWorkers);
    return 2;
  }
  const int jobs = absl::GetFlag(FLAGS_jobs);
  if (jobs < 1 || n % jobs != 0) {
    std::fprintf(stderr, "--jobs must be at least 1 and divide --workers (%d)\n", n);
    return 2;
  }
  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  absl::StatusOr<modelavg::client::ConnectionOptions> conn =
      modelavg::client::ConnectionFromFlags();
  if (!conn.ok()) {
    std::fprintf(stderr, "%s\n", std::string(conn.status().message()).c_str());
    return 2;
  }
  if (!conn->coordinator.empty()) {
    if (!state_dir.empty()) {
      std::fprintf(stderr, "--state_dir starts its own coordinators: leave --coordinator out\n");
      return 2;
    }
    if (!conn->auth_token.empty() || !conn->auth_token_file.empty()) {
      std::fprintf(stderr, "the load benchmark sends no token: run it against a coordinator "
                           "without --auth_token_file\n");
      return 2;
    }
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
        modelavg::client::ChannelCredentialsFor(*conn);
    if (!creds.ok()) {
      std::fprintf(stderr, "%s\n", std::string(creds.status().message()).c_str());
      return 2;
    }
    return RunOnce(conn->coordinator, absl::GetFlag(FLAGS_coordinator_pid), "external", *creds);
  }
  // Every child is forked before this process creates any gRPC state.
  struct Child {
    std::string state;
    std::string address;
    int pid = 0;
  };
  std::vector<Child> children = {{"memory", "", 0}};
  if (!state_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(state_dir, error);
    children.push_back({"sqlite", "", 0});
  }
  const std::string etcd = absl::GetFlag(FLAGS_etcd_endpoints);
  if (!etcd.empty()) children.push_back({"etcd", "", 0});
  for (Child& c : children) {
    c.pid = StartChildCoordinator(
        &c.address, c.state == "sqlite" ? absl::StrCat(state_dir, "/bench-", getpid()) : "",
        c.state == "etcd" ? etcd : "");
    if (c.pid <= 0) {
      std::fprintf(stderr, "could not start a coordinator (%s)\n", c.state.c_str());
      for (Child& d : children) {
        if (d.pid > 0) kill(d.pid, SIGTERM);
      }
      return 1;
    }
  }
  int rc = 0;
  for (Child& c : children) {
    if (c.state == "etcd" && rc == 0) {
      // Serves once elected: Ping answers (a standby's UNAVAILABLE before).
      auto stub = v1::Coordinator::NewStub(
          grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials()));
      const double start = SteadySeconds();
      grpc::Status s;
      do {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        v1::PingResponse pong;
        s = stub->Ping(&ctx, v1::PingRequest(), &pong);
        if (!s.ok()) absl::SleepFor(absl::Milliseconds(5));
      } while (!s.ok() && SteadySeconds() - start < 30);
      if (!s.ok()) {
        std::fprintf(stderr, "the etcd coordinator never led: %s\n", s.error_message().c_str());
        rc = 1;
      } else {
        std::printf("{\"state\": \"etcd\", \"leader_elected_s\": %.4f}\n",
                    SteadySeconds() - start);
      }
    }
    if (rc == 0) rc = RunOnce(c.address, c.pid, c.state);
    kill(c.pid, SIGTERM);
    waitpid(c.pid, nullptr, 0);
  }
  return rc;
}

}  // namespace
}  // namespace modelavg

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return modelavg::Main();
}
