// The connection flags every modelavg program that talks to a coordinator takes, one definition
// for all of them (the CLI, modelavg-health, modelavg-rpc, the trace worker, the demo, the
// benchmarks):
//
//   --coordinator=HOST:PORT[,HOST:PORT...]   $MODELAVG_COORDINATOR      (was --address)
//   --auth_token_file=PATH                   $MODELAVG_AUTH_TOKEN_FILE  (was --token_file,
//                                                                        $MODELAVG_TOKEN_FILE)
//   --tls                                    $MODELAVG_TLS
//   --tls_ca_file=PATH                       $MODELAVG_TLS_CA_FILE      (a TLS file implies --tls)
//   --tls_cert_file=PATH --tls_key_file=PATH $MODELAVG_TLS_CERT_FILE, $MODELAVG_TLS_KEY_FILE
//   --rpc_timeout_ms=MS                      $MODELAVG_RPC_TIMEOUT_MS   (was --timeout_ms)
//
// A flag beats its environment variable, which beats the program's default. An old name still
// works and is reported once on stderr, naming the new one. The flags are defined by this
// library alone: link modelavg_client_flags into programs, never into a library (a trainer has
// its own flags).
//
//   int main(int argc, char** argv) {
//     absl::ParseCommandLine(argc, argv);
//     modelavg::client::ConnectionOptions defaults;
//     defaults.coordinator = "127.0.0.1:50051";
//     absl::StatusOr<modelavg::client::ConnectionOptions> conn =
//         modelavg::client::ConnectionFromFlags(defaults);
#ifndef MODELAVG_CLIENT_FLAGS_CONNECTION_FLAGS_H_
#define MODELAVG_CLIENT_FLAGS_CONNECTION_FLAGS_H_

#include "absl/status/statusor.h"
#include "modelavg/client/connection.h"

namespace modelavg::client {

// For usage messages: the connection flags in one line.
inline constexpr char kConnectionFlagsUsage[] =
    "--coordinator=HOST:PORT --auth_token_file=F --tls --tls_ca_file=F --tls_cert_file=F "
    "--tls_key_file=F --rpc_timeout_ms=T";

// `defaults`, then the environment (client/rpc/connection.h), then the flags given. Call after
// absl::ParseCommandLine. INVALID_ARGUMENT naming the flag or variable for a bad value.
absl::StatusOr<ConnectionOptions> ConnectionFromFlags(const ConnectionOptions& defaults = {});

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_FLAGS_CONNECTION_FLAGS_H_
