#include "server/rpc/service_auth.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace modelavg::server {
namespace {

// Equal, in time independent of where the first difference is.
bool SameSecret(grpc::string_ref got, const std::string& want) {
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got.data()[i] : 0));
  }
  return diff == 0;
}

std::string BearerOf(const std::string& token) {
  return token.empty() ? "" : absl::StrCat("Bearer ", token);
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kOperator:
      return "operator";
    case Role::kWorker:
      return "worker";
    default:
      return "no";
  }
}

ServiceAuth::ServiceAuth(AuthOptions options)
    : options_(std::move(options)),
      operator_authorization_(BearerOf(options_.operator_token)),
      worker_authorization_(BearerOf(options_.worker_token)) {}

Role ServiceAuth::CertificateRole(const grpc::ServerContextBase& ctx) const {
  if (!options_.client_certificates) return Role::kNone;
  // The TLS handshake verified the certificate; without the list every such client is an
  // operator.
  if (options_.operator_cert_names.empty()) return Role::kOperator;
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return Role::kWorker;
  for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const grpc::string_ref& name : auth->FindPropertyValues(property)) {
      for (const std::string& want : options_.operator_cert_names) {
        if (name.size() == want.size() &&
            want.compare(0, want.size(), name.data(), name.size()) == 0) {
          return Role::kOperator;
        }
      }
    }
  }
  return Role::kWorker;
}

absl::StatusOr<Role> ServiceAuth::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (operator_authorization_.empty() && !options_.client_certificates) return Role::kOperator;
  const Role role = CertificateRole(ctx);
  if (operator_authorization_.empty() || role == Role::kOperator) return role;
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    if (role != Role::kNone) return role;
    return absl::UnauthenticatedError(
        "this coordinator needs metadata \"authorization: Bearer <token>\"");
  }
  if (SameSecret(it->second, operator_authorization_)) return Role::kOperator;
  if (!worker_authorization_.empty() && SameSecret(it->second, worker_authorization_)) {
    return Role::kWorker;
  }
  if (role != Role::kNone) return role;
  return absl::UnauthenticatedError("the authorization token is wrong");
}

absl::Status ServiceAuth::Authorize(const grpc::ServerContextBase& ctx, Role need,
                                    const char* rpc) const {
  absl::StatusOr<Role> role = Authenticate(ctx);
  if (!role.ok()) return role.status();
  if (*role >= need) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      rpc, " needs the ", RoleName(need), " role; this call has the ", RoleName(*role),
      " role: use the operator token (the coordinator's --auth_token_file) or an operator's "
      "client certificate"));
}

}  // namespace modelavg::server
