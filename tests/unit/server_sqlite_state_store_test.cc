// The SQLite StateStore: round trips across reopen, private files, the directory lock, and a
// damaged file refused by name; the registry's load and jobs-file merge on top of it.
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/job_registry.h"
#include "server/store/sqlite/sqlite_state_store.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/paced_rounds_store_cases.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Spec(const std::string& id, int world = 4) {
  return ::modelavg::testing::MakeSpec(id, world, v1::HIERARCHICAL, {{2, 2}, {4, world}}, 0);
}

class SqliteStateStoreTest : public ::testing::Test {
 protected:
  SqliteStateStoreTest() {
    char tmpl[] = "/tmp/modelavg_state_test.XXXXXX";
    root_ = mkdtemp(tmpl);
    dir_ = root_ + "/state";
  }
  ~SqliteStateStoreTest() override { std::filesystem::remove_all(root_); }

  std::unique_ptr<SqliteStateStore> Open() {
    absl::StatusOr<std::unique_ptr<SqliteStateStore>> store = SqliteStateStore::Open(dir_);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  std::string db() const { return dir_ + "/state.db"; }

  std::string root_;
  std::string dir_;
};

mode_t Mode(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

TEST_F(SqliteStateStoreTest, Open_NewDirectory_PrivateDirAndFiles) {
  auto store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateJob(Spec("a"), 5).ok());
  EXPECT_EQ(Mode(dir_), 0700u);
  EXPECT_EQ(Mode(db()), 0600u);
  EXPECT_EQ(Mode(db() + "-wal"), 0600u);
  EXPECT_EQ(Mode(dir_ + "/coordinator.lock"), 0600u);
  EXPECT_THAT(store->Describe(), HasSubstr(db()));
}

TEST_F(SqliteStateStoreTest, Reopen_EveryTransitionIsThere) {
  {
    auto store = Open();
    ASSERT_TRUE(store->CreateJob(Spec("a"), 123).ok());
    ASSERT_TRUE(store->CreateJob(Spec("b"), 124).ok());
    JobDelta d;
    d.header = MembershipHeader{v1::RUNNING, 7, std::nullopt};
    v1::GenerationChange change;
    change.set_generation(7);
    change.set_reason("rank 1 re-joined");
    d.header->last_change = change;
    d.members.push_back(Member{0, "w0", "h0", v1::ALIVE, 7, 5});
    d.members.push_back(Member{1, "w1", "h1", v1::DEAD, 6});
    d.members.push_back(Member{2, "w2", "h2", v1::ALIVE, 7});
    d.comm_id = StoredCommId{1, 0, "k", std::string("\0\1\2", 3)};
    ASSERT_TRUE(store->Apply("a", d).ok());
    JobDelta remove;
    remove.members.push_back(Member{2, "", "", v1::MEMBER_STATE_UNSPECIFIED, 0});
    ASSERT_TRUE(store->Apply("a", remove).ok());
    ASSERT_TRUE(store->DeleteJob("b").ok());
    EXPECT_EQ(store->Apply("b", d).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(store->CreateJob(Spec("a"), 1).code(), absl::StatusCode::kAlreadyExists);
  }
  auto store = Open();
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  const StoredJob& a = (*jobs)[0];
  EXPECT_EQ(a.spec.job_id(), "a");
  EXPECT_EQ(a.spec.world_size(), 4);
  EXPECT_EQ(a.created_unix_ms, 123);
  EXPECT_EQ(a.header.state, v1::RUNNING);
  EXPECT_EQ(a.header.generation, 7);
  ASSERT_TRUE(a.header.last_change.has_value());
  EXPECT_EQ(a.header.last_change->reason(), "rank 1 re-joined");
  ASSERT_EQ(a.members.size(), 2u);
  EXPECT_EQ(a.members[1].worker_id, "w1");
  EXPECT_EQ(a.members[1].state, v1::DEAD);
  EXPECT_EQ(a.members[1].generation, 6);
  EXPECT_EQ(a.members[1].joined_generation, 6);  // not given: the round's
  EXPECT_EQ(a.members[0].joined_generation, 5);
  ASSERT_EQ(a.comm_ids.size(), 1u);
  EXPECT_EQ(a.comm_ids[0].level, 1);
  EXPECT_EQ(a.comm_ids[0].key, "k");
  EXPECT_EQ(a.comm_ids[0].blob, std::string("\0\1\2", 3));
}

TEST_F(SqliteStateStoreTest, Reopen_AdmittedStepKept) {
  {
    auto store = Open();
    ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
    JobDelta d;
    d.members.push_back(Member{0, "w0", "h0", v1::ALIVE, 3, 1});
    Member newcomer{3, "new", "h3", v1::ALIVE, 3, 3, "digest"};
    newcomer.admitted_step = 120;
    d.members.push_back(newcomer);
    ASSERT_TRUE(store->Apply("a", d).ok());
  }
  auto store = Open();
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ((*jobs)[0].members.size(), 2u);
  EXPECT_EQ((*jobs)[0].members[0].admitted_step, -1);
  EXPECT_EQ((*jobs)[0].members[1].admitted_step, 120);
  EXPECT_EQ((*jobs)[0].members[1].credential_digest, "digest");
}

// Runs `sql` on the file at `path` (outside the store).
void RunSql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK)
      << (err != nullptr ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

std::string QueryOne(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  std::string out;
  if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK &&
      sqlite3_step(stmt) == SQLITE_ROW) {
    out = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return out;
}

// A state file written by the coordinator before admissions (schema version 2) is upgraded in
// place: its members are of the starting world (admitted_step -1), and new ones keep theirs.
TEST_F(SqliteStateStoreTest, SchemaVersion2File_UpgradedInPlaceToTheCurrentVersion) {
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
  RunSql(db(), absl::StrCat(R"sql(
PRAGMA journal_mode=WAL;
CREATE TABLE jobs(job_id TEXT PRIMARY KEY NOT NULL, spec BLOB NOT NULL,
  created_unix_ms INTEGER NOT NULL, state INTEGER NOT NULL, generation INTEGER NOT NULL,
  last_change BLOB) WITHOUT ROWID;
CREATE TABLE members(job_id TEXT NOT NULL, rank INTEGER NOT NULL, worker_id TEXT NOT NULL,
  host TEXT NOT NULL, state INTEGER NOT NULL, generation INTEGER NOT NULL,
  joined_generation INTEGER NOT NULL, credential_digest TEXT NOT NULL DEFAULT '',
  PRIMARY KEY(job_id, rank)) WITHOUT ROWID;
CREATE TABLE comm_ids(job_id TEXT NOT NULL, level INTEGER NOT NULL, subgroup INTEGER NOT NULL,
  key TEXT NOT NULL, blob BLOB NOT NULL, PRIMARY KEY(job_id, level, subgroup, key)) WITHOUT ROWID;
PRAGMA application_id=1835103847;
PRAGMA user_version=2;
INSERT INTO jobs VALUES('a', X')sql",
                            absl::BytesToHexString(Spec("a").SerializeAsString()),
                            R"sql(', 5, 2, 4, NULL);
INSERT INTO members VALUES('a', 0, 'w0', 'h0', 1, 4, 1, 'd0');
INSERT INTO members VALUES('a', 1, 'w1', 'h1', 2, 3, 1, 'd1');
)sql"));
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadAll();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ(jobs->size(), 1u);
    const StoredJob& a = (*jobs)[0];
    EXPECT_EQ(a.header.generation, 4);
    EXPECT_EQ(a.header.state, v1::RUNNING);
    ASSERT_EQ(a.members.size(), 2u);
    EXPECT_EQ(a.members[0].credential_digest, "d0");
    EXPECT_EQ(a.members[0].admitted_step, -1);
    EXPECT_EQ(a.members[1].admitted_step, -1);
    EXPECT_EQ(a.members[0].retired_by, -1);  // version 4: nobody retired
    EXPECT_EQ(a.members[0].retired_at_step, 0);
    JobDelta d;
    Member newcomer{1, "new", "h", v1::ALIVE, 5, 5, "d2"};
    newcomer.admitted_step = 42;
    d.members.push_back(newcomer);
    Member retired{0, "w0", "h0", v1::RETIRED, 4, 1, "d0"};
    retired.retired_by = 1;
    retired.retired_at_step = 17;
    d.members.push_back(retired);
    ASSERT_TRUE(store->Apply("a", d).ok());
  }
  EXPECT_EQ(QueryOne(db(), "PRAGMA user_version"), "6");
  auto store = Open();
  absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ((*jobs)[0].members[1].admitted_step, 42);
  EXPECT_EQ((*jobs)[0].members[0].admitted_step, -1);
  EXPECT_EQ((*jobs)[0].members[0].state, v1::RETIRED);
  EXPECT_EQ((*jobs)[0].members[0].retired_by, 1);
  EXPECT_EQ((*jobs)[0].members[0].retired_at_step, 17);
  EXPECT_EQ((*jobs)[0].members[1].retired_by, -1);
}

// A paced job's planned rounds (tests/tools/paced_rounds_store_cases.h), each step across a
// reopen of the file.
TEST_F(SqliteStateStoreTest, PacedRounds_KeptInRoundOrder_DroppedFromTheFront_GoneWithTheJob) {
  std::unique_ptr<SqliteStateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ::modelavg::testing::RunPacedRoundsCases(store.get(), [&] {
    store.reset();  // released first: the directory is locked by the open store
    store = Open();
    return store.get();
  });
  // Nothing of the deleted job's rounds is left in the file, not only out of LoadAll's view.
  EXPECT_EQ(QueryOne(db(), "SELECT count(*) FROM paced_rounds WHERE job_id = 'paced'"), "0");
  EXPECT_EQ(QueryOne(db(), "SELECT count(*) FROM paced_rounds"), "1");
}

// The rounds are written in the transaction of the rest of the delta: a write that fails at the
// last of its rounds (a trigger in the file refuses round 7), or at the drop (after the member
// and every round: a trigger refuses the delete), leaves neither the header and member change,
// nor the drop, nor any of the delta's rounds; once the fault is gone the same delta is written.
TEST_F(SqliteStateStoreTest, PacedRounds_WriteFailsAtTheLastRound_NothingOfTheDeltaStored) {
  std::unique_ptr<SqliteStateStore> store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  JobDelta kept;
  for (int64_t r : {0, 1, 2}) kept.paced_rounds.push_back(::modelavg::testing::MakePacedRound(r));
  ASSERT_TRUE(store->Apply("a", kept).ok());
  JobDelta delta;
  delta.header = MembershipHeader{v1::RUNNING, 1, std::nullopt};
  delta.members.push_back(Member{0, "w0", "h0", v1::ALIVE, 1});
  for (int64_t r : {5, 6, 7}) delta.paced_rounds.push_back(::modelavg::testing::MakePacedRound(r));
  delta.drop_paced_rounds_before = 2;
  for (const char* when : {"INSERT ON paced_rounds WHEN NEW.round = 7", "DELETE ON paced_rounds"}) {
    SCOPED_TRACE(when);
    RunSql(db(), absl::StrCat("CREATE TRIGGER fault BEFORE ", when,
                              " BEGIN SELECT RAISE(ABORT, 'injected fault'); END;"));
    absl::Status s = store->Apply("a", delta);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("injected fault"));
    EXPECT_THAT(std::string(s.message()), HasSubstr(db()));
    const StoredJob a = ::modelavg::testing::LoadPacedJob(*store, "a");
    EXPECT_EQ(a.header.state, v1::PENDING);
    EXPECT_TRUE(a.members.empty());
    ::modelavg::testing::ExpectPacedRounds(a.paced_rounds, {0, 1, 2});
    RunSql(db(), "DROP TRIGGER fault");
  }

  ASSERT_TRUE(store->Apply("a", delta).ok());
  store.reset();
  store = Open();
  ASSERT_NE(store, nullptr);
  const StoredJob a = ::modelavg::testing::LoadPacedJob(*store, "a");
  EXPECT_EQ(a.header.state, v1::RUNNING);
  ASSERT_EQ(a.members.size(), 1u);
  EXPECT_EQ(a.members[0].worker_id, "w0");
  ::modelavg::testing::ExpectPacedRounds(a.paced_rounds, {2, 5, 6, 7});
}

// A round that does not parse (or is stored under another round's index) is a damaged file, as a
// damaged plan is: LoadAll refuses it naming the file and the row, rather than forget the round.
TEST_F(SqliteStateStoreTest, PacedRounds_UnreadableRecord_LoadAllRefusesNamingIt) {
  {
    std::unique_ptr<SqliteStateStore> store = Open();
    ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
    JobDelta d;
    d.paced_rounds.push_back(::modelavg::testing::MakePacedRound(3));
    ASSERT_TRUE(store->Apply("a", d).ok());
  }
  const std::string round_3 =
      absl::BytesToHexString(::modelavg::testing::MakePacedRound(3).SerializeAsString());
  for (const std::string& damage :
       {std::string("UPDATE paced_rounds SET record = X'ffffffff'"),
        absl::StrCat("UPDATE paced_rounds SET round = 4, record = X'", round_3, "'")}) {
    SCOPED_TRACE(damage);
    RunSql(db(), damage);
    std::unique_ptr<SqliteStateStore> store = Open();
    ASSERT_NE(store, nullptr);
    absl::StatusOr<std::vector<StoredJob>> jobs = store->LoadAll();
    EXPECT_EQ(jobs.status().code(), absl::StatusCode::kDataLoss) << jobs.status();
    EXPECT_THAT(std::string(jobs.status().message()), HasSubstr(db()));
    EXPECT_THAT(std::string(jobs.status().message()), HasSubstr("job a: paced round"));
    EXPECT_THAT(std::string(jobs.status().message()), HasSubstr("backup"));
  }
}

// A state file of schema version 5 (plans, no paced rounds) is upgraded in place: what it held
// is read as before, and paced rounds are then written and kept.
TEST_F(SqliteStateStoreTest, SchemaVersion5File_UpgradedInPlace_PacedRoundsKept) {
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
  v1::PlanChange plan;
  plan.set_version(1);
  plan.set_switch_step(31);
  RunSql(db(), absl::StrCat(R"sql(
PRAGMA journal_mode=WAL;
CREATE TABLE jobs(job_id TEXT PRIMARY KEY NOT NULL, spec BLOB NOT NULL,
  created_unix_ms INTEGER NOT NULL, state INTEGER NOT NULL, generation INTEGER NOT NULL,
  last_change BLOB) WITHOUT ROWID;
CREATE TABLE members(job_id TEXT NOT NULL, rank INTEGER NOT NULL, worker_id TEXT NOT NULL,
  host TEXT NOT NULL, state INTEGER NOT NULL, generation INTEGER NOT NULL,
  joined_generation INTEGER NOT NULL, credential_digest TEXT NOT NULL DEFAULT '',
  admitted_step INTEGER NOT NULL DEFAULT -1, retired_by INTEGER NOT NULL DEFAULT -1,
  retired_at_step INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(job_id, rank)) WITHOUT ROWID;
CREATE TABLE comm_ids(job_id TEXT NOT NULL, level INTEGER NOT NULL, subgroup INTEGER NOT NULL,
  key TEXT NOT NULL, blob BLOB NOT NULL, PRIMARY KEY(job_id, level, subgroup, key)) WITHOUT ROWID;
CREATE TABLE plans(job_id TEXT NOT NULL, version INTEGER NOT NULL, change BLOB NOT NULL,
  PRIMARY KEY(job_id, version)) WITHOUT ROWID;
PRAGMA application_id=1835103847;
PRAGMA user_version=5;
INSERT INTO jobs VALUES('a', X')sql",
                            absl::BytesToHexString(Spec("a").SerializeAsString()),
                            R"sql(', 5, 2, 4, NULL);
INSERT INTO members VALUES('a', 0, 'w0', 'h0', 1, 4, 1, 'd0', -1, -1, 0);
INSERT INTO plans VALUES('a', 1, X')sql",
                            absl::BytesToHexString(plan.SerializeAsString()), R"sql(');
)sql"));
  {
    std::unique_ptr<SqliteStateStore> store = Open();
    ASSERT_NE(store, nullptr);
    const StoredJob a = ::modelavg::testing::LoadPacedJob(*store, "a");
    EXPECT_EQ(a.header.generation, 4);
    ASSERT_EQ(a.members.size(), 1u);
    EXPECT_EQ(a.members[0].credential_digest, "d0");
    ASSERT_EQ(a.plan_changes.size(), 1u);
    EXPECT_EQ(a.plan_changes[0].switch_step(), 31);
    EXPECT_TRUE(a.paced_rounds.empty());
    JobDelta d;
    for (int64_t r : {0, 1}) d.paced_rounds.push_back(::modelavg::testing::MakePacedRound(r));
    ASSERT_TRUE(store->Apply("a", d).ok());
  }
  EXPECT_EQ(QueryOne(db(), "PRAGMA user_version"), "6");
  std::unique_ptr<SqliteStateStore> store = Open();
  ASSERT_NE(store, nullptr);
  const StoredJob a = ::modelavg::testing::LoadPacedJob(*store, "a");
  ::modelavg::testing::ExpectPacedRounds(a.paced_rounds, {0, 1});
  EXPECT_EQ(a.plan_changes.size(), 1u);
}

TEST_F(SqliteStateStoreTest, ClearCommIds_DropsTheOldGenerationsIds) {
  auto store = Open();
  ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  JobDelta publish;
  publish.comm_id = StoredCommId{0, 0, "", "old"};
  ASSERT_TRUE(store->Apply("a", publish).ok());
  JobDelta bump;
  bump.header = MembershipHeader{v1::PENDING, 2, std::nullopt};
  bump.clear_comm_ids = true;
  ASSERT_TRUE(store->Apply("a", bump).ok());
  EXPECT_TRUE((*store->LoadAll())[0].comm_ids.empty());
}

TEST_F(SqliteStateStoreTest, SecondOpen_RefusedNamingTheHolder) {
  auto first = Open();
  ASSERT_NE(first, nullptr);
  absl::StatusOr<std::unique_ptr<SqliteStateStore>> second = SqliteStateStore::Open(dir_);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("pid ", getpid(), " on host")));
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(dir_));
  first.reset();
  EXPECT_TRUE(SqliteStateStore::Open(dir_).ok());  // released with the first
}

// Issue: the lock was on DIR/coordinator.lock alone; once that file was deleted, a second
// coordinator started on the same directory. The lock is on the directory itself.
TEST_F(SqliteStateStoreTest, LockFileDeleted_SecondOpenStillRefused) {
  auto first = Open();
  ASSERT_NE(first, nullptr);
  ASSERT_EQ(unlink((dir_ + "/coordinator.lock").c_str()), 0);
  absl::StatusOr<std::unique_ptr<SqliteStateStore>> second = SqliteStateStore::Open(dir_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("in use by another coordinator"));
  EXPECT_TRUE(first->CreateJob(Spec("a"), 1).ok());
}

// Issue: after rm -rf of the state directory the coordinator answered OK while writing into
// deleted files.
TEST_F(SqliteStateStoreTest, DirectoryRemoved_WritesRefusedSayingSo) {
  auto store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  std::filesystem::remove_all(dir_);
  for (absl::Status s : {store->CreateJob(Spec("b"), 1), store->DeleteJob("a"),
                         store->Apply("a", JobDelta{MembershipHeader{}, {}, false, {}})}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("was removed while the coordinator ran"));
    EXPECT_THAT(std::string(s.message()), HasSubstr(dir_));
  }
}

TEST_F(SqliteStateStoreTest, DirectoryReplaced_SecondOpensTheNewOne_FirstRefusesWrites) {
  auto first = Open();
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(first->CreateJob(Spec("a"), 1).ok());
  std::filesystem::rename(dir_, root_ + "/moved");
  auto second = Open();  // a fresh, empty directory at the same path
  ASSERT_NE(second, nullptr);
  absl::Status s = first->CreateJob(Spec("b"), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("was replaced"));
  EXPECT_TRUE(second->CreateJob(Spec("c"), 1).ok());
}

TEST_F(SqliteStateStoreTest, StateFileRemoved_WritesRefused) {
  auto store = Open();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  ASSERT_EQ(unlink(db().c_str()), 0);
  absl::Status s = store->CreateJob(Spec("b"), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(db()));
}

TEST_F(SqliteStateStoreTest, RequireState_MissingOrEmptyDirectoryRefused_ExistingOpens) {
  absl::StatusOr<std::unique_ptr<SqliteStateStore>> store =
      SqliteStateStore::Open(dir_, /*require_state=*/true);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("does not exist"));
  EXPECT_FALSE(std::filesystem::exists(dir_)) << "nothing is made";
  std::filesystem::create_directories(dir_);
  store = SqliteStateStore::Open(dir_, /*require_state=*/true);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("holds no state file"));
  EXPECT_FALSE(std::filesystem::exists(db())) << "nothing is made";
  Open()->CreateJob(Spec("a"), 1).IgnoreError();
  store = SqliteStateStore::Open(dir_, /*require_state=*/true);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->LoadAll()->size(), 1u);
}

