#!/usr/bin/env python3
"""`pip wheel ./python` makes a wheel that installs into a fresh virtual environment and runs a
2-rank drop-in job there.

Builds the wheel offline (--no-build-isolation: Debian's setuptools and wheel) from a copy of
python/ (so the checkout gets no build/ or egg-info), compiling in the given CMake build
directory (MODELAVG_CMAKE_BUILD_DIR: what is built there is reused). Then:
  * python3 -m venv --system-site-packages (for Debian's torch), pip install --no-index the wheel;
  * `import modelavg` in the venv comes from the venv's site-packages;
  * the venv's `modelavg` command lists the coordinator's jobs;
  * two processes of the venv's Python average a parameter with modelavg.torch's
    PeriodicModelAverager(period=2, warmup_steps=1) for 6 steps; every rank, every step checked
    against a naive re-statement of the rule.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

WORKER = mt.dropin_worker(
    '    print(json.dumps({"rank": rank, "step": step, "value": p[0].item(),\n'
    '                      "module": modelavg.__file__}), flush=True)')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--build_dir", required=True)
    args = parser.parse_args()
    root = mt.REPO_ROOT
    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-pip-")
        src = os.path.join(work, "python")
        shutil.copytree(os.path.join(root, "python"), src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        env = dict(os.environ, MODELAVG_SOURCE_DIR=root,
                   MODELAVG_CMAKE_BUILD_DIR=os.path.abspath(args.build_dir))
        env.pop("PYTHONPATH", None)
        dist = os.path.join(work, "dist")
        wheel = subprocess.run(
            ["/usr/bin/python3", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
             "--no-index", "-w", dist, src], capture_output=True, text=True, env=env, timeout=1200)
        if wheel.returncode != 0:
            mt.fail(f"pip wheel failed:\n{wheel.stdout[-4000:]}\n{wheel.stderr[-4000:]}")
        wheels = glob.glob(os.path.join(dist, "modelavg-*.whl"))
        if len(wheels) != 1:
            mt.fail(f"expected one wheel in {dist}, found {os.listdir(dist)}")
        print(f"built {os.path.basename(wheels[0])} ({os.path.getsize(wheels[0])} bytes)")

        venv = os.path.join(work, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                       check=True, timeout=300)
        py = os.path.join(venv, "bin", "python")
        inst = subprocess.run([py, "-m", "pip", "install", "--no-index", "--no-deps", wheels[0]],
                              capture_output=True, text=True, env=env, timeout=300)
        if inst.returncode != 0:
            mt.fail(f"pip install of the wheel failed:\n{inst.stdout}\n{inst.stderr}")
        where = subprocess.run([py, "-c", "import modelavg; print(modelavg.__file__)"],
                               capture_output=True, text=True, env=env, cwd=work, timeout=60)
        site = os.path.join(venv, "lib")
        if where.returncode != 0 or not where.stdout.strip().startswith(site):
            mt.fail(f"import modelavg in the venv: {where.stdout} {where.stderr} "
                    f"(expected under {site})")

        coord = mt.Coordinator(group, args.coordinator, workdir=os.path.join(work))
        cli = subprocess.run([os.path.join(venv, "bin", "modelavg"),
                              f"--coordinator={coord.address}", "jobs"],
                             capture_output=True, text=True, env=env, timeout=60)
        if cli.returncode != 0 or "no jobs" not in cli.stdout:
            mt.fail(f"the venv's modelavg command: {cli.returncode} {cli.stdout} {cli.stderr}")

        procs = []
        for rank in range(2):
            wenv = dict(env, RANK=str(rank), WORLD_SIZE="2", MODELAVG_COORDINATOR=coord.address,
                        MODELAVG_JOB="pip-dropin")
            procs.append(group.start([py, "-c", WORKER], f"rank{rank}", env=wenv))
        results = mt.wait_all(procs, timeout_s=180)
        want = mt.dropin_expected(2)
        for rank in range(2):
            rc, out, err = results[f"rank{rank}"]
            if rc != 0:
                mt.fail(f"rank {rank} exited {rc}:\n{err[-3000:]}\n{coord.log_tail()}")
            lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
            if len(lines) != 6:
                mt.fail(f"rank {rank} printed {len(lines)} steps:\n{out}")
            for line in lines:
                if not line["module"].startswith(site):
                    mt.fail(f"rank {rank} imported modelavg from {line['module']}")
                w = want[rank][line["step"]]
                if abs(line["value"] - w) > 1e-6:
                    mt.fail(f"rank {rank} step {line['step']}: {line['value']}, expected {w}")
        coord.stop()
    print("pip wheel into a venv, 2-rank drop-in: 1 passed, 0 failed")


if __name__ == "__main__":
    main()
