#include "client/comm/communicator_cache.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/comm/solo_communicator.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

int CommunicatorSetup::MemberIndex() const {
  if (members.empty()) return subgroup.IndexOf(rank);
  return static_cast<int>(std::lower_bound(members.begin(), members.end(), rank) -
                          members.begin());
}

int CommunicatorSetup::MemberCount() const {
  return members.empty() ? subgroup.size : static_cast<int>(members.size());
}

std::string CommunicatorSetup::MemberScope() const {
  if (members.empty() || static_cast<int>(members.size()) == subgroup.size) return "";
  // FNV-1a over the ranks: short, and the same on every member.
  uint64_t h = 1469598103934665603ull;
  for (int32_t r : members) {
    for (int i = 0; i < 4; ++i) {
      h ^= (static_cast<uint32_t>(r) >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return absl::StrCat("m", members.size(), "-", absl::Hex(h), "/");
}

CommunicatorCache::CommunicatorCache(std::unique_ptr<CommunicatorFactory> factory)
    : factory_(std::move(factory)) {}

CommunicatorCache::~CommunicatorCache() { Clear(); }

void CommunicatorCache::Clear() {
  std::map<CommunicatorKey, std::unique_ptr<Communicator>> comms;
  {
    absl::MutexLock l(&mu_);
    comms.swap(comms_);
  }
  comms.clear();  // Outside the lock: tearing down NCCL/Gloo state may take a while.
}

void CommunicatorCache::AbortBefore(int64_t generation, const absl::Status& why) {
  std::shared_ptr<SetupCanceller> creating;
  {
    absl::MutexLock l(&mu_);
    if (generation <= abort_before_) return;
    abort_before_ = generation;
    abort_why_ = why;
    for (auto& [key, comm] : comms_) {
      if (key.generation < generation) comm->Abort(why);
    }
    if (creating_ != nullptr && creating_generation_ < generation) creating = creating_;
  }
  // A set-up of an older generation is abandoned at once (its connects and waits wake), not at
  // its timeout. Outside mu_: the hooks take the transport's locks.
  if (creating != nullptr) creating->Cancel(why);
}

void CommunicatorCache::DropBefore(int64_t generation) {
  std::vector<std::unique_ptr<Communicator>> dropped;
  {
    absl::MutexLock l(&mu_);
    for (auto it = comms_.begin(); it != comms_.end();) {
      if (it->first.generation < generation) {
        dropped.push_back(std::move(it->second));
        it = comms_.erase(it);
      } else {
        ++it;
      }
    }
  }
  dropped.clear();  // Outside the lock, as in Clear.
}

bool CommunicatorCache::Contains(const CommunicatorKey& key) const {
  absl::MutexLock l(&mu_);
  return comms_.count(key) > 0;
}

absl::StatusOr<Communicator*> CommunicatorCache::Get(const CommunicatorSetup& setup,
                                                     const Device& device) {
  CommunicatorKey key{setup.generation, setup.plan, setup.level, setup.subgroup.index, device.kind,
                      device.is_cuda() ? device.index : 0,
                      static_cast<int>(setup.members.size()) == setup.subgroup.size
                          ? std::vector<int32_t>{}
                          : setup.members};
  if (!setup.members.empty() &&
      (!std::binary_search(setup.members.begin(), setup.members.end(), setup.rank) ||
       !std::is_sorted(setup.members.begin(), setup.members.end()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", setup.rank, " is not among the round's members (", absl::StrJoin(setup.members, ","),
        ") or they are not ascending"));
  }
  absl::MutexLock create(&create_mu_);
  auto cancel = std::make_shared<SetupCanceller>();
  {
    absl::MutexLock l(&mu_);
    auto it = comms_.find(key);
    if (it != comms_.end()) return it->second.get();
    if (key.generation < abort_before_) return abort_why_;
    creating_ = cancel;
    creating_generation_ = key.generation;
  }
  absl::Cleanup done_creating = [this] {
    absl::MutexLock l(&mu_);
    creating_.reset();
  };
  CommunicatorSetup watched = setup;
  watched.cancel = cancel;
  if (device.is_cuda()) {
    // NCCL polls check_alive while it waits: the cancel ends that wait too.
    watched.check_alive = [alive = setup.check_alive, cancel]() -> absl::Status {
      if (absl::Status s = cancel->status(); !s.ok()) return s;
      return alive ? alive() : absl::OkStatus();
    };
  }

  const int count = setup.MemberCount();
  const std::string what =
      absl::StrCat(device.is_cuda() ? "NCCL" : "Gloo", " communicator for level ", setup.level,
                   " subgroup ", setup.subgroup.index, " (ranks ",
                   setup.members.empty() ? setup.subgroup.Describe()
                                         : absl::StrJoin(setup.members, ","),
                   ", generation ", setup.generation, ")");
  std::unique_ptr<Communicator> comm;
  if (device.is_host() && count == 1) {
    comm = std::make_unique<SoloCommunicator>();
  } else {
    if (device.is_cuda()) {
      // Every bootstrap of a key (a retry after a failed one, or a re-creation after Clear) uses
      // a fresh coordinator key: a failed attempt's id is dead, and the coordinator keeps one id
      // per key and generation. The members count their attempts alike: a bootstrap fails or
      // succeeds on all of them.
      for (auto a = nccl_attempts_.begin(); a != nccl_attempts_.end();) {
        a = a->first.generation < setup.generation ? nccl_attempts_.erase(a) : std::next(a);
      }
      watched.bootstrap_attempt = nccl_attempts_[key]++;
    }
    absl::StatusOr<std::unique_ptr<Communicator>> made = factory_->Create(watched, device);
    if (!made.ok()) return Annotate(made.status(), absl::StrCat("creating the ", what));
    comm = *std::move(made);
  }
  spdlog::debug("created the {}", what);
  Communicator* out = comm.get();
  absl::MutexLock l(&mu_);
  // Aborted while it was being made: keep it (so that Clear tears it down like the others), but
  // broken.
  if (key.generation < abort_before_) out->Abort(abort_why_);
  comms_.emplace(key, std::move(comm));
  return out;
}

}  // namespace modelavg::client
