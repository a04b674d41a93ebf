// modelavg: the command line for a running coordinator.
//
//   modelavg jobs                                   every job, one line each
//   modelavg job ID                                 one job: its plan, members, last change
//   modelavg schedule ID --from=S --count=N [--rank=R]   the averaging decisions of N steps
//   modelavg watch ID [--watch_ms=T]                the job's events as they happen
//   modelavg create -f spec.json                    create a job from a JobSpec in JSON
//   modelavg update ID -f spec.json                 a new plan for the running job (UpdateJob,
//                                                   docs/plan-updates.md): the whole JobSpec
//   modelavg update ID --period=P [--level=L]       ... or its latest plan with one level's
//   modelavg update ID --outer_lr=X [--level=L]     period or outer lr changed (default: the
//                                                   last level)
//   modelavg delete ID                              delete a job
//
// Connection (client/flags/connection_flags.h, as every modelavg program): --coordinator=HOST:PORT
// (default $MODELAVG_COORDINATOR, else 127.0.0.1:50051), --auth_token_file (sends "authorization:
// Bearer <token>"; default $MODELAVG_AUTH_TOKEN_FILE), --tls with --tls_ca_file, --tls_cert_file/
// --tls_key_file for mutual TLS, --rpc_timeout_ms (each call's deadline). Output: tables for people
// by default, --json for scripts (one JSON object; `watch`: one per line). Exit status 0 on
// success; 1 with one line on stderr saying what failed; 2 on a usage error.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/flags/connection_flags.h"
#include "client/rpc/connection.h"
#include "common/file_util.h"
#include "common/job_spec.h"
#include "common/printable.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"

ABSL_FLAG(bool, json, false, "print JSON (the API's messages) instead of tables");
ABSL_FLAG(int64_t, from, 0, "schedule: first step");
ABSL_FLAG(int64_t, count, 20, "schedule: number of steps");
ABSL_FLAG(int32_t, rank, -1, "schedule: only this rank's decisions (-1: every subgroup)");
ABSL_FLAG(std::string, f, "",
          "create, update: the JobSpec file (JSON), '-' for standard input");
ABSL_FLAG(std::optional<int64_t>, period, std::nullopt,
          "update: the level's new period (the rest of the job's latest plan as it is)");
ABSL_FLAG(std::optional<double>, outer_lr, std::nullopt,
          "update: the level's new outer learning rate (the level must have an outer "
          "optimizer)");
ABSL_FLAG(std::optional<int32_t>, level, std::nullopt,
          "update --period/--outer_lr: the level's index (default: the last level)");
ABSL_FLAG(int64_t, watch_ms, 0, "watch: stop after this many milliseconds (0: until the job "
                                "is deleted or the coordinator stops)");

namespace {

namespace v1 = modelavg::v1;
using google::protobuf::util::JsonPrintOptions;

constexpr char kUsage[] =
    "The command line for a modelavg coordinator.\n"
    "  modelavg [flags] jobs\n"
    "  modelavg [flags] job ID\n"
    "  modelavg [flags] schedule ID --from=S --count=N [--rank=R]\n"
    "  modelavg [flags] watch ID [--watch_ms=T]\n"
    "  modelavg [flags] create -f spec.json\n"
    "  modelavg [flags] update ID -f spec.json\n"
    "  modelavg [flags] update ID --period=P [--level=L]\n"
    "  modelavg [flags] update ID --outer_lr=X [--level=L]\n"
    "  modelavg [flags] delete ID\n"
    "Flags: --coordinator=HOST:PORT --auth_token_file=F --tls --tls_ca_file=F --tls_cert_file=F "
    "--tls_key_file=F --rpc_timeout_ms=T --json (see --help)";

std::atomic<bool> g_interrupted{false};

class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string ReadOrFail(const std::string& path, const char* flag) {
  absl::StatusOr<std::string> text = modelavg::ReadFileToString(path);
  if (!text.ok()) throw Failure(absl::StrCat("--", flag, ": ", text.status().message()));
  return *std::move(text);
}

// The connection from the flags and the environment (127.0.0.1:50051 when neither names one).
const modelavg::client::ConnectionOptions& Connection() {
  static const modelavg::client::ConnectionOptions* conn = [] {
    modelavg::client::ConnectionOptions defaults;
    defaults.coordinator = "127.0.0.1:50051";
    absl::StatusOr<modelavg::client::ConnectionOptions> c =
        modelavg::client::ConnectionFromFlags(defaults);
    if (!c.ok()) throw Failure(std::string(c.status().message()));
    return new modelavg::client::ConnectionOptions(*std::move(c));
  }();
  return *conn;
}

std::string CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",         "UNKNOWN",          "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",  "ALREADY_EXISTS",   "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",      "UNAVAILABLE",      "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : absl::StrCat("code ", c);
}

