// A planted bug for each sanitizer, so that tests/sanitize.sh proves its builds still catch what
// they are for (a sanitizer silently off, e.g. a flag lost from the build, passes every other
// test): `use_after_free` reads freed memory (AddressSanitizer must report it), `data_race`
// writes one int from two threads without a lock (ThreadSanitizer must report it). The tests
// sanitizer_canary_asan and sanitizer_canary_tsan pass only on the sanitizer's report.
//   modelavg-sanitizer-canary use_after_free|data_race
#include <cstdio>
#include <cstring>
#include <thread>

namespace {

int UseAfterFree() {
  int* values = new int[16];
  for (int i = 0; i < 16; ++i) values[i] = i;
  delete[] values;
  // volatile: the read must happen, not be folded away.
  volatile int read = values[7];
  std::printf("read %d after free: no sanitizer caught it\n", read);
  return 0;
}

int DataRace() {
  int counter = 0;
  auto add = [&counter] {
    for (int i = 0; i < 1000; ++i) {
      counter = counter + 1;
    }
  };
  std::thread a(add);
  std::thread b(add);
  a.join();
  b.join();
  std::printf("counter %d after a race: no sanitizer caught it\n", counter);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "use_after_free") == 0) return UseAfterFree();
  if (argc == 2 && std::strcmp(argv[1], "data_race") == 0) return DataRace();
  std::fprintf(stderr, "usage: %s use_after_free|data_race\n", argv[0]);
  return 2;
}
