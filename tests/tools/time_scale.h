// Stretches a test's timeouts where the build runs slower than its timing assumes: under
// ThreadSanitizer (about 5-15x slower, and gRPC's handshakes with it) and AddressSanitizer the
// timeouts a test grants (heartbeat timeouts, join and RPC deadlines) are multiplied, so that a
// slow machine is not mistaken for a dead peer. MODELAVG_TEST_TIME_SCALE=<factor> overrides the
// factor (>= 1). Only the time a test *allows* scales: a wait that must run out (a timeout the
// test expects to pass) keeps its own value.
#ifndef MODELAVG_TESTS_TOOLS_TIME_SCALE_H_
#define MODELAVG_TESTS_TOOLS_TIME_SCALE_H_

#include <cstdlib>

#include "absl/time/time.h"

namespace modelavg::testing {

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MODELAVG_TESTING_SLOW_BUILD_SCALE 5.0
#elif __has_feature(address_sanitizer)
#define MODELAVG_TESTING_SLOW_BUILD_SCALE 2.0
#endif
#endif
#if !defined(MODELAVG_TESTING_SLOW_BUILD_SCALE) && defined(__SANITIZE_THREAD__)
#define MODELAVG_TESTING_SLOW_BUILD_SCALE 5.0
#endif
#if !defined(MODELAVG_TESTING_SLOW_BUILD_SCALE) && defined(__SANITIZE_ADDRESS__)
#define MODELAVG_TESTING_SLOW_BUILD_SCALE 2.0
#endif
#ifndef MODELAVG_TESTING_SLOW_BUILD_SCALE
#define MODELAVG_TESTING_SLOW_BUILD_SCALE 1.0
#endif

// The factor: MODELAVG_TEST_TIME_SCALE when set to a number >= 1, else the build's.
inline double TimeScale() {
  static const double scale = [] {
    if (const char* env = std::getenv("MODELAVG_TEST_TIME_SCALE"); env != nullptr && *env) {
      const double f = std::strtod(env, nullptr);
      if (f >= 1) return f;
    }
    return MODELAVG_TESTING_SLOW_BUILD_SCALE;
  }();
  return scale;
}

// `d` stretched by TimeScale().
inline absl::Duration Scaled(absl::Duration d) { return d * TimeScale(); }

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_TIME_SCALE_H_
