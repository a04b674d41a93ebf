"""``python -m modelavg ARGS``: the ``modelavg`` command (jobs, job, schedule, watch, create,
delete) of the installed wheel, for where its ``bin/`` is not on the PATH."""

import sys

from .cli import main

sys.exit(main())
