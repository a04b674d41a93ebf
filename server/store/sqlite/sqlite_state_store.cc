#include "server/store/sqlite/sqlite_state_store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

// PRAGMA application_id of every state file: "mavg".
constexpr int32_t kApplicationId = 0x6d617667;
// PRAGMA user_version: the schema below. A file with a higher one was written by a newer
// coordinator and is refused rather than misread.
// Version 2 added members.credential_digest; a version 1 file is upgraded in place (its members
// then have no credential and re-join). Version 3 added members.admitted_step; a version 2 file
// is upgraded in place (its members are of the starting world: -1). Version 4 added
// members.retired_by and members.retired_at_step (sharded replicas); a version 3 file is
// upgraded in place (nobody retired: -1 and 0). Version 5 added the plans table (UpdateJob); a
// version 4 file is upgraded in place (no job has been updated). Version 6 added the
// paced_rounds table (docs/paced.md); a version 5 file is upgraded in place (no job has planned
// a paced round).
constexpr int kSchemaVersion = 6;
// How long a write waits for a reader that holds the file (sqlite3's .backup, VACUUM INTO).
constexpr int kBusyTimeoutMs = 10000;

constexpr const char* kSchema = R"sql(
CREATE TABLE jobs(
  job_id TEXT PRIMARY KEY NOT NULL,
  spec BLOB NOT NULL,              -- modelavg.v1.JobSpec, binary protobuf, as created
  created_unix_ms INTEGER NOT NULL,
  state INTEGER NOT NULL,          -- modelavg.v1.JobState
  generation INTEGER NOT NULL,
  last_change BLOB                 -- modelavg.v1.GenerationChange or NULL
) WITHOUT ROWID;
CREATE TABLE members(
  job_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  worker_id TEXT NOT NULL,
  host TEXT NOT NULL,
  state INTEGER NOT NULL,          -- modelavg.v1.MemberState
  generation INTEGER NOT NULL,     -- the generation of the member's round
  joined_generation INTEGER NOT NULL,  -- the generation the worker joined in
  credential_digest TEXT NOT NULL DEFAULT '',  -- SHA-256 of its credential, never the credential
  admitted_step INTEGER NOT NULL DEFAULT -1,   -- a replacement's admission step; -1: from the start
  retired_by INTEGER NOT NULL DEFAULT -1,      -- RETIRED: the rank whose loss retired its replica
  retired_at_step INTEGER NOT NULL DEFAULT 0,  -- RETIRED: its first step outside the averaging
  PRIMARY KEY(job_id, rank)
) WITHOUT ROWID;
CREATE TABLE comm_ids(             -- the current generation's bootstrap ids
  job_id TEXT NOT NULL,
  level INTEGER NOT NULL,
  subgroup INTEGER NOT NULL,
  key TEXT NOT NULL,
  blob BLOB NOT NULL,
  PRIMARY KEY(job_id, level, subgroup, key)
) WITHOUT ROWID;
CREATE TABLE plans(                -- the plans UpdateJob accepted (version 0 is jobs.spec)
  job_id TEXT NOT NULL,
  version INTEGER NOT NULL,
  change BLOB NOT NULL,            -- modelavg.v1.PlanChange, binary protobuf
  PRIMARY KEY(job_id, version)
) WITHOUT ROWID;
CREATE TABLE paced_rounds(         -- a paced job's planned rounds still kept
  job_id TEXT NOT NULL,
  round INTEGER NOT NULL,
  record BLOB NOT NULL,            -- modelavg.v1.PacedRound, binary protobuf
  PRIMARY KEY(job_id, round)
) WITHOUT ROWID;
)sql";

// What to tell an operator whose state file cannot be used.
std::string DamagedAdvice(const std::string& path) {
  return absl::StrCat("; the coordinator will not start on it (that would forget every job). "
                      "Restore ",
                      path, " from a backup (README, \"Operations\"), or move it away to start "
                            "with no jobs");
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", dir, ": ", ErrnoText()));
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot fsync ", dir, ": ", ErrnoText()));
  return absl::OkStatus();
}