void Check(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return;
  std::string hint;
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    hint = absl::StrCat(" (is the coordinator running at ", Connection().coordinator,
                        "? TLS on one side only? set --coordinator or $MODELAVG_COORDINATOR)");
  } else if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    hint = " (pass the operator token: --auth_token_file or $MODELAVG_AUTH_TOKEN_FILE)";
  }
  throw Failure(absl::StrCat(what, ": ", CodeName(status.error_code()), ": ",
                             modelavg::EscapeControlCharacters(status.error_message()), hint));
}

class Cli {
 public:
  Cli() {
    absl::StatusOr<modelavg::client::CoordinatorChannel> c =
        modelavg::client::OpenChannel(Connection());
    if (!c.ok()) throw Failure(std::string(c.status().message()));
    token_ = c->token;
    stub_ = v1::Coordinator::NewStub(c->channel);
  }

  // A call's context: its deadline --rpc_timeout_ms, or `at_least` when that is longer (a call
  // that waits on the members, UpdateJob); none with deadline false (a stream).
  std::unique_ptr<grpc::ClientContext> Context(
      bool deadline = true, absl::Duration at_least = absl::ZeroDuration()) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (deadline) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(std::max(Connection().rpc_timeout, at_least)));
    }
    if (!token_.empty()) ctx->AddMetadata("authorization", "Bearer " + token_);
    return ctx;
  }

  v1::Coordinator::Stub* stub() { return stub_.get(); }

 private:
  std::string token_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

std::string Json(const google::protobuf::Message& m, bool one_line = false) {
  JsonPrintOptions options;
  options.add_whitespace = !one_line;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  if (!one_line && !out.empty() && out.back() != '\n') out += "\n";
  return out;
}

// What a table or line shows of a value from the coordinator: control characters escaped, so
// that a worker id, host or reason (or one stored before the coordinator refused them) cannot
// drive the operator's terminal.
std::string Shown(const std::string& value) { return modelavg::EscapeControlCharacters(value); }

