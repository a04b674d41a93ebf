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
    ConfigMap identical to deploy/jobs/demo-jobs.json.

  e2e_k8s_manifests_test.py --binary=modelavg-coordinator=PATH --binary=modelavg-demo=PATH ...
"""

import argparse
import glob
import json
import os
import re
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


def check_k8s(binaries):
    manifests = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml"))):
        for doc in load_yaml_docs(path):
            manifests.append((os.path.basename(path), doc))
    by_kind = {}
    for fname, doc in manifests:
        check("kind" in doc and "apiVersion" in doc, f"k8s/{fname}: a document lacks kind or "
              "apiVersion")
        by_kind.setdefault(doc.get("kind"), []).append((fname, doc))
    for kind in ("Deployment", "Service", "ConfigMap"):
        check(kind in by_kind, f"k8s: no {kind}")
    check("Job" in by_kind or "StatefulSet" in by_kind, "k8s: no worker Job or StatefulSet")
    check("Kustomization" in by_kind, "k8s: no kustomization.yaml")
    configmaps = {d["metadata"]["name"]: d for _, d in by_kind.get("ConfigMap", [])}
    with open(os.path.join(DEPLOY, "jobs", "demo-jobs.json")) as f:
        jobs_json = json.load(f)
    for name, cm in configmaps.items():
        for key, text in cm.get("data", {}).items():
            if key.endswith(".json"):
                check(json.loads(text) == jobs_json,
                      f"k8s ConfigMap {name}/{key} differs from deploy/jobs/demo-jobs.json")
    if "Kustomization" in by_kind:
        listed = set(by_kind["Kustomization"][0][1].get("resources", []))
        for fname, doc in manifests:
            if doc.get("kind") != "Kustomization":
                check(fname in listed, f"k8s/kustomization.yaml does not list {fname}")
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


def check_kustomize():
    """kubectl renders the kustomization offline (no cluster is contacted)."""
    import shutil
    import subprocess
    if not shutil.which("kubectl"):
        print("note: kubectl is not installed; the kustomization is not rendered")
        return
    out = subprocess.run(["kubectl", "kustomize", os.path.join(DEPLOY, "k8s")],
                         capture_output=True, text=True, timeout=60)
    if check(out.returncode == 0, f"kubectl kustomize deploy/k8s: {out.stderr.strip()}"):
        kinds = sorted(d.get("kind") for d in yaml.safe_load_all(out.stdout) if d)
        print(f"kubectl kustomize deploy/k8s: {len(kinds)} objects ({', '.join(kinds)})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", action="append", default=[], help="NAME=PATH of a built program")
    args = p.parse_args()
    binaries = Binaries(args.binary)
    check_k8s(binaries)
    check_kustomize()
    if errors:
        mt.fail(f"{len(errors)} problem(s) in the Kubernetes manifests:\n  " + "\n  ".join(errors))
    print("PASS: the Kubernetes manifests are consistent with the build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