absl::Status MakePrivateDir(const std::string& dir) {
  if (mkdir(dir.c_str(), 0700) == 0) return absl::OkStatus();
  if (errno != EEXIST) {
    return absl::Status(errno == EACCES ? absl::StatusCode::kPermissionDenied
                                        : absl::StatusCode::kInternal,
                        absl::StrCat("cannot create the state directory ", dir, ": ", ErrnoText()));
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir ", dir, " exists and is not a directory"));
  }
  if ((st.st_mode & 0077) != 0) {
    spdlog::warn("state directory {} is accessible to group/others (mode {:o}); the files in it "
                 "are created private (0600)",
                 dir, st.st_mode & 0777);
  }
  return absl::OkStatus();
}

// Runs `sql` (no results) on `db`.
absl::Status ExecOn(sqlite3* db, const char* sql, const std::string& path) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err != nullptr ? err : sqlite3_errmsg(db);
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat(path, ": ", msg));
  }
  return absl::OkStatus();
}

// The first column of the first row of `sql`, as text ("" if no row).
absl::StatusOr<std::string> QueryText(sqlite3* db, const char* sql) {
  sqlite3_stmt* stmt = nullptr;
  int rc = sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr);
  if (rc != SQLITE_OK) return absl::DataLossError(sqlite3_errmsg(db));
  std::string out;
  rc = sqlite3_step(stmt);
  if (rc == SQLITE_ROW) {
    const unsigned char* text = sqlite3_column_text(stmt, 0);
    if (text != nullptr) out = reinterpret_cast<const char*>(text);
  } else if (rc != SQLITE_DONE) {
    std::string msg = sqlite3_errmsg(db);
    sqlite3_finalize(stmt);
    return absl::DataLossError(msg);
  }
  sqlite3_finalize(stmt);
  return out;
}

// Builds a fresh state file at `path`: made under a temporary name and renamed into place once
// complete, so that `path` is either absent or a whole state file.
absl::Status CreateStateFile(const std::string& dir, const std::string& path) {
  const std::string tmp = absl::StrCat(path, ".new");
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) {
    unlink(absl::StrCat(tmp, suffix).c_str());  // leftovers of an interrupted creation
  }
  const int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", ErrnoText()));
  }
  close(fd);
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(tmp.c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) {
    std::string msg = db != nullptr ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", msg));
  }
  absl::Status s = ExecOn(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;", tmp);
  if (s.ok()) {
    s = ExecOn(db,
               absl::StrCat("BEGIN IMMEDIATE;", kSchema, "PRAGMA application_id=", kApplicationId,
                            "; PRAGMA user_version=", kSchemaVersion, "; COMMIT;")
                   .c_str(),
               tmp);
  }
  // Closing checkpoints the WAL into the file and removes it.
  if (sqlite3_close(db) != SQLITE_OK && s.ok()) {
    s = absl::InternalError(absl::StrCat("cannot close ", tmp));
  }
  if (s.ok()) {
    const int sync_fd = open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
    if (sync_fd < 0 || fsync(sync_fd) != 0) {
      s = absl::InternalError(absl::StrCat("cannot fsync ", tmp, ": ", ErrnoText()));
    }
    if (sync_fd >= 0) close(sync_fd);
  }
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ErrnoText()));
  }
  if (s.ok()) s = SyncDir(dir);
  if (!s.ok()) unlink(tmp.c_str());
  return s;
}

}  // namespace

