// Who a call is and what it may do: the bearer token of its metadata and, with mutual TLS, the
// names in its verified client certificate, mapped to a Role and, for a worker token limited to
// some jobs, those jobs. The gRPC adapter asks before every call and every stream, before it
// reads the request; nothing here knows the RPCs.
#ifndef MODELAVG_SERVER_RPC_SERVICE_AUTH_H_
#define MODELAVG_SERVER_RPC_SERVICE_AUTH_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace modelavg::server {

// A worker token and the jobs it may use.
struct WorkerToken {
  std::string token;
  // Job ids, or prefixes ending in '*' ("team-a-*"). Empty: every job.
  std::vector<std::string> jobs;
};

// Who may call what. Two roles:
//  * operator: every RPC;
//  * worker: what a worker and an observer need: every RPC whose line in the RPC list
//    (server/rpc/coordinator_rpcs.h) says Role::kWorker, that is all but CreateJob, DeleteJob
//    and UpdateJob (PERMISSION_DENIED naming the role).
// A call has the role of its bearer token ("authorization: Bearer <token>": operator_token or
// one of worker_tokens) or, with mutual TLS, of its client certificate; the higher of the two.
// A worker token limited to some jobs may name only those (PERMISSION_DENIED naming the job) and
// lists only those.
struct AuthOptions {
  // Empty: no token auth (and no roles unless client certificates give them).
  std::string operator_token;
  // Needs operator_token. Each differs from the others and from operator_token.
  std::vector<WorkerToken> worker_tokens;
  // True when the server verifies client certificates (mutual TLS).
  bool client_certificates = false;
  // With client_certificates: certificates naming one of these (subject CN or a SAN) are
  // operators, the others workers. Empty: every verified certificate is an operator.
  std::vector<std::string> operator_cert_names;
};

enum class Role { kNone = 0, kWorker = 1, kOperator = 2 };

// "operator", "worker" or "no".
const char* RoleName(Role role);

// What one call may do: its role and, for a worker token limited to some jobs, those jobs.
// Points into the ServiceAuth that made it, which must outlive it.
class Caller {
 public:
  Caller() = default;
  Caller(Role role, const WorkerToken* limited) : role_(role), limited_(limited) {}

  Role role() const { return role_; }
  // Whether the call may name job `job_id`.
  bool MayUse(absl::string_view job_id) const;
  // OK, or PERMISSION_DENIED naming `rpc`, the job and the jobs this caller may use.
  absl::Status CheckJob(absl::string_view job_id, const char* rpc) const;

 private:
  Role role_ = Role::kNone;
  const WorkerToken* limited_ = nullptr;  // null: every job
};

// INVALID_ARGUMENT unless every pattern is a job id, or a prefix of one followed by '*'.
absl::Status ValidateJobPatterns(const std::vector<std::string>& jobs);

// The worker token file (--worker_token_file): one token a line, alone (it may use every job:
// a file holding only the token, as before, still works) or followed by whitespace and the jobs
// it may use, comma-separated (job ids, or prefixes ending in '*'). Blank lines and lines
// starting with '#' are skipped. INVALID_ARGUMENT naming `path` and the line for an empty file,
// a bad job pattern or a token given twice.
absl::StatusOr<std::vector<WorkerToken>> ParseWorkerTokenFile(absl::string_view text,
                                                              const std::string& path);

// Stateless after construction; thread-safe.
class ServiceAuth {
 public:
  explicit ServiceAuth(AuthOptions options);

  // The caller's role and jobs: UNAUTHENTICATED without a valid token or certificate (always an
  // operator without auth).
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx) const;
  // The caller, when its role is at least `need`; UNAUTHENTICATED as Authenticate;
  // PERMISSION_DENIED naming `rpc` and both roles otherwise.
  absl::StatusOr<Caller> Authorize(const grpc::ServerContextBase& ctx, Role need = Role::kWorker,
                                   const char* rpc = "") const;

 private:
  // The role a verified client certificate gives (kNone without mutual TLS).
  Role CertificateRole(const grpc::ServerContextBase& ctx) const;

  const AuthOptions options_;
  const std::string operator_authorization_;  // "Bearer <token>", empty: no token auth
  // "Bearer <token>" of each of options_.worker_tokens.
  const std::vector<std::string> worker_authorizations_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_SERVICE_AUTH_H_
