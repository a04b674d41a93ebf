// modelavg._core: the Python binding of the client library (include/modelavg/client/client.h, include/modelavg/client/averager.h).
//
// A thin layer: the schedule, the protocol and the collectives are the C++ client's. Tensors
// cross as (data pointer, element count, dtype, device, CUDA stream) tuples that the pure-Python
// part of the package (modelavg/_params.py) reads off torch tensors, so nothing here links
// libtorch. Errors become the exceptions of modelavg/errors.py, built there from the status code
// and message.
//
// Every call that can wait (connecting, an averaging step, leaving, the job RPCs) runs on a
// helper thread while the calling thread waits without the GIL and checks for signals every
// kSignalPoll: Ctrl-C raises KeyboardInterrupt at once. An interrupted connect or leave is
// cancelled and ends at once; another interrupted call keeps running on its thread until its own
// deadline (collective_timeout, rpc_timeout) and owns what it uses meanwhile; an averager
// refuses new calls until its interrupted call has ended. The interpreter's exit waits up to
// kExitWait for the calls still running (an atexit handler registered at import, so it runs after
// those the package registers later, like modelavg.torch's leave). A skip step runs on the
// calling thread (it does not wait).
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/rpc/connection.h"
#include "common/payload_fields.h"
#include "client/rpc/coordinator_client.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"
#include "python/background_call.h"
#include "python/messages.h"
#include "python/status_exception.h"

namespace py = pybind11;
namespace mc = modelavg::client;
namespace v1 = modelavg::v1;

namespace modelavg::python {
namespace {

std::shared_ptr<mc::CoordinatorClient> MakeCoordinatorClient(const py::dict& conn) {
  return ValueOrRaise<std::shared_ptr<mc::CoordinatorClient>>(
      mc::CoordinatorClient::Create(ConnectionOptionsFrom(conn)));
}

// ---------------------------------------------------------------- client

// The Python object's hold on one Client. Shared with calls still running after an interrupt.
class PyClient {
 public:
  explicit PyClient(std::shared_ptr<mc::Client> client) : client_(std::move(client)) {}
  // ~Client leaves the job (an RPC): not with the GIL held.
  ~PyClient() {
    py::gil_scoped_release nogil;
    client_.reset();
  }
  const std::shared_ptr<mc::Client>& get() const { return client_; }

 private:
  std::shared_ptr<mc::Client> client_;
};

std::unique_ptr<PyClient> Connect(const py::dict& options) {
  mc::ClientOptions o = ClientOptionsFrom(options);
  // Ctrl-C cancels the Join: the abandoned call ends at once, not at join_timeout.
  auto cancel = std::make_shared<mc::CancelToken>();
  o.cancel = cancel;
  using Result = absl::StatusOr<std::shared_ptr<mc::Client>>;
  Result client = RunInterruptibly<Result>(
      [o]() -> Result {
        absl::StatusOr<std::unique_ptr<mc::Client>> c = mc::Client::Connect(o);
        if (!c.ok()) return c.status();
        return std::shared_ptr<mc::Client>(std::move(*c));
      },
      [cancel] { cancel->Cancel(); });
  return std::make_unique<PyClient>(ValueOrRaise(std::move(client)));
}

void Leave(const PyClient& self, const std::string& reason) {
  std::shared_ptr<mc::Client> client = self.get();
  // Ctrl-C cancels the Leave (its retries through an outage): the abandoned call ends at once.
  auto cancel = std::make_shared<mc::CancelToken>();
  absl::Status s = RunInterruptibly<absl::Status>(
      [client, reason, cancel] { return client->Leave(reason, cancel.get()); },
      [cancel] { cancel->Cancel(); });
  if (!s.ok()) Raise(s);
}

// ---------------------------------------------------------------- averagers

// One averager and its client. An interrupted averaging call keeps both alive until it ends.
class PyAverager {
 public:
  // `backup_host`: the outer state of CUDA parameters in pinned host memory (backup_device).
  PyAverager(const PyClient& client, bool hierarchical, bool backup_host)
      : client_(client.get()) {
    mc::AveragerOptions options;
    if (backup_host) options.backup_device = mc::AveragerOptions::BackupDevice::kHost;
    if (hierarchical) {
      averager_ = ValueOrRaise<std::shared_ptr<mc::ModelAverager>>(
          mc::HierarchicalModelAverager::Create(client_.get(), options));
    } else {
      averager_ = ValueOrRaise<std::shared_ptr<mc::ModelAverager>>(
          mc::PeriodicModelAverager::Create(client_.get(), options));
    }
  }

