#include "python/messages.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "pybind11/stl.h"

namespace py = pybind11;
namespace mc = modelavg::client;

namespace modelavg::python {
namespace {

absl::Duration Seconds(double s) { return absl::Seconds(s); }

template <typename T>
std::optional<T> Get(const py::dict& d, const char* key) {
  if (!d.contains(key)) return std::nullopt;
  py::object v = d[key];
  if (v.is_none()) return std::nullopt;
  return v.cast<T>();
}

}  // namespace

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
  if (auto v = Get<bool>(d, "share_heartbeat_stream")) o.share_heartbeat_stream = *v;
  if (auto v = Get<std::string>(d, "heartbeat_relay_dir")) o.heartbeat_relay_dir = *v;
  if (auto v = Get<double>(d, "collective_timeout")) o.collective_timeout = Seconds(*v);
  if (auto v = Get<double>(d, "leave_timeout")) o.leave_timeout = Seconds(*v);
  if (auto v = Get<double>(d, "coordinator_outage_timeout")) {
    o.coordinator_outage_timeout = Seconds(*v);
  }
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
  // One entry per level: None (plain) or (lr, momentum, nesterov).
  if (auto v = Get<std::vector<std::optional<std::tuple<double, double, bool>>>>(d, "outer")) {
    if (static_cast<int>(v->size()) != spec.levels_size()) {
      throw py::value_error(absl::StrCat("outer has ", v->size(), " entries for ",
                                         spec.levels_size(), " levels"));
    }
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].has_value()) continue;
      const auto& [lr, momentum, nesterov] = *(*v)[i];
      v1::OuterOptimizer* o = spec.mutable_levels(static_cast<int>(i))->mutable_outer();
      o->set_lr(lr);
      o->set_momentum(momentum);
      o->set_nesterov(nesterov);
    }
  }
  // One entry per level: (fragments, sync_delay, mix, payload name).
  if (auto v = Get<std::vector<std::tuple<int32_t, int64_t, double, std::string>>>(d,
                                                                                  "streaming")) {
    if (static_cast<int>(v->size()) != spec.levels_size()) {
      throw py::value_error(absl::StrCat("streaming has ", v->size(), " entries for ",
                                         spec.levels_size(), " levels"));
    }
    for (size_t i = 0; i < v->size(); ++i) {
      const auto& [fragments, sync_delay, mix, payload_name] = (*v)[i];
      v1::Level* level = spec.mutable_levels(static_cast<int>(i));
      v1::Payload payload;
      if (!v1::Payload_Parse(payload_name, &payload)) {
        throw py::value_error(absl::StrCat("levels[", i, "].payload '", payload_name,
                                           "': expected FP32, BF16 or INT8"));
      }
      level->set_fragments(fragments);
      level->set_sync_delay(sync_delay);
      level->set_mix(mix);
      level->set_payload(payload);
    }
  }
  if (auto v = Get<int64_t>(d, "heartbeat_timeout_ms")) spec.set_heartbeat_timeout_ms(*v);
  if (auto v = Get<int64_t>(d, "join_timeout_ms")) spec.set_join_timeout_ms(*v);
  if (auto v = Get<int32_t>(d, "min_world_size")) spec.set_min_world_size(*v);
  if (auto v = Get<int32_t>(d, "replica_size")) spec.set_replica_size(*v);
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
  py::list outer;
  for (const v1::Level& l : spec.levels()) {
    if (l.has_outer()) {
      outer.append(py::make_tuple(l.outer().lr(), l.outer().momentum(), l.outer().nesterov()));
    } else {
      outer.append(py::none());
    }
  }
  d["outer"] = outer;
  py::list streaming;
  for (const v1::Level& l : spec.levels()) {
    streaming.append(py::make_tuple(std::max(1, l.fragments()), l.sync_delay(), l.mix(),
                                    v1::Payload_Name(l.payload())));
  }
  d["streaming"] = streaming;
  d["heartbeat_timeout_ms"] = spec.heartbeat_timeout_ms();
  d["join_timeout_ms"] = spec.join_timeout_ms();
  d["min_world_size"] = spec.min_world_size();
  d["replica_size"] = spec.replica_size();
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
    md["admitted_step"] = m.admitted_step();
    md["replica"] = m.replica();
    md["shard"] = m.shard();
    md["retired_by"] = m.state() == v1::RETIRED ? m.retired_by() : -1;
    md["retired_at_step"] = m.retired_at_step();
    members.append(md);
  }
  d["members"] = members;
  d["min_step"] = job.min_step();
  d["max_step"] = job.max_step();
  py::list warnings;
  for (const std::string& w : job.warnings()) warnings.append(w);
  d["warnings"] = warnings;
  d["created_unix_ms"] = job.created_unix_ms();
  d["live_world_size"] = job.live_world_size();
  d["vacant_ranks"] = std::vector<int32_t>(job.vacant_ranks().begin(), job.vacant_ranks().end());
  d["deaths"] = job.deaths();
  d["admissions"] = job.admissions();
  d["waiting_ranks"] =
      std::vector<int32_t>(job.waiting_ranks().begin(), job.waiting_ranks().end());
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

}  // namespace modelavg::python