// Columns padded to their widest cell; every cell escaped (Shown).
class Table {
 public:
  explicit Table(std::vector<std::string> header) { Add(std::move(header)); }
  void Add(std::vector<std::string> row) {
    for (std::string& cell : row) cell = Shown(cell);
    rows_.push_back(std::move(row));
  }
  void Print(std::ostream& out) const {
    std::vector<size_t> width;
    for (const auto& row : rows_) {
      for (size_t i = 0; i < row.size(); ++i) {
        if (width.size() <= i) width.push_back(0);
        width[i] = std::max(width[i], row[i].size());
      }
    }
    for (const auto& row : rows_) {
      std::string line;
      for (size_t i = 0; i < row.size(); ++i) {
        line += row[i];
        if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
      }
      out << line << "\n";
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string Step(int64_t s) { return s < 0 ? "-" : absl::StrCat(s); }

std::string Mode(const v1::JobSpec& spec) {
  return spec.mode() == v1::PERIODIC ? "periodic" : "hierarchical";
}

// Each level as "(period, group size, ...)"; with `outer`, an outer level's optimizer too.
std::string Levels(const v1::JobSpec& spec, bool outer = false) {
  std::vector<std::string> levels;
  for (const v1::Level& l : spec.levels()) {
    std::string text = absl::StrCat("(", l.period(), ", ", l.group_size());
    if (outer && l.has_outer()) {
      absl::StrAppend(&text, ", outer lr ", l.outer().lr(), " momentum ", l.outer().momentum(),
                      l.outer().nesterov() ? " nesterov" : "");
    }
    if (l.payload() != v1::FP32) absl::StrAppend(&text, ", ", v1::Payload_Name(l.payload()));
    if (l.topk_density() != 0) absl::StrAppend(&text, " density ", l.topk_density());
    if (l.error_feedback() != 0) absl::StrAppend(&text, ", error feedback ", l.error_feedback());
    levels.push_back(text + ")");
  }
  return absl::StrJoin(levels, " ");
}

// One plan's levels on a line: "period/group" each, with ", outer lr X" for an outer level.
std::string PlanLevels(const v1::JobSpec& spec) {
  std::vector<std::string> levels;
  for (const v1::Level& l : spec.levels()) {
    std::string text = absl::StrCat(l.period(), "/", l.group_size());
    if (l.has_outer()) absl::StrAppend(&text, " outer lr ", l.outer().lr());
    levels.push_back(std::move(text));
  }
  return absl::StrJoin(levels, ", ");
}

std::string PlanText(const v1::JobSpec& spec) {
  return absl::StrCat(Mode(spec), ", warm-up ", spec.warmup_steps(),
                      ", levels (period, group size): ", Levels(spec, /*outer=*/true));
}

// "4x2" (4 replicas of 2 ranks) for sharded replicas, "-" otherwise.
std::string Replicas(const v1::JobSpec& spec) {
  if (spec.replica_size() <= 1) return "-";
  return absl::StrCat(spec.world_size() / spec.replica_size(), "x", spec.replica_size());
}

std::string When(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::FromUnixMillis(unix_ms),
                          absl::LocalTimeZone());
}

int Jobs(Cli& cli) {
  v1::ListJobsResponse all;
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  while (true) {
    v1::ListJobsResponse page;
    Check(cli.stub()->ListJobs(cli.Context().get(), request, &page), "ListJobs");
    for (v1::Job& j : *page.mutable_jobs()) *all.add_jobs() = std::move(j);
    if (page.next_page_token().empty()) break;
    request.set_page_token(page.next_page_token());
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << Json(all);
    return 0;
  }
  if (all.jobs().empty()) {
    std::cout << "no jobs\n";
    return 0;
  }
  Table t({"JOB", "STATE", "MODE", "LEVELS", "REPLICAS", "GEN", "LIVE/WORLD", "VACANT",
           "DEATHS", "ADMITTED", "MIN_STEP", "MAX_STEP"});
  for (const v1::Job& j : all.jobs()) {
    t.Add({j.spec().job_id(), v1::JobState_Name(j.state()), Mode(j.spec()), Levels(j.spec()),
           Replicas(j.spec()), absl::StrCat(j.generation()),
           absl::StrCat(j.live_world_size(), "/", j.spec().world_size()),
           j.vacant_ranks().empty() ? "-" : absl::StrJoin(j.vacant_ranks(), ","),
           absl::StrCat(j.deaths()), absl::StrCat(j.admissions()), Step(j.min_step()),
           Step(j.max_step())});
  }
  t.Print(std::cout);
  return 0;
}

void PrintJob(const v1::Job& j) {
  const v1::JobSpec& s = j.spec();
  Table kv({"job", s.job_id()});
  kv.Add({"state", v1::JobState_Name(j.state())});
  kv.Add({"generation", absl::StrCat(j.generation())});
  kv.Add({"plan", PlanText(s)});
  if (j.plan_history_size() > 1) {
    kv.Add({"plan version",
             absl::StrCat(j.plan_version(), " (latest ", j.plan_history_size() - 1, ")")});
  }
  if (j.has_pending_plan()) {
    kv.Add({"pending plan", absl::StrCat("version ", j.pending_plan().version(), " from step ",
                                         j.pending_plan().switch_step(), ": ",
                                         PlanText(j.pending_plan().spec()))});
  }
  kv.Add({"world", absl::StrCat(j.live_world_size(), " live of ", s.world_size(),
                                s.min_world_size() > 0
                                    ? absl::StrCat(" (elastic, at least ", s.min_world_size(), ")")
                                    : std::string())});
  if (s.replica_size() > 1) {
    kv.Add({"replicas", absl::StrCat(s.world_size() / s.replica_size(), " of ", s.replica_size(),
                                     " ranks (rank r holds shard r % ", s.replica_size(), ")")});
  }
  if (!j.vacant_ranks().empty()) kv.Add({"vacant ranks", absl::StrJoin(j.vacant_ranks(), ", ")});
  if (!j.waiting_ranks().empty()) {
    kv.Add({"waiting for their replica", absl::StrJoin(j.waiting_ranks(), ", ")});
  }
  kv.Add({"steps", j.min_step() < 0 ? "none reported"
                                    : absl::StrCat(j.min_step(), " to ", j.max_step())});
  kv.Add({"deaths", absl::StrCat(j.deaths(), ", admissions ", j.admissions())});
  if (j.nonfinite_reports() > 0) {
    const v1::NonFiniteReport& r = j.last_nonfinite();
    kv.Add({"non-finite", absl::StrCat(j.nonfinite_reports(), "; last: rank ", r.rank(), ", ",
                                       r.value(), " in tensor ", r.tensor(), " of its ",
                                       r.payload(), " at step ", r.step(), ", level ", r.level(),
                                       r.retired() ? " (retired)" : "")});
  }
  if (j.has_pacing()) {
    for (const auto& [name, text] : modelavg::PacingRows(j.pacing())) kv.Add({name, text});
  }
  kv.Add({"heartbeat timeout", absl::StrCat(s.heartbeat_timeout_ms(), " ms")});
  kv.Add({"created", When(j.created_unix_ms())});
  if (j.has_last_change()) {
    kv.Add({"last change", absl::StrCat("generation ", j.last_change().generation(), ": ",
                                        j.last_change().reason(), " (", When(j.last_change().unix_ms()),
                                        ")")});
  }
  for (const std::string& w : j.warnings()) kv.Add({"warning", w});
  kv.Print(std::cout);
  std::cout << "\n";
  // The plan history, once the job was updated: every plan with the step it took over at.
  if (j.plan_history_size() > 1) {
    Table plans({"PLAN", "FROM_STEP", "ACCEPTED", "STATUS", "LEVELS (period/group, outer lr)"});
    for (const v1::PlanChange& c : j.plan_history()) {
      const bool pending = j.has_pending_plan() && c.version() >= j.pending_plan().version();
      plans.Add({absl::StrCat("v", c.version()), absl::StrCat(c.switch_step()),
                 c.version() == 0 ? When(j.created_unix_ms()) : When(c.unix_ms()),
                 pending ? "pending" : c.version() == j.plan_version() ? "in force" : "past",
                 PlanLevels(c.spec())});
    }
    plans.Print(std::cout);
    std::cout << "\n";
  }
  if (j.members_omitted()) {
    std::cout << "members: too many to list (use --json with GetJob's limits in mind)\n";
    return;
  }
  if (j.members().empty()) {
    std::cout << "members: none yet\n";
    return;
  }
  // Sharded replicas: the members in replica order (rank order is replica-major), with the
  // replica and shard each holds and, for a retired one, the rank whose loss retired it.
  const bool sharded = s.replica_size() > 1;
  std::vector<std::string> header = {"RANK", "WORKER", "HOST", "STATE", "STEP", "LAG",
                                     "HEARTBEAT_MS", "ADMITTED_AT", "GEN"};
  if (sharded) header.insert(header.end(), {"REPLICA", "SHARD", "RETIRED_BY"});
  Table t(header);
  for (const v1::Member& m : j.members()) {
    const bool lag = m.last_step() >= 0 && j.max_step() >= 0;
    std::vector<std::string> row = {
        absl::StrCat(m.rank()), m.worker_id(), m.host(), v1::MemberState_Name(m.state()),
        Step(m.last_step()), lag ? absl::StrCat(j.max_step() - m.last_step()) : "-",
        absl::StrCat(m.ms_since_heartbeat()), Step(m.admitted_step()),
        absl::StrCat(m.generation())};
    if (sharded) {
      row.push_back(absl::StrCat(m.replica()));
      row.push_back(absl::StrCat(m.shard()));
      row.push_back(m.state() == v1::RETIRED ? absl::StrCat(m.retired_by()) : "-");
    }
    t.Add(row);
  }
  t.Print(std::cout);
}

int GetJob(Cli& cli, const std::string& id) {
  v1::GetJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  Check(cli.stub()->GetJob(cli.Context().get(), request, &job), "GetJob");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << Json(job);
  } else {
    PrintJob(job);
  }
  return 0;
}

int Schedule(Cli& cli, const std::string& id) {
  v1::GetScheduleRequest request;
  request.set_job_id(id);
  request.set_from_step(absl::GetFlag(FLAGS_from));
  request.set_count(absl::GetFlag(FLAGS_count));
  if (absl::GetFlag(FLAGS_rank) >= 0) request.set_rank(absl::GetFlag(FLAGS_rank));
  v1::GetScheduleResponse reply;
  Check(cli.stub()->GetSchedule(cli.Context().get(), request, &reply), "GetSchedule");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << Json(reply);
    return 0;
  }
  Table t({"STEP", "ACTION", "LEVEL", "PERIOD", "SUBGROUP", "RANKS", "GEN"});
  for (const v1::StepDecision& d : reply.decisions()) {
    const bool avg = d.action() == v1::AVERAGE;
    t.Add({absl::StrCat(d.step()), v1::Action_Name(d.action()),
           avg ? absl::StrCat(d.level()) : "-", avg ? absl::StrCat(d.period()) : "-",
           avg ? absl::StrCat(d.subgroup()) : "-", avg ? absl::StrJoin(d.ranks(), ",") : "-",
           absl::StrCat(d.generation())});
  }
  t.Print(std::cout);
  return 0;
}

