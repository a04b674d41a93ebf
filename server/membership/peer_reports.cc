#include "server/membership/peer_reports.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace modelavg::server {

void PeerReports::Add(int64_t generation, PeerReport report) {
  if (generation != generation_) {
    reports_.clear();
    generation_ = generation;
  }
  const int32_t reporter = report.reporter;
  reports_[reporter] = std::move(report);
}

std::vector<ConfirmedPeer> PeerReports::Confirmed(
    int64_t generation, absl::Time now, const std::function<bool(int32_t)>& in_round) const {
  std::vector<ConfirmedPeer> out;
  if (generation != generation_) return out;
  // The reports that count: fresh, of a reporter still in the round.
  std::vector<const PeerReport*> live;
  for (const auto& [reporter, report] : reports_) {
    if (now - report.at <= ttl_ && in_round(reporter)) live.push_back(&report);
  }
  const auto reached_any = [](const PeerReport& r) { return !r.reachable.empty(); };
  std::set<int32_t> reached;  // named reachable by someone other than themselves
  std::map<int32_t, std::vector<int32_t>> accused;  // suspect -> reporters
  for (const PeerReport* r : live) {
    for (int32_t p : r->reachable) {
      if (p != r->reporter) reached.insert(p);
    }
    for (int32_t p : r->unreachable) {
      if (p == r->reporter || !in_round(p)) continue;
      std::vector<int32_t>& by = accused[p];
      if (std::find(by.begin(), by.end(), r->reporter) == by.end()) by.push_back(r->reporter);
    }
  }
  for (auto& [suspect, by] : accused) {
    if (reached.count(suspect) > 0) continue;
    const auto own = reports_.find(suspect);
    if (own == reports_.end() || now - own->second.at > ttl_ || reached_any(own->second) ||
        own->second.unreachable.empty()) {
      continue;  // the suspect has not said that it reaches nobody
    }
    std::vector<int32_t> credible;  // accusers that reached some peer themselves
    for (int32_t r : by) {
      const auto accuser = reports_.find(r);
      if (accuser != reports_.end() && reached_any(accuser->second)) credible.push_back(r);
    }
    if (credible.empty()) continue;
    std::sort(credible.begin(), credible.end());
    ConfirmedPeer c;
    c.rank = suspect;
    c.reporters = credible;
    c.why = absl::StrCat(credible.size() == 1 ? "rank " : "ranks ", absl::StrJoin(credible, ","),
                         " could not reach it but reached other peers, no member reached it, "
                         "and it reached none of its ",
                         own->second.unreachable.size(), " probed peers");
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace modelavg::server
