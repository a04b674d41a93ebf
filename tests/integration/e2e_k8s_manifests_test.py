#!/usr/bin/python3
"""Checks the Kubernetes manifests, which no test can run here (no cluster).

The Dockerfile and deploy/docker-compose.yml are not checked here: e2e.container builds the image
and runs the compose job for real. Here:
  * deploy/k8s/*.yaml parse, and `kubectl kustomize deploy/k8s` renders them (offline, when
    kubectl is installed);
  * every program they run is one this build produces, and every flag they pass is one that
    program accepts (from its --helpfull);
  * the kinds a deployment needs (Deployment, Service, ConfigMap, a worker Job or StatefulSet),
    gRPC readiness and liveness probes on declared ports, selectors that match, non-root pods, the
    coordinator's --state_dir on a declared PersistentVolumeClaim, a
    worker Job that runs every rank at once against the coordinator's Service, and a jobs
    ConfigMap identical to deploy/jobs/demo-jobs.json;
  * deploy/k8s/ha (two coordinators on etcd): its kustomization lists every file and each listed
    file exists, `kubectl kustomize deploy/k8s/ha` renders; a three-member etcd StatefulSet whose
    members' names, peer and client URLs agree with its headless Service, its ports and an
    --initial-cluster of exactly its members (every etcd flag one Debian's etcd accepts, when
    installed), on a volume claim template; a coordinator Deployment of two replicas whose
    --etcd_endpoints are exactly those members' client addresses, which advertises its pod IP,
    keeps no --state_dir, is ready by the gRPC health service (SERVING on the leader only) and
    live by a probe that a standby passes (not the health service); a Service selecting those
    pods, which the demo workers dial; and the README next to the manifests, naming the files.

  e2e_k8s_manifests_test.py --binary=modelavg-coordinator=PATH --binary=modelavg-demo=PATH ...
"""

import argparse
import glob
import json
import os
import re
import shlex
import sys

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

ROOT = mt.REPO_ROOT
DEPLOY = os.path.join(ROOT, "deploy")

errors = []


def check(condition, message):
    if not condition:
        errors.append(message)
    return condition


class Binaries:
    def __init__(self, pairs):
        self.paths = {}
        for pair in pairs:
            name, _, path = pair.partition("=")
            self.paths[name] = path
        self._flags = {}

    def check_command(self, argv, where):
        """argv[0] must be one of our binaries, every --flag one it accepts."""
        if not check(argv, f"{where}: empty command"):
            return
        name = argv[0]
        if not check(name in self.paths, f"{where}: runs '{name}', which this build does not "
                     f"produce (known: {', '.join(sorted(self.paths))})"):
            return
        if name not in self._flags:
            self._flags[name] = mt.accepted_flags(self.paths[name])
        for arg in argv[1:]:
            if not check(arg.startswith("--"), f"{where}: argument '{arg}' of {name} is not "
                         "a --flag"):
                continue
            flag = arg[2:].split("=", 1)[0]
            check(flag in self._flags[name], f"{where}: {name} has no flag --{flag}")


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def flag_value(argv, flag):
    for arg in argv:
        if arg.startswith(f"--{flag}="):
            return arg.split("=", 1)[1]
    return None


def kustomization_docs(directory, seen=None):
    """The documents a kustomization directory lists, following the directories it lists
    (common/), as [(path relative to deploy/, doc)]. Each listed file must exist, and each *.yaml
    of a visited directory must be listed."""
    seen = set() if seen is None else seen
    rel_dir = os.path.relpath(directory, DEPLOY)
    path = os.path.join(directory, "kustomization.yaml")
    if not check(os.path.exists(path), f"{rel_dir}: no kustomization.yaml"):
        return []
    if directory in seen:
        return []
    seen.add(directory)
    kust = load_yaml_docs(path)[0]
    check(kust.get("kind") == "Kustomization", f"{rel_dir}/kustomization.yaml is not a "
          "Kustomization")
    listed = kust.get("resources", [])
    docs = []
    for rel in listed:
        target = os.path.normpath(os.path.join(directory, rel))
        if os.path.isdir(target):
            docs += kustomization_docs(target, seen)
        elif check(os.path.exists(target), f"{rel_dir}/kustomization.yaml lists {rel}, which is "
                   "missing"):
            docs += [(os.path.relpath(target, os.path.join(DEPLOY, "k8s")), d)
                     for d in load_yaml_docs(target)]
    for yaml_path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        name = os.path.basename(yaml_path)
        if name != "kustomization.yaml":
            check(name in listed, f"{rel_dir}/kustomization.yaml does not list {name}")
    return docs


