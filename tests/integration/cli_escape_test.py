#!/usr/bin/env python3
"""Control characters in what the `modelavg` CLI prints come out escaped.

The coordinator refuses control characters in a Join's worker_id and host, but a value stored
before it did (an old state file) still reaches the CLI: here one is written into the state file
of a stopped coordinator, which is then restarted on it. `modelavg job`, `jobs`, `watch` and
`--json` must print no control character (a worker id could otherwise retitle or clear the
operator's terminal, or forge lines; a right-to-left override reorders what follows it): every
one is shown as an escape (\\e, \\r, \\x07, \\u009b, \\u202e).
"""

import argparse
import os
import re
import sqlite3
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

EVIL_WORKER = "w\x1b]0;owned\x07\x1b[2J\x1b[H\u009b31m\u202egpj.exe"
EVIL_HOST = "h\r\n[info] job esc: all ranks joined\x7f"
# Control characters (C0 but newline, DEL, C1) and bidirectional formatting characters (which
# reorder what the terminal shows: U+202E makes "gpj.exe" read "exe.jpg") in what the CLI writes.
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f\u0080-\u009f\u061c\u200e\u200f\u202a-\u202e"
                     "\u2066-\u2069]")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--cli", required=True)
    args = parser.parse_args()
    import grpc
    pb, pb_grpc = mt.coordinator_stubs()
    checks = 0

    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-cli-escape-")
        state = os.path.join(work, "state")
        coord = mt.Coordinator(group, args.coordinator, workdir=work,
                               extra_flags=[f"--state_dir={state}"])
        mt.create_job(coord.address, "esc", "periodic", 1, 0, [(2, 1)])
        with grpc.insecure_channel(coord.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            # Refused now, naming the field (and showing the character escaped).
            for what, worker, named in (("ESC", EVIL_WORKER, "worker_id"),
                                        ("U+202E", "w\u202egpj.exe", "\\u202e")):
                try:
                    stub.Join(pb.JoinRequest(job_id="esc", worker_id=worker, host="h"),
                              timeout=10)
                    mt.fail(f"a Join with {what} in its worker_id was taken")
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT or named not in e.details():
                        mt.fail(f"Join with {what} in worker_id: {e.code()} {e.details()}")
                checks += 1
            stub.Join(pb.JoinRequest(job_id="esc", worker_id="w", host="h"), timeout=10)
        if coord.stop() != 0:
            mt.fail(f"the coordinator did not stop cleanly:\n{coord.log_tail()}")
        # What an older coordinator could have stored.
        db = sqlite3.connect(os.path.join(state, "state.db"))
        changed = db.execute("UPDATE members SET worker_id = ?, host = ? WHERE job_id = 'esc'",
                             (EVIL_WORKER, EVIL_HOST)).rowcount
        db.commit()
        db.close()
        if changed != 1:
            mt.fail(f"expected one stored member of job esc, updated {changed}")
        coord = mt.Coordinator(group, args.coordinator,  # a fresh --port_file
                               workdir=group.temp_dir("modelavg-cli-escape-2-"),
                               extra_flags=[f"--state_dir={state}"])

        def run(*argv):
            cmd = [args.cli, f"--coordinator={coord.address}", *argv]
            out = subprocess.run(cmd, capture_output=True, timeout=60)
            if out.returncode != 0:
                mt.fail(f"{' '.join(argv)}: exit {out.returncode}\n{out.stderr!r}")
            return out.stdout.decode("utf-8", errors="replace")

        table = run("job", "esc")
        print(f"$ modelavg job esc\n{table}")
        outputs = {"job esc": table, "jobs": run("jobs"), "job esc --json": run("job", "esc",
                                                                                 "--json"),
                   "watch esc": run("watch", "esc", "--watch_ms=500")}
        for name, text in outputs.items():
            found = CONTROL.search(text)
            if found:
                mt.fail(f"modelavg {name} printed the control character {found.group()!r}: "
                        f"{text!r}")
            checks += 1
        for escaped in ("w\\e]0;owned\\x07\\e[2J\\e[H\\u009b31m\\u202egpj.exe",
                        "h\\r\\n[info] job esc: all ranks joined\\x7f"):
            if escaped not in table:
                mt.fail(f"modelavg job esc does not show {escaped!r}:\n{table}")
            checks += 1
    print(f"cli_escape_test: {checks} checks passed")


if __name__ == "__main__":
    main()
