#include "server/rpc/service_auth.h"

#include <memory>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/job_spec.h"

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

std::vector<std::string> BearersOf(const std::vector<WorkerToken>& tokens) {
  std::vector<std::string> out;
  out.reserve(tokens.size());
  for (const WorkerToken& t : tokens) out.push_back(BearerOf(t.token));
  return out;
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

bool Caller::MayUse(absl::string_view job_id) const {
  if (limited_ == nullptr || limited_->jobs.empty()) return true;
  for (const std::string& pattern : limited_->jobs) {
    if (absl::EndsWith(pattern, "*")
            ? absl::StartsWith(job_id, absl::string_view(pattern).substr(0, pattern.size() - 1))
            : job_id == pattern) {
      return true;
    }
  }
  return false;
}

absl::Status Caller::CheckJob(absl::string_view job_id, const char* rpc) const {
  if (MayUse(job_id)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      rpc, " of job ", job_id.substr(0, kMaxJobIdLength),
      ": the worker token of this call is limited to job(s) ",
      absl::StrJoin(limited_->jobs, ", "),
      " (the coordinator's --worker_token_file); use the token given for this job"));
}

absl::Status ValidateJobPatterns(const std::vector<std::string>& jobs) {
  for (const std::string& pattern : jobs) {
    absl::string_view id = pattern;
    // A bare "*" is a prefix of every job: leave the jobs out instead.
    if (absl::ConsumeSuffix(&id, "*") && id.empty()) {
      return absl::InvalidArgumentError(
          "\"*\" is not a job pattern: give no jobs for a token that may use every job");
    }
    if (absl::Status s = ValidateJobId(id); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", pattern.substr(0, kMaxJobIdLength + 1),
                       "\" is neither a job id nor a prefix of one followed by '*': ",
                       s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<WorkerToken>> ParseWorkerTokenFile(absl::string_view text,
                                                              const std::string& path) {
  std::vector<WorkerToken> tokens;
  std::set<std::string> seen;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || absl::StartsWith(line, "#")) continue;
    const auto where = [&] { return absl::StrCat(path, " line ", line_number, ": "); };
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::MaxSplits(absl::ByAnyChar(" \t"), 1), absl::SkipEmpty());
    WorkerToken token;
    token.token = std::string(fields[0]);
    if (fields.size() > 1) {
      for (absl::string_view job :
           absl::StrSplit(fields[1], ',', absl::SkipWhitespace())) {
        token.jobs.emplace_back(absl::StripAsciiWhitespace(job));
      }
      if (token.jobs.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "no job after the token; write \"TOKEN job-a,job-b\", or the "
                                  "token alone for every job"));
      }
      if (absl::Status s = ValidateJobPatterns(token.jobs); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(where(), s.message()));
      }
    }
    if (!seen.insert(token.token).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "this token is on an earlier line too; give each token once"));
    }
    tokens.push_back(std::move(token));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token file ", path, " holds no token: put a token on a line (\"TOKEN\" for every job, "
        "\"TOKEN job-a,job-b\" for some)"));
  }
  return tokens;
}

ServiceAuth::ServiceAuth(AuthOptions options)
    : options_(std::move(options)),
      operator_authorization_(BearerOf(options_.operator_token)),
      worker_authorizations_(BearersOf(options_.worker_tokens)) {}

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

absl::StatusOr<Caller> ServiceAuth::Authenticate(const grpc::ServerContextBase& ctx) const {
  if (operator_authorization_.empty() && !options_.client_certificates) {
    return Caller(Role::kOperator, nullptr);
  }
  const Role role = CertificateRole(ctx);
  if (operator_authorization_.empty() || role == Role::kOperator) return Caller(role, nullptr);
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    if (role != Role::kNone) return Caller(role, nullptr);
    return absl::UnauthenticatedError(
        "this coordinator needs metadata \"authorization: Bearer <token>\"");
  }
  if (SameSecret(it->second, operator_authorization_)) return Caller(Role::kOperator, nullptr);
  // A worker certificate may use every job: it outranks a token limited to some.
  if (role == Role::kWorker) return Caller(role, nullptr);
  for (size_t i = 0; i < worker_authorizations_.size(); ++i) {
    if (SameSecret(it->second, worker_authorizations_[i])) {
      return Caller(Role::kWorker, &options_.worker_tokens[i]);
    }
  }
  return absl::UnauthenticatedError("the authorization token is wrong");
}

absl::StatusOr<Caller> ServiceAuth::Authorize(const grpc::ServerContextBase& ctx, Role need,
                                              const char* rpc) const {
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) return caller.status();
  if (caller->role() >= need) return caller;
  return absl::PermissionDeniedError(absl::StrCat(
      rpc, " needs the ", RoleName(need), " role; this call has the ", RoleName(caller->role()),
      " role: use the operator token (the coordinator's --auth_token_file) or an operator's "
      "client certificate"));
}

}  // namespace modelavg::server