def check_k8s(binaries):
    manifests = kustomization_docs(os.path.join(DEPLOY, "k8s"))
    by_kind = {}
    for fname, doc in manifests:
        check("kind" in doc and "apiVersion" in doc, f"k8s/{fname}: a document lacks kind or "
              "apiVersion")
        by_kind.setdefault(doc.get("kind"), []).append((fname, doc))
    for kind in ("Deployment", "Service", "ConfigMap"):
        check(kind in by_kind, f"k8s: no {kind}")
    check("Job" in by_kind or "StatefulSet" in by_kind, "k8s: no worker Job or StatefulSet")
    configmaps = {d["metadata"]["name"]: d for _, d in by_kind.get("ConfigMap", [])}
    with open(os.path.join(DEPLOY, "jobs", "demo-jobs.json")) as f:
        jobs_json = json.load(f)
    for name, cm in configmaps.items():
        for key, text in cm.get("data", {}).items():
            if key.endswith(".json"):
                check(json.loads(text) == jobs_json,
                      f"k8s ConfigMap {name}/{key} differs from deploy/jobs/demo-jobs.json")
    services = [d for _, d in by_kind.get("Service", [])]
    for fname, dep in by_kind.get("Deployment", []) + by_kind.get("Job", []) + \
            by_kind.get("StatefulSet", []):
        kind, name = dep["kind"], dep["metadata"]["name"]
        where = f"k8s/{fname} {kind} {name}"
        pod = dep["spec"]["template"]
        labels = pod.get("metadata", {}).get("labels", {})
        if kind != "Job":
            selector = dep["spec"]["selector"]["matchLabels"]
            check(all(labels.get(k) == v for k, v in selector.items()),
                  f"{where}: selector {selector} does not match the pod labels {labels}")
        sc = pod["spec"].get("securityContext", {})
        check(sc.get("runAsNonRoot") is True, f"{where}: pods should run as non-root")
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for c in pod["spec"]["containers"]:
            argv = list(c.get("command", [])) + list(c.get("args", []))
            binaries.check_command(argv, f"{where} container {c['name']}")
            for vm in c.get("volumeMounts", []):
                vol = volumes.get(vm["name"])
                if check(vol is not None, f"{where}: mounts unknown volume {vm['name']}") and \
                        "configMap" in vol:
                    check(vol["configMap"]["name"] in configmaps,
                          f"{where}: volume {vm['name']} uses unknown ConfigMap")
                    jobs_file = flag_value(argv, "jobs_file")
                    if jobs_file and jobs_file.startswith(vm["mountPath"]):
                        key = os.path.relpath(jobs_file, vm["mountPath"])
                        check(key in configmaps.get(vol["configMap"]["name"], {}).get("data", {}),
                              f"{where}: --jobs_file={jobs_file} is not a key of the ConfigMap")
            claims = {d["metadata"]["name"] for _, d in by_kind.get("PersistentVolumeClaim", [])}
            for vol in volumes.values():
                if "persistentVolumeClaim" in vol:
                    check(vol["persistentVolumeClaim"]["claimName"] in claims,
                          f"{where}: volume {vol['name']} claims an undeclared "
                          "PersistentVolumeClaim")
            state_dir = flag_value(argv, "state_dir")
            if state_dir:
                # The root filesystem is read-only, and the state must outlive the pod.
                check(any(state_dir.startswith(vm["mountPath"].rstrip("/") + "/") and
                          "persistentVolumeClaim" in volumes.get(vm["name"], {})
                          for vm in c.get("volumeMounts", [])),
                      f"{where}: --state_dir={state_dir} is not on a PersistentVolumeClaim")
            env_names = {e["name"] for e in c.get("env", [])}
            for ref in re.findall(r"\$\((\w+)\)", " ".join(argv)):
                check(ref in env_names, f"{where}: $({ref}) is not an env var of the container")
            if kind == "Deployment":
                ports = {p["containerPort"] for p in c.get("ports", [])}
                for probe in ("readinessProbe", "livenessProbe"):
                    p = c.get(probe, {})
                    check("grpc" in p, f"{where}: {probe} should be a gRPC health probe")
                    check(p.get("grpc", {}).get("port") in ports,
                          f"{where}: {probe} probes a port the container does not declare")
                matched = [s for s in services
                           if all(labels.get(k) == v for k, v in s["spec"]["selector"].items())]
                check(matched, f"{where}: no Service selects its pods")
                for s in matched:
                    named = {p["name"] for p in c.get("ports", [])}
                    for sp in s["spec"]["ports"]:
                        target = sp.get("targetPort", sp["port"])
                        check(target in named or target in ports,
                              f"{where}: Service port {sp['name']} targets {target}, not a "
                              "container port")
            if kind == "Job":
                coordinator = flag_value(argv, "coordinator") or ""
                host = coordinator.split(":")[0]
                check(any(s["metadata"]["name"] == host for s in services),
                      f"{where}: --coordinator={coordinator} names no Service")
                spec = dep["spec"]
                check(spec.get("completionMode") == "Indexed" and
                      spec.get("completions") == spec.get("parallelism"),
                      f"{where}: workers must be an Indexed Job running all ranks at once")


