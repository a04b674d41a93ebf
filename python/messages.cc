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
#include "common/payload_fields.h"
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

namespace {

void Set(std::string* field, const py::handle& v) { *field = v.cast<std::string>(); }
void Set(bool* field, const py::handle& v) { *field = v.cast<bool>(); }
void Set(int64_t* field, const py::handle& v) { *field = v.cast<int64_t>(); }
void Set(double* field, const py::handle& v) { *field = v.cast<double>(); }
void Set(absl::Duration* field, const py::handle& v) { *field = Seconds(v.cast<double>()); }

const char* KindOf(const std::string*) { return "str"; }
const char* KindOf(const bool*) { return "bool"; }
const char* KindOf(const int64_t*) { return "int"; }
const char* KindOf(const double*) { return "float"; }
const char* KindOf(const absl::Duration*) { return "duration"; }

// One row per keyword option of connect(): a field of ClientOptions, named as in C++, its kind
// for the package's checks, and whether the job calls (create_job, ...) take it too (a field of
// ConnectionOptions).
struct OptionField {
  const char* name;
  const char* kind;
  bool connection;
  void (*set)(mc::ClientOptions*, const py::handle&);
};

#define MODELAVG_OPTION(field, connection)                                                   \
  OptionField {                                                                              \
    #field, KindOf(static_cast<decltype(mc::ClientOptions::field)*>(nullptr)), connection,   \
        [](mc::ClientOptions* o, const py::handle& v) { Set(&o->field, v); }                 \
  }

const std::vector<OptionField>& OptionFields() {
  static const auto* fields = new std::vector<OptionField>{
      MODELAVG_OPTION(auth_token, true),
      MODELAVG_OPTION(auth_token_file, true),
      MODELAVG_OPTION(tls, true),
      MODELAVG_OPTION(tls_ca_file, true),
      MODELAVG_OPTION(tls_cert_file, true),
      MODELAVG_OPTION(tls_key_file, true),
      MODELAVG_OPTION(rpc_timeout, true),
      MODELAVG_OPTION(worker_id, false),
      MODELAVG_OPTION(join_timeout, false),
      MODELAVG_OPTION(heartbeat_interval, false),
      MODELAVG_OPTION(heartbeat_stream, false),
      MODELAVG_OPTION(share_heartbeat_stream, false),
      MODELAVG_OPTION(heartbeat_relay_dir, false),
      MODELAVG_OPTION(collective_timeout, false),
      MODELAVG_OPTION(leave_timeout, false),
      MODELAVG_OPTION(coordinator_outage_timeout, false),
      MODELAVG_OPTION(schedule_window, false),
      MODELAVG_OPTION(gloo_hostname, false),
      MODELAVG_OPTION(gloo_in_place, false),
      MODELAVG_OPTION(gloo_scatter_max_bytes, false),
      MODELAVG_OPTION(check_finite, false),
      MODELAVG_OPTION(tokens_per_step, false),
  };
  return *fields;
}

#undef MODELAVG_OPTION

// The rows of `fields` that `d` has (and not None) applied to `o`.
void ApplyOptions(const py::dict& d, bool connection_only, mc::ClientOptions* o) {
  if (auto v = Get<std::string>(d, "coordinator")) o->coordinator = *v;
  for (const OptionField& f : OptionFields()) {
    if (connection_only && !f.connection) continue;
    if (!d.contains(f.name)) continue;
    py::object v = d[f.name];
    if (!v.is_none()) f.set(o, v);
  }
}

}  // namespace

mc::ClientOptions ClientOptionsFrom(const py::dict& d) {
  mc::ClientOptions o;
  ApplyOptions(d, /*connection_only=*/false, &o);
  if (auto v = Get<std::string>(d, "job_id")) o.job_id = *v;
  if (auto v = Get<int32_t>(d, "rank")) o.rank = *v;
  return o;
}

mc::ConnectionOptions ConnectionOptionsFrom(const py::dict& d) {
  mc::ClientOptions o;
  ApplyOptions(d, /*connection_only=*/true, &o);
  return o;
}

py::dict OptionTable() {
  py::dict table;
  for (const OptionField& f : OptionFields()) table[f.name] = py::make_tuple(f.kind, f.connection);
  return table;
}

