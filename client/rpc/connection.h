// A ConnectionOptions (modelavg/client/connection.h) from the environment, and what a gRPC
// channel to the coordinator needs from one: its credentials and its token. The programs' flags
// (client/flags/connection_flags.h) and the Python package read the environment through here,
// so that every one of them speaks the same names:
//
//   MODELAVG_COORDINATOR       coordinator        "host:port[,host:port...]"
//   MODELAVG_AUTH_TOKEN_FILE   auth_token_file    (was MODELAVG_TOKEN_FILE; MODELAVG_AUTH_TOKEN
//                                                  held the token itself)
//   MODELAVG_TLS               tls                1/true/yes or 0/false/no
//   MODELAVG_TLS_CA_FILE       tls_ca_file        (any TLS file implies tls)
//   MODELAVG_TLS_CERT_FILE     tls_cert_file
//   MODELAVG_TLS_KEY_FILE      tls_key_file
//   MODELAVG_RPC_TIMEOUT_MS    rpc_timeout        milliseconds, > 0
//
// An old name still works and is reported once per process on stderr, naming the new one.
#ifndef MODELAVG_CLIENT_RPC_CONNECTION_H_
#define MODELAVG_CLIENT_RPC_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "modelavg/client/connection.h"

namespace modelavg::client {

// `defaults` with what the environment sets over it. INVALID_ARGUMENT naming the variable for a
// value that does not parse (MODELAVG_TLS, MODELAVG_RPC_TIMEOUT_MS).
absl::StatusOr<ConnectionOptions> ConnectionFromEnvironment(const ConnectionOptions& defaults);

// The channel credentials `options` asks for: plaintext, TLS, or mutual TLS. INVALID_ARGUMENT for
// an unreadable TLS file, one of tls_cert_file / tls_key_file without the other, or TLS files
// without tls.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ConnectionOptions& options);

// The bearer token: auth_token, or the contents of auth_token_file (whitespace stripped); empty
// for none. INVALID_ARGUMENT when both are set, or for an unreadable or empty file.
absl::StatusOr<std::string> AuthTokenOf(const ConnectionOptions& options);

// What a program that makes its own calls needs (the CLI, modelavg-rpc, modelavg-health): a
// channel to options.coordinator (one address) with ChannelCredentialsFor's credentials, and
// AuthTokenOf's token ("" for none), to send as "authorization: Bearer <token>".
struct CoordinatorChannel {
  std::shared_ptr<grpc::Channel> channel;
  std::string token;
};
absl::StatusOr<CoordinatorChannel> OpenChannel(const ConnectionOptions& options);

// Writes once per process, per `old_name`, that it is deprecated and `new_name` replaces it
// (stderr, so that a program's output stays clean).
void WarnDeprecatedName(absl::string_view old_name, absl::string_view new_name);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_RPC_CONNECTION_H_