int Watch(Cli& cli, const std::string& id) {
  v1::WatchJobRequest request;
  request.set_job_id(id);
  std::unique_ptr<grpc::ClientContext> ctx = cli.Context(/*deadline=*/false);
  grpc::ClientContext* raw = ctx.get();
  const int64_t limit_ms = absl::GetFlag(FLAGS_watch_ms);
  // Ends the stream on Ctrl-C / SIGTERM or after --watch_ms.
  std::atomic<bool> done{false};
  std::thread stopper([raw, &done, limit_ms] {
    const absl::Time end = limit_ms > 0 ? absl::Now() + absl::Milliseconds(limit_ms)
                                        : absl::InfiniteFuture();
    while (!done.load() && !g_interrupted.load() && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    if (!done.load()) raw->TryCancel();
  });
  std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader =
      cli.stub()->WatchJob(raw, request);
  v1::JobEvent event;
  const bool json = absl::GetFlag(FLAGS_json);
  while (reader->Read(&event)) {
    if (json) {
      std::cout << Json(event, /*one_line=*/true) << "\n" << std::flush;
      continue;
    }
    const v1::Job& j = event.job();
    std::string kind = v1::JobEvent::Kind_Name(event.kind());
    std::cout << When(event.unix_ms()) << "  " << kind << "  generation " << j.generation()
              << "  " << v1::JobState_Name(j.state()) << "  live " << j.live_world_size() << "/"
              << j.spec().world_size();
    if (event.rank() >= 0) std::cout << "  rank " << event.rank();
    if (!event.message().empty()) std::cout << "  " << Shown(event.message());
    std::cout << "\n" << std::flush;
  }
  const grpc::Status status = reader->Finish();
  done.store(true);
  stopper.join();
  if (status.error_code() == grpc::StatusCode::CANCELLED) return 0;  // we stopped it
  Check(status, "WatchJob");
  return 0;
}

// The JobSpec in JSON of -f (a file, or '-' for standard input).
v1::JobSpec ReadSpec(const std::string& path) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    text = ReadOrFail(path, "f");
  }
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions parse;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text, &spec, parse);
  if (!parsed.ok()) {
    throw Failure(absl::StrCat(path, " is not a JobSpec in JSON: ", parsed.ToString(),
                               " (e.g. {\"job_id\": \"demo\", \"world_size\": 4, \"mode\": "
                               "\"PERIODIC\", \"levels\": [{\"period\": 4, \"group_size\": 4}]})"));
  }
  return spec;
}

