// A small client of etcd's v3 gRPC API (the stubs generated from the .proto files Debian ships,
// cmake/ModelavgEtcd.cmake): one channel per endpoint, TLS and user/password auth, a deadline on
// every call, and gRPC errors turned into absl::Status naming the endpoint. No logic of its own
// beyond choosing an endpoint: a read or a lease call that finds its endpoint unreachable tries
// the next one; a write (Txn) is sent once, to one endpoint, since an error after sending leaves
// open whether it was applied (the caller decides; server/store/etcd/leader_election.h steps down).
#ifndef MODELAVG_SERVER_STORE_ETCD_ETCD_CLIENT_H_
#define MODELAVG_SERVER_STORE_ETCD_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"

namespace modelavg::server {

struct EtcdOptions {
  // "host:port" of each member (etcd's client URLs without the scheme).
  std::vector<std::string> endpoints;
  // TLS to etcd: the CA that signed the members' certificates (empty: plaintext), and a client
  // certificate and key when the members require one.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // etcd's own authentication (etcdctl auth enable); empty: none.
  std::string user;
  std::string password;
  // Deadline of one call that does not say otherwise.
  absl::Duration call_timeout = absl::Seconds(2);
};

// Parses "host:port[,host:port...]" (also accepting an http:// or https:// scheme on each).
// INVALID_ARGUMENT naming the bad entry.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& list);

// What a failed etcd call says about this coordinator's etcd options.
enum class EtcdProblem {
  kNone,               // OK
  kUnreachable,        // refused, unresolvable, timed out, no quorum: etcd may come (back)
  kClosesConnections,  // the TCP connection is made but closed before any answer: typically a
                       // plaintext client on a TLS port, or no client certificate where etcd
                       // requires one (--client-cert-auth)
  kTls,                // the TLS handshake failed (certificate verification, protocol)
  kAuth,               // etcd's authentication or authorization refused the call
  kOther,              // any other answer of etcd's
};
EtcdProblem ClassifyEtcdError(const absl::Status& status);

// The end of the key range that holds every key starting with `prefix` (etcd's range_end).
std::string EtcdPrefixEnd(const std::string& prefix);

// Thread-safe.
class EtcdClient {
 public:
  // INVALID_ARGUMENT for no endpoints, NOT_FOUND for unreadable TLS files. Does not connect.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(const EtcdOptions& options);

  // Each returns etcd's reply or UNAVAILABLE (unreachable, no quorum, past the deadline: the
  // message names the endpoint and etcd's words), UNAUTHENTICATED / PERMISSION_DENIED (etcd's
  // auth), INVALID_ARGUMENT / FAILED_PRECONDITION (etcd rejected the request).
  absl::StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& request);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> LeaseGrant(int64_t ttl_seconds);
  // One keep-alive of lease `id`, within `timeout`. The reply's TTL is 0 when the lease is gone.
  absl::StatusOr<etcdserverpb::LeaseKeepAliveResponse> LeaseKeepAlive(int64_t id,
                                                                      absl::Duration timeout);
  absl::Status LeaseRevoke(int64_t id);

  // "etcd at host:port,host:port".
  std::string Describe() const;
  const EtcdOptions& options() const { return options_; }

 private:
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Auth::Stub> auth;
  };
  using Attempt = std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>;

  explicit EtcdClient(EtcdOptions options) : options_(std::move(options)) {}
  // Runs `attempt` against the current endpoint and, when `failover` and that endpoint is
  // unreachable, against the others in turn, each with `timeout`. `what` names the call.
  absl::Status Invoke(const char* what, absl::Duration timeout, bool failover,
                      const Attempt& attempt);
  // The auth token for calls (empty without auth), fetched with Authenticate when missing.
  absl::StatusOr<std::string> Token(Endpoint& endpoint, absl::Duration timeout);

  const EtcdOptions options_;
  std::vector<Endpoint> endpoints_;
  // Where the next call starts: moves on when an endpoint fails.
  std::atomic<size_t> current_{0};
  absl::Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_ETCD_ETCD_CLIENT_H_
