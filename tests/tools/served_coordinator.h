// A CoordinatorServer in this process and an operator's CoordinatorClient connected to it: what a
// client-side test needs to create its jobs before its clients connect.
#ifndef MODELAVG_TESTS_TOOLS_SERVED_COORDINATOR_H_
#define MODELAVG_TESTS_TOOLS_SERVED_COORDINATOR_H_

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "client/rpc/coordinator_client.h"
#include "server/coordinator_server.h"

namespace modelavg::testing {

struct ServedCoordinator {
  std::unique_ptr<server::CoordinatorServer> server;  // stopped after the admin is gone
  std::unique_ptr<client::CoordinatorClient> admin;
};

// Serves `options` (by default on 127.0.0.1, port 0) and connects an admin client; the error of
// whichever step failed.
inline absl::StatusOr<ServedCoordinator> ServeCoordinator(server::ServerOptions options = {}) {
  absl::StatusOr<std::unique_ptr<server::CoordinatorServer>> server =
      server::CoordinatorServer::Start(options);
  if (!server.ok()) return server.status();
  client::ConnectionOptions admin_options;
  admin_options.coordinator = (*server)->address();
  admin_options.auth_token = options.auth_token;
  absl::StatusOr<std::unique_ptr<client::CoordinatorClient>> admin =
      client::CoordinatorClient::Create(admin_options);
  if (!admin.ok()) return admin.status();
  return ServedCoordinator{*std::move(server), *std::move(admin)};
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_SERVED_COORDINATOR_H_
