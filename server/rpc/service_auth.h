// Who a call is and what it may do: the bearer token of its metadata and, with mutual TLS, the
// names in its verified client certificate, mapped to a Role. The gRPC adapter asks before
// every call and every HeartbeatStream; nothing here knows the RPCs.
#ifndef MODELAVG_SERVER_RPC_SERVICE_AUTH_H_
#define MODELAVG_SERVER_RPC_SERVICE_AUTH_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace modelavg::server {

// Who may call what. Two roles:
//  * operator: every RPC;
//  * worker: what a worker and an observer need: Join, Heartbeat(Stream), Step, GetSchedule,
//    PublishCommId, GetCommId, Leave, ReportPeerFailure, ReportNonFinite, GetJob, ListJobs,
//    WatchJob, Ping (not CreateJob, DeleteJob: PERMISSION_DENIED naming the role).
// A call has the role of its bearer token ("authorization: Bearer <token>": operator_token or
// worker_token) or, with mutual TLS, of its client certificate; the higher of the two.
struct AuthOptions {
  // Empty: no token auth (and no roles unless client certificates give them).
  std::string operator_token;
  // Empty: no worker token. Needs operator_token.
  std::string worker_token;
  // True when the server verifies client certificates (mutual TLS).
  bool client_certificates = false;
  // With client_certificates: certificates naming one of these (subject CN or a SAN) are
  // operators, the others workers. Empty: every verified certificate is an operator.
  std::vector<std::string> operator_cert_names;
};

enum class Role { kNone = 0, kWorker = 1, kOperator = 2 };

// "operator", "worker" or "no".
const char* RoleName(Role role);

// Stateless after construction; thread-safe.
class ServiceAuth {
 public:
  explicit ServiceAuth(AuthOptions options);

  // The caller's role: UNAUTHENTICATED without a valid token or certificate (always operator
  // without auth).
  absl::StatusOr<Role> Authenticate(const grpc::ServerContextBase& ctx) const;
  // OK when the caller's role is at least `need`; UNAUTHENTICATED as Authenticate;
  // PERMISSION_DENIED naming `rpc` and both roles otherwise.
  absl::Status Authorize(const grpc::ServerContextBase& ctx, Role need = Role::kWorker,
                         const char* rpc = "") const;

 private:
  // The role a verified client certificate gives (kNone without mutual TLS).
  Role CertificateRole(const grpc::ServerContextBase& ctx) const;

  const AuthOptions options_;
  const std::string operator_authorization_;  // "Bearer <token>", empty: no token auth
  const std::string worker_authorization_;    // "Bearer <token>", empty: no worker token
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_SERVICE_AUTH_H_
