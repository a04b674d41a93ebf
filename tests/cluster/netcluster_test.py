#!/usr/bin/python3
"""The cluster harness itself (tests/cluster/netcluster.py), one CTest test (label `cluster`).

Builds two sites (w0, w1 in a; w2 in b), a core host and a control network, then checks that:
hosts reach each other across sites; the root namespace holds no address of the cluster; the
site link is shaped (its tbf has the rate asked for, and 3 MB across it take at least 80% of
the time the rate allows) and its counters count what crossed; cutting a host's data link, its
control link or a site link stops exactly the paths it should, and restoring brings them back;
close() removes every namespace and process; and remove_stale() cleans up after a run that was
killed (its namespaces and the processes left in them).
Skips (77) without root or network namespaces unless MODELAVG_REQUIRE_CLUSTER=1.
"""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import netcluster as nc  # noqa: E402

PY = "/usr/bin/python3"
PORT = 9000
SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
    while True:
        c, _ = s.accept()
        n = 0
        while True:
            d = c.recv(1 << 16)
            if not d: break
            n += len(d)
        c.sendall(str(n).encode()); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    t = time.monotonic()
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
        c.sendall(b"x" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)
        got = int(c.recv(64) or b"-1")
    except OSError as e:
        print("unreachable", e); sys.exit(3)
    print(got, time.monotonic() - t)
