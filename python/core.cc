// modelavg._core: the Python binding of the client library (client/client.h, client/averager.h).
//
// A thin layer: the schedule, the protocol and the collectives are the C++ client's. Tensors
// cross as (data pointer, element count, dtype, device, CUDA stream) tuples that the pure-Python
// part of the package (modelavg/_params.py) reads off torch tensors, so nothing here links
// libtorch. Errors become the exceptions of modelavg/errors.py, built there from the status code
// and message.
//
// Every call that can wait (connecting, an averaging step, leaving, the job RPCs) runs on a
// helper thread while the calling thread waits without the GIL and checks for signals every
// kSignalPoll: Ctrl-C raises KeyboardInterrupt at once. The interrupted call keeps running on its
// thread until its own deadline (join_timeout, collective_timeout, rpc_timeout) and owns what it
// uses meanwhile; an averager refuses new calls until its interrupted call has ended. A skip step
// runs on the calling thread (it does not wait).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/averager.h"
#include "client/client.h"
#include "client/coordinator_client.h"
#include "client/tensor.h"
#include "common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "pybind11/pybind11.h"
#include "pybind11/stl.h"

namespace py = pybind11;
namespace mc = modelavg::client;
namespace v1 = modelavg::v1;

namespace modelavg::python {
namespace {

constexpr absl::Duration kSignalPoll = absl::Milliseconds(20);

// Raises the modelavg.errors exception for `status` (never OK). `averaging`: the status came
// from an averaging step, where a peer's failure gets its own exception class.
[[noreturn]] void Raise(const absl::Status& status, bool averaging = false) {
  py::object errors = py::module_::import("modelavg.errors");
  py::object exc = errors.attr("_from_status")(static_cast<int>(status.code()),
                                               std::string(status.message()), averaging);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> v, bool averaging = false) {
  if (!v.ok()) Raise(v.status(), averaging);
  return *std::move(v);
}

// One call running on its own thread. The thread owns a reference, so an abandoned (interrupted)
// call ends on its own and frees what it holds.
template <typename T>
class BackgroundCall {
 public:
  static std::shared_ptr<BackgroundCall> Start(std::function<T()> fn) {
    auto call = std::make_shared<BackgroundCall>();
    std::thread([call, fn = std::move(fn)]() mutable {
      T result = fn();
      fn = nullptr;  // release what the call captured before saying it is done
      absl::MutexLock l(&call->mu_);
      call->result_.emplace(std::move(result));
    }).detach();
    return call;
  }

  bool done() const {
    absl::MutexLock l(&mu_);
    return result_.has_value();
  }

