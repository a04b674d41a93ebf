"""``python3 -m modelavg.run``: PyTorch's torchrun, also where Debian 12's torchrun fails.

Use it exactly as torchrun (same flags, same environment for the workers)::

    python3 -m modelavg.run --nproc_per_node=4 examples/train_torch.py

Debian 12 ships PyTorch 1.13 for Python 3.11, where ``torchrun`` fails on any script
(``AttributeError: 'NoneType' object has no attribute 'get'`` in
``torch/distributed/elastic/multiprocessing/api.py``, ``to_map``): ``Std.from_str`` looks the
value up by iterating over the ``Std`` flag enum, and since Python 3.11 that iteration leaves out
``Std.NONE`` (0) and ``Std.ALL`` (3), so the default ``--redirects=0 --tee=0`` become None. This
module puts a ``from_str`` that converts by value in its place, when (and only when) the
installed torch has the bug, then runs ``torch.distributed.run``. With PyTorch 2.x it is torchrun
unchanged, and plain ``torchrun`` works there too.

Without this module, Debian's torchrun runs when both options are given as a mapping that names
no local rank: ``torchrun --redirects=9:1 --tee=9:1 --nproc_per_node=4 train.py`` (up to 9
processes per node).
"""

import re
import sys


def fix_std_from_str() -> bool:
    """Replaces torch's ``Std.from_str`` when it is broken; True if it was."""
    from torch.distributed.elastic.multiprocessing import api
    std = api.Std
    if std.from_str("0") is std.NONE and std.from_str("3") is std.ALL:
        return False
    original = std.from_str

    def from_str(cls, vm):
        if re.match(api._VALUE_REGEX, vm):
            return cls(int(vm))
        if re.match(api._MAPPING_REGEX, vm):
            return {int(i): cls(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
        return original(vm)  # raises ValueError naming the accepted forms

    std.from_str = classmethod(from_str)
    return True


def main() -> None:
    fix_std_from_str()
    from torch.distributed import run
    sys.argv[0] = "python3 -m modelavg.run"
    run.main()


if __name__ == "__main__":
    main()
