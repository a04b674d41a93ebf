#include "server/store/etcd/etcd_client.h"

#include <chrono>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace modelavg::server {
namespace {

// etcd answers a whole job store in one Range; gRPC's default 4 MiB would cut a large one off.
constexpr int kMaxReceiveBytes = 256 * 1024 * 1024;

absl::StatusCode CodeOf(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return absl::StatusCode::kUnavailable;
    case grpc::StatusCode::UNAUTHENTICATED:
      return absl::StatusCode::kUnauthenticated;
    case grpc::StatusCode::PERMISSION_DENIED:
      return absl::StatusCode::kPermissionDenied;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return absl::StatusCode::kInvalidArgument;
    case grpc::StatusCode::NOT_FOUND:
      return absl::StatusCode::kNotFound;
    default:
      return absl::StatusCode::kFailedPrecondition;
  }
}

bool Unreachable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& list) {
  std::vector<std::string> endpoints;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    absl::ConsumePrefix(&entry, "http://") || absl::ConsumePrefix(&entry, "https://");
    const size_t colon = entry.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint \"", entry, "\" must be HOST:PORT (e.g. 127.0.0.1:2379)"));
    }
    endpoints.emplace_back(entry);
  }
  if (endpoints.empty()) {
    return absl::InvalidArgumentError(
        "no etcd endpoint given: --etcd_endpoints=HOST:PORT[,HOST:PORT...]");
  }
  return endpoints;
}

EtcdProblem ClassifyEtcdError(const absl::Status& status) {
  if (status.ok()) return EtcdProblem::kNone;
  const std::string text = absl::AsciiStrToLower(status.message());
  switch (status.code()) {
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return EtcdProblem::kAuth;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
      // etcd's ErrGRPCUserEmpty, ErrGRPCAuthFailed, ErrGRPCAuthNotEnabled.
      if (absl::StrContains(text, "user name is empty") ||
          absl::StrContains(text, "authentication failed") ||
          absl::StrContains(text, "authentication is not enabled")) {
        return EtcdProblem::kAuth;
      }
      return EtcdProblem::kOther;
    case absl::StatusCode::kUnavailable:
      // gRPC's words for a connection that fails after TCP: the handshake (a certificate
      // not trusted either way, TLS against plaintext), or the peer closing it unanswered.
      if (absl::StrContains(text, "handshake") || absl::StrContains(text, "certificate") ||
          absl::StrContains(text, "ssl")) {
        return EtcdProblem::kTls;
      }
      if (absl::StrContains(text, "socket closed") ||
          absl::StrContains(text, "endpoint read failed") ||
          absl::StrContains(text, "connection reset")) {
        return EtcdProblem::kClosesConnections;
      }
      return EtcdProblem::kUnreachable;
    default:
      return EtcdProblem::kOther;
  }
}

