#include "server/store/etcd/etcd_state_store.h"

#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/store/etcd/etcd_records.pb.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

// etcd's default --max-txn-ops.
constexpr int kMaxTxnOps = 128;

std::string Epoch(int64_t epoch) { return absl::StrFormat("%020d", epoch); }
std::string Bucket(int32_t bucket) { return absl::StrFormat("%06d", bucket); }
// Zero-padded so that key order is round order (LoadAll reads them in order; a drop is one
// range below a round's key).
constexpr int64_t kMaxPacedRound = 999'999'999'999;
std::string PacedRoundDigits(int64_t round) { return absl::StrFormat("%012d", round); }

etcd::EtcdMember ToRecord(const Member& m) {
  etcd::EtcdMember r;
  r.set_rank(m.rank);
  r.set_worker_id(m.worker_id);
  r.set_host(m.host);
  r.set_state(m.state);
  r.set_generation(m.generation);
  r.set_joined_generation(m.joined_generation);
  r.set_credential_digest(m.credential_digest);
  r.set_admitted_step(m.admitted_step);
  if (m.retired_by >= 0) r.set_retired_by(m.retired_by);
  r.set_retired_at_step(m.retired_at_step);
  return r;
}

Member FromRecord(const etcd::EtcdMember& r) {
  Member m;
  m.rank = r.rank();
  m.worker_id = r.worker_id();
  m.host = r.host();
  m.state = r.state();
  m.generation = r.generation();
  m.joined_generation = r.joined_generation();
  m.credential_digest = r.credential_digest();
  m.admitted_step = r.admitted_step();
  m.retired_by = r.has_retired_by() ? r.retired_by() : -1;
  m.retired_at_step = r.retired_at_step();
  return m;
}

void SetHeader(const MembershipHeader& h, etcd::EtcdJobRecord* r) {
  r->set_state(h.state);
  r->set_generation(h.generation);
  if (h.last_change.has_value()) {
    *r->mutable_last_change() = *h.last_change;
  } else {
    r->clear_last_change();
  }
}

MembershipHeader GetHeader(const etcd::EtcdJobRecord& r) {
  MembershipHeader h;
  h.state = r.state();
  h.generation = r.generation();
  if (r.has_last_change()) h.last_change = r.last_change();
  return h;
}

void Put(etcdserverpb::TxnRequest* txn, const std::string& key, const std::string& value) {
  etcdserverpb::PutRequest* put = txn->add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
}

void DeleteRange(etcdserverpb::TxnRequest* txn, const std::string& key, const std::string& end) {
  etcdserverpb::DeleteRangeRequest* del = txn->add_success()->mutable_request_delete_range();
  del->set_key(key);
  if (!end.empty()) del->set_range_end(end);
}

}  // namespace

// What the store last wrote for a job.
struct EtcdStateStore::Mirror {
  etcd::EtcdJobRecord record;
  std::map<int32_t, Member> members;
};

EtcdStateStore::EtcdStateStore(EtcdClient* etcd, EtcdFence* fence, std::string prefix)
    : etcd_(etcd), election_(fence), prefix_(std::move(prefix)) {}

EtcdStateStore::~EtcdStateStore() = default;

std::string EtcdStateStore::JobPrefix(absl::string_view job_id) const {
  return absl::StrCat(prefix_, "jobs/", job_id, "/");
}

std::string EtcdStateStore::Describe() const {
  return absl::StrCat(etcd_->Describe(), " under ", prefix_,
                      " (every write fenced by the leader key ", election_->key(), ")");
}

