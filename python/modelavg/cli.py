"""The `modelavg` command (jobs, job, schedule, watch, create, delete) of a pip-installed package.

The command itself is the C++ program tools/modelavg_cli.cc, shipped in the wheel as
``modelavg/_bin/modelavg``; this entry point runs it with the same arguments. (An installation
from CMake or the Debian package puts the program straight on the PATH.)
"""

import os
import sys


def main() -> int:
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "modelavg")
    if not os.access(program, os.X_OK):
        print(f"modelavg: {program} is missing: this installation of the Python package has no "
              "command line (install the wheel built by `pip wheel ./python`, or the Debian "
              "package `modelavg`)", file=sys.stderr)
        return 1
    os.execv(program, [program] + sys.argv[1:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
