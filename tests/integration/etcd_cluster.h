// An etcd cluster on loopback for tests: N etcd-server members, each with its own data dir under
// a test folder and its own free client and peer ports, killed and restarted one by one.
// Binary: $MODELAVG_ETCD_BIN, else /usr/bin/etcd (Debian's etcd-server).
#ifndef MODELAVG_TESTS_INTEGRATION_ETCD_CLUSTER_H_
#define MODELAVG_TESTS_INTEGRATION_ETCD_CLUSTER_H_

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/store/etcd/etcd_client.h"
#include "tests/integration/client_test_processes.h"

namespace modelavg::testing {

// The etcd binary, or "" when there is none.
inline std::string EtcdBinary() {
  const char* env = std::getenv("MODELAVG_ETCD_BIN");
  const std::string path = env != nullptr && *env != '\0' ? env : "/usr/bin/etcd";
  return access(path.c_str(), X_OK) == 0 ? path : "";
}

// True when the tests must not skip for want of etcd (CI).
inline bool EtcdRequired() {
  const char* env = std::getenv("MODELAVG_REQUIRE_ETCD");
  return env != nullptr && std::string(env) == "1";
}

// A port nobody listens on now (bound and released: another process could take it, rarely).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// TLS on the members' client port (empty cert_file: plaintext). The peers stay plaintext.
struct EtcdClientTls {
  std::string ca_file;    // --trusted-ca-file: the CA of the client certificates
  std::string cert_file;  // --cert-file / --key-file: the members' certificate
  std::string key_file;
  bool client_cert_auth = false;  // --client-cert-auth: clients need a certificate
  // What the cluster's own health check presents (with client_cert_auth).
  std::string client_cert_file, client_key_file;
};

class EtcdCluster {
 public:
  EtcdCluster(std::string dir, int members, EtcdClientTls tls = {})
      : dir_(std::move(dir)), tls_(std::move(tls)) {
    static int clusters = 0;
    token_ = absl::StrCat("modelavg-test-", getpid(), "-", clusters++);
    for (int i = 0; i < members; ++i) {
      client_ports_.push_back(FreePort());
      peer_ports_.push_back(FreePort());
    }
    processes_.resize(members);
  }
  ~EtcdCluster() { processes_.clear(); }

  int size() const { return static_cast<int>(processes_.size()); }
  std::string endpoint(int i) const { return absl::StrCat("127.0.0.1:", client_ports_[i]); }
  std::string endpoints() const {
    std::vector<std::string> all;
    for (int i = 0; i < size(); ++i) all.push_back(endpoint(i));
    return absl::StrJoin(all, ",");
  }

  // Starts every member and waits until the cluster answers a linearizable read.
  bool Start(absl::Duration timeout = absl::Seconds(60)) {
    for (int i = 0; i < size(); ++i) StartMember(i);
    return WaitHealthy(timeout);
  }
  void StartMember(int i) {
    std::vector<std::string> peers;
    for (int j = 0; j < size(); ++j) {
      peers.push_back(absl::StrCat("m", j, "=http://127.0.0.1:", peer_ports_[j]));
    }
    const std::string client =
        absl::StrCat(tls_.cert_file.empty() ? "http://" : "https://", endpoint(i));
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
    std::filesystem::create_directories(dir_);
    std::vector<std::string> argv = {
        EtcdBinary(), absl::StrCat("--name=m", i),
        absl::StrCat("--data-dir=", dir_, "/m", i, ".data"),
        "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
        "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
        "--initial-cluster=" + absl::StrJoin(peers, ","), "--initial-cluster-state=new",
        "--initial-cluster-token=" + token_, "--heartbeat-interval=100",
        "--election-timeout=1000", "--logger=zap", "--log-level=warn"};
    if (!tls_.cert_file.empty()) {
      argv.push_back("--cert-file=" + tls_.cert_file);
      argv.push_back("--key-file=" + tls_.key_file);
      argv.push_back("--trusted-ca-file=" + tls_.ca_file);
      if (tls_.client_cert_auth) argv.push_back("--client-cert-auth");
    }
    processes_[i] = std::make_unique<Process>(argv, absl::StrCat(dir_, "/m", i, "-", starts_++));
  }
  void Kill(int i) {
    if (processes_[i] == nullptr) return;
    processes_[i]->Signal(SIGKILL);
    processes_[i]->Wait(absl::Seconds(10));
    processes_[i].reset();
  }

  // A linearizable read through every endpoint succeeds (a quorum is up).
  bool WaitHealthy(absl::Duration timeout) {
    server::EtcdOptions options;
    options.endpoints = {endpoint(0)};
    for (int i = 1; i < size(); ++i) options.endpoints.push_back(endpoint(i));
    options.call_timeout = absl::Seconds(1);
    if (!tls_.cert_file.empty()) {
      options.tls_ca_file = tls_.ca_file;
      options.tls_cert_file = tls_.client_cert_file;
      options.tls_key_file = tls_.client_key_file;
    }
    auto client = server::EtcdClient::Create(options);
    if (!client.ok()) return false;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      etcdserverpb::RangeRequest range;
      range.set_key("modelavg-test-health");
      auto reply = (*client)->Range(range);
      if (reply.ok()) return true;
      last_error_ = std::string(reply.status().message());
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }

  std::string Logs() const {
    std::string all = absl::StrCat("last error: ", last_error_, "\n");
    for (int i = 0; i < size(); ++i) {
      if (processes_[i] != nullptr) absl::StrAppend(&all, "etcd m", i, ":\n", processes_[i]->err());
    }
    return all;
  }

 private:
  std::string dir_;
  EtcdClientTls tls_;
  std::string token_;
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::unique_ptr<Process>> processes_;
  int starts_ = 0;
  std::string last_error_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_ETCD_CLUSTER_H_
