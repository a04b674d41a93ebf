#include "tests/testing/in_process_coordinator.h"

#include <chrono>
#include <utility>

#include "common/status_util.h"

namespace modelavg::testing {

std::unique_ptr<grpc::ClientContext> CallContext(absl::Duration timeout,
                                                 const std::string& token) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

absl::StatusOr<InProcessCoordinator> InProcessCoordinator::Start(server::ServerOptions options) {
  options.listen = "127.0.0.1:0";
  InProcessCoordinator c;
  MODELAVG_ASSIGN_OR_RETURN(c.server, server::CoordinatorServer::Start(options));
  c.channel = grpc::CreateChannel(c.server->address(), grpc::InsecureChannelCredentials());
  c.stub = v1::Coordinator::NewStub(c.channel);
  c.generic = std::make_unique<grpc::GenericStub>(c.channel);
  client::ConnectionOptions admin;
  admin.coordinator = c.server->address();
  admin.auth_token = options.auth_token;
  MODELAVG_ASSIGN_OR_RETURN(c.admin, client::CoordinatorClient::Create(admin));
  return c;
}

void InProcessCoordinatorTest::Start(server::ServerOptions options) {
  absl::StatusOr<InProcessCoordinator> started = InProcessCoordinator::Start(std::move(options));
  ASSERT_TRUE(started.ok()) << started.status();
  coordinator_ = *std::move(started);
}

}  // namespace modelavg::testing