  // The averager may go while an interrupted call still writes into the tensors: keep them.
  ~PyAverager() {
    if (interrupted_ != nullptr && !interrupted_->done()) interrupted_tensors_.release();
  }

  // The decision at step() when it is a skip, taken (the step advances); None when the step
  // averages, applies a fragment's background all-reduce (streaming sync), or the decision is
  // not known yet: the caller then collects its tensors and calls Average. Cheap: no RPC within the prefetched window, no thread, no tensors.
  // Without the GIL: once per schedule_window steps the decision costs a GetSchedule RPC (at
  // most rpc_timeout; not interruptible, unlike the waits of an averaging step).
  std::optional<Decision> TakeSkip() {
    CheckNoInterruptedCall();
    absl::StatusOr<Decision> d;
    {
      py::gil_scoped_release nogil;
      const int64_t step = averager_->step();
      absl::StatusOr<Decision> next = client_->DecisionAt(step);
      if (!next.ok() || next->average) return std::nullopt;
      // A fragment's background all-reduce applied at this step needs the parameters.
      if (averager_->NeedsParametersAt(step)) return std::nullopt;
      d = averager_->AverageParameters({});
    }
    if (!d.ok()) Raise(d.status(), /*averaging=*/true);
    return *d;
  }

  // Averages `tensors` in place: (data_ptr, numel, dtype, device kind, device index, stream)
  // tuples. `keep` holds the tensors while the call may still be running after an interrupt.
  Decision Average(const std::vector<std::tuple<uintptr_t, int64_t, int, int, int, uintptr_t>>&
                       tensors,
                   py::object keep) {
    CheckNoInterruptedCall();
    std::vector<mc::TensorView> views;
    views.reserve(tensors.size());
    for (const auto& [ptr, numel, dtype, kind, index, stream] : tensors) {
      mc::TensorView v;
      v.data = reinterpret_cast<void*>(ptr);
      v.numel = numel;
      if (dtype < 0 || dtype > static_cast<int>(mc::DType::kBFloat16)) {
        throw py::value_error(absl::StrCat("dtype code ", dtype, " is not 0..3"));
      }
      v.dtype = static_cast<mc::DType>(dtype);
      v.device = kind == 0 ? mc::Device::Host() : mc::Device::Cuda(index);
      v.cuda_stream = reinterpret_cast<void*>(stream);
      views.push_back(v);
    }
    std::shared_ptr<mc::ModelAverager> averager = averager_;
    std::shared_ptr<mc::Client> client = client_;  // outlives the averager in the call
    using Result = absl::StatusOr<Decision>;
    auto call = BackgroundCall<Result>::Start(
        [client, averager, views]() -> Result { return averager->AverageParameters(views); },
        &calls_);
    Result d = [&] {
      try {
        return call->Wait();
      } catch (...) {
        interrupted_ = call;
        interrupted_tensors_ = std::move(keep);
        throw;
      }
    }();
    if (!d.ok()) Raise(d.status(), /*averaging=*/true);
    return *d;
  }

  // {"step": int, "anchors": {level: [(dtype code, numel, bytes)]}, "momenta": {...},
  //  "fragments": [(level, fragment, [anchor tensors], [momentum tensors], [residual tensors])],
  //  "pending": [{"level", "fragment", "start_step", "apply_step", "first", "result", "error"}]}.
  py::dict StateDict() {
    CheckNoInterruptedCall();
    mc::AveragerState state = averager_->state_dict();
    auto tensors = [](const std::map<int, std::vector<mc::StateTensor>>& m) {
      py::dict out;
      for (const auto& [level, list] : m) {
        py::list l;
        for (const mc::StateTensor& t : list) {
          l.append(py::make_tuple(static_cast<int>(t.dtype), t.numel,
                                  py::bytes(reinterpret_cast<const char*>(t.bytes.data()),
                                            t.bytes.size())));
        }
        out[py::int_(level)] = l;
      }
      return out;
    };
    auto list = [](const std::vector<mc::StateTensor>& ts) {
      py::list l;
      for (const mc::StateTensor& t : ts) {
        l.append(py::make_tuple(static_cast<int>(t.dtype), t.numel,
                                py::bytes(reinterpret_cast<const char*>(t.bytes.data()),
                                          t.bytes.size())));
      }
      return l;
    };
    py::dict d;
    d["step"] = state.step;
    d["anchors"] = tensors(state.anchors);
    d["momenta"] = tensors(state.momenta);
    py::list fragments;
    for (const mc::FragmentState& f : state.fragments) {
      fragments.append(py::make_tuple(f.level, f.fragment, list(f.anchor), list(f.momentum),
                                      list(f.residual)));
    }
    d["fragments"] = fragments;
    py::list pending;
    for (const mc::PendingState& p : state.pending) {
      py::dict e;
      e["level"] = p.level;
      e["fragment"] = p.fragment;
      e["start_step"] = p.start_step;
      e["apply_step"] = p.apply_step;
      e["first"] = p.first;
      e["result"] = list(p.result);
      e["error"] = p.error;
      pending.append(e);
    }
    d["pending"] = pending;
    return d;
  }

