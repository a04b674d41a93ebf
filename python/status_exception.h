// absl::Status -> the exceptions of modelavg/errors.py (modelavg.Error and its subclasses).
#ifndef MODELAVG_PYTHON_STATUS_EXCEPTION_H_
#define MODELAVG_PYTHON_STATUS_EXCEPTION_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace modelavg::python {

// Raises the modelavg.errors exception for `status` (never OK). `averaging`: the status came
// from an averaging step, where a peer's failure gets its own exception class.
// Needs the GIL.
[[noreturn]] void Raise(const absl::Status& status, bool averaging = false);

template <typename T>
T ValueOrRaise(absl::StatusOr<T> v, bool averaging = false) {
  if (!v.ok()) Raise(v.status(), averaging);
  return *std::move(v);
}

}  // namespace modelavg::python

#endif  // MODELAVG_PYTHON_STATUS_EXCEPTION_H_
