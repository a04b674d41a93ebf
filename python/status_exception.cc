#include "python/status_exception.h"

#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_replace.h"
#include "client/base/error_kind.h"
#include "pybind11/pybind11.h"

namespace py = pybind11;

namespace modelavg::python {

[[noreturn]] void Raise(const absl::Status& status, bool averaging) {
  py::object errors = py::module_::import("modelavg.errors");
  // The typed kind (client/base/error_kind.h) as "PEER_FAILURE", "GENERATION_MOVED",
  // "REPLICA_LOST", ... (None without one; it picks the class where one has its own, never the
  // message), and the rank it blames (None: none).
  const client::ErrorKind kind = client::ErrorKindOf(status);
  py::object kind_name = py::none();
  if (kind != client::ErrorKind::kUnknown) {
    kind_name = py::str(absl::AsciiStrToUpper(
        absl::StrReplaceAll(client::ErrorKindName(kind), {{" ", "_"}})));
  }
  const int32_t rank = client::ErrorRankOf(status);
  py::object exc = errors.attr("_from_status")(
      static_cast<int>(status.code()), std::string(status.message()), averaging, kind_name,
      rank >= 0 ? py::object(py::int_(rank)) : py::object(py::none()));
  if (std::optional<client::NonFiniteDetail> d = client::NonFiniteDetailOf(status)) {
    const auto known = [](int64_t v) { return v >= 0 ? py::object(py::int_(v)) : py::none(); };
    exc.attr("step") = known(d->step);
    exc.attr("level") = known(d->level);
    exc.attr("tensor") = known(d->tensor);
    exc.attr("value") = d->value.empty() ? py::object(py::none()) : py::object(py::str(d->value));
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

}  // namespace modelavg::python
