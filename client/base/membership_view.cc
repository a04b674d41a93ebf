#include "modelavg/client/membership_view.h"

#include <algorithm>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace modelavg::client {

MembershipView MembershipView::Initial(int64_t generation, int32_t world_size) {
  MembershipView v;
  v.generation = generation;
  v.live.assign(world_size, true);
  v.admitted.assign(world_size, -1);
  v.until.assign(world_size, std::numeric_limits<int64_t>::max());
  return v;
}

std::string ReplicaRetiredMessage(const v1::Job& job, const ViewReader& reader, int32_t lost) {
  const int32_t s = std::max(1, reader.replica_size);
  const int32_t replica = reader.rank / s;
  std::string what = "was lost";
  for (const v1::Member& m : job.members()) {
    if (m.rank() != lost) continue;
    what = m.state() == v1::LEFT   ? "left"
           : m.state() == v1::DEAD ? "died or failed"
                                   : "was lost";
  }
  return absl::StrCat(
      "replica ", replica, " (ranks ", replica * s, "..", replica * s + s - 1, ") of job ",
      job.spec().job_id(), " was retired because its rank ", lost, " ", what,
      ": rank ", reader.rank, " cannot average a partial replica; restart the replica's ", s,
      " workers, which re-join together as a replacement replica");
}

std::optional<MembershipView> ViewOf(const v1::Job& job, const ViewReader& reader,
                                     std::string* why, int32_t* retired_by) {
  if (retired_by != nullptr) *retired_by = -1;
  if (job.members_omitted()) {
    *why = "the job's member list is too large to read";
    return std::nullopt;
  }
  MembershipView v;
  v.generation = job.generation();
  v.live.assign(reader.world_size, false);
  v.admitted.assign(reader.world_size, -1);
  v.until.assign(reader.world_size, std::numeric_limits<int64_t>::max());
  bool me = false;
  for (const v1::Member& m : job.members()) {
    if (m.rank() < 0 || m.rank() >= reader.world_size) continue;
    // A replica mate of a rank that left in order averages the steps before retired_at_step.
    const bool lingering = m.state() == v1::RETIRED && m.retired_at_step() > 0;
    const bool live = (m.state() == v1::ALIVE && m.generation() == job.generation()) || lingering;
    v.live[m.rank()] = live;
    v.admitted[m.rank()] = m.admitted_step() > 0 ? m.admitted_step() : -1;
    if (lingering) v.until[m.rank()] = m.retired_at_step();
    if (m.rank() != reader.rank) continue;
    if (m.worker_id() != reader.worker_id) {
      *why = absl::StrCat("rank ", reader.rank, " is now held by worker \"", m.worker_id(), "\"");
    } else if (m.state() == v1::DEAD) {
      // A death the coordinator confirmed from peer failure reports (docs/cluster.md): this
      // rank still beat, but its peers could not reach it over the data network.
      const bool unreachable =
          absl::StartsWith(job.last_change().reason(),
                           absl::StrCat("rank ", reader.rank, " unreachable by its peers"));
      *why = unreachable
                 ? std::string("the coordinator declared this rank dead (its peers could not "
                               "reach it over the data network though its heartbeats came "
                               "through: check this host's data link); connect a new Client "
                               "to re-join")
                 : absl::StrCat("the coordinator declared this rank dead (no heartbeat within ",
                                absl::FormatDuration(reader.heartbeat_timeout),
                                "); connect a new Client to re-join");
    } else if (m.state() == v1::LEFT) {
      *why = "this rank left";
    } else if (m.state() == v1::RETIRED) {
      if (retired_by != nullptr) *retired_by = m.retired_by();
      v.retired_by = m.retired_by();
      v.retired_why = ReplicaRetiredMessage(job, reader, m.retired_by());
      if (lingering) {
        me = true;  // until its retired_at_step
      } else {
        *why = v.retired_why;
      }
    } else {
      me = live;
    }
  }
  if (job.state() != v1::RUNNING) {
    *why = absl::StrCat(
        "the job is ", v1::JobState_Name(job.state()),
        job.state() == v1::PENDING
            ? absl::StrCat(": fewer than min_world_size (", job.spec().min_world_size(),
                           ") ranks are alive; every worker must re-join (connect a new Client)")
            : std::string());
    return std::nullopt;
  }
  if (!me) {
    if (why->empty()) *why = absl::StrCat("rank ", reader.rank, " is not a live member of it");
    return std::nullopt;
  }
  return v;
}

Departures DeparturesOf(const v1::Job& job, int64_t generation, int32_t world_size) {
  Departures d;
  for (const v1::Member& m : job.members()) {
    if (m.state() == v1::LEFT) {
      d.left.push_back(m.rank());
    } else if (m.state() == v1::DEAD || m.generation() > generation) {
      d.hard = true;  // A death or a re-join: every communicator with that rank is broken.
    }
  }
  // A rank missing from the member list has been replaced or removed.
  if (job.members_size() < world_size && d.left.empty()) d.hard = true;
  return d;
}

}  // namespace modelavg::client