// A prepared statement, reset after each use.
class SqliteStateStore::Statement {
 public:
  Statement(sqlite3* db, sqlite3_stmt* stmt) : db_(db), stmt_(stmt) {}
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Statement& Bind(int i, absl::string_view v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& BindBlob(int i, absl::string_view v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& BindNull(int i) {
    sqlite3_bind_null(stmt_, i);
    return *this;
  }
  // Runs a statement without results; returns the rows it changed.
  absl::StatusOr<int> Run() {
    const int rc = sqlite3_step(stmt_);
    const int changed = sqlite3_changes(db_);
    std::string msg = rc == SQLITE_DONE || rc == SQLITE_ROW ? "" : sqlite3_errmsg(db_);
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    if (!msg.empty()) return absl::InternalError(msg);
    return changed;
  }
  // Runs a query; true if it returned a row.
  absl::StatusOr<bool> Exists() {
    const int rc = sqlite3_step(stmt_);
    std::string msg = rc == SQLITE_DONE || rc == SQLITE_ROW ? "" : sqlite3_errmsg(db_);
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    if (!msg.empty()) return absl::InternalError(msg);
    return rc == SQLITE_ROW;
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_;
};

absl::StatusOr<std::unique_ptr<SqliteStateStore>> SqliteStateStore::Open(const std::string& dir,
                                                                          bool require_state) {
  if (dir.empty()) return absl::InvalidArgumentError("--state_dir must not be empty");
  const std::string path = absl::StrCat(dir, "/state.db");
  const auto missing = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--require_state: ", what, "; the coordinator will not start empty (that would forget "
        "every job). Mount the volume that holds the state, restore it from a backup, or start "
        "once without --require_state to begin with no jobs"));
  };
  if (require_state && !FileExists(dir)) {
    return missing(absl::StrCat("the state directory ", dir, " does not exist"));
  }
  if (absl::Status s = MakePrivateDir(dir); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<DirLock>> lock = DirLock::Acquire(dir);
  if (!lock.ok()) return lock.status();
  if (!FileExists(path)) {
    if (require_state) {
      return missing(absl::StrCat("the state directory ", dir, " holds no state file (",
                                  path, ")"));
    }
    if (absl::Status s = CreateStateFile(dir, path); !s.ok()) return s;
    spdlog::info("state: created {}", path);
  }
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & 0077) != 0) {
    spdlog::warn("state: {} was accessible to group/others (mode {:o}); made it 0600", path,
                 st.st_mode & 0777);
    chmod(path.c_str(), 0600);
  }
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, nullptr) !=
      SQLITE_OK) {
    std::string msg = db != nullptr ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::InternalError(absl::StrCat("cannot open the state file ", path, ": ", msg));
  }
  auto damaged = [&](const std::string& what) {
    sqlite3_close(db);
    return absl::DataLossError(
        absl::StrCat("the state file ", path, " ", what, DamagedAdvice(path)));
  };
  sqlite3_busy_timeout(db, kBusyTimeoutMs);
  // Each check reads the file: a truncated or overwritten one fails here, not later.
  absl::StatusOr<std::string> app = QueryText(db, "PRAGMA application_id");
  if (!app.ok()) return damaged(absl::StrCat("cannot be read: ", app.status().message()));
  if (*app != std::to_string(kApplicationId)) {
    return damaged(*app == "0" ? "is empty or not a modelavg state file (no application id)"
                               : absl::StrCat("is not a modelavg state file (application id ",
                                              *app, ")"));
  }
  absl::StatusOr<std::string> version = QueryText(db, "PRAGMA user_version");
  if (!version.ok()) return damaged(absl::StrCat("cannot be read: ", version.status().message()));
  // Older schemas are upgraded in place, one version at a time, each step in one transaction.
  struct Upgrade {
    const char* from;
    const char* sql;
  };
  static constexpr Upgrade kUpgrades[] = {
      {"1",
       "BEGIN IMMEDIATE; ALTER TABLE members ADD COLUMN credential_digest TEXT NOT NULL "
       "DEFAULT ''; PRAGMA user_version=2; COMMIT;"},
      {"2",
       "BEGIN IMMEDIATE; ALTER TABLE members ADD COLUMN admitted_step INTEGER NOT NULL "
       "DEFAULT -1; PRAGMA user_version=3; COMMIT;"},
      {"3",
       "BEGIN IMMEDIATE; ALTER TABLE members ADD COLUMN retired_by INTEGER NOT NULL "
       "DEFAULT -1; ALTER TABLE members ADD COLUMN retired_at_step INTEGER NOT NULL DEFAULT 0; "
       "PRAGMA user_version=4; COMMIT;"},
      {"4",
       "BEGIN IMMEDIATE; CREATE TABLE plans(job_id TEXT NOT NULL, version INTEGER NOT NULL, "
       "change BLOB NOT NULL, PRIMARY KEY(job_id, version)) WITHOUT ROWID; "
       "PRAGMA user_version=5; COMMIT;"},
      {"5",
       "BEGIN IMMEDIATE; CREATE TABLE paced_rounds(job_id TEXT NOT NULL, round INTEGER NOT "
       "NULL, record BLOB NOT NULL, PRIMARY KEY(job_id, round)) WITHOUT ROWID; "
       "PRAGMA user_version=6; COMMIT;"},
  };
  for (const Upgrade& upgrade : kUpgrades) {
    if (*version != upgrade.from) continue;
    if (absl::Status s = ExecOn(db, upgrade.sql, path); !s.ok()) {
      ExecOn(db, "ROLLBACK", path).IgnoreError();
      sqlite3_close(db);
      return s;
    }
    spdlog::info("state file {}: schema upgraded from version {} to {}", path, upgrade.from,
                 std::stoi(upgrade.from) + 1);
    version = std::to_string(std::stoi(upgrade.from) + 1);
  }
  if (*version != std::to_string(kSchemaVersion)) {
    sqlite3_close(db);
    return absl::FailedPreconditionError(absl::StrCat(
        "the state file ", path, " has schema version ", *version, "; this coordinator reads "
        "version ", kSchemaVersion, " (was it written by a newer modelavg-coordinator?)"));
  }
  absl::StatusOr<std::string> check = QueryText(db, "PRAGMA quick_check");
  if (!check.ok()) return damaged(absl::StrCat("is damaged: ", check.status().message()));
  if (*check != "ok") return damaged(absl::StrCat("is damaged: ", *check));
  absl::StatusOr<std::string> mode = QueryText(db, "PRAGMA journal_mode=WAL");
  if (!mode.ok() || *mode != "wal") {
    return damaged(absl::StrCat("cannot use write-ahead logging: ",
                                mode.ok() ? *mode : std::string(mode.status().message())));
  }
  if (absl::Status s = ExecOn(db, "PRAGMA synchronous=FULL", path); !s.ok()) {
    sqlite3_close(db);
    return s;
  }
  if (stat(path.c_str(), &st) != 0) {
    sqlite3_close(db);
    return absl::InternalError(
        absl::StrCat("cannot stat the state file ", path, ": ", ErrnoText()));
  }
  std::unique_ptr<SqliteStateStore> store(
      new SqliteStateStore(path, *std::move(lock), db, st.st_dev, st.st_ino));
  if (absl::Status s = store->Prepare(); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("the state file ", path, " lacks the expected tables: ", s.message(),
                     DamagedAdvice(path)));
  }
  return store;
}