// Damages the state file with `damage` and expects Open to refuse it by name.
void ExpectRefused(const std::string& dir, const std::string& db) {
  absl::StatusOr<std::unique_ptr<SqliteStateStore>> store = SqliteStateStore::Open(dir);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(db));
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("backup"));
}

TEST_F(SqliteStateStoreTest, TruncatedFile_RefusedNamingIt) {
  {
    auto store = Open();
    ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  }  // closed: checkpointed into state.db
  const auto size = std::filesystem::file_size(db());
  ASSERT_GT(size, 4096u);
  std::filesystem::resize_file(db(), size / 2);
  ExpectRefused(dir_, db());
}

TEST_F(SqliteStateStoreTest, EmptyFile_RefusedNotStartedEmpty) {
  std::filesystem::create_directories(dir_);
  std::ofstream(db()).close();
  ExpectRefused(dir_, db());
}

TEST_F(SqliteStateStoreTest, GarbageFile_RefusedNamingIt) {
  {
    auto store = Open();
    ASSERT_TRUE(store->CreateJob(Spec("a"), 1).ok());
  }
  {
    std::fstream f(db(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f << "this is not an SQLite file, it was overwritten by something else";
  }
  ExpectRefused(dir_, db());
}

TEST_F(SqliteStateStoreTest, CorruptPage_RefusedNamingIt) {
  {
    auto store = Open();
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(store->CreateJob(Spec(absl::StrCat("j", i)), 1).ok());
  }
  ASSERT_GT(std::filesystem::file_size(db()), 3 * 4096u);
  {
    std::fstream f(db(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);  // page 2 and 3: table pages
    const std::string junk(2 * 4096, '\x5a');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  ExpectRefused(dir_, db());
}

TEST_F(SqliteStateStoreTest, NotADirectory_ClearError) {
  std::ofstream(root_ + "/file").close();
  absl::StatusOr<std::unique_ptr<SqliteStateStore>> store =
      SqliteStateStore::Open(root_ + "/file");
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("not a directory"));
}

class RegistryOnSqliteTest : public SqliteStateStoreTest {
 protected:
  std::unique_ptr<JobRegistry> Registry(SqliteStateStore* store) {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.store = store;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    return std::make_unique<JobRegistry>(options);
  }
  FakeClock clock_;
};

TEST_F(RegistryOnSqliteTest, Restart_ContinuesGenerationAndGivesGrace) {
  // rank -> its member's credential: stored (as a digest), so it still works after the restart.
  std::map<int, std::string> credentials;
  {
    auto store = Open();
    auto registry = Registry(store.get());
    ASSERT_TRUE(registry->CreateJob(Spec("a", 2), nullptr).ok());
    std::shared_ptr<Job> job = *registry->Find("a");
    for (int r = 0; r < 2; ++r) {
      v1::JoinRequest join;
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      job->Join(join, absl::InfiniteFuture(), registry->NewWaitId(),
                [](absl::StatusOr<v1::JoinResponse> r) { ASSERT_TRUE(r.ok()); });
    }
    clock_.Advance(absl::Seconds(4));
    registry->CheckStaleness();  // both dead: generation 2
    // Every member silent at once is ridden through for three heartbeat timeouts (the
    // coordinator may be the one cut off); past that the silent are dead.
    clock_.Advance(absl::Seconds(10));
    registry->CheckStaleness();
    for (int r = 0; r < 2; ++r) {
      v1::JoinRequest join;
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      job->Join(join, absl::InfiniteFuture(), registry->NewWaitId(),
                [&credentials](absl::StatusOr<v1::JoinResponse> r) {
                  ASSERT_TRUE(r.ok());
                  credentials[r->rank()] = r->credential();
                });
    }
    v1::Job proto;
    job->ToProto(&proto);
    ASSERT_EQ(proto.generation(), 2);
    ASSERT_EQ(proto.state(), v1::RUNNING);
    registry->Stop();
  }
  auto store = Open();
  auto registry = Registry(store.get());
  ASSERT_EQ(*registry->LoadFromStore(absl::Seconds(10)), 1);
  std::shared_ptr<Job> job = *registry->Find("a");
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 2);
  EXPECT_EQ(proto.state(), v1::RUNNING);
  EXPECT_EQ(proto.members_size(), 2);
  // Within the grace period nobody dies, though no heartbeat came for more than the timeout.
  clock_.Advance(absl::Seconds(9));
  registry->CheckStaleness();
  proto.Clear();
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 2);
  // Rank 0 re-attaches; rank 1 never does and dies once the grace period is over.
  v1::HeartbeatRequest hb;
  hb.set_rank(0);
  hb.set_generation(2);
  hb.set_credential(credentials[0]);
  v1::HeartbeatResponse reply;
  ASSERT_TRUE(job->Heartbeat(hb, &reply).ok());
  EXPECT_EQ(reply.generation(), 2);
  clock_.Advance(absl::Seconds(2));
  registry->CheckStaleness();
  proto.Clear();
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 3);  // never 2 again
  EXPECT_EQ(proto.members(1).state(), v1::DEAD);
  EXPECT_EQ(proto.members(0).state(), v1::ALIVE);
}

