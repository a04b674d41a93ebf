// A fixture for tests that drive a real CoordinatorServer in this process through its gRPC API:
// Start() serves on 127.0.0.1 (port 0, so tests run side by side) and opens a plaintext channel
// to it, with the generated stub and a generic stub (for bytes that are no request). CallContext
// makes a call's context with a deadline, so that no call of a test waits for ever.
#ifndef MODELAVG_TESTS_TOOLS_IN_PROCESS_COORDINATOR_H_
#define MODELAVG_TESTS_TOOLS_IN_PROCESS_COORDINATOR_H_

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"

namespace modelavg::server {

// A context whose deadline is `timeout` from now, sending `token` (if any) as a bearer token.
inline std::unique_ptr<grpc::ClientContext> CallContext(absl::Duration timeout,
                                                        const std::string& token) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

class InProcessCoordinatorTest : public ::testing::Test {
 protected:
  // Serves `options` on 127.0.0.1:0 (whatever `listen` they name); a test failure if it cannot.
  void Start(ServerOptions options = {}) {
    options.listen = "127.0.0.1:0";
    auto server = CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_TESTS_TOOLS_IN_PROCESS_COORDINATOR_H_
