#include "python/status_exception.h"

#include <string>

#include "pybind11/pybind11.h"

namespace py = pybind11;

namespace modelavg::python {

[[noreturn]] void Raise(const absl::Status& status, bool averaging) {
  py::object errors = py::module_::import("modelavg.errors");
  py::object exc = errors.attr("_from_status")(static_cast<int>(status.code()),
                                               std::string(status.message()), averaging);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

}  // namespace modelavg::python