""")


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def send(cluster, src, dst_ip, nbytes=1000, timeout=2.0):
    """(ok, seconds): `nbytes` from host `src` to the server at dst_ip."""
    out = cluster.run(src, [PY, "-c", CLIENT, dst_ip, str(PORT), str(nbytes), str(timeout)],
                      check=False, timeout=120)
    if out.returncode == 3:
        print(f"  {src} -> {dst_ip}: {out.stdout.strip()}")
        return False, None
    if out.returncode != 0:
        fail(f"the client on {src} failed: {out.stderr}")
    got, secs = out.stdout.split()
    if int(got) != nbytes:
        fail(f"{src} -> {dst_ip}: the server got {got} of {nbytes} bytes")
    return True, float(secs)


def expect(cluster, src, dst, reachable, control=False, what=""):
    h = cluster.hosts[dst]
    # Reachable: within 10 s (after a restore, a neighbour entry that failed during the cut is
    # re-resolved only after a few seconds); unreachable: 2 s without an answer.
    address = h.control_address if control else h.address
    ok, _ = send(cluster, src, address, timeout=2.0)
    deadline = time.monotonic() + 10
    while reachable and not ok and time.monotonic() < deadline:
        time.sleep(0.5)
        ok, _ = send(cluster, src, address, timeout=2.0)
    if ok != reachable:
        fail(f"{what}: {src} -> {dst} ({'control' if control else 'data'}) is "
             f"{'reachable' if ok else 'unreachable'}, expected the opposite")


def own_namespaces(run_id):
    return [n for n in nc._netns_names() if n.startswith(run_id + "-")]


def root_has_no_cluster_address():
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True)
    net = ipaddress.ip_network("198.18.0.0/15")
    for link in json.loads(out.stdout):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet" and ipaddress.ip_address(a["local"]) in net:
                fail(f"the root namespace holds {a['local']} on {link['ifname']}")


def stale_cleanup():
    """A child builds a cluster, starts a process in it and is killed: remove_stale() must
    remove what it left."""
    child = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import sys, time, subprocess
        sys.path.insert(0, {HERE!r})
        import netcluster as nc
        c = nc.Cluster([nc.Host("x", "a"), nc.Host("y", "b")])
        c.popen("x", ["sleep", "600"])
        print("ready", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "ready":
        fail(f"the child cluster did not come up: {line!r}")
    run_id = f"{nc.PREFIX}{child.pid}"
    left = own_namespaces(run_id)
    if len(left) != 3:
        fail(f"the child's cluster should have 3 namespaces, has {left}")
    sleeper = subprocess.run(["ip", "netns", "pids", f"{run_id}-x"], capture_output=True,
                             text=True).stdout.split()
    child.kill()
    child.wait()
    removed = nc.remove_stale()
    if sorted(removed) != sorted(left) or own_namespaces(run_id):
        fail(f"remove_stale removed {removed}; the killed run left {left}; still there: "
             f"{own_namespaces(run_id)}")
    time.sleep(0.2)
    for pid in sleeper:
        if os.path.exists(f"/proc/{pid}") and "sleep" in open(f"/proc/{pid}/cmdline").read():
            fail(f"the killed run's process {pid} in its namespace still runs")


def main():
    reason = nc.unavailable_reason()
    if reason:
        if os.environ.get("MODELAVG_REQUIRE_CLUSTER") == "1":
            fail(f"MODELAVG_REQUIRE_CLUSTER=1 but {reason}")
        print(f"SKIP: {reason} (set MODELAVG_REQUIRE_CLUSTER=1 to fail instead)")
        sys.exit(77)
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    rate = 20
    hosts = [nc.Host("core", None, control=True), nc.Host("w0", "a", control=True),
             nc.Host("w1", "a", control=True), nc.Host("w2", "b", control=True)]
    cluster = nc.Cluster(hosts, site_rate_mbit=rate, control=True)
    run_id = cluster.run_id
    try:
        root_has_no_cluster_address()
        for h in cluster.hosts.values():
            cluster.popen(h.name, [PY, "-c", SERVER, str(PORT)])
        time.sleep(0.5)
        for src, dst in (("w0", "w1"), ("w0", "w2"), ("w2", "core"), ("w1", "w2")):
            expect(cluster, src, dst, True, what="fresh cluster")
            expect(cluster, src, dst, True, control=True, what="fresh cluster")

        # Shaping: the qdisc, a lower bound on the time, and the counters.
        q = json.loads(cluster._fab("-j", "link", "show", "dev", "up-b").stdout)
        qdiscs = json.loads(subprocess.run(
            ["tc", "-n", cluster.fabric, "-j", "qdisc", "show", "dev", "up-b"],
            capture_output=True, text=True, check=True).stdout)
        tbf = [x for x in qdiscs if x.get("kind") == "tbf"]
        if not tbf or tbf[0]["options"]["rate"] != rate * 1000 * 1000 // 8:
            fail(f"site b's uplink should carry a tbf of {rate} Mbit/s: {qdiscs} ({q})")
        payload = 3_000_000
        before = cluster.site_bytes("b")
        ok, secs = send(cluster, "w0", cluster.hosts["w2"].address, payload, timeout=60)
        crossed = cluster.site_bytes("b") - before
        least = 0.8 * payload * 8 / (rate * 1e6)
        if not ok or secs < least:
            fail(f"3 MB across a {rate} Mbit/s link took {secs} s; at least {least:.2f} s "
                 "expected: the link is not shaped")
        if not payload <= crossed <= 1.2 * payload:
            fail(f"site b's uplink counted {crossed} bytes for a {payload}-byte transfer")
        within = cluster.host_bytes("w1")
        send(cluster, "w0", cluster.hosts["w1"].address, 100_000)
        if cluster.host_bytes("w1") - within < 100_000:
            fail("w1's interface did not count a 100 kB transfer to it")
        print(f"shaped: {payload} B in {secs:.2f} s ({payload * 8 / secs / 1e6:.1f} Mbit/s "
              f"at {rate}); the uplink counted {crossed} B")

        # A host cut: its data path only.
        cluster.cut_host("w2")
        expect(cluster, "w0", "w2", False, what="w2 cut")
        expect(cluster, "w0", "w2", True, control=True, what="w2 cut (data only)")
        expect(cluster, "w0", "w1", True, what="w2 cut")
        cluster.restore_host("w2")
        expect(cluster, "w0", "w2", True, what="w2 restored")
        # Its control path only.
        cluster.cut_control("w2")
        expect(cluster, "w0", "w2", False, control=True, what="w2's control cut")
        expect(cluster, "w0", "w2", True, what="w2's control cut")
        cluster.restore_control("w2")
        expect(cluster, "w0", "w2", True, control=True, what="w2's control restored")
        # A site cut: within the site yes, beyond no; the control network is apart.
        cluster.cut_site("a")
        expect(cluster, "w0", "w1", True, what="site a cut")
        expect(cluster, "w0", "w2", False, what="site a cut")
        expect(cluster, "w0", "core", False, what="site a cut")
        expect(cluster, "w0", "w2", True, control=True, what="site a cut")
        cluster.restore_site("a")
        expect(cluster, "w0", "w2", True, what="site a restored")
        expect(cluster, "w0", "core", True, what="site a restored")
    finally:
        cluster.close()
    if own_namespaces(run_id):
        fail(f"close() left namespaces: {own_namespaces(run_id)}")
    stale_cleanup()
    print("harness: reachability, shaping, counters, cuts, close and stale clean-up: ok")


if __name__ == "__main__":
    main()