// An elastic job's survivors keep the generation they joined in while the round moves on; after
// a restart their heartbeats (which carry it) must still count.
TEST_F(RegistryOnSqliteTest, Restart_ElasticSurvivorsHeartbeatsStillCount) {
  v1::JobSpec spec = Spec("e", 4);
  spec.set_min_world_size(2);
  // rank -> its member's credential (stored as a digest: it survives the restart).
  std::map<int, std::string> credentials;
  auto heartbeat = [&credentials](Job& job, int rank, int64_t generation) {
    v1::HeartbeatRequest hb;
    hb.set_rank(rank);
    hb.set_credential(credentials[rank]);
    hb.set_generation(generation);
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(job.Heartbeat(hb, &reply).ok());
  };
  {
    auto store = Open();
    auto registry = Registry(store.get());
    ASSERT_TRUE(registry->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry->Find("e");
    for (int r = 0; r < 4; ++r) {
      v1::JoinRequest join;
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      job->Join(join, absl::InfiniteFuture(), registry->NewWaitId(),
                [&credentials](absl::StatusOr<v1::JoinResponse> r) {
                  ASSERT_TRUE(r.ok());
                  credentials[r->rank()] = r->credential();
                });
    }
    clock_.Advance(absl::Seconds(2));
    for (int r = 0; r < 3; ++r) heartbeat(*job, r, 1);
    clock_.Advance(absl::Seconds(2));
    registry->CheckStaleness();  // rank 3 dead: the job shrinks to generation 2, still RUNNING
    v1::Job proto;
    job->ToProto(&proto);
    ASSERT_EQ(proto.generation(), 2);
    ASSERT_EQ(proto.state(), v1::RUNNING);
    registry->Stop();
  }
  auto store = Open();
  auto registry = Registry(store.get());
  ASSERT_EQ(*registry->LoadFromStore(absl::Seconds(5)), 1);
  std::shared_ptr<Job> job = *registry->Find("e");
  // The survivors joined in generation 1 and say so; ranks 0 and 1 re-attach, rank 2 does not.
  clock_.Advance(absl::Seconds(4));
  heartbeat(*job, 0, 1);
  heartbeat(*job, 1, 1);
  clock_.Advance(absl::Seconds(2));
  registry->CheckStaleness();
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.members(0).state(), v1::ALIVE);
  EXPECT_EQ(proto.members(1).state(), v1::ALIVE);
  EXPECT_EQ(proto.members(2).state(), v1::DEAD);
  EXPECT_EQ(proto.generation(), 3);
  EXPECT_EQ(proto.state(), v1::RUNNING);  // shrunk again, to ranks 0 and 1
}

