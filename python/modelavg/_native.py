"""Loads the compiled module ``modelavg._core`` so that it binds to its own libraries.

libtorch carries its own Gloo (and Protobuf) and exports their symbols. Where PyTorch is loaded
into the global scope (``TORCH_USE_RTLD_GLOBAL=1``, or a host program's ``RTLD_GLOBAL``), those
symbols would win every lookup that the module, or the Gloo library it links, makes through the
global scope, whichever was imported first: the module would run the other Gloo's code on its
own objects, and crash. ``RTLD_DEEPBIND`` puts the module's own scope (it and its libraries)
ahead of the global one. The module itself exports nothing but ``PyInit__core``
(python/core.map), so it stands in for no one else's symbols either.

The sanitizers' runtimes refuse ``RTLD_DEEPBIND``; under one (tests/sanitize.sh) the module is
loaded as Python loads any extension.
"""

import ctypes
import os
import sys


def _under_a_sanitizer() -> bool:
    process = ctypes.CDLL(None)
    return any(hasattr(process, name) for name in ("__tsan_init", "__asan_init", "__msan_init"))


def load() -> None:
    """Imports ``modelavg._core`` (once) with ``RTLD_DEEPBIND`` where that is possible."""
    if "modelavg._core" in sys.modules or not hasattr(os, "RTLD_DEEPBIND") or \
            _under_a_sanitizer():
        return
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_DEEPBIND)
    try:
        from . import _core  # noqa: F401
    finally:
        sys.setdlopenflags(flags)
