#include "server/store/etcd/leader_election.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

using Steady = std::chrono::steady_clock;

Steady::duration ToSteady(absl::Duration d) {
  return std::chrono::duration_cast<Steady::duration>(absl::ToChronoNanoseconds(d));
}

}  // namespace

LeaderElection::LeaderElection(EtcdClient* etcd, LeaderElectionOptions options,
                               Callbacks callbacks)
    : etcd_(etcd),
      options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      ttl_seconds_(std::max<int64_t>(
          2, (absl::ToInt64Milliseconds(options_.ttl) + 999) / 1000)) {
  absl::MutexLock lock(&mu_);
  not_serving_why_ = "this coordinator has not started campaigning yet";
}

LeaderElection::~LeaderElection() { Stop(); }

void LeaderElection::Start(const std::string& advertise) {
  absl::MutexLock lock(&mu_);
  if (started_ || stop_) return;
  started_ = true;
  advertise_ = advertise;
  not_serving_why_ = absl::StrCat("this coordinator (", advertise_,
                                  ") has not reached etcd yet (", etcd_->Describe(), ")");
  thread_ = std::thread([this] { Run(); });
}

std::string LeaderElection::Describe() const {
  return absl::StrCat(etcd_->Describe(), ", key ", options_.key);
}

absl::Status LeaderElection::CheckServing(std::string* leader) const {
  absl::ReaderMutexLock lock(&mu_);
  if (leader != nullptr) *leader = leader_ == advertise_ ? "" : leader_;
  if (fence_ != 0 && serving_ && lost_.empty() && Steady::now() < lease_alive_until_) {
    return absl::OkStatus();
  }
  if (fence_ != 0 && !serving_ && lost_.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "this coordinator (", advertise_,
        ") is taking over as the leader and loading the jobs from etcd; retry in a moment"));
  }
  if (!leader_.empty() && leader_ != advertise_) {
    return absl::UnavailableError(absl::StrCat("this coordinator (", advertise_,
                                               ") is a standby; the leader is at ", leader_,
                                               " (", Describe(), ")"));
  }
  return absl::UnavailableError(not_serving_why_);
}

int64_t LeaderElection::fence() const {
  absl::ReaderMutexLock lock(&mu_);
  return fence_;
}

void LeaderElection::LostLeadership(int64_t fence, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (fence_ == 0 || fence_ != fence || !lost_.empty()) return;
  lost_ = why;
}

bool LeaderElection::KeepAlive() {
  int64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (lease_id_ != 0 && Steady::now() < next_keepalive_) return true;
    id = lease_id_;
  }
  const absl::Duration ttl = absl::Seconds(ttl_seconds_);
  const Steady::time_point sent = Steady::now();
  // Etcd's expiry is at least its receive time + TTL; ours is measured from the send, less a
  // margin for clock rate differences.
  const Steady::time_point alive_until =
      sent + ToSteady(ttl - std::min(absl::Milliseconds(200), ttl / 10));
  const Steady::time_point next = sent + ToSteady(ttl / 3);
  if (id == 0) {
    absl::StatusOr<etcdserverpb::LeaseGrantResponse> grant = etcd_->LeaseGrant(ttl_seconds_);
    absl::MutexLock lock(&mu_);
    etcd_error_ = grant.status();
    if (!grant.ok()) {
      not_serving_why_ = absl::StrCat("this coordinator (", advertise_,
                                      ") cannot reach etcd: ", grant.status().message(),
                                      "; not serving until it can");
      next_keepalive_ = Steady::now() + std::chrono::milliseconds(200);
      return false;
    }
    lease_id_ = grant->id();
    lease_alive_until_ = alive_until;
    next_keepalive_ = next;
    spdlog::debug("etcd lease {:x} granted ({} s)", lease_id_, grant->ttl());
    return true;
  }
  absl::StatusOr<etcdserverpb::LeaseKeepAliveResponse> reply =
      etcd_->LeaseKeepAlive(id, std::min(ttl / 3, etcd_->options().call_timeout));
  absl::MutexLock lock(&mu_);
  etcd_error_ = reply.status();
  if (!reply.ok()) {
    not_serving_why_ = absl::StrCat("this coordinator (", advertise_,
                                    ") cannot keep its etcd lease alive: ",
                                    reply.status().message(), "; not serving until it can");
    next_keepalive_ = Steady::now() + std::chrono::milliseconds(100);
    return false;
  }
  if (reply->ttl() <= 0) {
    spdlog::warn("etcd lease {:x} has expired", id);
    lease_id_ = 0;
    if (fence_ != 0 && lost_.empty()) {
      lost_ = "its etcd lease expired (another coordinator may lead now)";
    }
    return false;
  }
  lease_alive_until_ = alive_until;
  next_keepalive_ = next;
  return true;
}

