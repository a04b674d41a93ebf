// The same cases of a paced job's planned rounds (StoredJob::paced_rounds, JobDelta's
// paced_rounds and drop_paced_rounds_before) for every StateStore: the in-memory store
// (tests/unit/server_state_store_test.cc), SQLite (tests/unit/server_sqlite_state_store_test.cc)
// and etcd (tests/integration/etcd_ha_test.cc). What a failed write leaves is tested beside each
// store, with the fault that store can be given.
#ifndef MODELAVG_TESTS_TOOLS_PACED_ROUNDS_STORE_CASES_H_
#define MODELAVG_TESTS_TOOLS_PACED_ROUNDS_STORE_CASES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/store/state_store.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {

// Round `round` of a 4-rank job paced in two groups, every field set and each depending on the
// round, so that a round stored under the wrong index or with a field lost reads back different.
inline v1::PacedRound MakePacedRound(int64_t round) {
  v1::PacedRound r;
  r.set_round(round);
  r.set_fragment(static_cast<int32_t>(round % 3));
  r.set_group_size(2);
  for (int g = 0; g < 2; ++g) {
    r.add_sync_steps(10 * (round + 1) + g);
    r.add_inner_steps(8 + g + round);
    r.add_group_paces(1.5 * (g + 1) + 0.25 * static_cast<double>(round));
  }
  for (int rank = 0; rank < 4; ++rank) r.add_tokens_per_step(1000.5 + rank + round);
  return r;
}

// `got` is exactly MakePacedRound of each of `rounds`, in that order.
inline void ExpectPacedRounds(const std::vector<v1::PacedRound>& got,
                              const std::vector<int64_t>& rounds) {
  ASSERT_EQ(got.size(), rounds.size());
  for (size_t i = 0; i < rounds.size(); ++i) {
    const v1::PacedRound want = MakePacedRound(rounds[i]);
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(got[i], want))
        << "at " << i << ": got " << got[i].ShortDebugString() << "; want "
        << want.ShortDebugString();
  }
}

// The stored job `id` of `store` (a failure and an empty job if there is none).
inline server::StoredJob LoadPacedJob(server::StateStore& store, const std::string& id) {
  absl::StatusOr<std::vector<server::StoredJob>> jobs = store.LoadAll();
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  if (jobs.ok()) {
    for (server::StoredJob& job : *jobs) {
      if (job.spec.job_id() == id) return std::move(job);
    }
  }
  ADD_FAILURE() << "job " << id << " is not stored";
  return {};
}

// Rounds written (out of the order they were planned in, across deltas), reloaded equal and in
// round order; a drop keeps the rounds from its index on (and a round written below the drop in
// the same delta is not kept); a rewritten round replaces the stored one; the rounds of two jobs
// stay apart, and DeleteJob removes the job's rounds. `reopen` gives the store as a restarted
// coordinator sees it (the same one for the in-memory store); every later call goes to it.
inline void RunPacedRoundsCases(server::StateStore* store,
                                const std::function<server::StateStore*()>& reopen) {
  ASSERT_TRUE(store->CreateJob(MakeSpec("paced", 4, v1::PERIODIC, {{2, 4}}, 0), 1).ok());
  ASSERT_TRUE(store->CreateJob(MakeSpec("other", 4, v1::PERIODIC, {{2, 4}}, 0), 2).ok());
  server::JobDelta first;
  for (int64_t r : {0, 1, 2}) first.paced_rounds.push_back(MakePacedRound(r));
  ASSERT_TRUE(store->Apply("paced", first).ok());
  server::JobDelta other;
  other.paced_rounds.push_back(MakePacedRound(0));
  ASSERT_TRUE(store->Apply("other", other).ok());
  server::JobDelta next;  // written by its own delta: still in round order with the others
  next.paced_rounds.push_back(MakePacedRound(3));
  ASSERT_TRUE(store->Apply("paced", next).ok());

  store = reopen();
  ASSERT_NE(store, nullptr);
  ExpectPacedRounds(LoadPacedJob(*store, "paced").paced_rounds, {0, 1, 2, 3});
  ExpectPacedRounds(LoadPacedJob(*store, "other").paced_rounds, {0});

  // The front dropped while the next rounds are written; round 1 written again is dropped too.
  server::JobDelta drop;
  drop.paced_rounds.push_back(MakePacedRound(1));
  drop.paced_rounds.push_back(MakePacedRound(4));
  drop.paced_rounds.push_back(MakePacedRound(5));
  drop.drop_paced_rounds_before = 2;
  ASSERT_TRUE(store->Apply("paced", drop).ok());
  // Round 3 rewritten with other contents replaces the stored one.
  server::JobDelta rewrite;
  v1::PacedRound changed = MakePacedRound(3);
  changed.set_fragment(7);
  rewrite.paced_rounds.push_back(changed);
  ASSERT_TRUE(store->Apply("paced", rewrite).ok());
  // A drop alone (nothing else in the delta) is written.
  server::JobDelta drop_only;
  drop_only.drop_paced_rounds_before = 3;
  ASSERT_TRUE(store->Apply("paced", drop_only).ok());

  store = reopen();
  ASSERT_NE(store, nullptr);
  const server::StoredJob paced = LoadPacedJob(*store, "paced");
  ASSERT_EQ(paced.paced_rounds.size(), 3u);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(paced.paced_rounds[0], changed))
      << paced.paced_rounds[0].ShortDebugString();
  std::vector<v1::PacedRound> after_three(paced.paced_rounds.begin() + 1,
                                          paced.paced_rounds.end());
  ExpectPacedRounds(after_three, {4, 5});
  ExpectPacedRounds(LoadPacedJob(*store, "other").paced_rounds, {0});  // another job's drop

  ASSERT_TRUE(store->DeleteJob("paced").ok());
  store = reopen();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<std::vector<server::StoredJob>> jobs = store->LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  ExpectPacedRounds((*jobs)[0].paced_rounds, {0});
  // A job created again under the deleted one's id starts with no rounds.
  ASSERT_TRUE(store->CreateJob(MakeSpec("paced", 4, v1::PERIODIC, {{2, 4}}, 0), 3).ok());
  EXPECT_TRUE(LoadPacedJob(*store, "paced").paced_rounds.empty());
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_PACED_ROUNDS_STORE_CASES_H_