int Create(Cli& cli) {
  const std::string path = absl::GetFlag(FLAGS_f);
  if (path.empty()) throw Failure("create needs -f FILE (a JobSpec in JSON; '-' for stdin)");
  v1::CreateJobRequest request;
  *request.mutable_spec() = ReadSpec(path);
  v1::Job job;
  Check(cli.stub()->CreateJob(cli.Context().get(), request, &job), "CreateJob");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << Json(job);
  } else {
    std::cout << "created job " << Shown(job.spec().job_id()) << "\n";
    PrintJob(job);
  }
  return 0;
}

// The latest plan of `job`: the last of its plan history (the pending one if any), or its spec
// from a coordinator that predates UpdateJob.
v1::JobSpec LatestPlan(const v1::Job& job) {
  if (job.plan_history().empty()) return job.spec();
  return job.plan_history(job.plan_history_size() - 1).spec();
}

// `base` with the level of --level (default: the last) given --period and --outer_lr.
v1::JobSpec WithShortcuts(v1::JobSpec base, const std::string& id) {
  const int n = base.levels_size();
  if (n == 0) throw Failure(absl::StrCat("job ", Shown(id), " has no levels to change"));
  const int level = absl::GetFlag(FLAGS_level).value_or(n - 1);
  if (level < 0 || level >= n) {
    throw Failure(absl::StrCat("--level=", level, ": job ", Shown(id), " has ", n,
                               n == 1 ? " level (0)" : absl::StrCat(" levels (0..", n - 1, ")")));
  }
  v1::Level* l = base.mutable_levels(level);
  if (const std::optional<int64_t> period = absl::GetFlag(FLAGS_period)) {
    if (*period <= 0) {
      throw Failure(absl::StrCat("--period=", *period, ": a period is a number of steps >= 1"));
    }
    l->set_period(*period);
  }
  if (const std::optional<double> lr = absl::GetFlag(FLAGS_outer_lr)) {
    if (!l->has_outer()) {
      throw Failure(absl::StrCat(
          "--outer_lr: level ", level, " of job ", Shown(id),
          " has no outer optimizer (a plain level averages the parameters themselves); name an "
          "outer level with --level, or give a whole spec with an outer optimizer with -f"));
    }
    if (!(*lr > 0) || !std::isfinite(*lr)) {
      throw Failure(absl::StrCat("--outer_lr=", *lr, ": an outer lr is finite and > 0"));
    }
    l->mutable_outer()->set_lr(*lr);
  }
  return base;
}