  // Waits without the GIL until the call ends; checks for signals every kSignalPoll (with the
  // GIL) and throws the KeyboardInterrupt (or whatever a signal handler raised) at once.
  T Wait() {
    while (true) {
      {
        py::gil_scoped_release nogil;
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(this, &BackgroundCall::HasResult), kSignalPoll);
        if (result_.has_value()) return *std::move(result_);
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

 private:
  bool HasResult() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return result_.has_value(); }

  mutable absl::Mutex mu_;
  std::optional<T> result_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
T RunInterruptibly(std::function<T()> fn) {
  return BackgroundCall<T>::Start(std::move(fn))->Wait();
}

absl::Duration Seconds(double s) { return absl::Seconds(s); }

// ---------------------------------------------------------------- options and job messages

template <typename T>
std::optional<T> Get(const py::dict& d, const char* key) {
  if (!d.contains(key)) return std::nullopt;
  py::object v = d[key];
  if (v.is_none()) return std::nullopt;
  return v.cast<T>();
}

mc::ClientOptions ClientOptionsFrom(const py::dict& d) {
  mc::ClientOptions o;
  if (auto v = Get<std::string>(d, "coordinator")) o.coordinator = *v;
  if (auto v = Get<std::string>(d, "job_id")) o.job_id = *v;
  if (auto v = Get<int32_t>(d, "rank")) o.rank = *v;
  if (auto v = Get<std::string>(d, "worker_id")) o.worker_id = *v;
  if (auto v = Get<std::string>(d, "auth_token")) o.auth_token = *v;
  if (auto v = Get<bool>(d, "tls")) o.tls = *v;
  if (auto v = Get<std::string>(d, "tls_ca_file")) o.tls_ca_file = *v;
  if (auto v = Get<std::string>(d, "tls_cert_file")) o.tls_cert_file = *v;
  if (auto v = Get<std::string>(d, "tls_key_file")) o.tls_key_file = *v;
  if (auto v = Get<double>(d, "join_timeout")) o.join_timeout = Seconds(*v);
  if (auto v = Get<double>(d, "rpc_timeout")) o.rpc_timeout = Seconds(*v);
  if (auto v = Get<double>(d, "heartbeat_interval")) o.heartbeat_interval = Seconds(*v);
  if (auto v = Get<bool>(d, "heartbeat_stream")) o.heartbeat_stream = *v;
  if (auto v = Get<double>(d, "collective_timeout")) o.collective_timeout = Seconds(*v);
  if (auto v = Get<int64_t>(d, "schedule_window")) o.schedule_window = *v;
  if (auto v = Get<std::string>(d, "gloo_hostname")) o.gloo_hostname = *v;
  if (auto v = Get<bool>(d, "gloo_in_place")) o.gloo_in_place = *v;
  return o;
}

mc::CoordinatorClientOptions CoordinatorOptionsFrom(const py::dict& d) {
  mc::CoordinatorClientOptions o;
  if (auto v = Get<std::string>(d, "coordinator")) o.address = *v;
  if (auto v = Get<std::string>(d, "auth_token")) o.auth_token = *v;
  if (auto v = Get<bool>(d, "tls")) o.tls = *v;
  if (auto v = Get<std::string>(d, "tls_ca_file")) o.tls_ca_file = *v;
  if (auto v = Get<std::string>(d, "tls_cert_file")) o.tls_cert_file = *v;
  if (auto v = Get<std::string>(d, "tls_key_file")) o.tls_key_file = *v;
  if (auto v = Get<double>(d, "rpc_timeout")) o.rpc_timeout = Seconds(*v);
  return o;
}

v1::JobSpec JobSpecFrom(const py::dict& d) {
  v1::JobSpec spec;
  if (auto v = Get<std::string>(d, "job_id")) spec.set_job_id(*v);
  if (auto v = Get<int32_t>(d, "world_size")) spec.set_world_size(*v);
  if (auto v = Get<int64_t>(d, "warmup_steps")) spec.set_warmup_steps(*v);
  if (auto v = Get<std::string>(d, "mode")) {
    v1::Mode mode;
    if (!v1::Mode_Parse(*v, &mode)) {
      throw py::value_error(absl::StrCat("mode '", *v, "': expected PERIODIC or HIERARCHICAL"));
    }
    spec.set_mode(mode);
  }
  if (auto v = Get<std::vector<std::pair<int64_t, int32_t>>>(d, "levels")) {
    for (const auto& [period, group_size] : *v) {
      v1::Level* level = spec.add_levels();
      level->set_period(period);
      level->set_group_size(group_size);
    }
  }
  if (auto v = Get<int64_t>(d, "heartbeat_timeout_ms")) spec.set_heartbeat_timeout_ms(*v);
  if (auto v = Get<int64_t>(d, "join_timeout_ms")) spec.set_join_timeout_ms(*v);
  return spec;
}

py::dict SpecDict(const v1::JobSpec& spec) {
  py::dict d;
  d["job_id"] = spec.job_id();
  d["world_size"] = spec.world_size();
  d["warmup_steps"] = spec.warmup_steps();
  d["mode"] = v1::Mode_Name(spec.mode());
  py::list levels;
  for (const v1::Level& l : spec.levels()) levels.append(py::make_tuple(l.period(), l.group_size()));
  d["levels"] = levels;
  d["heartbeat_timeout_ms"] = spec.heartbeat_timeout_ms();
  d["join_timeout_ms"] = spec.join_timeout_ms();
  return d;
}

py::dict JobDict(const v1::Job& job) {
  py::dict d;
  d["spec"] = SpecDict(job.spec());
  d["state"] = v1::JobState_Name(job.state());
  d["generation"] = job.generation();
  py::list members;
  for (const v1::Member& m : job.members()) {
    py::dict md;
    md["rank"] = m.rank();
    md["worker_id"] = m.worker_id();
    md["host"] = m.host();
    md["last_step"] = m.last_step();
    md["ms_since_heartbeat"] = m.ms_since_heartbeat();
    md["state"] = v1::MemberState_Name(m.state());
    md["generation"] = m.generation();
    members.append(md);
  }
  d["members"] = members;
  d["min_step"] = job.min_step();
  d["max_step"] = job.max_step();
  py::list warnings;
  for (const std::string& w : job.warnings()) warnings.append(w);
  d["warnings"] = warnings;
  d["created_unix_ms"] = job.created_unix_ms();
  if (job.has_last_change()) {
    py::dict c;
    c["generation"] = job.last_change().generation();
    c["rank"] = job.last_change().rank();
    c["reason"] = job.last_change().reason();
    c["unix_ms"] = job.last_change().unix_ms();
    d["last_change"] = c;
  } else {
    d["last_change"] = py::none();
  }
  return d;
}

std::shared_ptr<mc::CoordinatorClient> MakeCoordinatorClient(const py::dict& conn) {
  return ValueOrRaise<std::shared_ptr<mc::CoordinatorClient>>(
      mc::CoordinatorClient::Create(CoordinatorOptionsFrom(conn)));
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
  using Result = absl::StatusOr<std::shared_ptr<mc::Client>>;
  Result client = RunInterruptibly<Result>([o]() -> Result {
    absl::StatusOr<std::unique_ptr<mc::Client>> c = mc::Client::Connect(o);
    if (!c.ok()) return c.status();
    return std::shared_ptr<mc::Client>(std::move(*c));
  });
  return std::make_unique<PyClient>(ValueOrRaise(std::move(client)));
}

void Leave(const PyClient& self, const std::string& reason) {
  std::shared_ptr<mc::Client> client = self.get();
  absl::Status s =
      RunInterruptibly<absl::Status>([client, reason] { return client->Leave(reason); });
  if (!s.ok()) Raise(s);
}

// ---------------------------------------------------------------- averagers

// One averager and its client. An interrupted averaging call keeps both alive until it ends.
class PyAverager {
 public:
  PyAverager(const PyClient& client, bool hierarchical) : client_(client.get()) {
    if (hierarchical) {
      averager_ = ValueOrRaise<std::shared_ptr<mc::ModelAverager>>(
          mc::HierarchicalModelAverager::Create(client_.get()));
    } else {
      averager_ = ValueOrRaise<std::shared_ptr<mc::ModelAverager>>(
          mc::PeriodicModelAverager::Create(client_.get()));
    }
  }

  // The averager may go while an interrupted call still writes into the tensors: keep them.
  ~PyAverager() {
    if (interrupted_ != nullptr && !interrupted_->done()) interrupted_tensors_.release();
  }

  // The decision at step() when it is a skip, taken (the step advances); None when the step
  // averages (or the decision is not known yet): the caller then collects its tensors and calls
  // Average. Cheap: no RPC within the prefetched window, no thread, no tensors.
  // Without the GIL: once per schedule_window steps the decision costs a GetSchedule RPC (at
  // most rpc_timeout; not interruptible, unlike the waits of an averaging step).
  std::optional<Decision> TakeSkip() {
    CheckNoInterruptedCall();
    absl::StatusOr<Decision> d;
    {
      py::gil_scoped_release nogil;
      absl::StatusOr<Decision> next = client_->DecisionAt(averager_->step());
      if (!next.ok() || next->average) return std::nullopt;
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
    auto call = BackgroundCall<Result>::Start([client, averager, views]() -> Result {
      return averager->AverageParameters(views);
    });
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

  int64_t step() const { return averager_->step(); }
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
  py::object interrupted_tensors_ = py::none();
};

std::string ActionName(const Decision& d) { return d.average ? "AVERAGE" : "SKIP"; }

}  // namespace
}  // namespace modelavg::python

PYBIND11_MODULE(_core, m) {
  using namespace modelavg::python;  // NOLINT
  using modelavg::Decision;
  m.doc() = "The C++ client library's binding. Use the modelavg package, not this module.";

  py::class_<Decision>(m, "Decision", R"doc(
What one rank did at one step: SKIP, or AVERAGE with a level and its subgroup's members.

Attributes:
  step: the step this decision was taken at (the averager's step before the call).
  action: "AVERAGE" or "SKIP".
  average: True when the parameters were averaged.
  level: index into the job's levels of the averaging level; -1 for SKIP.
  period: that level's period; 0 for SKIP.
  subgroup: index of the subgroup that averaged (AVERAGE only).
  ranks: the ranks whose parameters were averaged, ascending; [] for SKIP.
)doc")
      .def_readonly("step", &Decision::step)
      .def_property_readonly("action", &ActionName)
      .def_readonly("average", &Decision::average)
      .def_readonly("level", &Decision::level)
      .def_readonly("period", &Decision::period)
      .def_property_readonly("subgroup",
                             [](const Decision& d) { return d.average ? d.subgroup.index : -1; })
      .def_property_readonly("ranks",
                             [](const Decision& d) {
                               return d.average ? d.subgroup.Ranks() : std::vector<int32_t>{};
                             })
      .def("__eq__", [](const Decision& a, const Decision& b) { return a == b; })
      .def("__repr__", [](const Decision& d) {
        if (!d.average) return absl::StrCat("Decision(step=", d.step, ", action='SKIP')");
        std::string ranks;
        for (int32_t r : d.subgroup.Ranks()) absl::StrAppend(&ranks, ranks.empty() ? "" : ", ", r);
        return absl::StrCat("Decision(step=", d.step, ", action='AVERAGE', level=", d.level,
                            ", period=", d.period, ", ranks=[", ranks, "])");
      });

  py::class_<PyClient>(m, "Client", "One rank's membership in a job (see modelavg.Client).")
      .def_property_readonly("rank", [](const PyClient& c) { return c.get()->rank(); })
      .def_property_readonly("world_size", [](const PyClient& c) { return c.get()->world_size(); })
      .def_property_readonly("generation", [](const PyClient& c) { return c.get()->generation(); })
      .def_property_readonly("latest_generation",
                             [](const PyClient& c) { return c.get()->latest_generation(); })
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
                               d["warmup_steps"] = s.warmup_steps;
                               d["mode"] = s.mode == modelavg::AveragingMode::kPeriodic
                                               ? "PERIODIC"
                                               : "HIERARCHICAL";
                               py::list levels;
                               for (const auto& l : s.levels) {
                                 levels.append(py::make_tuple(l.period, l.group_size));
                               }
                               d["levels"] = levels;
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

  py::class_<PyAverager>(m, "Averager", "A periodic or hierarchical averager on one client.")
      .def(py::init<const PyClient&, bool>(), py::arg("client"), py::arg("hierarchical"),
           py::keep_alive<1, 2>())
      .def("take_skip", &PyAverager::TakeSkip)
      .def("average", &PyAverager::Average, py::arg("tensors"), py::arg("keep"))
      .def_property("step", &PyAverager::step, &PyAverager::set_step);

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
      "delete_job",
      [](const py::dict& conn, const std::string& job_id) {
        auto cc = MakeCoordinatorClient(conn);
        absl::Status s =
            RunInterruptibly<absl::Status>([cc, job_id] { return cc->DeleteJob(job_id); });
        if (!s.ok()) Raise(s);
      },
      py::arg("conn"), py::arg("job_id"));
}
