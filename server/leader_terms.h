// A coordinator that keeps its state in etcd and serves only while it leads
// (--etcd_endpoints): owns the etcd client, the election (server/store/etcd/leader_election.h) and the
// fenced state store (server/store/etcd/etcd_state_store.h), and runs the JobRegistry's terms. Each time
// this coordinator wins it loads every job from etcd, as a restarted --state_dir coordinator
// does (the members get the recovery grace to re-attach), merges the jobs file, and serves;
// each time it loses, it stops serving at once, drops every job (pending waits fail with
// UNAVAILABLE) and campaigns again.
//
// Built only with etcd support (cmake/ModelavgEtcd.cmake); without it Create says what to
// install.
#ifndef MODELAVG_SERVER_LEADER_TERMS_H_
#define MODELAVG_SERVER_LEADER_TERMS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

class JobRegistry;
class StateStore;

struct LeaderTermsOptions {
  // "host:port[,host:port...]".
  std::string endpoints;
  // Every key under this prefix; coordinators on the same endpoints and prefix elect one leader.
  std::string prefix = "/modelavg/";
  absl::Duration leader_ttl = absl::Seconds(5);
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  std::string user, password;
};

// True when this build has the etcd store.
bool HaveEtcd();

class LeaderTerms {
 public:
  // Callbacks of Start, on the election's thread.
  struct Hooks {
    // The jobs file's jobs, merged with etcd's at each win.
    std::vector<v1::JobSpec> jobs;
    absl::Duration recovery_grace = absl::Seconds(10);
    // Health: SERVING while leading.
    std::function<void(bool serving)> set_serving;
    // etcd refused this coordinator's options for good before it ever campaigned
    // (LeaderElection::Callbacks::fatal): the election has stopped. Unset: only logged.
    std::function<void(const absl::Status& status)> fatal;
  };

  // INVALID_ARGUMENT for bad options (naming the flag), NOT_FOUND for unreadable TLS files,
  // FAILED_PRECONDITION when this build has no etcd support (naming the packages). Does not
  // connect yet.
  static absl::StatusOr<std::unique_ptr<LeaderTerms>> Create(const LeaderTermsOptions& options);
  virtual ~LeaderTerms() = default;

  // The store to build the registry on (owned here).
  virtual StateStore* store() = 0;
  // Starts campaigning as `advertise`; `registry` (not owned) outlives Stop().
  virtual void Start(JobRegistry* registry, const std::string& advertise, Hooks hooks) = 0;
  // OK while leading; UNAVAILABLE naming the leader (`leader` gets its address if known).
  virtual absl::Status CheckServing(std::string* leader) const = 0;
  // Stops serving, hands the leadership over. Idempotent.
  virtual void Stop() = 0;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_LEADER_TERMS_H_
