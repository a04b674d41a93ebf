// The writes of one server stream of the callback API. gRPC allows one write in flight per
// stream, so the others wait here, and Finish may come only once that write is done: both
// streaming reactors (WatchJob, HeartbeatStream) hand their writes and their end to one of these.
#ifndef MODELAVG_SERVER_RPC_STREAM_WRITES_H_
#define MODELAVG_SERVER_RPC_STREAM_WRITES_H_

#include <cstddef>
#include <deque>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/status_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/status_conversion.h"

namespace modelavg::server {

// `Reactor` has StartWrite(const grpc::ByteBuffer*) and Finish(grpc::Status) (a
// grpc::ServerWriteReactor or ServerBidiReactor). Thread-safe: writes and the end may come from
// any thread; the reactor is called outside the lock.
template <typename Reactor>
class StreamWrites {
 public:
  // What a write does when `max_waiting` writes already wait behind the one in flight.
  enum class WhenFull {
    kReplaceNewest,  // it replaces the newest waiting write (only the latest news matters)
    kRefuse,         // it is refused (the caller decides: usually it ends the stream)
  };
  enum class Queued {
    kWriting,    // started at once
    kWaiting,    // waits for the write in flight
    kFull,       // refused: kRefuse and max_waiting writes wait already
    kFinishing,  // refused: the stream is ending (or its reactor is gone)
  };

  // `broken` is the message of the CANCELLED status that a failed write ends the stream with.
  StreamWrites(Reactor* reactor, size_t max_waiting, WhenFull when_full, std::string broken)
      : reactor_(reactor), max_waiting_(max_waiting), when_full_(when_full),
        broken_(std::move(broken)) {}

  Queued Write(grpc::ByteBuffer bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    Reactor* start = nullptr;
    const grpc::ByteBuffer* first = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (ending_ || reactor_ == nullptr) return Queued::kFinishing;
      const size_t waiting = queue_.empty() ? 0 : queue_.size() - 1;
      if (writing_ && waiting >= max_waiting_) {
        if (when_full_ == WhenFull::kRefuse || waiting == 0) return Queued::kFull;
        queue_.back() = std::move(bytes);
        return Queued::kWaiting;
      }
      // (std::deque keeps references to its front valid as it grows at the back.)
      queue_.push_back(std::move(bytes));
      if (writing_) return Queued::kWaiting;
      writing_ = true;
      start = reactor_;
      first = &queue_.front();
    }
    start->StartWrite(first);
    return Queued::kWriting;
  }

  // From the reactor's OnWriteDone: starts the next waiting write, or the deferred Finish. A
  // failed write ends the stream at once (CANCELLED, `broken`). True when the stream is then
  // idle: no write in flight and not ending.
  bool OnWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    Reactor* reactor = nullptr;
    const grpc::ByteBuffer* next = nullptr;
    absl::Status finish;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      reactor = reactor_;
      if (!ok) {
        queue_.clear();
        writing_ = false;
        if (finished_) return false;
        if (!ending_) end_status_ = absl::CancelledError(broken_);
        ending_ = true;
      } else if (!queue_.empty()) {
        next = &queue_.front();
      } else {
        writing_ = false;
        if (!ending_) return true;
        if (finished_) return false;
      }
      if (next == nullptr) {
        finished_ = true;
        finish = end_status_;
      }
    }
    if (reactor == nullptr) return false;
    if (next != nullptr) {
      reactor->StartWrite(next);
    } else {
      reactor->Finish(ToGrpcStatus(finish));
    }
    return false;
  }

  // Finishes the stream with `status` once the writes queued before are done (at once when none
  // is in flight). The first end stands; later writes are refused.
  void End(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    Reactor* finish = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (ending_ || reactor_ == nullptr) return;
      ending_ = true;
      end_status_ = status;
      if (writing_) return;  // OnWriteDone finishes
      finished_ = true;
      finish = reactor_;
    }
    finish->Finish(ToGrpcStatus(status));
  }

  // End was called, the stream broke, or the reactor is gone.
  bool ending() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return ending_ || reactor_ == nullptr;
  }
  // The code the stream was finished with; OK before.
  absl::StatusCode final_code() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return finished_ ? end_status_.code() : absl::StatusCode::kOk;
  }
  // The reactor is gone (its OnDone); later calls do nothing. For an owner that outlives it.
  void Detach() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  mutable absl::Mutex mu_;
  Reactor* reactor_ ABSL_GUARDED_BY(mu_);
  const size_t max_waiting_;
  const WhenFull when_full_;
  const std::string broken_;
  // The write in flight (front, while writing_) and those waiting behind it.
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;    // End was called or a write failed
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called (or is being)
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_STREAM_WRITES_H_
