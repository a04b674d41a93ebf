// modelavg-health: asks a gRPC server's standard health service whether it is serving.
//
//   modelavg-health --coordinator=127.0.0.1:50051 [--service=modelavg.v1.Coordinator]
//                   [--rpc_timeout_ms=2000] [--tls_ca_file=ca.pem]
//
// The connection flags are every modelavg program's (client/flags/connection_flags.h; the old
// --address and --timeout_ms still work): --coordinator (default $MODELAVG_COORDINATOR, else
// 127.0.0.1:50051), --tls, --tls_ca_file, --tls_cert_file/--tls_key_file, --rpc_timeout_ms
// (default 2000 here), --auth_token_file (sent, though the coordinator's health needs none).
//
// Exit status 0 when the server answers SERVING, 1 otherwise, with one line on stderr saying
// why. Container HEALTHCHECKs and Kubernetes exec probes run it.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/flags/connection_flags.h"
#include "client/rpc/connection.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, service, "", "service name to ask about; empty: the server as a whole");

namespace {

int Fail(const std::string& message) {
  std::cerr << "modelavg-health: " << message << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Probes a gRPC server's health service; exit 0 iff it is SERVING.");
  absl::ParseCommandLine(argc, argv);
  modelavg::client::ConnectionOptions defaults;
  defaults.coordinator = "127.0.0.1:50051";
  defaults.rpc_timeout = absl::Milliseconds(2000);
  absl::StatusOr<modelavg::client::ConnectionOptions> conn =
      modelavg::client::ConnectionFromFlags(defaults);
  if (!conn.ok()) return Fail(std::string(conn.status().message()));
  const std::string address = conn->coordinator;
  absl::StatusOr<modelavg::client::CoordinatorChannel> c = modelavg::client::OpenChannel(*conn);
  if (!c.ok()) return Fail(std::string(c.status().message()));
  auto stub = grpc::health::v1::Health::NewStub(c->channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(conn->rpc_timeout));
  // The coordinator's health service needs no token; one given is sent all the same (a proxy
  // in front of it may want it).
  if (!c->token.empty()) context.AddMetadata("authorization", "Bearer " + c->token);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    return Fail(absl::StrCat(address, ": health check failed: code ",
                             static_cast<int>(status.error_code()), ": ", status.error_message()));
  }
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return Fail(absl::StrCat(
        address, " is not serving (status ",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status()), ")"));
  }
  std::cout << address << ": SERVING" << std::endl;
  return 0;
}