bool LeaderElection::Campaign() {
  int64_t lease;
  std::string advertise;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_id_;
    advertise = advertise_;
  }
  if (lease == 0) return false;
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* absent = txn.add_compare();
  absent->set_key(options_.key);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(options_.key);
  put->set_value(advertise);
  put->set_lease(lease);
  txn.add_failure()->mutable_request_range()->set_key(options_.key);
  absl::StatusOr<etcdserverpb::TxnResponse> reply = etcd_->Txn(txn);
  absl::MutexLock lock(&mu_);
  etcd_error_ = reply.status();
  if (!reply.ok()) {
    not_serving_why_ = absl::StrCat("this coordinator (", advertise_,
                                    ") cannot campaign for leadership in etcd: ",
                                    reply.status().message(), "; not serving until it can");
    return false;
  }
  campaign_answered_ = true;
  if (reply->succeeded()) {
    fence_ = reply->header().revision();
    leader_ = advertise_;
    return true;
  }
  if (reply->responses_size() == 1 && reply->responses(0).response_range().kvs_size() == 1) {
    const mvccpb::KeyValue& kv = reply->responses(0).response_range().kvs(0);
    if (kv.lease() == lease) {
      // Still ours from a term this coordinator stepped down from (its lease never expired):
      // nobody else can have written since.
      fence_ = kv.create_revision();
      leader_ = advertise_;
      return true;
    }
    if (leader_ != kv.value()) {
      spdlog::info("the leader is {} ({})", kv.value(), Describe());
    }
    leader_ = kv.value();
  }
  return false;
}

void LeaderElection::StepDown(const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    if (fence_ == 0) return;
    spdlog::warn("this coordinator ({}) stops leading: {}", advertise_, why);
    fence_ = 0;
    serving_ = false;
    lost_.clear();
    leader_.clear();
    not_serving_why_ = absl::StrCat("this coordinator (", advertise_,
                                    ") stopped leading (", why, ") and is campaigning again");
  }
  callbacks_.deposed(why);
}

absl::Status LeaderElection::ReviewEtcdError() {
  absl::Status error;
  bool answered;
  {
    absl::MutexLock lock(&mu_);
    error = etcd_error_;
    answered = campaign_answered_;
  }
  const Steady::time_point now = Steady::now();
  const EtcdProblem problem = ClassifyEtcdError(error);
  if (problem != EtcdProblem::kClosesConnections) closing_since_ = {};
  if (error.ok()) {
    if (!logged_.empty()) spdlog::info("etcd answers again ({})", Describe());
    logged_.clear();
    return absl::OkStatus();
  }
  if (problem == EtcdProblem::kClosesConnections && closing_since_ == Steady::time_point{}) {
    closing_since_ = now;
  }
  const std::string text(error.message());
  if (text != logged_ || now - logged_at_ > std::chrono::seconds(10)) {
    spdlog::warn("etcd: {}", text);
    logged_ = text;
    logged_at_ = now;
  }
  if (answered) return absl::OkStatus();
  switch (problem) {
    case EtcdProblem::kAuth:
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd refused this coordinator's credentials: ", text,
          ". With etcd's auth enabled, pass --etcd_user and --etcd_password_file of a user "
          "whose role may read and write the keys under the prefix (--etcd_prefix)"));
    case EtcdProblem::kTls:
      return absl::FailedPreconditionError(absl::StrCat(
          "the TLS connection to etcd failed: ", text,
          ". --etcd_tls_ca must be the CA that signed the members' certificates (whose names "
          "must include the endpoint's host), and --etcd_tls_cert/--etcd_tls_key a client "
          "certificate that the members' --trusted-ca-file trusts; against plaintext members "
          "(http:// client URLs) pass no --etcd_tls_* flag"));
    case EtcdProblem::kClosesConnections:
      if (now - closing_since_ >= ToSteady(kFatalAfter)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "etcd closed every connection of this coordinator unanswered for ",
            absl::FormatDuration(kFatalAfter), " (", text,
            "): a TLS mismatch. Members with https:// client URLs need --etcd_tls_ca, and "
            "--etcd_tls_cert/--etcd_tls_key where they require client certificates "
            "(--client-cert-auth)"));
      }
      return absl::OkStatus();
    default:
      return absl::OkStatus();
  }
}