  // fragments: [(level, fragment, anchor tensors, momentum tensors[, residual tensors])];
  // pending: [dict] as
  // StateDict gives them.
  void LoadStateDict(int64_t step, const py::dict& anchors, const py::dict& momenta,
                     const py::list& fragments, const py::list& pending) {
    if (step < 0) {
      throw py::value_error(absl::StrCat("step ", step, " is negative: steps count from 0"));
    }
    CheckNoInterruptedCall();
    mc::AveragerState state;
    state.step = step;
    auto read_list = [](py::handle value, std::vector<mc::StateTensor>* list) {
      for (const py::handle item : value) {
        auto [dtype, numel, bytes] = item.cast<std::tuple<int, int64_t, py::bytes>>();
        if (dtype < 0 || dtype > static_cast<int>(mc::DType::kBFloat16)) {
          throw py::value_error(absl::StrCat("dtype code ", dtype, " is not 0..3"));
        }
        mc::StateTensor t;
        t.dtype = static_cast<mc::DType>(dtype);
        t.numel = numel;
        const std::string raw = bytes;
        t.bytes.assign(raw.begin(), raw.end());
        list->push_back(std::move(t));
      }
    };
    auto read = [&](const py::dict& in, std::map<int, std::vector<mc::StateTensor>>* out) {
      for (const auto& [key, value] : in) read_list(value, &(*out)[key.cast<int>()]);
    };
    read(anchors, &state.anchors);
    read(momenta, &state.momenta);
    for (const py::handle item : fragments) {
      auto t = item.cast<py::tuple>();
      mc::FragmentState f;
      f.level = t[0].cast<int>();
      f.fragment = t[1].cast<int>();
      read_list(t[2], &f.anchor);
      read_list(t[3], &f.momentum);
      if (t.size() > 4) read_list(t[4], &f.residual);
      state.fragments.push_back(std::move(f));
    }
    for (const py::handle item : pending) {
      auto e = item.cast<py::dict>();
      mc::PendingState p;
      p.level = e["level"].cast<int>();
      p.fragment = e["fragment"].cast<int>();
      p.start_step = e["start_step"].cast<int64_t>();
      p.apply_step = e["apply_step"].cast<int64_t>();
      p.first = e["first"].cast<bool>();
      read_list(e["result"], &p.result);
      p.error = e.contains("error") ? e["error"].cast<std::string>() : std::string();
      state.pending.push_back(std::move(p));
    }
    absl::Status s = averager_->load_state_dict(state);
    if (!s.ok()) Raise(s);
  }

  // Per level: (bytes sent, seconds waited for background all-reduces).
  std::vector<std::pair<int64_t, double>> Traffic() const {
    std::vector<std::pair<int64_t, double>> out;
    for (const mc::ModelAverager::LevelTraffic& t : averager_->traffic()) {
      out.emplace_back(t.bytes_sent, absl::ToDoubleSeconds(t.waited));
    }
    return out;
  }

  int64_t step() const { return averager_->step(); }
  bool budget_spent() const { return averager_->budget_spent(); }
  void set_step(int64_t step) {
    if (step < 0) {
      throw py::value_error(absl::StrCat("step ", step, " is negative: steps count from 0"));
    }
    CheckNoInterruptedCall();
    averager_->set_step(step);
  }

 private:
  void CheckNoInterruptedCall() {
    if (interrupted_ == nullptr) return;
    if (!interrupted_->done()) {
      absl::Status s = absl::FailedPreconditionError(
          "an interrupted average_parameters call of this averager is still running (until "
          "it ends or collective_timeout passes); its tensors may still change. Wait, or "
          "restart from a checkpoint with a new client");
      Raise(s);
    }
    interrupted_ = nullptr;
    interrupted_tensors_ = py::none();
  }

