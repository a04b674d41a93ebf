// Temporary folders for tests: named modelavg-test-<name>.XXXXXX under $TEST_TMPDIR, $TMPDIR
// or /tmp (tests/run_all.sh gives the tests a private TMPDIR and fails if anything is left in it).
#ifndef MODELAVG_TESTS_TOOLS_TEMP_DIR_H_
#define MODELAVG_TESTS_TOOLS_TEMP_DIR_H_

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"

namespace modelavg::testing {

// A fresh directory modelavg-test-<name>.XXXXXX under $TEST_TMPDIR, $TMPDIR or /tmp ("" if
// none can be made). See TempDir for one that removes itself.
inline std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  if (base == nullptr || *base == '\0') base = std::getenv("TMPDIR");
  std::string tmpl =
      absl::StrCat(base && *base ? base : "/tmp", "/modelavg-test-", name, ".XXXXXX");
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  return buf.data();
}

// A temporary directory, removed with everything in it when this goes out of scope (kept, and
// its path printed, when MODELAVG_KEEP_TEST_DIRS is set, to look at the logs in it).
class TempDir {
 public:
  explicit TempDir(const std::string& name) : path_(MakeTempDir(name)) {}
  ~TempDir() {
    if (path_.empty()) return;
    if (std::getenv("MODELAVG_KEEP_TEST_DIRS") != nullptr) {
      std::fprintf(stderr, "kept %s\n", path_.c_str());
      return;
    }
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_TEMP_DIR_H_