SqliteStateStore::SqliteStateStore(std::string path, std::unique_ptr<DirLock> lock, sqlite3* db,
                                   dev_t dev, ino_t ino)
    : path_(std::move(path)), lock_(std::move(lock)), file_dev_(dev), file_ino_(ino), db_(db) {}

SqliteStateStore::~SqliteStateStore() {
  absl::MutexLock lock(&mu_);
  insert_job_.reset();
  delete_job_.reset();
  delete_members_.reset();
  delete_comm_ids_.reset();
  update_header_.reset();
  upsert_member_.reset();
  delete_member_.reset();
  insert_comm_id_.reset();
  job_exists_.reset();
  delete_plans_.reset();
  insert_plan_.reset();
  delete_paced_rounds_.reset();
  upsert_paced_round_.reset();
  drop_paced_rounds_.reset();
  // A clean close checkpoints the WAL into state.db.
  sqlite3_close(db_);
}

absl::Status SqliteStateStore::Prepare() {
  absl::MutexLock lock(&mu_);
  struct {
    std::unique_ptr<Statement>* out;
    const char* sql;
  } statements[] = {
      {&insert_job_,
       "INSERT INTO jobs(job_id, spec, created_unix_ms, state, generation, last_change) "
       "VALUES(?1, ?2, ?3, ?4, ?5, NULL)"},
      {&delete_job_, "DELETE FROM jobs WHERE job_id = ?1"},
      {&delete_members_, "DELETE FROM members WHERE job_id = ?1"},
      {&delete_comm_ids_, "DELETE FROM comm_ids WHERE job_id = ?1"},
      {&update_header_,
       "UPDATE jobs SET state = ?2, generation = ?3, last_change = ?4 WHERE job_id = ?1"},
      {&upsert_member_,
       "INSERT OR REPLACE INTO members(job_id, rank, worker_id, host, state, generation, "
       "joined_generation, credential_digest, admitted_step, retired_by, retired_at_step) "
       "VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"},
      {&delete_member_, "DELETE FROM members WHERE job_id = ?1 AND rank = ?2"},
      {&insert_comm_id_,
       "INSERT OR REPLACE INTO comm_ids(job_id, level, subgroup, key, blob) "
       "VALUES(?1, ?2, ?3, ?4, ?5)"},
      {&job_exists_, "SELECT 1 FROM jobs WHERE job_id = ?1"},
      {&delete_plans_, "DELETE FROM plans WHERE job_id = ?1"},
      {&insert_plan_, "INSERT INTO plans(job_id, version, change) VALUES(?1, ?2, ?3)"},
      {&delete_paced_rounds_, "DELETE FROM paced_rounds WHERE job_id = ?1"},
      {&upsert_paced_round_,
       "INSERT OR REPLACE INTO paced_rounds(job_id, round, record) VALUES(?1, ?2, ?3)"},
      {&drop_paced_rounds_, "DELETE FROM paced_rounds WHERE job_id = ?1 AND round < ?2"},
  };
  for (auto& s : statements) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v3(db_, s.sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr) !=
        SQLITE_OK) {
      return absl::InternalError(sqlite3_errmsg(db_));
    }
    *s.out = std::make_unique<Statement>(db_, stmt);
  }
  return absl::OkStatus();
}

