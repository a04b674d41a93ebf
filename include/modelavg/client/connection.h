// How a program reaches the coordinator: its addresses, the bearer token and TLS. One struct for
// every caller: the trainers' ClientOptions (client.h) is one, the RPC client takes one, and the
// programs fill one from their flags and the environment (the same names everywhere:
// --coordinator / $MODELAVG_COORDINATOR, --auth_token_file / $MODELAVG_AUTH_TOKEN_FILE,
// --tls_ca_file / $MODELAVG_TLS_CA_FILE, ...; docs/cpp.md).
#ifndef MODELAVG_CLIENT_CONNECTION_H_
#define MODELAVG_CLIENT_CONNECTION_H_

#include <string>

#include "absl/time/time.h"

namespace modelavg::client {

struct ConnectionOptions {
  // The coordinator's "host:port", or several comma-separated ("a:50051,b:50051"):
  // coordinators of which one leads (etcd, docs/high-availability.md). Calls go to one; when it
  // answers UNAVAILABLE the next calls go to the leader it names, or else to the next address.
  std::string coordinator;
  // Sent as "authorization: Bearer <token>" when non-empty. Never logged.
  std::string auth_token;
  // A file holding the token (surrounding whitespace ignored), read when the connection is
  // made; for auth_token left empty (both set: INVALID_ARGUMENT).
  std::string auth_token_file;
  // TLS to the coordinator. tls_ca_file: PEM roots (empty: the system's); tls_cert_file and
  // tls_key_file: a client certificate for mutual TLS (both or neither).
  bool tls = false;
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  // Deadline of an RPC to the coordinator that does not say otherwise.
  absl::Duration rpc_timeout = absl::Seconds(10);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_CONNECTION_H_
