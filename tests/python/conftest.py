"""What the Python tests share: where the build is, and the package made importable from it.

  pytest tests/python                                   # the build in build/
  MODELAVG_BUILD_DIR=b pytest tests/python              # another build directory
  MODELAVG_PYTHON_DIR=d MODELAVG_COORDINATOR_BIN=c pytest tests/python   # as ctest runs them

The package's pure-Python tests (package_test.py) need no build: they load python/modelavg
against a fake of the compiled module. The others start modelavg-coordinator processes and
import the built package (the extension module in <build>/python/modelavg).
"""

import os
import sys
import types

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_DIR = os.path.abspath(os.environ.get("MODELAVG_BUILD_DIR") or
                            os.path.join(REPO_ROOT, "build"))
PYTHON_DIR = os.path.abspath(os.environ.get("MODELAVG_PYTHON_DIR") or
                             os.path.join(BUILD_DIR, "python"))
COORDINATOR_BIN = os.path.abspath(os.environ.get("MODELAVG_COORDINATOR_BIN") or
                                  os.path.join(BUILD_DIR, "server", "modelavg-coordinator"))
# The per-test bound of the tests that run ranks (each rank's wait for its result).
TIMEOUT_S = float(os.environ.get("MODELAVG_TEST_TIMEOUT_S", "150"))


def pytest_configure(config):
    # The build's package first, here and in every process a test starts (the ranks, started
    # as new processes or forked, and `python -c` children).
    if PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    path = os.environ.get("PYTHONPATH", "")
    if PYTHON_DIR not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, path) if p)


@pytest.fixture(scope="session")
def coordinator_bin():
    """The modelavg-coordinator binary the tests start."""
    if not os.access(COORDINATOR_BIN, os.X_OK):
        pytest.fail(f"no coordinator at {COORDINATOR_BIN}: build it (cmake --build build "
                    "--target modelavg-coordinator modelavg-python), or set MODELAVG_BUILD_DIR "
                    "or MODELAVG_COORDINATOR_BIN", pytrace=False)
    return COORDINATOR_BIN


@pytest.fixture(scope="session")
def python_dir():
    """The build's python/ directory, which holds the package with its compiled module."""
    package = os.path.join(PYTHON_DIR, "modelavg")
    if not any(n.startswith("_core") and n.endswith(".so")
               for n in (os.listdir(package) if os.path.isdir(package) else [])):
        pytest.fail(f"no built package in {PYTHON_DIR}: build it (cmake --build build --target "
                    "modelavg-python), or set MODELAVG_BUILD_DIR or MODELAVG_PYTHON_DIR",
                    pytrace=False)
    return PYTHON_DIR


@pytest.fixture
def suite_args(coordinator_bin, python_dir):
    """What the end-to-end tests take: coordinator_bin, python_dir, timeout_s."""
    return types.SimpleNamespace(coordinator_bin=coordinator_bin, python_dir=python_dir,
                                 timeout_s=TIMEOUT_S)