absl::Status SqliteStateStore::Error(const std::string& what, int code) {
  std::string why;
  switch ((code < 0 ? sqlite3_errcode(db_) : code) & 0xff) {
    case SQLITE_FULL:
      why = "; the disk is full: free space on the state volume";
      break;
    case SQLITE_READONLY:
      why = "; the state file or its volume is read-only: make it writable";
      break;
    case SQLITE_IOERR:
      why = "; an I/O error: check the state volume (dmesg)";
      break;
    case SQLITE_CANTOPEN:
      why = "; a file beside it cannot be opened: check the state directory";
      break;
    default:
      break;
  }
  // Give back the space the failed transaction took in the write-ahead log (a later write that
  // succeeds would otherwise fill the space just freed up again).
  if (sqlite3_wal_checkpoint_v2(db_, nullptr, SQLITE_CHECKPOINT_TRUNCATE, nullptr, nullptr) !=
      SQLITE_OK) {
    spdlog::warn("state: could not checkpoint {} after a failed write: {}", path_,
                 sqlite3_errmsg(db_));
  }
  return absl::UnavailableError(absl::StrCat("cannot write ", path_, ": ", what, why));
}

absl::Status SqliteStateStore::CheckInPlace() {
  absl::Status s = lock_->Check();
  if (s.ok()) {
    struct stat st;
    if (stat(path_.c_str(), &st) != 0) {
      s = absl::UnavailableError(absl::StrCat(
          "the state file ", path_, " was removed while the coordinator ran; what it writes now "
          "would be lost, so it writes nothing. Restore it and restart the coordinator"));
    } else if (st.st_dev != file_dev_ || st.st_ino != file_ino_) {
      s = absl::UnavailableError(absl::StrCat(
          "the state file ", path_, " was replaced while the coordinator ran; what it writes now "
          "would go to the old one, so it writes nothing. Restart the coordinator"));
    }
  }
  if (!s.ok() && !moved_logged_) spdlog::error("state: {}", std::string(s.message()));
  moved_logged_ = !s.ok();
  return s;
}

absl::Status SqliteStateStore::Exec(const char* sql) { return ExecOn(db_, sql, path_); }

