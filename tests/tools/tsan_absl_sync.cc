// ThreadSanitizer and the system's Abseil: Debian's libabsl is not built with -fsanitize=thread,
// so TSan cannot see absl::Mutex or absl::Notification synchronise, and would report every access
// they guard as a race. Linked into the TSan build's test binaries only (tests/sanitize.sh), this
// file interposes their entry points: each calls the library's own function (found with
// dlsym(RTLD_NEXT)) and tells TSan what it did (__tsan_acquire after a lock is taken,
// __tsan_release before it is given up), so the reports left are real races in modelavg's code.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {

template <typename Fn>
Fn Real(const char* mangled) {
  void* f = dlsym(RTLD_NEXT, mangled);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: %s not found in the Abseil library\n", mangled);
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

// Abseil's deadlock detection keeps a graph of the locks in memory of its own (uninstrumented
// allocator, instrumented memmove): TSan would take its bookkeeping for races. Off in this build.
const bool kNoDeadlockGraph = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// Each name below is the Itanium mangling of the member it defines, in the inline namespace of
// the installed Abseil (ABSL_NAMESPACE_BEGIN): built from the namespace's name.
#define MODELAVG_NS_STR2(x) #x
#define MODELAVG_NS_STR(x) MODELAVG_NS_STR2(x)
#define MODELAVG_NS MODELAVG_NS_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME)

namespace {
// "_ZN[K]4absl<len><ns>" + rest (K: a const member function).
const char* Sym(const char* rest, bool konst = false) {
  static thread_local char buf[256];
  const char* ns = MODELAVG_NS;
  int len = 0;
  while (ns[len] != '\0') ++len;
  std::snprintf(buf, sizeof(buf), "_ZN%s4absl%d%s%s", konst ? "K" : "", len, ns, rest);
  return buf;
}
}  // namespace

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>(Sym("5Mutex4LockEv"));
  real(this);
  __tsan_acquire(this);
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>(Sym("5Mutex6UnlockEv"));
  __tsan_release(this);
  real(this);
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>(Sym("5Mutex7TryLockEv"));
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>(Sym("5Mutex10ReaderLockEv"));
  real(this);
  __tsan_acquire(this);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>(Sym("5Mutex12ReaderUnlockEv"));
  __tsan_release(this);
  real(this);
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>(Sym("5Mutex8LockWhenERKNS0_9ConditionE"));
  real(this, cond);
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      Sym("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  const bool r = real(this, cond, timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      Sym("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  const bool r = real(this, cond, deadline);
  __tsan_acquire(this);
  return r;
}

// Await releases the lock while it waits and takes it again before it returns.
void Mutex::Await(const Condition& cond) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>(Sym("5Mutex5AwaitERKNS0_9ConditionE"));
  __tsan_release(this);
  real(this, cond);
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      Sym("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"));
  __tsan_release(this);
  const bool r = real(this, cond, timeout);
  __tsan_acquire(this);
  return r;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      Sym("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"));
  __tsan_release(this);
  const bool r = real(this, cond, deadline);
  __tsan_acquire(this);
  return r;
}

void Notification::Notify() {
  static const auto real = Real<void (*)(Notification*)>(Sym("12Notification6NotifyEv"));
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  static const auto real =
      Real<void (*)(const Notification*)>(Sym("12Notification19WaitForNotificationEv", true));
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const auto real = Real<bool (*)(const Notification*, Duration)>(
      Sym("12Notification30WaitForNotificationWithTimeoutENS0_8DurationE", true));
  const bool r = real(this, timeout);
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const auto real = Real<bool (*)(const Notification*, Time)>(
      Sym("12Notification31WaitForNotificationWithDeadlineENS0_4TimeE", true));
  const bool r = real(this, deadline);
  if (r) __tsan_acquire(const_cast<Notification*>(this));
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl
