// Reading small files named on command lines and in options: jobs files, TLS material, tokens;
// what a failed system call said.
#ifndef MODELAVG_COMMON_FILE_UTIL_H_
#define MODELAVG_COMMON_FILE_UTIL_H_

#include <string>

#include "absl/status/statusor.h"

namespace modelavg {

// The whole file. NOT_FOUND "cannot read PATH: <reason>" if it cannot be opened or read.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// A bearer token kept in a file: its contents without surrounding whitespace. NOT_FOUND as
// ReadFileToString; INVALID_ARGUMENT if the file holds no token.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// strerror(errno): what the last failed system call said, for an error message (read errno
// before anything else can change it).
std::string ErrnoText();

}  // namespace modelavg

#endif  // MODELAVG_COMMON_FILE_UTIL_H_
