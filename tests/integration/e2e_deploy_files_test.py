#!/usr/bin/python3
"""Checks the container and Kubernetes files without a container engine.

  * deploy/docker-compose.yml and deploy/k8s/*.yaml parse;
  * every program they (and the Dockerfile) run is one this build produces, and every flag they
    pass is one that program accepts (from its --helpfull);
  * every file they mount, copy or build from exists in the repository;
  * the compose services, networks and dependencies are consistent, the coordinator has a
    health check and the workers a coordinator to talk to;
  * the Kubernetes manifests have the kinds a deployment needs (Deployment, Service, ConfigMap,
    a worker Job or StatefulSet), gRPC readiness and liveness probes, selectors that match, and a
    jobs ConfigMap identical to deploy/jobs/demo-jobs.json;
  * the Dockerfile is multi-stage, runs as a non-root user, has a HEALTHCHECK and EXPOSEs the
    ports its coordinator listens on;
  * the coordinator accepts the jobs file and declares the jobs the workers use.

  e2e_deploy_files_test.py --binary=modelavg-coordinator=PATH --binary=modelavg-demo=PATH ...
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
# Images of other projects that the files may use (not built here).
EXTERNAL_IMAGES = ("fullstorydev/grpcurl",)

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


def check_compose(binaries):
    path = os.path.join(DEPLOY, "docker-compose.yml")
    docs = load_yaml_docs(path)
    if not check(len(docs) == 1, "docker-compose.yml: expected one YAML document"):
        return
    compose = docs[0]
    services = compose.get("services", {})
    networks = set((compose.get("networks") or {}).keys())
    check("coordinator" in services, "docker-compose.yml: no 'coordinator' service")
    workers = [n for n in services if n.startswith("worker-")]
    check(len(workers) == 4, f"docker-compose.yml: expected 4 workers, found {workers}")
    for name, svc in services.items():
        where = f"docker-compose.yml service {name}"
        image = svc.get("image", "")
        external = image.startswith(EXTERNAL_IMAGES)
        check(image or "build" in svc, f"{where}: neither image nor build")
        if "build" in svc:
            ctx = os.path.normpath(os.path.join(DEPLOY, svc["build"].get("context", ".")))
            check(os.path.isdir(ctx), f"{where}: build context {ctx} is missing")
            check(os.path.isfile(os.path.join(ctx, svc["build"].get("dockerfile", "Dockerfile"))),
                  f"{where}: the Dockerfile is missing")
        for net in svc.get("networks", []):
            check(net in networks, f"{where}: network {net} is not declared")
        for dep in (svc.get("depends_on") or {}):
            check(dep in services, f"{where}: depends on unknown service {dep}")
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith((".", "/")):
                check(os.path.exists(os.path.normpath(os.path.join(DEPLOY, source))),
                      f"{where}: volume source {source} does not exist")
        command = svc.get("command")
        if external:
            check("inspect" in svc.get("profiles", []),
                  f"{where}: the external image should only run under a profile")
            continue
        check(image.startswith("modelavg"), f"{where}: image {image} is not modelavg's")
        if isinstance(command, str):
            command = shlex.split(command)
        binaries.check_command(command or [], where)
        health = (svc.get("healthcheck") or {})
        if name == "coordinator":
            test = health.get("test", [])
            check(test[:1] == ["CMD"], f"{where}: healthcheck should be an exec-form CMD")
            binaries.check_command(test[1:], f"{where} healthcheck")
            listen = flag_value(command, "listen") or ""
            health_addr = flag_value(test[1:], "address") or ""
            check(listen.split(":")[-1] == health_addr.split(":")[-1],
                  f"{where}: healthcheck probes {health_addr} but the coordinator listens on "
                  f"{listen}")
        if name in workers:
            check(flag_value(command, "coordinator") == "coordinator:50051",
                  f"{where}: should reach the coordinator at coordinator:50051")
            check(flag_value(command, "gloo_hostname") in (name, svc.get("hostname")),
                  f"{where}: --gloo_hostname must be the worker's own host name")
            check("coordinator" in (svc.get("depends_on") or {}),
                  f"{where}: should depend on the coordinator")
    ranks = sorted(int(flag_value(services[w]["command"], "rank")) for w in workers)
    check(ranks == list(range(len(workers))), f"docker-compose.yml: worker ranks {ranks}")
    return compose


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


def check_dockerfile(binaries):
    path = os.path.join(ROOT, "Dockerfile")
    text = open(path).read()
    joined = re.sub(r"\\\n", " ", text)
    lines = [l.strip() for l in joined.splitlines() if l.strip() and not l.strip().startswith("#")]
    froms = [l for l in lines if l.upper().startswith("FROM ")]
    check(len(froms) >= 2, "Dockerfile: expected a multi-stage build")
    for l in lines:
        if l.upper().startswith("COPY ") and "--from=" not in l:
            sources = l.split()[1:-1]
            for s in sources:
                check(os.path.exists(os.path.join(ROOT, s.rstrip("/"))),
                      f"Dockerfile: COPY source {s} does not exist")
    user = [l for l in lines if l.upper().startswith("USER ")]
    check(user and user[-1].split()[1].split(":")[0] not in ("root", "0"),
          "Dockerfile: the runtime stage must run as a non-root USER")
    health = [l for l in lines if l.upper().startswith("HEALTHCHECK ")]
    exposed = set()
    for l in lines:
        if l.upper().startswith("EXPOSE "):
            exposed.update(int(p.split("/")[0]) for p in l.split()[1:])
    cmd = [l for l in lines if l.upper().startswith("CMD ")]
    if check(health, "Dockerfile: no HEALTHCHECK"):
        argv = json.loads(health[-1].split(" CMD ", 1)[1])
        binaries.check_command(argv, "Dockerfile HEALTHCHECK")
    if check(cmd, "Dockerfile: no CMD"):
        argv = json.loads(cmd[-1][4:])
        binaries.check_command(argv, "Dockerfile CMD")
        for flag in ("listen", "metrics_listen"):
            value = flag_value(argv, flag)
            if check(value, f"Dockerfile CMD: no --{flag}"):
                check(int(value.rsplit(":", 1)[1]) in exposed,
                      f"Dockerfile: --{flag}={value} but EXPOSE has {sorted(exposed)}")
        jobs_file = flag_value(argv, "jobs_file")
        if jobs_file:
            check(os.path.exists(os.path.join(DEPLOY, "jobs", os.path.basename(jobs_file))),
                  f"Dockerfile CMD: --jobs_file={jobs_file} is not shipped from deploy/jobs/")
    targets = re.search(r"--target\s+((?:[\w-]+\s*)+)", joined)
    if check(targets, "Dockerfile: no cmake --build --target list"):
        for t in targets.group(1).split():
            if t.startswith("modelavg"):
                check(t in binaries.paths, f"Dockerfile builds target {t}, unknown to this build")
    ignore = open(os.path.join(ROOT, ".dockerignore")).read().split()
    check("build/" in ignore and ".git" in ignore,
          ".dockerignore should leave out build/ and .git")


def check_jobs_file(binaries):
    """The coordinator takes the jobs file and declares the jobs the workers join."""
    if "modelavg-coordinator" not in binaries.paths:
        return
    jobs_file = os.path.join(DEPLOY, "jobs", "demo-jobs.json")
    expected = {j["job_id"]: j for j in json.load(open(jobs_file))["jobs"]}
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, binaries.paths["modelavg-coordinator"],
                                     [f"--jobs_file={jobs_file}"])
        if "modelavg-health" in binaries.paths:
            import subprocess
            out = subprocess.run([binaries.paths["modelavg-health"],
                                  f"--address={coordinator.address}"],
                                 capture_output=True, text=True, timeout=30)
            check(out.returncode == 0, f"modelavg-health against a serving coordinator: "
                  f"{out.returncode} {out.stderr.strip()}")
        jobs = {j.spec.job_id: j for j in mt.list_jobs(coordinator.address)}
        check(set(jobs) == set(expected),
              f"--jobs_file declared {sorted(jobs)}, the file has {sorted(expected)}")
        for job_id, spec in expected.items():
            if job_id in jobs:
                got = jobs[job_id].spec
                check(got.world_size == spec["world_size"] and
                      [(l.period, l.group_size) for l in got.levels] ==
                      [(l["period"], l["group_size"]) for l in spec["levels"]],
                      f"job {job_id}: the coordinator has {got}, the file says {spec}")
        rc = coordinator.stop()
        check(rc == 0, f"the coordinator exited with {rc} after SIGTERM")


def check_tools(binaries):
    """The helpers the image build runs work on this build's programs."""
    import shutil
    import subprocess
    programs = [binaries.paths[n] for n in sorted(binaries.paths)]
    out = subprocess.run(["bash", os.path.join(DEPLOY, "runtime_packages.sh"), *programs],
                         capture_output=True, text=True, timeout=120)
    packages = out.stdout.split()
    if check(out.returncode == 0, f"deploy/runtime_packages.sh failed: {out.stderr.strip()}"):
        check(any(p.startswith("libgrpc++") for p in packages),
              f"deploy/runtime_packages.sh found no gRPC runtime package: {packages}")
    if shutil.which("kubectl"):  # offline: renders the kustomization, contacts no cluster
        out = subprocess.run(["kubectl", "kustomize", os.path.join(DEPLOY, "k8s")],
                             capture_output=True, text=True, timeout=60)
        check(out.returncode == 0, f"kubectl kustomize deploy/k8s: {out.stderr.strip()}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", action="append", default=[], help="NAME=PATH of a built program")
    args = p.parse_args()
    binaries = Binaries(args.binary)
    check_compose(binaries)
    check_k8s(binaries)
    check_dockerfile(binaries)
    check_jobs_file(binaries)
    check_tools(binaries)
    if errors:
        mt.fail(f"{len(errors)} problem(s) in the deployment files:\n  " + "\n  ".join(errors))
    print("PASS: compose, Kubernetes and Dockerfile are consistent with the build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