def check_kustomize(path):
    """kubectl renders the kustomization offline (no cluster is contacted)."""
    import shutil
    import subprocess
    rel = os.path.relpath(path, ROOT)
    if not shutil.which("kubectl"):
        print(f"note: kubectl is not installed; {rel} is not rendered")
        return None
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True,
                         timeout=60)
    if check(out.returncode == 0, f"kubectl kustomize {rel}: {out.stderr.strip()}"):
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        kinds = sorted(d.get("kind") for d in docs)
        print(f"kubectl kustomize {rel}: {len(kinds)} objects ({', '.join(kinds)})")
        return docs
    return None


def etcd_flags():
    """The flags Debian's etcd accepts (from its --help), or None without etcd."""
    import subprocess
    path = os.environ.get("MODELAVG_ETCD_BIN") or "/usr/bin/etcd"
    if not os.access(path, os.X_OK):
        print("note: no etcd binary; the StatefulSet's etcd flags are not checked against it")
        return None
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+--([a-z0-9-]+)", out.stdout + out.stderr, re.MULTILINE))


def expand(text, env):
    """Kubernetes' $(VAR) references, from a pod's env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def url_hostport(url):
    m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", url.strip('"'))
    return (m.group(1), int(m.group(2))) if m else None


def check_k8s_ha(binaries):
    ha = os.path.join(DEPLOY, "k8s", "ha")
    where = "k8s/ha"
    if not check(os.path.isdir(ha), f"{where}: no deploy/k8s/ha"):
        return
    docs = kustomization_docs(ha)
    rendered = check_kustomize(ha)
    if rendered is not None:
        got = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
        want = sorted((d["kind"], d["metadata"]["name"]) for _, d in docs)
        check(got == want, f"kubectl kustomize {where} renders {got}, not the listed {want}")

    def of_kind(kind):
        return [d for _, d in docs if d.get("kind") == kind]

    services = of_kind("Service")

    def selecting(labels):
        return [s for s in services
                if all(labels.get(k) == v for k, v in s["spec"].get("selector", {}).items())]

    # ---- etcd: a three-member StatefulSet behind a headless Service ----
    etcd_sets = [d for d in of_kind("StatefulSet")
                 if any("etcd" in " ".join(c.get("command", []) + c.get("args", []))
                        for c in d["spec"]["template"]["spec"]["containers"])]
    endpoints = set()
    if check(len(etcd_sets) == 1, f"{where}: expected one etcd StatefulSet, found "
             f"{len(etcd_sets)}"):
        sts = etcd_sets[0]
        name, spec = sts["metadata"]["name"], sts["spec"]
        w = f"{where} StatefulSet {name}"
        replicas = spec.get("replicas", 1)
        check(replicas == 3, f"{w}: {replicas} replicas, expected 3 (a quorum survives one lost)")
        pod = spec["template"]
        labels = pod["metadata"].get("labels", {})
        check(all(labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()),
              f"{w}: selector does not match the pod labels")
        check(pod["spec"].get("securityContext", {}).get("runAsNonRoot") is True,
              f"{w}: pods should run as non-root")
        headless = [s for s in services if s["metadata"]["name"] == spec.get("serviceName")]
        svc_name = spec.get("serviceName")
        if check(headless, f"{w}: serviceName {svc_name} names no Service"):
            hs = headless[0]
            check(hs["spec"].get("clusterIP") == "None",
                  f"{w}: Service {svc_name} must be headless (clusterIP: None) to name members")
            check(hs["spec"].get("publishNotReadyAddresses") is True,
                  f"{w}: Service {svc_name} must publish not-ready members (they must find "
                  "each other before a quorum makes any ready)")
            check(hs in selecting(labels), f"{w}: Service {svc_name} does not select its pods")
        c = pod["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        check({"client", "peer"} <= set(ports), f"{w}: expected ports named client and peer, "
              f"got {ports}")
        if headless:
            svc_ports = {p["name"]: p.get("targetPort", p["port"]) for p in hs["spec"]["ports"]}
            for port_name in ("client", "peer"):
                check(svc_ports.get(port_name) in (port_name, ports.get(port_name)),
                      f"{w}: Service {svc_name} port {port_name} does not reach the container's")
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        flags_known = etcd_flags()
        peers_seen = []
        for i in range(replicas):
            pod_name = f"{name}-{i}"
            env = {"POD_NAME": pod_name}
            # Kubernetes expands $(POD_NAME) in command and args, then the shell splits.
            argv = [expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            if argv[:2] == ["sh", "-c"] and len(argv) == 3:
                argv = shlex.split(argv[2])
            if argv and argv[0] == "exec":
                argv = argv[1:]
            if not check(argv and argv[0] == "etcd", f"{w}: runs {argv[:1]}, not etcd"):
                break
            flags = {}
            for arg in argv[1:]:
                if check(arg.startswith("--") and "=" in arg, f"{w}: etcd argument {arg!r} "
                         "is not --flag=value"):
                    flags[arg[2:].split("=", 1)[0]] = arg.split("=", 1)[1]
            if flags_known is not None:
                for flag in flags:
                    check(flag in flags_known, f"{w}: etcd has no flag --{flag}")
            fqdn = f"{pod_name}.{svc_name}"
            check(flags.get("name") == pod_name, f"{w}: member {i} is named "
                  f"{flags.get('name')!r}, not its pod's name {pod_name}")
            check(url_hostport(flags.get("initial-advertise-peer-urls", "")) ==
                  (fqdn, ports.get("peer")),
                  f"{w}: member {i} advertises peer URL {flags.get('initial-advertise-peer-urls')}"
                  f", not http://{fqdn}:{ports.get('peer')}")
            check(url_hostport(flags.get("advertise-client-urls", "")) ==
                  (fqdn, ports.get("client")),
                  f"{w}: member {i} advertises client URL {flags.get('advertise-client-urls')}, "
                  f"not http://{fqdn}:{ports.get('client')}")
            for flag, port_name in (("listen-peer-urls", "peer"),
                                    ("listen-client-urls", "client")):
                hp = url_hostport(flags.get(flag, ""))
                check(hp is not None and hp[1] == ports.get(port_name),
                      f"{w}: --{flag}={flags.get(flag)} is not on the {port_name} port")
            cluster = {}
            for entry in flags.get("initial-cluster", "").split(","):
                member, _, url = entry.partition("=")
                cluster[member] = url_hostport(url)
            want = {f"{name}-{j}": (f"{name}-{j}.{svc_name}", ports.get("peer"))
                    for j in range(replicas)}
            check(cluster == want, f"{w}: --initial-cluster lists {cluster}, expected exactly "
                  f"the {replicas} members {want}")
            check(flags.get("initial-cluster-state") == "new",
                  f"{w}: --initial-cluster-state should be new")
            data = flags.get("data-dir", "")
            check(any(data.startswith(vm["mountPath"].rstrip("/") + "/") and vm["name"] in claims
                      for vm in c.get("volumeMounts", [])),
                  f"{w}: --data-dir={data} is not on a volume claim template")
            peers_seen.append(flags.get("name"))
            endpoints.add(f"{fqdn}:{ports.get('client')}")
        check(len(set(peers_seen)) == replicas, f"{w}: member names {peers_seen} not distinct")
        check("grpc" in c.get("readinessProbe", {}) and
              c["readinessProbe"]["grpc"].get("port") == ports.get("client"),
              f"{w}: readiness should be etcd's gRPC health service on the client port")

    # ---- two coordinators on those members, behind a Service ----
    coordinators = [d for d in of_kind("Deployment")
                    if any(c.get("command", [""])[0] == "modelavg-coordinator"
                           for c in d["spec"]["template"]["spec"]["containers"])]
    if not check(len(coordinators) == 1, f"{where}: expected one coordinator Deployment, found "
                 f"{len(coordinators)}"):
        return
    dep = coordinators[0]
    w = f"{where} Deployment {dep['metadata']['name']}"
    check(dep["spec"].get("replicas") == 2, f"{w}: {dep['spec'].get('replicas')} replicas, "
          "expected 2 (a leader and a standby)")
    pod = dep["spec"]["template"]
    labels = pod["metadata"].get("labels", {})
    check(all(labels.get(k) == v for k, v in dep["spec"]["selector"]["matchLabels"].items()),
          f"{w}: selector does not match the pod labels")
    check(pod["spec"].get("securityContext", {}).get("runAsNonRoot") is True,
          f"{w}: pods should run as non-root")
    c = next(c for c in pod["spec"]["containers"]
             if c.get("command", [""])[0] == "modelavg-coordinator")
    argv = list(c.get("command", [])) + list(c.get("args", []))
    binaries.check_command(argv, f"{w} container {c['name']}")
    got = set(filter(None, (flag_value(argv, "etcd_endpoints") or "").split(",")))
    check(endpoints and got == endpoints, f"{w}: --etcd_endpoints={sorted(got)}, expected the etcd "
          f"members' client addresses {sorted(endpoints)}")
    check(flag_value(argv, "state_dir") is None, f"{w}: --state_dir with --etcd_endpoints (the "
          "state is etcd's)")
    env = {e["name"]: e for e in c.get("env", [])}
    advertise = flag_value(argv, "advertise") or ""
    check("$(POD_IP)" in advertise and
          env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") ==
          "status.podIP",
          f"{w}: --advertise={advertise!r} should be the pod IP ($(POD_IP) from status.podIP): "
          "a standby names it to the clients")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    listen = flag_value(argv, "listen") or ""
    check(listen.endswith(f":{ports.get('grpc')}"), f"{w}: --listen={listen} is not the grpc port")
    check(advertise.endswith(f":{ports.get('grpc')}"),
          f"{w}: --advertise={advertise} is not on the grpc port")
    ready = c.get("readinessProbe", {})
    check(ready.get("grpc", {}).get("port") in (ports.get("grpc"), "grpc") and
          not ready["grpc"].get("service"),
          f"{w}: readiness should be the gRPC health service on the grpc port (SERVING on the "
          f"leader only), got {ready}")
    live = c.get("livenessProbe", {})
    check(live and "grpc" not in live,
          f"{w}: the liveness probe must be one a standby passes (not the health service, "
          f"NOT_SERVING on a standby, which would restart it forever), got {live}")
    matched = selecting(labels)
    check(matched, f"{w}: no Service selects its pods")
    for svc in matched:
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            check(target in ports or target in ports.values(),
                  f"{w}: Service {svc['metadata']['name']} port {sp['name']} targets {target}, "
                  "not a container port")
        check(svc["spec"].get("clusterIP") != "None",
              f"{w}: Service {svc['metadata']['name']} should route (not headless)")
    for job in of_kind("Job"):
        for wc in job["spec"]["template"]["spec"]["containers"]:
            wargv = list(wc.get("command", [])) + list(wc.get("args", []))
            hosts = [a.split(":")[0] for a in (flag_value(wargv, "coordinator") or "").split(",")]
            check(hosts and all(h in {s["metadata"]["name"] for s in matched} for h in hosts),
                  f"{where} Job {job['metadata']['name']}: --coordinator names {hosts}, not the "
                  "coordinators' Service")

    # ---- the README ----
    readme = os.path.join(ha, "README.md")
    if check(os.path.exists(readme), f"{where}: no README.md"):
        text = open(readme).read()
        check("kubectl apply -k deploy/k8s/ha" in text,
              f"{where}/README.md does not say how to apply the manifests")
        for name in ("etcd.yaml", "coordinator.yaml"):
            check(name in text, f"{where}/README.md does not describe {name}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", action="append", default=[], help="NAME=PATH of a built program")
    args = p.parse_args()
    binaries = Binaries(args.binary)
    check_k8s(binaries)
    check_kustomize(os.path.join(DEPLOY, "k8s"))
    check_k8s_ha(binaries)
    if errors:
        mt.fail(f"{len(errors)} problem(s) in the Kubernetes manifests:\n  " + "\n  ".join(errors))
    print("PASS: the Kubernetes manifests are consistent with the build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
