// Between Python dicts and the client library's options and the coordinator's messages. The
// pure-Python layer (modelavg/__init__.py) validates names and kinds and turns the dicts into
// dataclasses; these conversions only copy fields.
#ifndef MODELAVG_PYTHON_MESSAGES_H_
#define MODELAVG_PYTHON_MESSAGES_H_

#include "modelavg/client/connection.h"
#include "modelavg/client/client.h"
#include "modelavg/v1/coordinator.pb.h"
#include "pybind11/pybind11.h"

namespace modelavg::python {

// ClientOptions from connect()'s keywords: coordinator, job_id, rank and the options of
// OptionTable() (durations in seconds). Absent or None keys keep the defaults.
client::ClientOptions ClientOptionsFrom(const pybind11::dict& d);
// The coordinator address and the connection options (ConnectionOptions).
client::ConnectionOptions ConnectionOptionsFrom(const pybind11::dict& d);
// The package's table of connect()'s keyword options (modelavg._core.OPTIONS): name -> (kind,
// connection), kind "str", "bool", "int" or "duration" (seconds), connection: whether the job
// calls take it too. Made from the same rows as the two conversions above.
pybind11::dict OptionTable();
// The fields of `o` that differ from a default ConnectionOptions, by the options' names.
pybind11::dict ConnectionDict(const client::ConnectionOptions& o);
// job_id, world_size, warmup_steps, mode ("PERIODIC"/"HIERARCHICAL"; ValueError otherwise),
// levels [(period, group_size)], outer [None or (lr, momentum, nesterov) per level],
// streaming [(fragments, sync_delay, mix, payload "FP32"/"BF16"/"INT8") per level],
// heartbeat_timeout_ms, join_timeout_ms, min_world_size.
v1::JobSpec JobSpecFrom(const pybind11::dict& d);
// The same keys back.
pybind11::dict SpecDict(const v1::JobSpec& spec);
// version, switch_step, spec (as SpecDict), unix_ms.
pybind11::dict PlanChangeDict(const v1::PlanChange& change);
// spec, state, generation, members (with admitted_step), min_step, max_step, warnings,
// created_unix_ms, last_change, live_world_size, vacant_ranks, deaths, admissions,
// plan_history [PlanChangeDict], plan_version, pending_plan (PlanChangeDict or None).
pybind11::dict JobDict(const v1::Job& job);

}  // namespace modelavg::python

#endif  // MODELAVG_PYTHON_MESSAGES_H_