int Update(Cli& cli, const std::string& id) {
  const std::string path = absl::GetFlag(FLAGS_f);
  v1::UpdateJobRequest request;
  request.set_job_id(id);
  if (!path.empty()) {
    *request.mutable_spec() = ReadSpec(path);
    if (request.spec().job_id().empty()) request.mutable_spec()->set_job_id(id);
    if (request.spec().job_id() != id) {
      throw Failure(absl::StrCat(path, " is the spec of job \"", Shown(request.spec().job_id()),
                                 "\", not of ", Shown(id),
                                 ": a job's id may not change (leave job_id out or make it ",
                                 Shown(id), ")"));
    }
  } else {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job job;
    Check(cli.stub()->GetJob(cli.Context().get(), get, &job), "GetJob");
    *request.mutable_spec() = WithShortcuts(LatestPlan(job), id);
  }
  v1::UpdateJobResponse reply;
  // The coordinator answers once the members gave back their decisions: a few heartbeat
  // intervals, at most about 5 s.
  Check(cli.stub()->UpdateJob(cli.Context(true, absl::Seconds(15)).get(), request, &reply),
        "UpdateJob");
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << Json(reply);
    return 0;
  }
  const v1::Job& j = reply.job();
  std::cout << "updated job " << Shown(id) << ": plan version " << reply.plan_version()
            << " from step " << reply.switch_step() << "\n";
  Table kv({"switch step", absl::StrCat(reply.switch_step())});
  kv.Add({"plan version", absl::StrCat(reply.plan_version())});
  kv.Add({"members' steps", j.min_step() < 0 ? "none reported"
                                              : absl::StrCat(j.min_step(), " to ", j.max_step())});
  kv.Add({"new plan", PlanText(request.spec())});
  kv.Print(std::cout);
  return 0;
}