TEST_F(RegistryOnSqliteTest, MergeJobs_SameSpecKeptNewAddedDifferentRefusedNamingField) {
  {
    auto store = Open();
    auto registry = Registry(store.get());
    ASSERT_TRUE(registry->MergeJobs({Spec("a")}).ok());
    registry->Stop();
  }
  auto store = Open();
  auto registry = Registry(store.get());
  ASSERT_EQ(*registry->LoadFromStore(absl::Seconds(10)), 1);
  v1::JobSpec changed = Spec("a");
  changed.set_warmup_steps(17);
  absl::Status s = registry->MergeJobs({Spec("b"), changed});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("job \"a\""));
  EXPECT_THAT(std::string(s.message()), HasSubstr("warmup_steps"));
  EXPECT_FALSE(registry->Find("b").ok()) << "a conflict creates nothing";
  ASSERT_TRUE(registry->MergeJobs({Spec("b"), Spec("a")}).ok());
  EXPECT_EQ(registry->ListJobs().size(), 2u);
  EXPECT_EQ((*store->LoadAll()).size(), 2u);
}

// A replacement admitted before a restart keeps its admission step: the decisions after the
// restart are the same.
TEST_F(RegistryOnSqliteTest, Restart_ElasticAdmissionKept) {
  v1::JobSpec spec = Spec("e", 4);
  spec.set_min_world_size(2);
  std::map<int, std::string> credentials;
  auto join = [&credentials](JobRegistry& registry, Job& job, const std::string& worker,
                             std::optional<int> rank) {
    v1::JoinRequest request;
    request.set_worker_id(worker);
    if (rank.has_value()) request.set_rank(*rank);
    job.Join(request, absl::InfiniteFuture(), registry.NewWaitId(),
             [&credentials](absl::StatusOr<v1::JoinResponse> r) {
               ASSERT_TRUE(r.ok()) << r.status();
               credentials[r->rank()] = r->credential();
             });
  };
  auto heartbeat = [&credentials](Job& job, int rank, int64_t generation, int64_t step) {
    v1::HeartbeatRequest hb;
    hb.set_rank(rank);
    hb.set_credential(credentials[rank]);
    hb.set_generation(generation);
    hb.set_step(step);
    v1::HeartbeatResponse reply;
    ASSERT_TRUE(job.Heartbeat(hb, &reply).ok());
  };
  auto schedule = [](Job& job) {
    v1::GetScheduleRequest req;
    req.set_from_step(0);
    req.set_count(40);
    v1::GetScheduleResponse resp;
    EXPECT_TRUE(job.GetSchedule(req, &resp).ok());
    return resp.SerializeAsString();
  };
  std::string before;
  {
    auto store = Open();
    auto registry = Registry(store.get());
    ASSERT_TRUE(registry->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry->Find("e");
    for (int r = 0; r < 4; ++r) join(*registry, *job, absl::StrCat("w", r), r);
    clock_.Advance(absl::Seconds(2));
    for (int r = 0; r < 3; ++r) heartbeat(*job, r, 1, 9);
    clock_.Advance(absl::Seconds(2));
    registry->CheckStaleness();  // rank 3 dead: generation 2
    join(*registry, *job, "new", std::nullopt);
    v1::Job proto;
    job->ToProto(&proto);
    ASSERT_EQ(proto.generation(), 3);
    ASSERT_EQ(proto.members(3).admitted_step(), 12);  // floor 9 + 2 = 11 averages nothing
    before = schedule(*job);
    registry->Stop();
  }
  auto store = Open();
  auto registry = Registry(store.get());
  ASSERT_EQ(*registry->LoadFromStore(absl::Seconds(5)), 1);
  std::shared_ptr<Job> job = *registry->Find("e");
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 3);
  EXPECT_EQ(proto.state(), v1::RUNNING);
  EXPECT_EQ(proto.members(3).admitted_step(), 12);
  EXPECT_EQ(proto.members(3).worker_id(), "new");
  EXPECT_EQ(proto.members(0).admitted_step(), -1);
  EXPECT_EQ(schedule(*job), before);
}

}  // namespace
}  // namespace modelavg::server
