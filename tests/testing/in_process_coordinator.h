// A CoordinatorServer in this process, for tests that drive the coordinator through its gRPC API
// or run clients against it: served on 127.0.0.1 (port 0, so that tests run side by side), with a
// plaintext channel to it (the generated stub, and a generic stub for bytes that are no request)
// and an operator's CoordinatorClient that creates the jobs before the clients connect.
// CallContext makes a call's context with a deadline, so that no call of a test waits for ever.
#ifndef MODELAVG_TESTS_TESTING_IN_PROCESS_COORDINATOR_H_
#define MODELAVG_TESTS_TESTING_IN_PROCESS_COORDINATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"

namespace modelavg::testing {

// A context whose deadline is `timeout` from now, sending `token` (if any) as a bearer token.
std::unique_ptr<grpc::ClientContext> CallContext(absl::Duration timeout,
                                                 const std::string& token);

struct InProcessCoordinator {
  // Declared first: stopped after everything that talks to it is gone.
  std::unique_ptr<server::CoordinatorServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  std::unique_ptr<grpc::GenericStub> generic;
  // Sends the server's auth_token (if any); plaintext.
  std::unique_ptr<client::CoordinatorClient> admin;

  // Serves `options` on 127.0.0.1:0 (whatever `listen` they name) and connects the channel and
  // the admin client; the error of whichever step failed.
  static absl::StatusOr<InProcessCoordinator> Start(server::ServerOptions options = {});
  // "127.0.0.1:<port>".
  std::string address() const { return server->address(); }
};

// A fixture for tests of one coordinator: Start() in the test body (with the options it needs),
// then server(), stub(), generic(), channel(), admin(). StopServer() stops it early.
class InProcessCoordinatorTest : public ::testing::Test {
 protected:
  // A test failure if it cannot start.
  void Start(server::ServerOptions options = {});
  // Stops the server (the channel and the stubs stay, failing every call).
  void StopServer() { coordinator_.server.reset(); }

  server::CoordinatorServer* server() const { return coordinator_.server.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return coordinator_.channel; }
  v1::Coordinator::Stub* stub() const { return coordinator_.stub.get(); }
  grpc::GenericStub* generic() const { return coordinator_.generic.get(); }
  client::CoordinatorClient* admin() const { return coordinator_.admin.get(); }

  InProcessCoordinator coordinator_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TESTING_IN_PROCESS_COORDINATOR_H_
