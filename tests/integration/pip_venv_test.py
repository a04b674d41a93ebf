#!/usr/bin/env python3
"""deploy/build_wheel.sh makes a manylinux wheel that installs into a clean virtual environment
(no --system-site-packages: no Debian gRPC, Protobuf, Abseil, Gloo, spdlog or fmt from it) and
runs a 2-rank drop-in job there, against the wheel's own coordinator.

Builds the wheel with deploy/build_wheel.sh (pip wheel offline, then auditwheel repair with
.venv's pinned auditwheel), compiling in the given CMake build directory
(MODELAVG_CMAKE_BUILD_DIR: what is built there is reused). Then:
  * the wheel's tag is the manylinux tag auditwheel gave it, and it holds the extension, the two
    programs and the libraries auditwheel copied (modelavg.libs/, named with a hash);
  * /usr/bin/python3 -m venv, without --system-site-packages; pip install --no-index --no-deps
    the wheel (its time is printed);
  * PyTorch is not downloaded a second time: after the wheel is installed, a .pth file in the
    fresh venv adds .venv's site-packages (site.addsitedir: after the venv's own, so that
    `modelavg` still comes from the fresh venv, which is checked, and torch from .venv);
    one process imports modelavg, then torch; the ranks import torch, then modelavg, rank 1
    with TORCH_USE_RTLD_GLOBAL=1 (libtorch's Gloo and Protobuf in the global scope: the
    extension, loaded with RTLD_DEEPBIND, must still bind to the wheel's hashed copies);
  * ldd of the extension and of both programs, and the libraries that `import modelavg` maps into
    a process: each one is the wheel's own (modelavg.libs/) or a glibc-level system library
    (the manylinux policy's: libc, libm, libstdc++, libgcc_s, ...); none is the build
    directory's, none Debian's gRPC/Protobuf/Abseil/Gloo/spdlog/fmt;
  * the extension still exports PyInit__core and nothing else (python/core.map);
  * `modelavg-coordinator --help`, `python -m modelavg jobs` and the `modelavg` command;
  * the venv's `modelavg-coordinator` serves, and two processes of the venv's Python average a
    parameter with modelavg.torch's PeriodicModelAverager(period=2, warmup_steps=1) for 6 steps
    with PyTorch 2.x; every rank, every step checked against a naive re-statement of the rule.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

WORKER = mt.dropin_worker(
    '    print(json.dumps({"rank": rank, "step": step, "value": p[0].item(),\n'
    '                      "module": modelavg.__file__, "torch": torch.__version__}),\n'
    '          flush=True)')

# What a manylinux wheel may load from the system: the loader and the libraries of auditwheel's
# manylinux policies that a program of ours could use (glibc's, libstdc++, libgcc_s, libatomic,
# and zlib, which the policies list too); everything else must come from the wheel.
SYSTEM_LIBS = {
    "linux-vdso.so.1", "ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libmvec.so.1",
    "libdl.so.2", "librt.so.1", "libpthread.so.0", "libresolv.so.2", "libutil.so.1",
    "libnsl.so.1", "libanl.so.1", "libstdc++.so.6", "libgcc_s.so.1", "libatomic.so.1",
    "libz.so.1",
}
# Debian's libraries that the build links and the wheel must carry its own copies of instead.
DEBIAN_BUILD_LIBS = re.compile(
    r"lib(grpc|gpr|upb|address_sorting|protobuf|absl_|gloo|spdlog|fmt|re2|cares|prometheus|"
    r"microhttpd|sqlite3|ssl|crypto|gnutls)")
# auditwheel's name for a copied library: its own name, a hash of its contents, then .so...
HASHED = re.compile(r"^lib[^/]*-[0-9a-f]{8}\.so")

# In the venv: the shared objects that `import modelavg` adds to the process's mappings, less
# the interpreter's own extension modules (lib-dynload), ctypes (which modelavg/_native.py uses
# to load the extension) with libffi, and PyTorch's own libraries, loaded first (a module built
# with the NCCL path imports PyTorch before it loads: modelavg/_native.py).
LOADED = r"""
import _ctypes, ctypes, json, os
import torch
dynload = os.path.dirname(_ctypes.__file__) + os.sep
def mapped():
    with open("/proc/self/maps") as f:
        return {ln.split()[-1] for ln in f if ".so" in ln.split()[-1]}
before = mapped()
import modelavg
loaded = [p for p in sorted(mapped() - before) if not p.startswith(dynload)]
print(json.dumps({"module": modelavg.__file__, "loaded": loaded}))
"""


def run(argv, what, env, timeout=120, cwd=None):
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    if out.returncode != 0:
        mt.fail(f"{what} exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out


def check_library(path, soname, where, libs_dir, build_dir):
    """One library that `where` loads: the wheel's own, or a glibc-level system library."""
    real = os.path.realpath(path) if path else ""
    if real.startswith(os.path.realpath(build_dir) + os.sep):
        mt.fail(f"{where} loads {soname} from the build directory: {real}")
    if real.startswith(libs_dir + os.sep):
        if not HASHED.match(os.path.basename(real)):
            mt.fail(f"{where} loads {real}: a copied library without auditwheel's hashed name")
        return
    if DEBIAN_BUILD_LIBS.match(soname):
        mt.fail(f"{where} loads {soname} from {real}, not from the wheel's {libs_dir}")
    if soname not in SYSTEM_LIBS:
        mt.fail(f"{where} loads {soname} ({real}): neither the wheel's nor a manylinux system "
                "library")