absl::Status EtcdStateStore::Commit(etcdserverpb::TxnRequest txn, absl::string_view what,
                                    bool* refused) {
  const int64_t fence = election_->fence();
  if (fence == 0) {
    return absl::UnavailableError(absl::StrCat(
        "this coordinator is not the leader; nothing was written (", what, ")"));
  }
  if (txn.success_size() > kMaxTxnOps) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", txn.success_size(), " etcd operations, more than etcd's --max-txn-ops "
        "default of ", kMaxTxnOps));
  }
  etcdserverpb::TxnRequest fenced;
  etcdserverpb::Compare* leader = fenced.add_compare();
  leader->set_key(election_->key());
  leader->set_target(etcdserverpb::Compare::CREATE);
  leader->set_result(etcdserverpb::Compare::EQUAL);
  leader->set_create_revision(fence);
  for (etcdserverpb::Compare& c : *txn.mutable_compare()) *fenced.add_compare() = std::move(c);
  *fenced.mutable_success() = std::move(*txn.mutable_success());
  // On failure: read the leader key to tell a lost leadership from the caller's condition.
  fenced.add_failure()->mutable_request_range()->set_key(election_->key());
  absl::StatusOr<etcdserverpb::TxnResponse> reply = etcd_->Txn(fenced);
  if (!reply.ok()) {
    const std::string why = absl::StrCat("an etcd write (", what, ") failed with its outcome "
                                         "unknown: ", reply.status().message());
    election_->LostLeadership(fence, why);
    return absl::UnavailableError(absl::StrCat(
        "the coordinator could not write to etcd (", reply.status().message(),
        "); it reloads its state from etcd and serves again once etcd answers; retry"));
  }
  if (reply->succeeded()) return absl::OkStatus();
  const auto& kvs = reply->responses_size() == 1
                        ? reply->responses(0).response_range().kvs()
                        : google::protobuf::RepeatedPtrField<mvccpb::KeyValue>();
  if (kvs.size() == 1 && kvs[0].create_revision() == fence) {
    if (refused != nullptr) *refused = true;
    return absl::FailedPreconditionError(absl::StrCat(what, ": etcd's condition failed"));
  }
  const std::string leader_now = kvs.size() == 1 ? kvs[0].value() : std::string("nobody");
  const std::string why = absl::StrCat("etcd refused a write (", what,
                                       "): this coordinator is no longer the leader (now: ",
                                       leader_now, ")");
  spdlog::error("{}", why);
  election_->LostLeadership(fence, why);
  return absl::UnavailableError(absl::StrCat(
      "this coordinator lost the leadership (the leader is now ", leader_now,
      "); nothing was written; retry against the leader"));
}

absl::StatusOr<std::vector<StoredJob>> EtcdStateStore::LoadAll() {
  const std::string jobs_prefix = absl::StrCat(prefix_, "jobs/");
  etcdserverpb::RangeRequest range;
  range.set_key(jobs_prefix);
  range.set_range_end(EtcdPrefixEnd(jobs_prefix));
  absl::StatusOr<etcdserverpb::RangeResponse> reply = etcd_->Range(range);
  if (!reply.ok()) return reply.status();
  // First pass: headers (their comm epochs say which comm ids are current).
  std::map<std::string, std::unique_ptr<Mirror>> mirrors;
  struct CommEntry {
    std::string job, epoch;
    const mvccpb::KeyValue* kv;
  };
  std::vector<CommEntry> comm;
  std::vector<std::pair<std::string, const mvccpb::KeyValue*>> buckets;
  // Plans in key order (the version's digits): version order.
  std::vector<std::pair<std::string, const mvccpb::KeyValue*>> plans;
  // Paced rounds in key order (the round's digits): round order.
  std::vector<std::pair<std::string, const mvccpb::KeyValue*>> paced_rounds;
  for (const mvccpb::KeyValue& kv : reply->kvs()) {
    absl::string_view rest = kv.key();
    rest.remove_prefix(jobs_prefix.size());
    std::vector<absl::string_view> parts = absl::StrSplit(rest, absl::MaxSplits('/', 3));
    auto corrupt = [&](absl::string_view why) {
      return absl::DataLossError(absl::StrCat("etcd key ", kv.key(), " (", etcd_->Describe(),
                                              "): ", why, "; delete the job's keys under ",
                                              jobs_prefix, " with etcdctl to drop it"));
    };
    if (parts.size() < 2) return corrupt("not a key this coordinator writes");
    const std::string job(parts[0]);
    if (parts[1] == "h" && parts.size() == 2) {
      auto mirror = std::make_unique<Mirror>();
      if (!mirror->record.ParseFromString(kv.value()) || mirror->record.spec().job_id() != job) {
        return corrupt("the job record does not parse");
      }
      mirrors[job] = std::move(mirror);
    } else if (parts[1] == "m" && parts.size() == 3) {
      buckets.emplace_back(job, &kv);
    } else if (parts[1] == "c" && parts.size() == 4) {
      comm.push_back(CommEntry{job, std::string(parts[2]), &kv});
    } else if (parts[1] == "p" && parts.size() == 3) {
      plans.emplace_back(job, &kv);
    } else if (parts[1] == "r" && parts.size() == 3) {
      paced_rounds.emplace_back(job, &kv);
    } else {
      return corrupt("not a key this coordinator writes");
    }
  }
  for (const auto& [job, kv] : buckets) {
    auto it = mirrors.find(job);
    etcd::EtcdMemberBucket bucket;
    if (it == mirrors.end() || !bucket.ParseFromString(kv->value())) {
      return absl::DataLossError(absl::StrCat("etcd key ", kv->key(),
                                              ": a member record without its job, or damaged"));
    }
    for (const etcd::EtcdMember& m : bucket.members()) it->second->members[m.rank()] = FromRecord(m);
  }
  std::vector<StoredJob> jobs;
  std::map<std::string, std::vector<StoredCommId>> ids;
  for (const CommEntry& c : comm) {
    auto it = mirrors.find(c.job);
    if (it == mirrors.end() || c.epoch != Epoch(it->second->record.comm_epoch())) continue;
    etcd::EtcdCommIdRecord r;
    if (!r.ParseFromString(c.kv->value())) {
      return absl::DataLossError(absl::StrCat("etcd key ", c.kv->key(), ": damaged comm id"));
    }
    ids[c.job].push_back(StoredCommId{r.level(), r.subgroup(), r.key(), r.blob()});
  }
  std::map<std::string, std::vector<v1::PlanChange>> job_plans;
  for (const auto& [job, kv] : plans) {
    v1::PlanChange change;
    if (mirrors.find(job) == mirrors.end() || !change.ParseFromString(kv->value())) {
      return absl::DataLossError(
          absl::StrCat("etcd key ", kv->key(), ": a plan record without its job, or damaged"));
    }
    job_plans[job].push_back(std::move(change));
  }
  std::map<std::string, std::vector<v1::PacedRound>> job_rounds;
  for (const auto& [job, kv] : paced_rounds) {
    v1::PacedRound round;
    absl::string_view key = kv->key();
    if (mirrors.find(job) == mirrors.end() || !round.ParseFromString(kv->value()) ||
        !absl::EndsWith(key, absl::StrCat("/r/", PacedRoundDigits(round.round())))) {
      return absl::DataLossError(absl::StrCat(
          "etcd key ", kv->key(), ": a paced round record without its job, or damaged"));
    }
    job_rounds[job].push_back(std::move(round));
  }
  for (auto& [id, mirror] : mirrors) {
    StoredJob job;
    job.spec = mirror->record.spec();
    job.created_unix_ms = mirror->record.created_unix_ms();
    job.header = GetHeader(mirror->record);
    for (const auto& [rank, m] : mirror->members) job.members.push_back(m);
    job.comm_ids = std::move(ids[id]);
    job.plan_changes = std::move(job_plans[id]);
    job.paced_rounds = std::move(job_rounds[id]);
    jobs.push_back(std::move(job));
  }
  absl::MutexLock lock(&mu_);
  jobs_.clear();
  for (auto& [id, mirror] : mirrors) jobs_.emplace(id, std::move(mirror));
  return jobs;
}