py::dict ConnectionDict(const mc::ConnectionOptions& o) {
  const mc::ConnectionOptions defaults;
  py::dict d;
  if (o.coordinator != defaults.coordinator) d["coordinator"] = o.coordinator;
  if (o.auth_token != defaults.auth_token) d["auth_token"] = o.auth_token;
  if (o.auth_token_file != defaults.auth_token_file) d["auth_token_file"] = o.auth_token_file;
  if (o.tls != defaults.tls) d["tls"] = o.tls;
  if (o.tls_ca_file != defaults.tls_ca_file) d["tls_ca_file"] = o.tls_ca_file;
  if (o.tls_cert_file != defaults.tls_cert_file) d["tls_cert_file"] = o.tls_cert_file;
  if (o.tls_key_file != defaults.tls_key_file) d["tls_key_file"] = o.tls_key_file;
  if (o.rpc_timeout != defaults.rpc_timeout) {
    d["rpc_timeout"] = absl::ToDoubleSeconds(o.rpc_timeout);
  }
  return d;
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
  // One entry per level: (fragments, sync_delay, mix, payload name, error_feedback,
  // topk_density).
  if (auto v = Get<std::vector<std::tuple<int32_t, int64_t, double, std::string, double, double>>>(
          d, "streaming")) {
    if (static_cast<int>(v->size()) != spec.levels_size()) {
      throw py::value_error(absl::StrCat("streaming has ", v->size(), " entries for ",
                                         spec.levels_size(), " levels"));
    }
    for (size_t i = 0; i < v->size(); ++i) {
      const auto& [fragments, sync_delay, mix, payload_name, error_feedback, topk_density] =
          (*v)[i];
      v1::Level* level = spec.mutable_levels(static_cast<int>(i));
      v1::Payload payload;
      if (!v1::Payload_Parse(payload_name, &payload)) {
        throw py::value_error(absl::StrCat(
            "levels[", i, "].payload '", payload_name, "': expected ",
            PayloadNameList([](const PayloadInfo&) { return true; })));
      }
      level->set_fragments(fragments);
      level->set_sync_delay(sync_delay);
      level->set_mix(mix);
      level->set_payload(payload);
      level->set_error_feedback(error_feedback);
      level->set_topk_density(topk_density);
    }
  }
  // One entry per level, or absent (no level paced): (paced, max_lag, rounds).
  if (auto v = Get<std::vector<std::tuple<bool, double, int64_t>>>(d, "pacing")) {
    if (static_cast<int>(v->size()) != spec.levels_size()) {
      throw py::value_error(absl::StrCat("pacing has ", v->size(), " entries for ",
                                         spec.levels_size(), " levels"));
    }
    for (size_t i = 0; i < v->size(); ++i) {
      const auto& [paced, max_lag, rounds] = (*v)[i];
      v1::Level* level = spec.mutable_levels(static_cast<int>(i));
      level->set_paced(paced);
      level->set_max_lag(max_lag);
      level->set_rounds(rounds);
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
                                    v1::Payload_Name(l.payload()), l.error_feedback(),
                                    l.topk_density()));
  }
  d["streaming"] = streaming;
  py::list pacing;
  for (const v1::Level& l : spec.levels()) {
    pacing.append(py::make_tuple(l.paced(), l.max_lag(), l.rounds()));
  }
  d["pacing"] = pacing;
  d["heartbeat_timeout_ms"] = spec.heartbeat_timeout_ms();
  d["join_timeout_ms"] = spec.join_timeout_ms();
  d["min_world_size"] = spec.min_world_size();
  d["replica_size"] = spec.replica_size();
  return d;
}

py::dict PlanChangeDict(const v1::PlanChange& change) {
  py::dict d;
  d["version"] = change.version();
  d["switch_step"] = change.switch_step();
  d["spec"] = SpecDict(change.spec());
  d["unix_ms"] = change.unix_ms();
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
  py::list plans;
  for (const v1::PlanChange& c : job.plan_history()) plans.append(PlanChangeDict(c));
  d["plan_history"] = plans;
  d["plan_version"] = job.plan_version();
  d["pending_plan"] = job.has_pending_plan() ? py::object(PlanChangeDict(job.pending_plan()))
                                             : py::object(py::none());
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
