// The coordinator's hard state in SQLite under --state_dir (DIR/state.db, with DIR/state.db-wal
// and DIR/state.db-shm beside it, and DIR/coordinator.lock, see server/store/sqlite/dir_lock.h).
//
// * WAL journal, synchronous=FULL: a transition is in the WAL file and fsync'ed before Apply
//   returns, so an acknowledged change survives kill -9 and also a crash or power loss of the
//   node (a rescheduled coordinator may come back on another node with the same volume).
//   Transitions are rare (join, leave, death, one id per subgroup and generation), so the fsync
//   is paid only there; steps and heartbeats never write.
// * The directory and files are private (0700/0600): the ids are communicator bootstrap secrets.
// * Open refuses a file it did not write, or a damaged one, naming it; a fresh file is built
//   under a temporary name and renamed, so an empty or half-made state.db is always an error.
//   With `require_state` (--require_state) a missing directory or state.db is an error too,
//   rather than the start of an empty coordinator (a volume that was not mounted).
// * Every write first checks that the directory and state.db are still the ones it opened
//   (DirLock::Check, the file's inode): a removed or replaced directory is refused with
//   UNAVAILABLE, never written into deleted files.
// * A failed write (disk full, read-only, I/O error) is rolled back and answered UNAVAILABLE
//   saying why; the write-ahead log is then checkpointed and truncated, giving its space back.
#ifndef MODELAVG_SERVER_STORE_SQLITE_SQLITE_STATE_STORE_H_
#define MODELAVG_SERVER_STORE_SQLITE_SQLITE_STATE_STORE_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/store/sqlite/dir_lock.h"
#include "server/store/state_store.h"

struct sqlite3;
struct sqlite3_stmt;

namespace modelavg::server {

class SqliteStateStore final : public StateStore {
 public:
  // Locks `dir` (created 0700 if missing) and opens or creates DIR/state.db. Errors:
  //   FAILED_PRECONDITION  another coordinator holds the directory (naming it)
  //   DATA_LOSS            state.db is damaged, truncated or not a modelavg state file
  //   PERMISSION_DENIED / INTERNAL  the directory or file cannot be made or opened
  //   FAILED_PRECONDITION  `require_state` and the directory or DIR/state.db is missing
  static absl::StatusOr<std::unique_ptr<SqliteStateStore>> Open(const std::string& dir,
                                                                bool require_state = false);
  ~SqliteStateStore() override;

  absl::StatusOr<std::vector<StoredJob>> LoadAll() override;
  absl::Status CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) override;
  absl::Status DeleteJob(absl::string_view job_id) override;
  absl::Status Apply(absl::string_view job_id, const JobDelta& delta) override;
  std::string Describe() const override;

  const std::string& path() const { return path_; }

 private:
  class Statement;
  SqliteStateStore(std::string path, std::unique_ptr<DirLock> lock, sqlite3* db, dev_t dev,
                   ino_t ino);
  absl::Status Prepare();
  // UNAVAILABLE for a failed write: `what` and, from SQLite's error code, why and what to do.
  // Gives the write-ahead log's space back.
  // `code`: SQLite's error code (-1: the connection's latest).
  absl::Status Error(const std::string& what, int code = -1) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK while the directory and the file are the ones opened (see the top of this file).
  absl::Status CheckInPlace() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyLocked(absl::string_view job_id, const JobDelta& delta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const std::unique_ptr<DirLock> lock_;
  const dev_t file_dev_;
  const ino_t file_ino_;
  mutable absl::Mutex mu_;
  // The last CheckInPlace failure was logged (logged once, not at every refused write).
  bool moved_logged_ ABSL_GUARDED_BY(mu_) = false;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
  std::unique_ptr<Statement> insert_job_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_job_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_members_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_comm_ids_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> update_header_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> upsert_member_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_member_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> insert_comm_id_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> job_exists_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_plans_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> insert_plan_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> delete_paced_rounds_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> upsert_paced_round_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Statement> drop_paced_rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_SQLITE_SQLITE_STATE_STORE_H_
