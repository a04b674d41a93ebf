// modelavg-health: asks a gRPC server's standard health service whether it is serving.
//
//   modelavg-health --address=127.0.0.1:50051 [--service=modelavg.v1.Coordinator]
//                   [--timeout_ms=2000] [--tls_ca_file=ca.pem]
//
// Exit status 0 when the server answers SERVING, 1 otherwise, with one line on stderr saying
// why. Container HEALTHCHECKs and Kubernetes exec probes run it.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "HOST:PORT of the gRPC server to probe");
ABSL_FLAG(std::string, service, "", "service name to ask about; empty: the server as a whole");
ABSL_FLAG(int64_t, timeout_ms, 2000, "deadline of the health call, milliseconds");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM file of the CA that signed the server's certificate; empty: plaintext");

namespace {

int Fail(const std::string& message) {
  std::cerr << "modelavg-health: " << message << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Probes a gRPC server's health service; exit 0 iff it is SERVING.");
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_address);
  const int64_t timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (timeout_ms <= 0) return Fail("--timeout_ms must be > 0");

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  const std::string ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  if (!ca_file.empty()) {
    std::ifstream in(ca_file);
    if (!in) return Fail(absl::StrCat("cannot read --tls_ca_file=", ca_file));
    std::stringstream pem;
    pem << in.rdbuf();
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = pem.str();
    creds = grpc::SslCredentials(options);
  }
  auto channel = grpc::CreateChannel(address, creds);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
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
