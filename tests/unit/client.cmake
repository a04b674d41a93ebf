# Client library unit tests (no coordinator process: ranks as threads, in-memory stores).
modelavg_add_gtest(client_half_test SOURCES client_half_test.cc LIBS modelavg_client)
modelavg_add_gtest(client_membership_view_test SOURCES client_membership_view_test.cc
                   LIBS modelavg_client)
modelavg_add_gtest(client_streaming_codec_test SOURCES client_streaming_codec_test.cc
                   LIBS modelavg_client)
modelavg_add_gtest(client_staging_test SOURCES client_staging_test.cc LIBS modelavg_client)
modelavg_add_gtest(client_outer_state_test SOURCES client_outer_state_test.cc LIBS modelavg_client)
modelavg_add_gtest(client_gloo_test SOURCES client_gloo_test.cc LIBS modelavg_client modelavg_testing
                   TIMEOUT 120)
modelavg_add_gtest(client_gloo_abort_test SOURCES client_gloo_abort_test.cc LIBS modelavg_client
                   TIMEOUT 120)
modelavg_add_gtest(client_gloo_compressed_test SOURCES client_gloo_compressed_test.cc
                   LIBS modelavg_client TIMEOUT 120)
modelavg_add_gtest(client_gloo_setup_test SOURCES client_gloo_setup_test.cc
                   LIBS modelavg_client modelavg_testing TIMEOUT 60)
modelavg_add_gtest(client_gloo_round_test SOURCES client_gloo_round_test.cc
                   LIBS modelavg_client modelavg_testing TIMEOUT 120)
# A paced round's weighted contribution (client/averaging/round_weights.h) over Gloo: plain and
# outer INT8 with error feedback against the weighted mean recomputed naively.
modelavg_add_gtest(client_paced_weights_test SOURCES client_paced_weights_test.cc
                   LIBS modelavg_client TIMEOUT 120)
# The finite check (client/comm/finite_check.h): the scan, and Gloo rounds with a NaN or an Inf.
modelavg_add_gtest(client_finite_check_test SOURCES client_finite_check_test.cc
                   LIBS modelavg_client TIMEOUT 120)
# The direct exchange (client/comm/gloo/gloo_exchange.h): bit for bit against the rule restated,
# and its failures through the link proxies.
modelavg_add_gtest(client_gloo_direct_test SOURCES client_gloo_direct_test.cc
                   LIBS modelavg_client modelavg_testing TIMEOUT 180)
# The round protocol both backends speak (client/comm/round_agreement.h), on its own.
modelavg_add_gtest(client_round_agreement_test SOURCES client_round_agreement_test.cc
                   LIBS modelavg_client)
modelavg_add_gtest(client_peer_probe_test SOURCES client_peer_probe_test.cc LIBS modelavg_client
                   TIMEOUT 30)
# The programs' connection flags and environment variables (new and old names), the typed
# errors' blamed rank.
modelavg_add_gtest(client_connection_flags_test SOURCES client_connection_flags_test.cc
                   LIBS modelavg_client modelavg_client_flags TIMEOUT 30)
if(TARGET modelavg_server)
  modelavg_add_gtest(client_coordinator_test SOURCES client_coordinator_test.cc
                     LIBS modelavg_client modelavg_testing modelavg_server TIMEOUT 120)
  # A paced round's weights through RoundRunner and StreamingLevel (crafted paced decisions on
  # an in-process coordinator's job): the weighted mean, and failed rounds that write nothing.
  modelavg_add_gtest(client_paced_round_test SOURCES client_paced_round_test.cc
                     LIBS modelavg_client modelavg_testing modelavg_server TIMEOUT 120)
  modelavg_add_gtest(client_nccl_bootstrap_test SOURCES client_nccl_bootstrap_test.cc
                     LIBS modelavg_client modelavg_testing modelavg_server TIMEOUT 60)
  # share_heartbeat_stream: one process's ranks in one HostHeartbeatStream.
  modelavg_add_gtest(client_shared_heartbeat_test SOURCES client_shared_heartbeat_test.cc
                     LIBS modelavg_client modelavg_testing modelavg_server TIMEOUT 120)
endif()
# The session's parts on their own: the generation tracker (no threads, no clock), and the
# timeouts of the outage, Join and Leave on a FakeClock.
modelavg_add_gtest(client_generation_tracker_test SOURCES client_generation_tracker_test.cc
                   LIBS modelavg_client)
modelavg_add_gtest(client_session_clock_test SOURCES client_session_clock_test.cc
                   LIBS modelavg_client TIMEOUT 60)
# Paced rounds' client side without a coordinator: the compute pace on a FakeClock, and the
# tokens_per_step option and its variable.
modelavg_add_gtest(client_pace_test SOURCES client_pace_test.cc LIBS modelavg_client TIMEOUT 30)
modelavg_add_gtest(client_nccl_core_test SOURCES client_nccl_core_test.cc
                   LIBS modelavg_client modelavg_testing)
modelavg_add_gtest(client_nccl_outer_test SOURCES client_nccl_outer_test.cc
                   LIBS modelavg_client modelavg_testing)
# A paced round's weighted copy on CUDA tensors (round_weights.h on OuterDevice), plain and outer
# levels on the simulated device, against the weighted mean recomputed naively.
modelavg_add_gtest(client_nccl_paced_test SOURCES client_nccl_paced_test.cc
                   LIBS modelavg_client modelavg_testing)
modelavg_add_gtest(client_nccl_streaming_test SOURCES client_nccl_streaming_test.cc
                   LIBS modelavg_client modelavg_testing)
modelavg_add_gtest(client_nccl_compressed_test SOURCES client_nccl_compressed_test.cc
                   LIBS modelavg_client modelavg_testing)
modelavg_add_gtest(client_nccl_feedback_test SOURCES client_nccl_feedback_test.cc
                   LIBS modelavg_client modelavg_testing)
# The Gloo pairs' proof of membership (client/comm/gloo/pair_proof.h) on its own.
modelavg_add_gtest(client_pair_proof_test SOURCES client_pair_proof_test.cc LIBS modelavg_client
                   TIMEOUT 60)
