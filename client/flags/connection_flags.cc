#include "client/flags/connection_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/rpc/connection.h"

ABSL_FLAG(std::string, coordinator, "",
          "the coordinator's HOST:PORT, or several comma-separated (coordinators on etcd: calls "
          "fail over to the leader); default: $MODELAVG_COORDINATOR, else the program's");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding the coordinator's bearer token, sent as \"authorization: Bearer "
          "<token>\"; default: $MODELAVG_AUTH_TOKEN_FILE");
ABSL_FLAG(bool, tls, false,
          "TLS to the coordinator (implied by any of the --tls_*_file flags); default: "
          "$MODELAVG_TLS");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM file of the CA that signed the coordinator's certificate (empty with --tls: the "
          "system's roots); default: $MODELAVG_TLS_CA_FILE");
ABSL_FLAG(std::string, tls_cert_file, "",
          "mutual TLS: this client's certificate (PEM, with --tls_key_file); default: "
          "$MODELAVG_TLS_CERT_FILE");
ABSL_FLAG(std::string, tls_key_file, "",
          "mutual TLS: this client's private key (PEM); default: $MODELAVG_TLS_KEY_FILE");
ABSL_FLAG(int64_t, rpc_timeout_ms, 0,
          "deadline of each call to the coordinator, milliseconds; 0: $MODELAVG_RPC_TIMEOUT_MS, "
          "else the program's default");
// The old names (deprecated; each says which flag replaces it).
ABSL_FLAG(std::string, address, "", "deprecated: use --coordinator");
ABSL_FLAG(std::string, token_file, "", "deprecated: use --auth_token_file");
ABSL_FLAG(int64_t, timeout_ms, 0, "deprecated: use --rpc_timeout_ms");

namespace modelavg::client {
namespace {

// The flag's value, or the deprecated one's (reported) when only that is given.
std::string NewOrOld(const absl::Flag<std::string>& flag, const absl::Flag<std::string>& old,
                     const char* name, const char* old_name) {
  const std::string old_value = absl::GetFlag(old);
  if (!old_value.empty()) WarnDeprecatedName(old_name, name);
  const std::string value = absl::GetFlag(flag);
  return value.empty() ? old_value : value;
}

}  // namespace

absl::StatusOr<ConnectionOptions> ConnectionFromFlags(const ConnectionOptions& defaults) {
  absl::StatusOr<ConnectionOptions> env = ConnectionFromEnvironment(defaults);
  if (!env.ok()) return env.status();
  ConnectionOptions o = *std::move(env);
  if (std::string v = NewOrOld(FLAGS_coordinator, FLAGS_address, "--coordinator", "--address");
      !v.empty()) {
    o.coordinator = v;
  }
  if (std::string v =
          NewOrOld(FLAGS_auth_token_file, FLAGS_token_file, "--auth_token_file", "--token_file");
      !v.empty()) {
    o.auth_token_file = v;
    o.auth_token.clear();
  }
  if (absl::GetFlag(FLAGS_tls)) o.tls = true;
  if (std::string v = absl::GetFlag(FLAGS_tls_ca_file); !v.empty()) o.tls_ca_file = v;
  if (std::string v = absl::GetFlag(FLAGS_tls_cert_file); !v.empty()) o.tls_cert_file = v;
  if (std::string v = absl::GetFlag(FLAGS_tls_key_file); !v.empty()) o.tls_key_file = v;
  if (!o.tls_ca_file.empty() || !o.tls_cert_file.empty() || !o.tls_key_file.empty()) o.tls = true;
  const int64_t old_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (old_ms != 0) WarnDeprecatedName("--timeout_ms", "--rpc_timeout_ms");
  const int64_t ms = absl::GetFlag(FLAGS_rpc_timeout_ms) != 0 ? absl::GetFlag(FLAGS_rpc_timeout_ms)
                                                              : old_ms;
  if (ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rpc_timeout_ms=", ms, ": expected a positive number of milliseconds (0: the default)"));
  }
  if (ms > 0) o.rpc_timeout = absl::Milliseconds(ms);
  return o;
}

}  // namespace modelavg::client
