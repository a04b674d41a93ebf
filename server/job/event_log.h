// A job's recent history for people (the status page): its last events and its last generation
// changes with their reasons, each bounded. Soft state: kept in memory only, begun anew when the
// coordinator restarts. No lock (the Job's mutex guards it).
#ifndef MODELAVG_SERVER_JOB_EVENT_LOG_H_
#define MODELAVG_SERVER_JOB_EVENT_LOG_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

struct LoggedEvent {
  v1::JobEvent::Kind kind = v1::JobEvent::KIND_UNSPECIFIED;
  int32_t rank = -1;
  std::string message;
  int64_t unix_ms = 0;
  // The job's generation after the event.
  int64_t generation = 0;
};

class EventLog {
 public:
  // Most events and generation changes kept (older ones are dropped first).
  static constexpr size_t kMaxEvents = 50;
  static constexpr size_t kMaxGenerations = 50;

  void AddEvent(LoggedEvent event) {
    events_.push_back(std::move(event));
    if (events_.size() > kMaxEvents) events_.pop_front();
  }
  void AddGeneration(v1::GenerationChange change) {
    generations_.push_back(std::move(change));
    if (generations_.size() > kMaxGenerations) generations_.pop_front();
  }
  // Oldest first.
  std::vector<LoggedEvent> events() const { return {events_.begin(), events_.end()}; }
  std::vector<v1::GenerationChange> generations() const {
    return {generations_.begin(), generations_.end()};
  }

 private:
  std::deque<LoggedEvent> events_;
  std::deque<v1::GenerationChange> generations_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_EVENT_LOG_H_