void LeaderElection::Run() {
  const absl::Duration tick =
      std::clamp(absl::Seconds(ttl_seconds_) / 10, absl::Milliseconds(50), absl::Milliseconds(250));
  std::string advertise;
  {
    absl::MutexLock lock(&mu_);
    advertise = advertise_;
  }
  spdlog::info("campaigning for leadership ({}, lease TTL {} s, advertising {})", Describe(),
               ttl_seconds_, advertise);
  absl::Status fatal;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
    }
    const bool lease_ok = KeepAlive();
    if (fatal = ReviewEtcdError(); !fatal.ok()) break;
    std::string why;
    int64_t fence = 0;
    {
      absl::MutexLock lock(&mu_);
      fence = fence_;
      if (fence_ != 0) {
        if (!lost_.empty()) {
          why = lost_;
        } else if (Steady::now() >= lease_alive_until_) {
          why = "no etcd keep-alive was acknowledged within the lease's TTL (etcd unreachable or "
                "without quorum, or this process was paused)";
        }
      }
    }
    if (!why.empty()) {
      StepDown(why);
      continue;
    }
    if (fence == 0 && lease_ok) {
      const bool won = Campaign();
      if (fatal = ReviewEtcdError(); !fatal.ok()) break;
      if (won) {
        fence = this->fence();
        spdlog::info("this coordinator ({}) won the election (fence revision {}); loading the "
                     "jobs", advertise, fence);
        absl::Status s = callbacks_.elected(fence);
        bool serving = false;
        {
          absl::MutexLock lock(&mu_);
          if (s.ok() && fence_ == fence && lost_.empty()) serving = serving_ = true;
        }
        if (serving) {
          spdlog::info("this coordinator ({}) leads and serves", advertise);
        } else {
          StepDown(s.ok() ? "the term ended while loading"
                          : absl::StrCat("loading failed: ", s.message()));
        }
        continue;
      }
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stop_), tick);
  }
  if (!fatal.ok()) {
    // Never led (no campaign was ever answered): nothing to step down from.
    spdlog::error("{}", std::string(fatal.message()));
    {
      absl::MutexLock lock(&mu_);
      not_serving_why_ = absl::StrCat("this coordinator (", advertise, ") cannot use etcd: ",
                                      fatal.message());
    }
    if (callbacks_.fatal) callbacks_.fatal(fatal);
  }
}

void LeaderElection::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  const int64_t fence = this->fence();
  StepDown("the coordinator is shutting down");
  int64_t lease;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_id_;
    lease_id_ = 0;
  }
  if (fence != 0) {
    // Hand over at once: a standby need not wait for the lease to run out.
    etcdserverpb::TxnRequest txn;
    etcdserverpb::Compare* ours = txn.add_compare();
    ours->set_key(options_.key);
    ours->set_target(etcdserverpb::Compare::CREATE);
    ours->set_result(etcdserverpb::Compare::EQUAL);
    ours->set_create_revision(fence);
    txn.add_success()->mutable_request_delete_range()->set_key(options_.key);
    if (absl::StatusOr<etcdserverpb::TxnResponse> r = etcd_->Txn(txn); !r.ok()) {
      spdlog::warn("could not hand the leadership over: {}", r.status().ToString());
    }
  }
  if (lease != 0) {
    if (absl::Status s = etcd_->LeaseRevoke(lease); !s.ok()) {
      spdlog::debug("could not revoke the etcd lease: {}", s.ToString());
    }
  }
}

}  // namespace modelavg::server
