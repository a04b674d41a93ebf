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

A module built with the NCCL path links the CUDA runtime and NCCL by soname (libcudart.so.13,
libnccl.so.2), and a process holds one library per soname: whichever is loaded first serves
both. PyTorch's wheels bring their own, newer builds of the same sonames (the nvidia-* packages)
and need symbols that an older system NCCL lacks ("libtorch_cuda.so: undefined symbol"), while
NCCL and the CUDA runtime keep their ABI within a major version. So when such a module is
loaded and PyTorch is installed, PyTorch is imported first: the module then runs on PyTorch's
CUDA runtime and NCCL, whichever of the two the trainer imported first.
"""

import ctypes
import importlib.util
import mmap
import os
import sys


def _under_a_sanitizer() -> bool:
    process = ctypes.CDLL(None)
    return any(hasattr(process, name) for name in ("__tsan_init", "__asan_init", "__msan_init"))


def _links_cuda(path: str) -> bool:
    """Whether the compiled module at ``path`` names the CUDA runtime or NCCL among its libraries
    (the sonames are in its dynamic string table)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(b"libnccl.so.") >= 0 or m.find(b"libcudart.so.") >= 0
    except (OSError, ValueError):
        return False


def _torch_first() -> None:
    """Imports PyTorch before a module that links CUDA's libraries, where PyTorch is installed."""
    if "torch" in sys.modules:
        return
    spec = importlib.util.find_spec("modelavg._core")
    if spec is None or not spec.origin or not _links_cuda(spec.origin):
        return
    if importlib.util.find_spec("torch") is None:
        return
    import torch  # noqa: F401  (its CUDA runtime and NCCL serve the module too)


def load() -> None:
    """Imports ``modelavg._core`` (once) with ``RTLD_DEEPBIND`` where that is possible."""
    if "modelavg._core" in sys.modules:
        return
    _torch_first()
    if not hasattr(os, "RTLD_DEEPBIND") or _under_a_sanitizer():
        return
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_DEEPBIND)
    try:
        from . import _core  # noqa: F401
    finally:
        sys.setdlopenflags(flags)
