"""The programs of a pip-installed package: ``modelavg`` (jobs, job, schedule, watch, create,
delete) and ``modelavg-coordinator``.

Both are the C++ programs (tools/modelavg_cli.cc, the coordinator of server/), shipped in the
wheel as ``modelavg/_bin/modelavg`` and ``modelavg/_bin/modelavg-coordinator`` with the
libraries they load in ``modelavg.libs/`` beside the package (docs/installing.md, "The wheel").
These entry points replace the Python process with the program, same arguments and same process
id, so that a signal sent to the command reaches the program. (An installation from CMake or the
Debian package puts the programs straight on the PATH.)
"""

import os
import sys


def _exec(name: str) -> int:
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", name)
    if not os.access(program, os.X_OK):
        print(f"{name}: {program} is missing: this installation of the Python package has no "
              "programs (install the wheel built by deploy/build_wheel.sh, or the Debian "
              "package `modelavg`)", file=sys.stderr)
        return 1
    os.execv(program, [program] + sys.argv[1:])
    return 1  # not reached


def main() -> int:
    """The ``modelavg`` command (also ``python -m modelavg``)."""
    return _exec("modelavg")


def coordinator() -> int:
    """The ``modelavg-coordinator`` command."""
    return _exec("modelavg-coordinator")


if __name__ == "__main__":
    sys.exit(main())