absl::StatusOr<std::vector<StoredJob>> SqliteStateStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<StoredJob> jobs;
  auto damaged = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("the state file ", path_, " ", what,
                                            DamagedAdvice(path_)));
  };
  sqlite3_stmt* stmt = nullptr;
  auto query = [&](const char* sql) -> absl::Status {
    if (sqlite3_prepare_v2(db_, sql, -1, &stmt, nullptr) != SQLITE_OK) {
      return damaged(absl::StrCat("cannot be read: ", sqlite3_errmsg(db_)));
    }
    return absl::OkStatus();
  };
  auto blob = [&](int col) {
    const void* p = sqlite3_column_blob(stmt, col);
    return p == nullptr ? std::string()
                        : std::string(static_cast<const char*>(p),
                                      static_cast<size_t>(sqlite3_column_bytes(stmt, col)));
  };
  auto text = [&](int col) {
    const unsigned char* p = sqlite3_column_text(stmt, col);
    return p == nullptr ? std::string() : std::string(reinterpret_cast<const char*>(p));
  };
  auto finish = [&](int rc) -> absl::Status {
    std::string msg = rc == SQLITE_DONE ? "" : sqlite3_errmsg(db_);
    sqlite3_finalize(stmt);
    stmt = nullptr;
    if (!msg.empty()) return damaged(absl::StrCat("cannot be read: ", msg));
    return absl::OkStatus();
  };

  if (absl::Status s = query("SELECT job_id, spec, created_unix_ms, state, generation, "
                             "last_change FROM jobs ORDER BY job_id");
      !s.ok()) {
    return s;
  }
  int rc;
  std::vector<std::string> bad;
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    StoredJob job;
    const std::string id = text(0);
    if (!job.spec.ParseFromString(blob(1)) || job.spec.job_id() != id) {
      bad.push_back(absl::StrCat("job ", id, ": unreadable spec"));
      continue;
    }
    job.created_unix_ms = sqlite3_column_int64(stmt, 2);
    const int64_t state = sqlite3_column_int64(stmt, 3);
    if (!v1::JobState_IsValid(static_cast<int>(state))) {
      bad.push_back(absl::StrCat("job ", id, ": state ", state));
      continue;
    }
    job.header.state = static_cast<v1::JobState>(state);
    job.header.generation = sqlite3_column_int64(stmt, 4);
    if (sqlite3_column_type(stmt, 5) != SQLITE_NULL) {
      v1::GenerationChange change;
      if (!change.ParseFromString(blob(5))) {
        bad.push_back(absl::StrCat("job ", id, ": unreadable last_change"));
        continue;
      }
      job.header.last_change = std::move(change);
    }
    jobs.push_back(std::move(job));
  }
  if (absl::Status s = finish(rc); !s.ok()) return s;
  if (!bad.empty()) return damaged(absl::StrCat("holds unreadable rows (", bad[0], ")"));

  // Jobs are in job_id order; members and ids are read in the same order and matched up.
  size_t j = 0;
  auto find = [&](const std::string& id) -> StoredJob* {
    while (j < jobs.size() && jobs[j].spec.job_id() < id) ++j;
    return j < jobs.size() && jobs[j].spec.job_id() == id ? &jobs[j] : nullptr;
  };
  if (absl::Status s = query("SELECT job_id, rank, worker_id, host, state, generation, "
                             "joined_generation, credential_digest, admitted_step, retired_by, "
                             "retired_at_step FROM members ORDER BY job_id, rank");
      !s.ok()) {
    return s;
  }
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    StoredJob* job = find(text(0));
    if (job == nullptr) continue;  // rows of a deleted job cannot exist; ignore defensively
    Member m;
    m.rank = static_cast<int32_t>(sqlite3_column_int64(stmt, 1));
    m.worker_id = text(2);
    m.host = text(3);
    const int64_t state = sqlite3_column_int64(stmt, 4);
    m.state = v1::MemberState_IsValid(static_cast<int>(state))
                  ? static_cast<v1::MemberState>(state)
                  : v1::MEMBER_STATE_UNSPECIFIED;
    m.generation = sqlite3_column_int64(stmt, 5);
    m.joined_generation = sqlite3_column_int64(stmt, 6);
    m.credential_digest = text(7);
    m.admitted_step = sqlite3_column_int64(stmt, 8);
    m.retired_by = static_cast<int32_t>(sqlite3_column_int64(stmt, 9));
    m.retired_at_step = sqlite3_column_int64(stmt, 10);
    if (m.rank < 0 || m.rank >= job->spec.world_size()) {
      bad.push_back(absl::StrCat("job ", job->spec.job_id(), ": rank ", m.rank));
      continue;
    }
    job->members.push_back(std::move(m));
  }
  if (absl::Status s = finish(rc); !s.ok()) return s;
  if (!bad.empty()) return damaged(absl::StrCat("holds unreadable rows (", bad[0], ")"));

  j = 0;
  if (absl::Status s = query("SELECT job_id, level, subgroup, key, blob FROM comm_ids ORDER BY "
                             "job_id, level, subgroup, key");
      !s.ok()) {
    return s;
  }
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    StoredJob* job = find(text(0));
    if (job == nullptr) continue;
    job->comm_ids.push_back(StoredCommId{static_cast<int32_t>(sqlite3_column_int64(stmt, 1)),
                                         static_cast<int32_t>(sqlite3_column_int64(stmt, 2)),
                                         text(3), blob(4)});
  }
  if (absl::Status s = finish(rc); !s.ok()) return s;

  j = 0;
  if (absl::Status s = query("SELECT job_id, version, change FROM plans ORDER BY job_id, version");
      !s.ok()) {
    return s;
  }
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    StoredJob* job = find(text(0));
    if (job == nullptr) continue;
    v1::PlanChange change;
    if (!change.ParseFromString(blob(2)) || change.version() != sqlite3_column_int64(stmt, 1)) {
      bad.push_back(absl::StrCat("job ", job->spec.job_id(), ": plan version ",
                                 sqlite3_column_int64(stmt, 1)));
      continue;
    }
    job->plan_changes.push_back(std::move(change));
  }
  if (absl::Status s = finish(rc); !s.ok()) return s;
  if (!bad.empty()) return damaged(absl::StrCat("holds unreadable rows (", bad[0], ")"));

  j = 0;
  if (absl::Status s = query("SELECT job_id, round, record FROM paced_rounds ORDER BY job_id, "
                             "round");
      !s.ok()) {
    return s;
  }
  while ((rc = sqlite3_step(stmt)) == SQLITE_ROW) {
    StoredJob* job = find(text(0));
    if (job == nullptr) continue;
    v1::PacedRound round;
    if (!round.ParseFromString(blob(2)) || round.round() != sqlite3_column_int64(stmt, 1)) {
      bad.push_back(absl::StrCat("job ", job->spec.job_id(), ": paced round ",
                                 sqlite3_column_int64(stmt, 1)));
      continue;
    }
    job->paced_rounds.push_back(std::move(round));
  }
  if (absl::Status s = finish(rc); !s.ok()) return s;
  if (!bad.empty()) return damaged(absl::StrCat("holds unreadable rows (", bad[0], ")"));
  return jobs;
}

