#!/usr/bin/python3
"""One worker of bench/peers: bench/lm/worker.py with the modes of peer_modes.py added."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peer_modes  # noqa: E402,F401  (adds its modes to bench/lm's MODES)

sys.path.insert(0, os.path.join(HERE, "..", "lm"))
import worker  # noqa: E402

if __name__ == "__main__":
    worker.main()