std::string EtcdPrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(const EtcdOptions& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("no etcd endpoint given");
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "an etcd client certificate needs both --etcd_tls_cert and --etcd_tls_key");
  }
  if (!options.tls_cert_file.empty() && options.tls_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--etcd_tls_cert needs --etcd_tls_ca (the CA that signed the etcd members' certificates)");
  }
  if (options.user.empty() != options.password.empty()) {
    return absl::InvalidArgumentError("etcd auth needs both a user and a password");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    absl::StatusOr<std::string> ca = ReadFileToString(options.tls_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    if (!options.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFileToString(options.tls_cert_file);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFileToString(options.tls_key_file);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    creds = grpc::SslCredentials(ssl);
  }
  std::unique_ptr<EtcdClient> client(new EtcdClient(options));
  for (const std::string& address : options.endpoints) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
    // A member that comes back is used again within about a second (gRPC's default backoff
    // grows to two minutes).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // Each endpoint its own connection, even to one host.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    Endpoint e;
    e.address = address;
    e.channel = grpc::CreateCustomChannel(address, creds, args);
    e.kv = etcdserverpb::KV::NewStub(e.channel);
    e.lease = etcdserverpb::Lease::NewStub(e.channel);
    e.auth = etcdserverpb::Auth::NewStub(e.channel);
    client->endpoints_.push_back(std::move(e));
  }
  return client;
}

std::string EtcdClient::Describe() const {
  return absl::StrCat("etcd at ", absl::StrJoin(options_.endpoints, ","));
}

absl::StatusOr<std::string> EtcdClient::Token(Endpoint& endpoint, absl::Duration timeout) {
  if (options_.user.empty()) return std::string();
  {
    absl::MutexLock lock(&token_mu_);
    if (!token_.empty()) return token_;
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(timeout));
  etcdserverpb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(options_.password);
  etcdserverpb::AuthenticateResponse response;
  const grpc::Status s = endpoint.auth->Authenticate(&context, request, &response);
  if (!s.ok()) {
    return absl::Status(CodeOf(s), absl::StrCat("etcd at ", endpoint.address,
                                                ": authenticating as ", options_.user, ": ",
                                                s.error_message()));
  }
  absl::MutexLock lock(&token_mu_);
  token_ = response.token();
  return token_;
}

absl::Status EtcdClient::Invoke(const char* what, absl::Duration timeout, bool failover,
                                const Attempt& attempt) {
  const size_t n = endpoints_.size();
  const size_t first = current_.load(std::memory_order_relaxed) % n;
  absl::Status last;
  bool reauthenticated = false;
  for (size_t i = 0; i < n; ++i) {
    Endpoint& endpoint = endpoints_[(first + i) % n];
    absl::StatusOr<std::string> token = Token(endpoint, timeout);
    grpc::Status s;
    if (token.ok()) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(timeout));
      if (!token->empty()) context.AddMetadata("token", *token);
      s = attempt(endpoint, &context);
      if (s.ok()) return absl::OkStatus();
      if (!token->empty() && !reauthenticated &&
          s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
        // Simple tokens expire (etcd's --auth-token-ttl; etcd answers UNAUTHENTICATED): fetch a
        // new one and try again here, once (a refused user or password fails the fetch itself).
        {
          absl::MutexLock lock(&token_mu_);
          token_.clear();
        }
        reauthenticated = true;
        --i;
        continue;
      }
      last = absl::Status(CodeOf(s), absl::StrCat("etcd at ", endpoint.address, ": ", what, ": ",
                                                  s.error_message()));
    } else {
      last = token.status();
    }
    if (!token.ok() ? token.status().code() != absl::StatusCode::kUnavailable : !Unreachable(s)) {
      return last;  // etcd answered: another member would say the same
    }
    // The next call starts at the next member.
    current_.store((first + i + 1) % n, std::memory_order_relaxed);
    if (!failover) return last;
  }
  return last;
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(
    const etcdserverpb::RangeRequest& request) {
  etcdserverpb::RangeResponse response;
  absl::Status s = Invoke("Range", options_.call_timeout, /*failover=*/true,
                          [&](Endpoint& e, grpc::ClientContext* ctx) {
                            return e.kv->Range(ctx, request, &response);
                          });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status s = Invoke("Txn", options_.call_timeout, /*failover=*/false,
                          [&](Endpoint& e, grpc::ClientContext* ctx) {
                            return e.kv->Txn(ctx, request, &response);
                          });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::LeaseGrantResponse> EtcdClient::LeaseGrant(int64_t ttl_seconds) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse response;
  absl::Status s = Invoke("LeaseGrant", options_.call_timeout, /*failover=*/true,
                          [&](Endpoint& e, grpc::ClientContext* ctx) {
                            return e.lease->LeaseGrant(ctx, request, &response);
                          });
  if (!s.ok()) return s;
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", response.error()));
  }
  return response;
}

absl::StatusOr<etcdserverpb::LeaseKeepAliveResponse> EtcdClient::LeaseKeepAlive(
    int64_t id, absl::Duration timeout) {
  etcdserverpb::LeaseKeepAliveResponse response;
  absl::Status s = Invoke(
      "LeaseKeepAlive", timeout, /*failover=*/true, [&](Endpoint& e, grpc::ClientContext* ctx) {
        // One request and one reply on a stream of its own: the context's deadline bounds both.
        std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::LeaseKeepAliveRequest,
                                                 etcdserverpb::LeaseKeepAliveResponse>>
            stream = e.lease->LeaseKeepAlive(ctx);
        etcdserverpb::LeaseKeepAliveRequest request;
        request.set_id(id);
        if (stream->Write(request) && stream->Read(&response)) {
          stream->WritesDone();
          ctx->TryCancel();
          stream->Finish();
          return grpc::Status::OK;
        }
        stream->WritesDone();
        grpc::Status status = stream->Finish();
        if (status.ok()) {
          status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream ended early");
        }
        return status;
      });
  if (!s.ok()) return s;
  return response;
}

absl::Status EtcdClient::LeaseRevoke(int64_t id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(id);
  etcdserverpb::LeaseRevokeResponse response;
  return Invoke("LeaseRevoke", options_.call_timeout, /*failover=*/true,
                [&](Endpoint& e, grpc::ClientContext* ctx) {
                  return e.lease->LeaseRevoke(ctx, request, &response);
                });
}

}  // namespace modelavg::server