absl::Status SqliteStateStore::CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckInPlace(); !s.ok()) return s;
  absl::StatusOr<bool> exists = job_exists_->Bind(1, spec.job_id()).Exists();
  if (!exists.ok()) return Error(std::string(exists.status().message()));
  if (*exists) {
    return absl::AlreadyExistsError(absl::StrCat("job ", spec.job_id(), " is already stored"));
  }
  // One statement: committed (and fsync'ed) on its own.
  absl::StatusOr<int> done = insert_job_->Bind(1, spec.job_id())
                                 .BindBlob(2, spec.SerializeAsString())
                                 .Bind(3, created_unix_ms)
                                 .Bind(4, int64_t{v1::PENDING})
                                 .Bind(5, int64_t{1})
                                 .Run();
  if (!done.ok()) return Error(std::string(done.status().message()));
  return absl::OkStatus();
}

absl::Status SqliteStateStore::DeleteJob(absl::string_view job_id) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckInPlace(); !s.ok()) return s;
  if (absl::Status s = Exec("BEGIN IMMEDIATE"); !s.ok()) return Error(std::string(s.message()));
  absl::Status s;
  for (Statement* st : {delete_comm_ids_.get(), delete_members_.get(), delete_plans_.get(),
                        delete_paced_rounds_.get(), delete_job_.get()}) {
    absl::StatusOr<int> done = st->Bind(1, job_id).Run();
    if (!done.ok()) {
      s = done.status();
      break;
    }
  }
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) {
    const int code = sqlite3_errcode(db_);
    Exec("ROLLBACK").IgnoreError();
    return Error(std::string(s.message()), code);
  }
  return absl::OkStatus();
}

