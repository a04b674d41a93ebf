"""What the Python examples share to run end to end on one machine: find and start a coordinator
on 127.0.0.1, start the workers, gather their output, stop everything. Not part of a trainer."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def find_coordinator(explicit, who):
    """The modelavg-coordinator to run: `explicit`, else the build's, else the one on PATH."""
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "..", os.environ.get("MODELAVG_BUILD_DIR", "build"),
                                   "server", "modelavg-coordinator"),
                      shutil.which("modelavg-coordinator")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit(f"{who}: no modelavg-coordinator: build it (cmake --build build --target "
             "modelavg-coordinator) or pass --coordinator_bin")


class LocalCoordinator:
    """A coordinator on 127.0.0.1 for the life of a `with` block: `address`, and `log_tail()`.
    Several trainers and a coordinator on one machine: a long heartbeat timeout, so that a busy
    machine gets no worker declared dead."""

    def __init__(self, binary, who):
        self.who = who
        self.work = tempfile.mkdtemp(prefix=f"modelavg-{who}-")
        port_file = os.path.join(self.work, "port")
        self.log = open(os.path.join(self.work, "coordinator.log"), "w")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", f"--port_file={port_file}", "--log_level=warn",
             "--default_heartbeat_timeout_ms=15000"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit(f"{who}: the coordinator did not start")
            time.sleep(0.05)
        self.address = open(port_file).read().strip()

    def log_tail(self, chars=4000):
        self.log.flush()
        return open(self.log.name).read()[-chars:]

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def gather(workers, timeout_s):
    """Waits for `workers` (started with stdout=PIPE), printing their "[rank" lines; returns their
    JSON summary lines (one dict each, by rank) and whether any worker failed."""
    summaries, failed = [], False
    try:
        for w in workers:
            out, _ = w.communicate(timeout=timeout_s)
            for line in out.splitlines():
                if line.startswith("{"):
                    summaries.append(json.loads(line))
                elif line.startswith("[rank"):
                    print(line)
            failed |= w.returncode != 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    summaries.sort(key=lambda s: s["rank"])
    for s in summaries:
        print(json.dumps(s))
    return summaries, failed
