#include "python/status_exception.h"

#include <string>

#include "client/base/error_kind.h"
#include "pybind11/pybind11.h"

namespace py = pybind11;

namespace modelavg::python {

[[noreturn]] void Raise(const absl::Status& status, bool averaging) {
  py::object errors = py::module_::import("modelavg.errors");
  // The error's kind (client/base/error_kind.h) picks the class where one has its own (a lost
  // replica), never its message.
  py::object exc = errors.attr("_from_status")(
      static_cast<int>(status.code()), std::string(status.message()), averaging,
      static_cast<int>(client::ErrorKindOf(status)), client::ErrorPeerOf(status));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

}  // namespace modelavg::python
