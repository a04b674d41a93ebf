#include "server/leader_terms.h"

#include <utility>

#include "absl/strings/str_cat.h"

#ifdef MODELAVG_HAVE_ETCD
#include "absl/synchronization/mutex.h"
#include "server/core/job_registry.h"
#include "server/store/etcd/etcd_client.h"
#include "server/store/etcd/etcd_state_store.h"
#include "server/store/etcd/leader_election.h"
#include "spdlog/spdlog.h"
#endif

namespace modelavg::server {

#ifndef MODELAVG_HAVE_ETCD

bool HaveEtcd() { return false; }

absl::StatusOr<std::unique_ptr<LeaderTerms>> LeaderTerms::Create(const LeaderTermsOptions&) {
  return absl::FailedPreconditionError(
      "--etcd_endpoints: this coordinator was built without etcd support. Install "
      "golang-etcd-server-dev golang-github-gogo-protobuf-dev "
      "golang-github-grpc-ecosystem-grpc-gateway-dev (bash deploy/install_deps.sh), configure "
      "again (-DMODELAVG_WITH_ETCD=ON to insist) and rebuild; or use --state_dir");
}

#else

bool HaveEtcd() { return true; }

namespace {

class EtcdLeaderTerms final : public LeaderTerms {
 public:
  EtcdLeaderTerms(std::unique_ptr<EtcdClient> etcd, const LeaderTermsOptions& options)
      : etcd_(std::move(etcd)),
        election_(etcd_.get(),
                  LeaderElectionOptions{absl::StrCat(options.prefix, "leader"),
                                        options.leader_ttl},
                  LeaderElection::Callbacks{
                      [this](int64_t fence) { return Elected(fence); },
                      [this](const std::string& why) { Deposed(why); },
                      [this](const absl::Status& status) {
                        if (hooks_.fatal) hooks_.fatal(status);
                      }}),
        store_(etcd_.get(), &election_, options.prefix) {}
  ~EtcdLeaderTerms() override { Stop(); }

  StateStore* store() override { return &store_; }

  void Start(JobRegistry* registry, const std::string& advertise, Hooks hooks) override {
    {
      absl::MutexLock lock(&mu_);
      registry_ = registry;
      hooks_ = std::move(hooks);
    }
    if (hooks_.set_serving) hooks_.set_serving(false);
    election_.Start(advertise);
  }

  absl::Status CheckServing(std::string* leader) const override {
    return election_.CheckServing(leader);
  }

  void Stop() override { election_.Stop(); }

 private:
  absl::Status Elected(int64_t fence) {
    JobRegistry* registry;
    {
      absl::MutexLock lock(&mu_);
      registry = registry_;
    }
    absl::StatusOr<int> loaded = registry->LoadFromStore(hooks_.recovery_grace);
    if (!loaded.ok()) return loaded.status();
    if (absl::Status s = registry->MergeJobs(hooks_.jobs); !s.ok()) return s;
    spdlog::info("leader term {}: {} job(s) loaded from etcd, {} in the jobs file; incarnation {}",
                 fence, *loaded, hooks_.jobs.size(), registry->incarnation());
    if (hooks_.set_serving) hooks_.set_serving(true);
    return absl::OkStatus();
  }

  void Deposed(const std::string& why) {
    if (hooks_.set_serving) hooks_.set_serving(false);
    JobRegistry* registry;
    {
      absl::MutexLock lock(&mu_);
      registry = registry_;
    }
    if (registry != nullptr) {
      registry->Unload(absl::UnavailableError(absl::StrCat(
          "this coordinator stopped leading (", why,
          "); ask the leader (the UNAVAILABLE answers name it)")));
    }
  }

  const std::unique_ptr<EtcdClient> etcd_;
  LeaderElection election_;
  EtcdStateStore store_;
  absl::Mutex mu_;
  JobRegistry* registry_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Set by Start before the election's thread runs; read only there afterwards.
  Hooks hooks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LeaderTerms>> LeaderTerms::Create(
    const LeaderTermsOptions& options) {
  absl::StatusOr<std::vector<std::string>> endpoints = ParseEtcdEndpoints(options.endpoints);
  if (!endpoints.ok()) return endpoints.status();
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "--etcd_prefix \"", options.prefix, "\" must end with '/' (e.g. /modelavg/)"));
  }
  if (options.leader_ttl < absl::Seconds(1) || options.leader_ttl > absl::Seconds(600)) {
    return absl::InvalidArgumentError("--leader_ttl_ms must be in [1000, 600000]");
  }
  if (!options.user.empty() && options.tls_ca_file.empty()) {
    spdlog::warn("etcd auth without TLS (--etcd_user without --etcd_tls_ca): the password, "
                 "etcd's auth tokens and the jobs' state (communicator ids included) cross the "
                 "network in the clear; give --etcd_tls_ca unless etcd is on this host");
  }
  EtcdOptions etcd;
  etcd.endpoints = *std::move(endpoints);
  etcd.tls_ca_file = options.tls_ca_file;
  etcd.tls_cert_file = options.tls_cert_file;
  etcd.tls_key_file = options.tls_key_file;
  etcd.user = options.user;
  etcd.password = options.password;
  // A call must fail well within the lease: a keep-alive retried after it still keeps it.
  etcd.call_timeout = std::min(absl::Seconds(2), options.leader_ttl / 2);
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(etcd);
  if (!client.ok()) return client.status();
  return std::unique_ptr<LeaderTerms>(new EtcdLeaderTerms(*std::move(client), options));
}

#endif  // MODELAVG_HAVE_ETCD

}  // namespace modelavg::server