absl::Status EtcdStateStore::CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) {
  auto mirror = std::make_unique<Mirror>();
  *mirror->record.mutable_spec() = spec;
  mirror->record.set_created_unix_ms(created_unix_ms);
  SetHeader(MembershipHeader{}, &mirror->record);
  const std::string key = absl::StrCat(JobPrefix(spec.job_id()), "h");
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* absent = txn.add_compare();
  absent->set_key(key);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_create_revision(0);
  Put(&txn, key, mirror->record.SerializeAsString());
  absl::MutexLock lock(&mu_);
  bool refused = false;
  absl::Status s = Commit(std::move(txn), absl::StrCat("create job ", spec.job_id()), &refused);
  if (refused) {
    return absl::AlreadyExistsError(absl::StrCat("job ", spec.job_id(), " is already in etcd"));
  }
  if (!s.ok()) return s;
  jobs_[spec.job_id()] = std::move(mirror);
  return absl::OkStatus();
}

absl::Status EtcdStateStore::DeleteJob(absl::string_view job_id) {
  etcdserverpb::TxnRequest txn;
  DeleteRange(&txn, JobPrefix(job_id), EtcdPrefixEnd(JobPrefix(job_id)));
  absl::MutexLock lock(&mu_);
  absl::Status s = Commit(std::move(txn), absl::StrCat("delete job ", job_id), nullptr);
  if (!s.ok()) return s;
  if (auto it = jobs_.find(job_id); it != jobs_.end()) jobs_.erase(it);
  return absl::OkStatus();
}