  std::shared_ptr<mc::Client> client_;
  std::shared_ptr<mc::ModelAverager> averager_;
  std::shared_ptr<BackgroundCall<absl::StatusOr<Decision>>> interrupted_;
  // The thread averaging calls run on (kept between calls).
  CallThread calls_;
  py::object interrupted_tensors_ = py::none();
};

std::string ActionName(const Decision& d) { return d.average ? "AVERAGE" : "SKIP"; }

// The ranks that averaged: the subgroup's live members (Decision::Members()); none on a skip.
std::vector<int32_t> DecisionMembers(const Decision& d) {
  return d.average ? d.Members() : std::vector<int32_t>{};
}

}  // namespace
}  // namespace modelavg::python

PYBIND11_MODULE(_core, m) {
  using namespace modelavg::python;  // NOLINT
  using modelavg::Decision;
  m.doc() = "The C++ client library's binding. Use the modelavg package, not this module.";
  m.def("_background_calls_at_exit", &WaitForBackgroundCallsAtExit,
        "Waits (a bounded time) for the calls interrupted by Ctrl-C; run at interpreter exit.");
  m.def(
      "_background_calls_running",
      [] { return BackgroundCalls::Get().WaitFor(absl::ZeroDuration()); },
      "The number of calls running on background threads (those interrupted by Ctrl-C).");
  // atexit runs its handlers last registered first: this one after any the package registers.
  py::module_::import("atexit").attr("register")(m.attr("_background_calls_at_exit"));

  py::class_<Decision>(m, "Decision", R"doc(
What one rank did at one step: SKIP, or AVERAGE with a level and the ranks that averaged.

Attributes:
  step: the step this decision was taken at (the averager's step before the call).
  action: "AVERAGE" or "SKIP".
  average: True when the parameters were averaged.
  level: index into the job's levels of the averaging level; -1 for SKIP.
  period: that level's period; 0 for SKIP.
  fragment: the fragment of the parameters this step synced (Level.fragments; 0 for a level of
    one fragment); -1 for SKIP.
  fragments: the level's fragment count (1: the whole model); 0 for SKIP.
  subgroup: index of the subgroup (block of ranks) that averaged; -1 for SKIP.
  ranks: the ranks whose parameters were actually averaged, ascending; [] for SKIP. The whole
    subgroup in a strict job; in an elastic job its live members only (vacant ranks left out).
  members: the same list as ranks.
  joining: the replacements admitted at this step (elastic jobs): they contributed nothing and
    received the average of the others. Usually []; [this rank] on a replacement's first call.
  generation: the job generation the decision was taken (and the averaging ran) in; in an
    elastic job it moves on with every death, departure and admission.
  round: a paced level's round (docs/paced.md), from 0; -1 on every other decision.
  weights: a paced round's weights, aligned with members (a joining member's is 0); [] on
    every other decision (the members weigh the same).
)doc")
      .def_readonly("step", &Decision::step)
      .def_property_readonly("action", &ActionName)
      .def_readonly("average", &Decision::average)
      .def_readonly("level", &Decision::level)
      .def_readonly("period", &Decision::period)
      .def_property_readonly("fragment",
                             [](const Decision& d) { return d.average ? d.fragment : -1; })
      .def_property_readonly("fragments",
                             [](const Decision& d) { return d.average ? d.fragments : 0; })
      .def_property_readonly("subgroup",
                             [](const Decision& d) { return d.average ? d.subgroup.index : -1; })
      .def_property_readonly("ranks", &DecisionMembers)
      .def_property_readonly("members", &DecisionMembers)
      .def_property_readonly("joining",
                             [](const Decision& d) {
                               return d.average ? d.joining : std::vector<int32_t>{};
                             })
      .def_readonly("generation", &Decision::generation)
      .def_readonly("round", &Decision::round)
      .def_property_readonly("weights",
                             [](const Decision& d) {
                               return d.average ? d.weights : std::vector<double>{};
                             })
      .def("__eq__", [](const Decision& a, const Decision& b) { return a == b; })
      .def("__repr__", [](const Decision& d) {
        if (!d.average) return absl::StrCat("Decision(step=", d.step, ", action='SKIP')");
        std::string repr = absl::StrCat(
            "Decision(step=", d.step, ", action='AVERAGE', level=", d.level, ", period=",
            d.period, ", ranks=[", absl::StrJoin(d.Members(), ", "), "]");
        if (d.fragments > 1) {
          absl::StrAppend(&repr, ", fragment=", d.fragment, ", fragments=", d.fragments);
        }
        if (!d.joining.empty()) {
          absl::StrAppend(&repr, ", joining=[", absl::StrJoin(d.joining, ", "), "]");
        }
        if (d.generation > 0) absl::StrAppend(&repr, ", generation=", d.generation);
        return absl::StrCat(repr, ")");
      });

  py::class_<PyClient>(m, "Client", "One rank's membership in a job (see modelavg.Client).")
      .def_property_readonly("rank", [](const PyClient& c) { return c.get()->rank(); })
      .def_property_readonly("world_size", [](const PyClient& c) { return c.get()->world_size(); })
      .def_property_readonly("generation", [](const PyClient& c) { return c.get()->generation(); })
      .def_property_readonly("latest_generation",
                             [](const PyClient& c) { return c.get()->latest_generation(); })
      .def_property_readonly("admission_step",
                             [](const PyClient& c) { return c.get()->admission_step(); })
      .def_property_readonly("elastic", [](const PyClient& c) { return c.get()->elastic(); })
      .def_property_readonly("replica_size",
                             [](const PyClient& c) { return c.get()->replica_size(); })
      .def_property_readonly("replica", [](const PyClient& c) { return c.get()->replica(); })
      .def_property_readonly("shard", [](const PyClient& c) { return c.get()->shard(); })
      .def_property_readonly("job_id", [](const PyClient& c) { return c.get()->job_id(); })
      .def_property_readonly("heartbeat_timeout",
                             [](const PyClient& c) {
                               return absl::ToDoubleSeconds(c.get()->heartbeat_timeout());
                             })
      .def_property_readonly("spec",
                             [](const PyClient& c) {
                               const modelavg::ScheduleSpec& s = c.get()->schedule().spec();
                               py::dict d;
                               d["job_id"] = c.get()->job_id();
                               d["world_size"] = s.world_size;
                               d["replica_size"] = s.replica_size;
                               d["warmup_steps"] = s.warmup_steps;
                               d["mode"] = s.mode == modelavg::AveragingMode::kPeriodic
                                               ? "PERIODIC"
                                               : "HIERARCHICAL";
                               py::list levels;
                               for (const auto& l : s.levels) {
                                 levels.append(py::make_tuple(l.period, l.group_size));
                               }
                               d["levels"] = levels;
                               py::list outer;
                               for (const auto& l : s.levels) {
                                 if (l.outer.has_value()) {
                                   outer.append(py::make_tuple(l.outer->lr, l.outer->momentum,
                                                               l.outer->nesterov));
                                 } else {
                                   outer.append(py::none());
                                 }
                               }
                               d["outer"] = outer;
                               py::list streaming;
                               for (const auto& l : s.levels) {
                                 streaming.append(py::make_tuple(
                                     std::max(1, l.fragments), l.sync_delay, l.mix,
                                     modelavg::PayloadName(l.payload), l.error_feedback,
                                     l.topk_density));
                               }
                               d["streaming"] = streaming;
                               return d;
                             })
      .def("check_usable",
           [](const PyClient& c) {
             absl::Status s = c.get()->CheckUsable();
             if (!s.ok()) Raise(s, /*averaging=*/true);
           })
      .def("leave", &Leave, py::arg("reason"));

  m.def("connect", &Connect, py::arg("options"),
        "Joins a job (ClientOptions fields as a dict; durations in seconds).");
  m.attr("OPTIONS") = OptionTable();
  m.def(
      "connection_from_environment",
      [] { return ConnectionDict(ValueOrRaise(mc::ConnectionFromEnvironment({}))); },
      "The connection options the environment sets (MODELAVG_COORDINATOR, "
      "MODELAVG_AUTH_TOKEN_FILE, ...), by name; deprecated names are reported once on stderr.");
  m.def(
      "tokens_per_step_from_environment",
      [] { return ValueOrRaise(mc::TokensPerStepFromEnvironment(1)); },
      "MODELAVG_TOKENS_PER_STEP as a number (1 when unset); InvalidArgumentError for a value "
      "that is not a number in (0, 1e12].");

  py::class_<PyAverager>(m, "Averager", "A periodic or hierarchical averager on one client.")
      .def(py::init<const PyClient&, bool, bool>(), py::arg("client"), py::arg("hierarchical"),
           py::arg("backup_host") = false, py::keep_alive<1, 2>())
      .def("take_skip", &PyAverager::TakeSkip)
      .def("average", &PyAverager::Average, py::arg("tensors"), py::arg("keep"))
      .def_property("step", &PyAverager::step, &PyAverager::set_step)
      .def_property_readonly("budget_spent", &PyAverager::budget_spent)
      .def("state_dict", &PyAverager::StateDict)
      .def("load_state_dict", &PyAverager::LoadStateDict, py::arg("step"), py::arg("anchors"),
           py::arg("momenta"), py::arg("fragments"), py::arg("pending"))
      .def("traffic", &PyAverager::Traffic);

  m.def(
      "create_job",
      [](const py::dict& conn, const py::dict& spec) {
        auto cc = MakeCoordinatorClient(conn);
        v1::JobSpec s = JobSpecFrom(spec);
        using R = absl::StatusOr<v1::Job>;
        return JobDict(ValueOrRaise(RunInterruptibly<R>([cc, s] { return cc->CreateJob(s); })));
      },
      py::arg("conn"), py::arg("spec"));
  m.def(
      "get_job",
      [](const py::dict& conn, const std::string& job_id) {
        auto cc = MakeCoordinatorClient(conn);
        using R = absl::StatusOr<v1::Job>;
        return JobDict(
            ValueOrRaise(RunInterruptibly<R>([cc, job_id] { return cc->GetJob(job_id); })));
      },
      py::arg("conn"), py::arg("job_id"));
  m.def("payload_names",
        [] {
          py::list names;
          for (const modelavg::PayloadInfo& info : modelavg::kPayloads) names.append(info.name);
          return py::tuple(names);
        },
        "The payload encodings' names (Level.payload), in the proto enum's order.");
  m.def(
      "check_payload",
      [](const std::string& where, const std::string& payload, double topk_density,
         double error_feedback) -> std::string {
        const std::optional<modelavg::Payload> p = modelavg::PayloadNamed(payload);
        if (!p.has_value()) {
          return absl::StrCat(
              where, ": payload=", py::repr(py::str(payload)).cast<std::string>(),
              ": expected one of ",
              modelavg::PayloadNameList([](const modelavg::PayloadInfo&) { return true; }));
        }
        const absl::Status s = modelavg::CheckPayloadFields(
            *p, topk_density, error_feedback, /*outer=*/true,
            [&where](absl::string_view field, double value) {
              return absl::StrCat(where, ": ", field, "=",
                                  py::repr(py::float_(value)).cast<std::string>());
            });
        return std::string(s.message());
      },
      py::arg("where"), py::arg("payload"), py::arg("topk_density"), py::arg("error_feedback"),
      "The level fields `payload` needs (common/payload_fields.h): '' when they fit, else the "
      "message naming the field.");
  m.def(
      "list_jobs",
      [](const py::dict& conn) {
        auto cc = MakeCoordinatorClient(conn);
        using R = absl::StatusOr<v1::ListJobsResponse>;
        v1::ListJobsResponse r =
            ValueOrRaise(RunInterruptibly<R>([cc] { return cc->ListJobs(); }));
        py::list jobs;
        for (const v1::Job& j : r.jobs()) jobs.append(JobDict(j));
        return jobs;
      },
      py::arg("conn"));
  m.def(
      "update_job",
      [](const py::dict& conn, const std::string& job_id, const py::dict& spec) {
        auto cc = MakeCoordinatorClient(conn);
        v1::JobSpec s = JobSpecFrom(spec);
        s.set_job_id(job_id);
        using R = absl::StatusOr<v1::UpdateJobResponse>;
        // Waits for the members' answers (a few heartbeat intervals); Ctrl-C stops the wait.
        v1::UpdateJobResponse r =
            ValueOrRaise(RunInterruptibly<R>([cc, s] { return cc->UpdateJob(s); }));
        py::dict d;
        d["switch_step"] = r.switch_step();
        d["plan_version"] = r.plan_version();
        d["job"] = JobDict(r.job());
        return d;
      },
      py::arg("conn"), py::arg("job_id"), py::arg("spec"));
  m.def(
      "delete_job",
      [](const py::dict& conn, const std::string& job_id) {
        auto cc = MakeCoordinatorClient(conn);
        absl::Status s =
            RunInterruptibly<absl::Status>([cc, job_id] { return cc->DeleteJob(job_id); });
        if (!s.ok()) Raise(s);
      },
      py::arg("conn"), py::arg("job_id"));
}