absl::Status SqliteStateStore::Apply(absl::string_view job_id, const JobDelta& delta) {
  if (delta.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckInPlace(); !s.ok()) return s;
  if (absl::Status s = Exec("BEGIN IMMEDIATE"); !s.ok()) return Error(std::string(s.message()));
  absl::Status s = ApplyLocked(job_id, delta);
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) {
    const int code = sqlite3_errcode(db_);
    Exec("ROLLBACK").IgnoreError();
    if (s.code() == absl::StatusCode::kNotFound) return s;
    return Error(std::string(s.message()), code);
  }
  return absl::OkStatus();
}

absl::Status SqliteStateStore::ApplyLocked(absl::string_view job_id, const JobDelta& delta) {
  if (delta.header.has_value()) {
    const MembershipHeader& h = *delta.header;
    update_header_->Bind(1, job_id).Bind(2, int64_t{h.state}).Bind(3, h.generation);
    if (h.last_change.has_value()) {
      update_header_->BindBlob(4, h.last_change->SerializeAsString());
    } else {
      update_header_->BindNull(4);
    }
    absl::StatusOr<int> changed = update_header_->Run();
    if (!changed.ok()) return changed.status();
    if (*changed == 0) return absl::NotFoundError(absl::StrCat("job ", job_id, " is not stored"));
  } else {
    absl::StatusOr<bool> exists = job_exists_->Bind(1, job_id).Exists();
    if (!exists.ok()) return exists.status();
    if (!*exists) return absl::NotFoundError(absl::StrCat("job ", job_id, " is not stored"));
  }
  for (const Member& m : delta.members) {
    absl::StatusOr<int> done =
        m.worker_id.empty()
            ? delete_member_->Bind(1, job_id).Bind(2, int64_t{m.rank}).Run()
            : upsert_member_->Bind(1, job_id)
                  .Bind(2, int64_t{m.rank})
                  .Bind(3, m.worker_id)
                  .Bind(4, m.host)
                  .Bind(5, int64_t{m.state})
                  .Bind(6, m.generation)
                  .Bind(7, m.joined_generation > 0 ? m.joined_generation : m.generation)
                  .Bind(8, m.credential_digest)
                  .Bind(9, m.admitted_step)
                  .Bind(10, int64_t{m.retired_by})
                  .Bind(11, m.retired_at_step)
                  .Run();
    if (!done.ok()) return done.status();
  }
  if (delta.clear_comm_ids) {
    absl::StatusOr<int> done = delete_comm_ids_->Bind(1, job_id).Run();
    if (!done.ok()) return done.status();
  }
  if (delta.comm_id.has_value()) {
    const StoredCommId& c = *delta.comm_id;
    absl::StatusOr<int> done = insert_comm_id_->Bind(1, job_id)
                                   .Bind(2, int64_t{c.level})
                                   .Bind(3, int64_t{c.subgroup})
                                   .Bind(4, c.key)
                                   .BindBlob(5, c.blob)
                                   .Run();
    if (!done.ok()) return done.status();
  }
  if (delta.plan_change.has_value()) {
    absl::StatusOr<int> done = insert_plan_->Bind(1, job_id)
                                   .Bind(2, int64_t{delta.plan_change->version()})
                                   .BindBlob(3, delta.plan_change->SerializeAsString())
                                   .Run();
    if (!done.ok()) return done.status();
  }
  for (const v1::PacedRound& r : delta.paced_rounds) {
    absl::StatusOr<int> done = upsert_paced_round_->Bind(1, job_id)
                                   .Bind(2, r.round())
                                   .BindBlob(3, r.SerializeAsString())
                                   .Run();
    if (!done.ok()) return done.status();
  }
  // After the writes: a round below the drop is gone even if this delta wrote it.
  if (delta.drop_paced_rounds_before > 0) {
    absl::StatusOr<int> done =
        drop_paced_rounds_->Bind(1, job_id).Bind(2, delta.drop_paced_rounds_before).Run();
    if (!done.ok()) return done.status();
  }
  return absl::OkStatus();
}

std::string SqliteStateStore::Describe() const {
  return absl::StrCat("SQLite ", path_, " (WAL, synchronous=FULL)");
}

}  // namespace modelavg::server
