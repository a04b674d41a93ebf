// The Python interpreter as a ThreadSanitizer program (tests/sanitize.sh): CPython itself is not
// built for TSan, but the extension module modelavg._core of the TSan build is, and it needs the
// sanitizer's runtime in the program that loads it. This program is `python3` with that runtime
// (and tests/tools/tsan_absl_sync.cc, exported so that the module's calls into the system's
// Abseil reach it). Runs scripts exactly as python3 does: tsan-python script.py args...
#include <Python.h>

int main(int argc, char** argv) { return Py_BytesMain(argc, argv); }
