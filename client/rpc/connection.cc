#include "client/rpc/connection.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/file_util.h"
#include "grpcpp/create_channel.h"
#include "common/status_util.h"

namespace modelavg::client {
namespace {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> Env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The first of `name`, then `old_name` (deprecated) that is set.
std::optional<std::string> EnvOrOld(const char* name, const char* old_name) {
  std::optional<std::string> old = Env(old_name);
  if (old.has_value()) WarnDeprecatedName(old_name, name);
  std::optional<std::string> v = Env(name);
  return v.has_value() ? v : old;
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", text.status().message(),
                                                   " (check the path and permissions)"));
  }
  return text;
}

}  // namespace

void WarnDeprecatedName(absl::string_view old_name, absl::string_view new_name) {
  static absl::Mutex mu(absl::kConstInit);
  static std::set<std::string>* warned ABSL_GUARDED_BY(mu) = new std::set<std::string>();
  {
    absl::MutexLock l(&mu);
    if (!warned->insert(std::string(old_name)).second) return;
  }
  const std::string line = absl::StrCat("modelavg: warning: ", old_name, " is deprecated: use ",
                                        new_name, " instead\n");
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

absl::StatusOr<ConnectionOptions> ConnectionFromEnvironment(const ConnectionOptions& defaults) {
  ConnectionOptions o = defaults;
  if (auto v = Env("MODELAVG_COORDINATOR")) o.coordinator = *v;
  if (auto v = EnvOrOld("MODELAVG_AUTH_TOKEN_FILE", "MODELAVG_TOKEN_FILE")) {
    o.auth_token_file = *v;
    o.auth_token.clear();
  } else if (auto token = Env("MODELAVG_AUTH_TOKEN")) {
    // The token itself in the environment, where every process of the user can read it.
    WarnDeprecatedName("MODELAVG_AUTH_TOKEN",
                       "MODELAVG_AUTH_TOKEN_FILE (a file holding the token)");
    o.auth_token = *token;
    o.auth_token_file.clear();
  }
  if (auto v = Env("MODELAVG_TLS")) {
    const std::string b = absl::AsciiStrToLower(*v);
    if (b == "1" || b == "true" || b == "yes") {
      o.tls = true;
    } else if (b == "0" || b == "false" || b == "no") {
      o.tls = false;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "environment variable MODELAVG_TLS=\"", *v, "\": expected 1, true, yes, 0, false or no"));
    }
  }
  if (auto v = Env("MODELAVG_TLS_CA_FILE")) o.tls_ca_file = *v;
  if (auto v = Env("MODELAVG_TLS_CERT_FILE")) o.tls_cert_file = *v;
  if (auto v = Env("MODELAVG_TLS_KEY_FILE")) o.tls_key_file = *v;
  if (Env("MODELAVG_TLS_CA_FILE") || Env("MODELAVG_TLS_CERT_FILE") || Env("MODELAVG_TLS_KEY_FILE")) {
    o.tls = true;
  }
  if (auto v = Env("MODELAVG_RPC_TIMEOUT_MS")) {
    int64_t ms = 0;
    if (!absl::SimpleAtoi(*v, &ms) || ms <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "environment variable MODELAVG_RPC_TIMEOUT_MS=\"", *v,
          "\": expected a positive number of milliseconds"));
    }
    o.rpc_timeout = absl::Milliseconds(ms);
  }
  return o;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ConnectionOptions& options) {
  if (!options.tls) {
    if (!options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
        !options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TLS files given but tls is false: set tls = true");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    MODELAVG_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_ca_file, "tls_ca_file"));
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together: set both (mutual TLS) or neither");
  }
  if (!options.tls_cert_file.empty()) {
    MODELAVG_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(options.tls_cert_file, "tls_cert_file"));
    MODELAVG_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(options.tls_key_file, "tls_key_file"));
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::string> AuthTokenOf(const ConnectionOptions& options) {
  if (options.auth_token_file.empty()) return options.auth_token;
  if (!options.auth_token.empty()) {
    return absl::InvalidArgumentError(
        "auth_token and auth_token_file are both set: pass the token one way");
  }
  absl::StatusOr<std::string> token = ReadTokenFile(options.auth_token_file);
  if (!token.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth_token_file: ", token.status().message()));
  }
  return token;
}

absl::StatusOr<CoordinatorChannel> OpenChannel(const ConnectionOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = ChannelCredentialsFor(options);
  if (!creds.ok()) return creds.status();
  absl::StatusOr<std::string> token = AuthTokenOf(options);
  if (!token.ok()) return token.status();
  return CoordinatorChannel{grpc::CreateChannel(options.coordinator, *creds), *std::move(token)};
}

}  // namespace modelavg::client
