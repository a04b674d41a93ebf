"""A cluster on one machine: hosts as network namespaces, sites as bridges, shaped site links.

Used by the cluster tests (tests/cluster/) and the benchmark (bench/lm_bench.py) alike::

    with Cluster([Host("coord", site=None, control=True),
                  Host("w0", "a"), Host("w1", "a"), Host("w2", "b"), Host("w3", "b")],
                 site_rate_mbit=50, control=True) as cluster:
        proc = cluster.popen("w0", ["modelavg-trace-worker", ...])
        cluster.cut_site("b"); ...; cluster.restore_site("b")
        print(cluster.site_bytes("b"))

Topology. Every bridge and every link end that is not a host's own interface lives in one
namespace of its own, the *fabric*, so that the root namespace gets no interface and no address
of the cluster, and nothing routes out of it. Each site is a bridge (``br-<site>``); each site
joins a core bridge (``br-core``) through its *uplink*, a veth pair shaped with tbf in both
directions (``up-<site>`` carries the site's traffic towards the core, ``dn-<site>`` the traffic
back). A host is a namespace with one interface ``eth0`` on its site's bridge (a host whose site
is None sits on the core bridge itself, one unshaped hop from every site); with ``control=True``
the cluster also has a separate control bridge (``br-ctl``) and each host that asks for it gets a
second interface ``ctl0`` there, so that the data path can be cut while the control path stays.

Addresses come from 198.18.0.0/15 (RFC 2544, reserved for benchmarks): the data network is
198.18.0.0/16 (host i of site k at 198.18.(k+1).(i+1); core hosts 198.18.0.x), the control
network 198.19.0.0/16. The root namespace holds none of them.

Names carry a run prefix, ``mavg<pid>-``: namespaces are ``mavg<pid>-fabric`` and
``mavg<pid>-<host>``. :func:`remove_stale` deletes every cluster of a process that no longer runs
(what a crashed or killed run left), ending the processes still inside its namespaces first.
:meth:`Cluster.close` removes everything the cluster made, and the processes it started.

Needs root, ``ip`` and ``tc`` (iproute2) and a kernel with network namespaces, veth, bridges and
tbf; :func:`unavailable_reason` says what is missing.
"""

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "mavg"
DATA_NET = ipaddress.ip_network("198.18.0.0/16")
CONTROL_NET = ipaddress.ip_network("198.19.0.0/16")
_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")


class ClusterError(RuntimeError):
    """A command that builds or changes the cluster failed."""


