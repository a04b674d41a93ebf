# Coordinator core (fake clock) and jobs-file unit tests.
modelavg_add_gtest(server_job_test SOURCES server_job_test.cc LIBS modelavg_server_core)
# The pending Joins and GetCommIds: indexed by id, rank or key, and deadline.
modelavg_add_gtest(server_pending_waits_test SOURCES server_pending_waits_test.cc
  LIBS modelavg_server_core)
modelavg_add_gtest(server_membership_test SOURCES server_membership_test.cc
  LIBS modelavg_server_core)
# A paced job's planned rounds (paced_plan.h); the plan of a paced level (pacing.h) against
# tests/reference/paced_reference.h.
modelavg_add_gtest(server_paced_plan_test SOURCES server_paced_plan_test.cc
  LIBS modelavg_server_pacing)
modelavg_add_gtest(server_pacing_test SOURCES server_pacing_test.cc
  LIBS modelavg_server_pacing)
modelavg_add_gtest(server_state_store_test SOURCES server_state_store_test.cc
  LIBS modelavg_server_core)
modelavg_add_gtest(server_jobs_file_test SOURCES server_jobs_file_test.cc LIBS modelavg_server)
modelavg_add_gtest(server_sqlite_state_store_test SOURCES server_sqlite_state_store_test.cc
  LIBS modelavg_server_sqlite modelavg_server_core)
modelavg_add_gtest(server_elastic_test SOURCES server_elastic_test.cc LIBS modelavg_server_core)
# Sharded replicas: the replica as the unit of failure and of admission.
modelavg_add_gtest(server_replicas_test SOURCES server_replicas_test.cc LIBS modelavg_server_core)
# Bounds on what a client can make the core hold and compute (specs, pages, cancellation).
modelavg_add_gtest(server_bounds_test SOURCES server_bounds_test.cc LIBS modelavg_server_core)
# Per-member credentials: each rank-scoped call without, with a wrong and with the right one.
modelavg_add_gtest(server_credentials_test SOURCES server_credentials_test.cc
  LIBS modelavg_server_core)
modelavg_add_gtest(server_silent_members_test SOURCES server_silent_members_test.cc
                   LIBS modelavg_server_core)
# The status page of the HTTP port: contents, escaping, the operator token.
modelavg_add_gtest(status_page_test SOURCES status_page_test.cc LIBS modelavg_server)
# Gray failures: peer failure reports, confirmed before anyone is evicted.
modelavg_add_gtest(server_peer_reports_test SOURCES server_peer_reports_test.cc
                   LIBS modelavg_server_core)
# Non-finite values reported by a member: recorded; an elastic job retires the member.
modelavg_add_gtest(server_nonfinite_test SOURCES server_nonfinite_test.cc
                   LIBS modelavg_server_core)
# UpdateJob: the proposal, the switch step from the members' answers, the plan kept across a
# restart of the core, refused changes.
modelavg_add_gtest(server_update_test SOURCES server_update_test.cc LIBS modelavg_server_core)
# The streaming reactors' write queue (one write in flight, the deferred Finish).
modelavg_add_gtest(server_stream_writes_test SOURCES server_stream_writes_test.cc
                   LIBS modelavg_server)
# Which HeartbeatStream beats are answered (fake clock).
modelavg_add_gtest(server_heartbeat_replies_test SOURCES server_heartbeat_replies_test.cc
                   LIBS modelavg_server_core)
# The core of a HostHeartbeatStream: several members' beats per message (fake clock).
modelavg_add_gtest(server_host_heartbeats_test SOURCES server_host_heartbeats_test.cc
                   LIBS modelavg_server_core)
# The worker token file and the jobs a limited worker token may name.
modelavg_add_gtest(service_auth_test SOURCES service_auth_test.cc LIBS modelavg_server_rpc)
# The RPC list the service routes by, against the proto: one line per method, its messages, roles.
modelavg_add_gtest(server_rpc_list_test SOURCES server_rpc_list_test.cc LIBS modelavg_server_rpc)
# Control characters escaped for terminals and logs.
modelavg_add_gtest(printable_test SOURCES printable_test.cc LIBS modelavg_common)