absl::Status EtcdStateStore::Apply(absl::string_view job_id, const JobDelta& delta) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not stored"));
  }
  Mirror& mirror = *it->second;
  const std::string job_prefix = JobPrefix(job_id);
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* present = txn.add_compare();
  present->set_key(absl::StrCat(job_prefix, "h"));
  present->set_target(etcdserverpb::Compare::CREATE);
  present->set_result(etcdserverpb::Compare::GREATER);
  present->set_create_revision(0);

  etcd::EtcdJobRecord record = mirror.record;
  const bool header_changes = delta.header.has_value() || delta.clear_comm_ids;
  if (delta.header.has_value()) SetHeader(*delta.header, &record);
  if (delta.clear_comm_ids) record.set_comm_epoch(record.comm_epoch() + 1);
  if (header_changes) Put(&txn, absl::StrCat(job_prefix, "h"), record.SerializeAsString());

  // The members after the delta, for the buckets it touches.
  std::map<int32_t, const Member*> changed;
  for (const Member& m : delta.members) changed[m.rank] = &m;
  std::set<int32_t> touched;
  for (const auto& [rank, m] : changed) touched.insert(rank / kEtcdMemberBucket);
  for (int32_t b : touched) {
    const int32_t lo = b * kEtcdMemberBucket;
    const int32_t hi = lo + kEtcdMemberBucket;
    std::map<int32_t, const Member*> now;
    for (auto m = mirror.members.lower_bound(lo); m != mirror.members.end() && m->first < hi; ++m) {
      now[m->first] = &m->second;
    }
    for (auto c = changed.lower_bound(lo); c != changed.end() && c->first < hi; ++c) {
      if (c->second->worker_id.empty()) {
        now.erase(c->first);
      } else {
        now[c->first] = c->second;
      }
    }
    etcd::EtcdMemberBucket bucket;
    for (const auto& [rank, m] : now) *bucket.add_members() = ToRecord(*m);
    const std::string key = absl::StrCat(job_prefix, "m/", Bucket(b));
    if (bucket.members_size() == 0) {
      DeleteRange(&txn, key, "");
    } else {
      Put(&txn, key, bucket.SerializeAsString());
    }
  }
  const std::string comm_prefix = absl::StrCat(job_prefix, "c/");
  if (delta.clear_comm_ids) {
    // Every epoch before the new one.
    DeleteRange(&txn, comm_prefix, absl::StrCat(comm_prefix, Epoch(record.comm_epoch())));
  }
  if (delta.comm_id.has_value()) {
    const StoredCommId& c = *delta.comm_id;
    etcd::EtcdCommIdRecord r;
    r.set_level(c.level);
    r.set_subgroup(c.subgroup);
    r.set_key(c.key);
    r.set_blob(c.blob);
    Put(&txn,
        absl::StrCat(comm_prefix, Epoch(record.comm_epoch()), "/", c.level, ":", c.subgroup, ":",
                     absl::BytesToHexString(c.key)),
        r.SerializeAsString());
  }
  if (delta.plan_change.has_value()) {
    Put(&txn, absl::StrCat(job_prefix, "p/", absl::StrFormat("%06d", delta.plan_change->version())),
        delta.plan_change->SerializeAsString());
  }
  // A drop is one range delete (every round below it), so the transaction's size does not grow
  // with the rounds dropped. etcd refuses a put inside a range deleted by the same transaction,
  // and a round below the drop is not kept anyway: such a round is not written.
  const std::string rounds_prefix = absl::StrCat(job_prefix, "r/");
  for (const v1::PacedRound& r : delta.paced_rounds) {
    if (r.round() < 0 || r.round() > kMaxPacedRound) {
      return absl::InternalError(absl::StrCat("job ", job_id, ": paced round ", r.round(),
                                              " has no etcd key (0 to ", kMaxPacedRound, ")"));
    }
    if (r.round() < delta.drop_paced_rounds_before) continue;
    Put(&txn, absl::StrCat(rounds_prefix, PacedRoundDigits(r.round())), r.SerializeAsString());
  }
  if (delta.drop_paced_rounds_before > 0) {
    DeleteRange(&txn, rounds_prefix,
                delta.drop_paced_rounds_before > kMaxPacedRound
                    ? EtcdPrefixEnd(rounds_prefix)
                    : absl::StrCat(rounds_prefix,
                                   PacedRoundDigits(delta.drop_paced_rounds_before)));
  }
  if (txn.success_size() == 0) return absl::OkStatus();
  bool refused = false;
  absl::Status s = Commit(std::move(txn), absl::StrCat("job ", job_id, " transition"), &refused);
  if (refused) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not in etcd"));
  }
  if (!s.ok()) return s;
  mirror.record = std::move(record);
  for (const auto& [rank, m] : changed) {
    if (m->worker_id.empty()) {
      mirror.members.erase(rank);
    } else {
      mirror.members[rank] = *m;
    }
  }
  return absl::OkStatus();
}

}  // namespace modelavg::server