def _run(argv, check=True, timeout=30):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable_reason():
    """None when this machine can build a cluster; otherwise why not, in one sentence."""
    if os.geteuid() != 0:
        return "the cluster needs root (network namespaces, veth, bridges, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        for argv, what in (
                (["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                 "veth"),
                (["ip", "-n", probe, "link", "add", "b0", "type", "bridge"], "bridge"),
                (["ip", "-n", probe, "link", "set", "p0", "up"], "veth"),
                (["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
                  "10mbit", "burst", "32kb", "latency", "50ms"], "the tbf qdisc")):
            out = _run(argv, check=False)
            if out.returncode != 0:
                return f"the kernel refused {what}: {out.stderr.strip()}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None


def _netns_names():
    out = _run(["ip", "-j", "netns", "list"], check=False)
    if out.returncode != 0 or not out.stdout.strip():
        return []
    return [entry["name"] for entry in json.loads(out.stdout)]


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(name):
    """Ends every process inside namespace `name`, then deletes it."""
    for _ in range(50):
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    _run(["ip", "netns", "delete", name], check=False)


def remove_stale():
    """Deletes the namespaces of clusters whose owning process is gone; returns their names."""
    removed = []
    for name in _netns_names():
        m = re.match(rf"^{PREFIX}(\d+)-", name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete_netns(name)
            removed.append(name)
    return removed


class Host:
    """A host: a name (lowercase letters and digits, at most 10), its site (None: on the core
    bridge) and whether it has an interface on the control network."""

    def __init__(self, name, site, control=False):
        if not _NAME.match(name) or name in ("fabric", "probe"):
            raise ValueError(f"host name {name!r}: use 1-10 lowercase letters and digits, "
                             "starting with a letter (not 'fabric' or 'probe')")
        if site is not None and not _NAME.match(site):
            raise ValueError(f"site name {site!r}: use 1-10 lowercase letters and digits")
        self.name, self.site, self.control = name, site, control
        self.address = None          # on the data network, set by the cluster
        self.control_address = None  # on the control network, or None


class Cluster:
    """Builds the hosts, sites and links; close() (or leaving the `with`) removes them."""

    def __init__(self, hosts, site_rate_mbit=50, site_rates_mbit=None, control=False,
                 burst_kb=None):
        """hosts: [Host]; site_rate_mbit: the rate of every site's uplink, each direction
        (site_rates_mbit: {site: rate} overrides per site; 0 or None: unshaped); control: build
        the control network (hosts with control=True get an interface there)."""
        names = [h.name for h in hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        if any(h.control for h in hosts) and not control:
            raise ValueError("a host asks for the control network, but control=False")
        self.run_id = f"{PREFIX}{os.getpid()}"
        self.hosts = {h.name: h for h in hosts}
        self.sites = sorted({h.site for h in hosts if h.site is not None})
        self.control = control
        self.rates = {s: (site_rates_mbit or {}).get(s, site_rate_mbit) for s in self.sites}
        self.burst_kb = burst_kb
        self.fabric = f"{self.run_id}-fabric"
        self._procs = []
        self._made = []
        remove_stale()
        if self.fabric in _netns_names():
            raise ClusterError(f"namespace {self.fabric} already exists (a cluster of this "
                               "process is open: close it first)")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building

    def netns(self, host):
        return f"{self.run_id}-{host}"

    def _add_netns(self, name):
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        # No IPv6: no router solicitations or DAD packets in the byte counters.
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                  f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _fab(self, *args):
        return _run(["ip", "-n", self.fabric, *args])

    def _bridge(self, name):
        self._fab("link", "add", name, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        self._fab("link", "set", name, "up")

    def _shape(self, dev, rate_mbit):
        if not rate_mbit:
            return
        # tbf: the bucket holds a few ms at the rate (at least 32 KiB, so that the kernel's
        # timer granularity cannot hold the rate below what was asked); up to 50 ms of queue.
        burst_kb = self.burst_kb or max(32, int(rate_mbit * 1000 / 8 * 0.004))
        _run(["tc", "-n", self.fabric, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
              f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"])

    def _build(self):
        self._add_netns(self.fabric)
        self._bridge("br-core")
        if self.control:
            self._bridge("br-ctl")
        for s in self.sites:
            self._bridge(f"br-{s}")
            self._fab("link", "add", f"up-{s}", "type", "veth", "peer", "name", f"dn-{s}")
            self._fab("link", "set", f"up-{s}", "master", f"br-{s}", "up")
            self._fab("link", "set", f"dn-{s}", "master", "br-core", "up")
            self._shape(f"up-{s}", self.rates[s])
            self._shape(f"dn-{s}", self.rates[s])
        index_in = {}
        for i, h in enumerate(self.hosts.values()):
            ns = self.netns(h.name)
            self._add_netns(ns)
            k = 0 if h.site is None else self.sites.index(h.site) + 1
            index_in[k] = index_in.get(k, 0) + 1
            h.address = str(DATA_NET.network_address + k * 256 + index_in[k])
            self._fab("link", "add", f"h-{h.name}", "type", "veth", "peer", "name", "eth0",
                      "netns", ns)
            bridge = "br-core" if h.site is None else f"br-{h.site}"
            self._fab("link", "set", f"h-{h.name}", "master", bridge, "up")
            _run(["ip", "-n", ns, "addr", "add", f"{h.address}/16", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if h.control:
                h.control_address = str(CONTROL_NET.network_address + i + 1)
                self._fab("link", "add", f"c-{h.name}", "type", "veth", "peer", "name", "ctl0",
                          "netns", ns)
                self._fab("link", "set", f"c-{h.name}", "master", "br-ctl", "up")
                _run(["ip", "-n", ns, "addr", "add", f"{h.control_address}/16", "dev", "ctl0"])
                _run(["ip", "-n", ns, "link", "set", "ctl0", "up"])

    # ---- faults

    def _set(self, devs, state):
        for dev in devs:
            self._fab("link", "set", dev, state)
        if state == "up":
            self._wait_up(devs)

    def _wait_up(self, devs, timeout_s=5.0):
        """Waits until each link has its carrier back (the kernel reports it asynchronously,
        up to a second late for a link that changed recently), so that a restore is complete
        when it returns."""
        deadline = time.monotonic() + timeout_s
        pending = list(devs)
        while pending:
            out = self._fab("-j", "link", "show", "dev", pending[0])
            if json.loads(out.stdout)[0].get("operstate") == "UP":
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ClusterError(f"link {pending[0]} in {self.fabric} is not up "
                                   f"{timeout_s} s after it was restored")
            time.sleep(0.02)

    def cut_host(self, host, control=False):
        """The host's data link goes dark (its process lives on, its packets go nowhere); with
        control=True its control link too."""
        self._set([f"h-{host}"] + ([f"c-{host}"] if control else []), "down")

    def restore_host(self, host, control=False):
        self._set([f"h-{host}"] + ([f"c-{host}"] if control else []), "up")

    def cut_control(self, host):
        self._set([f"c-{host}"], "down")

    def restore_control(self, host):
        self._set([f"c-{host}"], "up")

    def cut_site(self, site):
        """The site's uplink goes dark: its hosts still reach each other, nothing beyond."""
        self._set([f"up-{site}", f"dn-{site}"], "down")

    def restore_site(self, site):
        self._set([f"up-{site}", f"dn-{site}"], "up")

    # ---- counters

    def counters(self, dev):
        """{'rx_bytes', 'tx_bytes', 'rx_packets', 'tx_packets', 'tx_dropped'} of a fabric
        interface, as the kernel counts them."""
        out = self._fab("-s", "-j", "link", "show", "dev", dev)
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"],
                "tx_dropped": stats["tx"]["dropped"]}

    def site_bytes(self, site):
        """Bytes that crossed the site's uplink so far, both directions (Ethernet frames)."""
        c = self.counters(f"up-{site}")
        return c["rx_bytes"] + c["tx_bytes"]

    def host_bytes(self, host):
        """Bytes the host sent and received on its data interface."""
        c = self.counters(f"h-{host}")
        return c["rx_bytes"] + c["tx_bytes"]

    # ---- processes

    def argv(self, host, argv):
        """`argv` run inside the host's namespace."""
        if host not in self.hosts:
            raise ValueError(f"no host {host!r} in this cluster ({sorted(self.hosts)})")
        return ["ip", "netns", "exec", self.netns(host), *argv]

    def popen(self, host, argv, **kwargs):
        """Starts `argv` in the host (a session of its own); close() ends it if still running."""
        proc = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host, argv, timeout=30, check=True):
        return _run(self.argv(host, argv), check=check, timeout=timeout)

    # ---- tear-down

    def close(self):
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        for name in reversed(self._made):
            _delete_netns(name)
        self._made = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