def check_ldd(binary, libs_dir, build_dir, env):
    """ldd of `binary`: what the loader resolves each of its libraries (and theirs) to."""
    out = run(["ldd", binary], f"ldd {binary}", env).stdout
    count = 0
    for line in out.splitlines():
        line = line.strip()
        if "not found" in line:
            mt.fail(f"ldd {binary}: {line}")
        m = re.match(r"^(\S+) => (\S+) \(0x", line) or re.match(r"^(\S+) \(0x", line)
        if not m:
            continue
        soname = os.path.basename(m.group(1))
        path = m.group(2) if m.lastindex == 2 else m.group(1)
        check_library(path if path.startswith("/") else "", soname, binary, libs_dir, build_dir)
        count += 1
    return count


def check_exports(extension, env):
    """The extension's defined dynamic symbols: PyInit__core alone."""
    out = run(["readelf", "--dyn-syms", "-W", extension], "readelf --dyn-syms", env).stdout
    defined = set()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 8 and cols[4] in ("GLOBAL", "WEAK") and cols[6] != "UND":
            defined.add(cols[7].split("@")[0])
    if defined != {"PyInit__core"}:
        mt.fail(f"{extension} exports {sorted(defined)[:20]}, expected only PyInit__core")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build_dir", required=True)
    args = parser.parse_args()
    root = mt.REPO_ROOT
    build_dir = os.path.abspath(args.build_dir)
    tools_python = os.path.join(root, ".venv", "bin", "python")
    if not os.access(os.path.join(root, ".venv", "bin", "auditwheel"), os.X_OK):
        mt.fail(f"{root}/.venv has no auditwheel: bash deploy/install_deps.sh")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONHOME")}
    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-pip-")
        dist = os.path.join(work, "dist")
        built = run(["bash", os.path.join(root, "deploy", "build_wheel.sh"), dist],
                    "deploy/build_wheel.sh", dict(env, MODELAVG_CMAKE_BUILD_DIR=build_dir),
                    timeout=1200)
        wheels = glob.glob(os.path.join(dist, "modelavg-*.whl"))
        if len(wheels) != 1 or built.stdout.strip().splitlines()[-1] != wheels[0]:
            mt.fail(f"expected one wheel in {dist}, found {os.listdir(dist)}")
        wheel = wheels[0]
        # The tag is auditwheel's: the file name carries it; `auditwheel show` says it is the
        # wheel's (build_wheel.sh printed that on stderr).
        tag = os.path.basename(wheel).split("-")[-1][:-len(".whl")]
        if not re.fullmatch(r"manylinux_2_\d+_x86_64(\.manylinux\S*)?", tag):
            mt.fail(f"the wheel's platform tag is {tag}, not a manylinux tag:\n{built.stderr}")
        shown = run([tools_python, "-m", "auditwheel", "show", wheel], "auditwheel show",
                    dict(env, PATH=os.path.join(root, ".venv", "bin") + ":" + env["PATH"]))
        first_tag = tag.split(".")[0]
        if f'"{first_tag}"' not in shown.stdout.replace("\n", " "):
            mt.fail(f"auditwheel show does not give {wheel} the tag {first_tag}:\n{shown.stdout}")
        print(f"built {os.path.basename(wheel)} ({os.path.getsize(wheel) / 1e6:.1f} MB)")

        venv = os.path.join(work, "venv")
        run(["/usr/bin/python3", "-m", "venv", venv], "python3 -m venv", env, timeout=300)
        py = os.path.join(venv, "bin", "python")
        site = run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   "the venv's site-packages", env).stdout.strip()
        if run([py, "-c", "import sys; print(sys.flags.no_site, sys.path)"], "sys.path",
               env).stdout.count("dist-packages"):
            mt.fail("the fresh venv sees Debian's dist-packages")
        start = time.monotonic()
        run([py, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
             wheel], "pip install of the wheel", env, timeout=300)
        install_s = time.monotonic() - start
        print(f"pip install of the wheel: {install_s:.1f} s")

        # PyTorch from .venv, added after the wheel's install and after the venv's own
        # site-packages (addsitedir appends, and reads .venv's .pth files too).
        torch_site = run([os.path.join(root, ".venv", "bin", "python"), "-c",
                          "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         ".venv's site-packages", env).stdout.strip()
        with open(os.path.join(site, "zz_modelavg_test_torch.pth"), "w") as f:
            f.write(f"import site; site.addsitedir({torch_site!r})\n")
        where = json.loads(run([py, "-c", "import json, modelavg, torch; print(json.dumps("
                                "[modelavg.__file__, torch.__file__, torch.__version__]))"],
                               "import modelavg, torch in the venv", env, cwd=work)
                           .stdout.strip().splitlines()[-1])
        if not where[0].startswith(site + os.sep):
            mt.fail(f"modelavg comes from {where[0]}, not from the venv's {site}")
        if where[1].startswith(venv + os.sep) or not where[2].startswith("2."):
            mt.fail(f"torch {where[2]} from {where[1]}: expected .venv's PyTorch 2.x")

        package = os.path.dirname(where[0])
        libs_dir = os.path.realpath(os.path.join(site, "modelavg.libs"))
        copied = sorted(os.listdir(libs_dir)) if os.path.isdir(libs_dir) else []
        if not copied:
            mt.fail(f"the wheel has no modelavg.libs/ with the libraries it needs: {site}")
        extension = glob.glob(os.path.join(package, "_core*.so"))
        programs = [os.path.join(package, "_bin", n) for n in ("modelavg", "modelavg-coordinator")]
        if len(extension) != 1 or not all(os.access(p, os.X_OK) for p in programs):
            mt.fail(f"the installed package lacks the extension or a program: "
                    f"{os.listdir(package)}")
        resolved = sum(check_ldd(b, libs_dir, build_dir, env) for b in extension + programs)
        check_exports(extension[0], env)
        loaded = json.loads(run([py, "-c", LOADED], "import modelavg (mappings)", env,
                                cwd=work).stdout.strip().splitlines()[-1])
        for path in loaded["loaded"]:
            if os.path.realpath(path) != os.path.realpath(extension[0]):
                # A mapping names the file (libstdc++.so.6.0.30); the list has SONAMEs.
                soname = re.match(r"^(.*?\.so(?:\.\d+)?)", os.path.basename(path)).group(1)
                check_library(path, soname, "import modelavg", libs_dir, build_dir)
        print(f"{len(copied)} libraries in modelavg.libs; {resolved} resolutions by ldd and "
              f"{len(loaded['loaded'])} objects mapped by `import modelavg` checked")

        # Abseil's --help exits with status 1; what matters is that it lists the flags.
        help_out = subprocess.run([os.path.join(venv, "bin", "modelavg-coordinator"), "--help"],
                                  capture_output=True, text=True, env=env, timeout=60)
        text = help_out.stdout + help_out.stderr
        if help_out.returncode not in (0, 1) or not all(
                f"--{flag} (" in text for flag in ("listen", "state_dir", "port_file")):
            mt.fail(f"modelavg-coordinator --help exited {help_out.returncode} without listing "
                    f"--listen, --state_dir and --port_file:\n{text[-3000:]}")

        coord = mt.Coordinator(group, os.path.join(venv, "bin", "modelavg-coordinator"),
                               workdir=work)
        for argv in ([os.path.join(venv, "bin", "modelavg")], [py, "-m", "modelavg"]):
            cli = run(argv + [f"--coordinator={coord.address}", "jobs"], " ".join(argv), env,
                      timeout=60)
            if "no jobs" not in cli.stdout:
                mt.fail(f"{' '.join(argv)} jobs: {cli.stdout} {cli.stderr}")

        procs = []
        for rank in range(2):
            wenv = dict(env, RANK=str(rank), WORLD_SIZE="2", MODELAVG_COORDINATOR=coord.address,
                        MODELAVG_JOB="pip-dropin")
            if rank == 1:  # libtorch's symbols (its Gloo, its Protobuf) in the global scope
                wenv["TORCH_USE_RTLD_GLOBAL"] = "1"
            procs.append(group.start([py, "-c", WORKER], f"rank{rank}", env=wenv))
        results = mt.wait_all(procs, timeout_s=180)
        want = mt.dropin_expected(2)
        for rank in range(2):
            rc, out, err = results[f"rank{rank}"]
            if rc != 0:
                mt.fail(f"rank {rank} exited {rc}:\n{err[-3000:]}\n{coord.log_tail()}")
            lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
            if len(lines) != mt.DROPIN_STEPS:
                mt.fail(f"rank {rank} printed {len(lines)} steps:\n{out}")
            for line in lines:
                if not line["module"].startswith(site + os.sep):
                    mt.fail(f"rank {rank} imported modelavg from {line['module']}")
                if not line["torch"].startswith("2."):
                    mt.fail(f"rank {rank} ran PyTorch {line['torch']}, expected 2.x")
                w = want[rank][line["step"]]
                if abs(line["value"] - w) > 1e-6:
                    mt.fail(f"rank {rank} step {line['step']}: {line['value']}, expected {w}")
        if coord.stop() != 0:
            mt.fail(f"the wheel's coordinator did not stop cleanly:\n{coord.log_tail()}")
    print(f"manylinux wheel ({tag}) into a clean venv in {install_s:.1f} s, 2-rank drop-in with "
          f"PyTorch {where[2]}: 1 passed, 0 failed")


if __name__ == "__main__":
    main()