int Delete(Cli& cli, const std::string& id) {
  v1::DeleteJobRequest request;
  request.set_job_id(id);
  v1::DeleteJobResponse reply;
  Check(cli.stub()->DeleteJob(cli.Context().get(), request, &reply), "DeleteJob");
  if (absl::GetFlag(FLAGS_json)) {
    v1::GetJobRequest deleted;  // {"job_id": ...}, escaped as JSON
    deleted.set_job_id(id);
    std::cout << Json(deleted);
  } else {
    std::cout << "deleted job " << Shown(id) << "\n";
  }
  return 0;
}

int Usage(const std::string& why) {
  std::cerr << "modelavg: " << why << "\n" << kUsage << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> args(positional.begin() + 1, positional.end());
  if (args.empty()) return Usage("no command");
  const std::string& command = args[0];
  const bool needs_id = command == "job" || command == "schedule" || command == "watch" ||
                        command == "delete" || command == "update";
  if (needs_id && args.size() != 2) return Usage(absl::StrCat(command, " needs one job id"));
  if ((command == "jobs" || command == "create") && args.size() != 1) {
    return Usage(absl::StrCat(command, " takes no arguments"));
  }
  if (command == "update") {
    const bool whole = !absl::GetFlag(FLAGS_f).empty();
    const bool shortcut =
        absl::GetFlag(FLAGS_period).has_value() || absl::GetFlag(FLAGS_outer_lr).has_value();
    if (whole == shortcut) {
      return Usage("update needs either -f spec.json (the whole new JobSpec) or --period / "
                   "--outer_lr (one level of the job's latest plan changed)");
    }
    if (whole && absl::GetFlag(FLAGS_level).has_value()) {
      return Usage("update: --level goes with --period or --outer_lr, not with -f");
    }
  }
  signal(SIGINT, [](int) { g_interrupted.store(true); });
  signal(SIGTERM, [](int) { g_interrupted.store(true); });
  try {
    Cli cli;
    if (command == "jobs") return Jobs(cli);
    if (command == "job") return GetJob(cli, args[1]);
    if (command == "schedule") return Schedule(cli, args[1]);
    if (command == "watch") return Watch(cli, args[1]);
    if (command == "create") return Create(cli);
    if (command == "update") return Update(cli, args[1]);
    if (command == "delete") return Delete(cli, args[1]);
    return Usage(absl::StrCat("unknown command \"", command, "\""));
  } catch (const Failure& e) {
    std::cerr << "modelavg: " << e.what() << "\n";
    return 1;
  }
}
