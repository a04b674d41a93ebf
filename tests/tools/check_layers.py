#!/usr/bin/env python3
"""The house rules of the source tree (docs/architecture.md), checked from the code itself.

* Every product folder of client/ and server/ holds at most 16 source files directly.
* Each folder includes only from itself and the folders it may depend on (LAYERS below, the same
  table as docs/architecture.md): dependencies point down, never up or sideways.
* The public headers (include/modelavg/) include only each other, the generated API and
  third-party headers: nothing private.
* No test hook in product code (client/, server/, common/, include/): no `FaultInjection` and no
  `...ForTesting` name. Faults come from fakes that tests wrap around the product
  (tests/testing/), never from a switch inside it.

Usage: check_layers.py [REPO_ROOT] prints every violation and exits 1 if there is any.
check_layers.py --self-test [REPO_ROOT] checks that the rules catch seeded violations: it
copies the tree's product folders, seeds one of each kind, and expects every one reported.
"""
import os
import re
import shutil
import sys
import tempfile

# folder -> the folders it may include from (besides itself). Transitive: a folder may include
# what its dependencies may.
LAYERS = {
    "proto": [],  # the API's messages (generated from proto/modelavg/v1/)
    "proto/grpc": ["proto"],  # its gRPC stubs and the status conversion: the RPC layers only
    "include/modelavg": ["proto"],
    "common": ["include/modelavg"],
    "client/base": ["common"],
    "client/rpc": ["client/base", "proto/grpc"],
    "client/flags": ["client/rpc"],  # the programs' connection flags (not in modelavg_client)
    "client/heartbeat": ["client/rpc"],
    "client/payload": ["client/base"],
    "client/comm": ["client/base", "client/payload"],
    "client/comm/gloo": ["client/comm", "client/rpc"],
    "client/comm/nccl": ["client/comm", "client/rpc"],
    "client/comm/nccl/cuda": ["client/comm/nccl"],
    "client/session": ["client/heartbeat", "client/comm/gloo", "client/comm/nccl/cuda"],
    "client/averaging": ["client/session"],
    "server/membership": ["common"],
    "server/store": ["server/membership"],
    "server/store/sqlite": ["server/store"],
    "server/store/etcd": ["server/store", "proto/grpc"],
    "server/core": ["server/store"],
    "server/http": ["server/core"],
    "server/rpc": ["server/core", "proto/grpc"],
    "server": ["server/rpc", "server/http", "server/store/sqlite", "server/store/etcd"],
}
MAX_FILES = 16
SOURCE = (".h", ".cc", ".cu", ".cuh", ".proto")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# Folders of the table that are a part of another's files, not a directory of their own.
VIRTUAL = {"proto/grpc"}
# Product code: what ships. Test hooks have no place in it.
PRODUCT = ("client", "server", "common", "include")
HOOK = re.compile(r"\b(FaultInjection\w*|\w*ForTesting\w*)\b")


def closure(folder):
    seen, todo = set(), [folder]
    while todo:
        f = todo.pop()
        for d in LAYERS[f]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def owner(path):
    """The LAYERS folder a repository path belongs to (the longest that contains it)."""
    best = None
    for f in LAYERS:
        if path == f or path.startswith(f + "/"):
            if best is None or len(f) > len(best):
                best = f
    return best


def included_path(inc):
    """The repository path an include names (public headers are included as modelavg/...)."""
    if inc.endswith(".grpc.pb.h") or inc == "proto/status_conversion.h":
        return "proto/grpc/" + os.path.basename(inc)
    if inc.startswith("modelavg/v1/"):
        return "proto/" + inc  # generated from proto/modelavg/v1/
    if inc.startswith("modelavg/"):
        return "include/" + inc
    return inc


def check(root):
    """Every violation of the house rules in the tree at `root`, as lines for people."""
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return check_here()
    finally:
        os.chdir(cwd)


def check_here():
    problems = []
    for folder in sorted(LAYERS):
        if folder in VIRTUAL:
            continue
        if not os.path.isdir(folder):
            problems.append(f"{folder}: in the layer table but not in the tree")
            continue
        names = [n for n in os.listdir(folder) if n.endswith(SOURCE)]
        if folder.startswith(("client", "server")) and len(names) > MAX_FILES:
            problems.append(f"{folder}: {len(names)} source files directly (at most {MAX_FILES}):"
                            " split it along its seams")
    for top in ("client", "server", "common", "include", "proto"):
        for dirpath, _, files in os.walk(top):
            for name in files:
                if not name.endswith(SOURCE):
                    continue
                path = os.path.join(dirpath, name)
                folder = owner(dirpath)
                if path == "proto/status_conversion.h" or path == "proto/status_conversion.cc":
                    folder = "proto/grpc"
                if folder is None:
                    problems.append(f"{path}: its folder is not in the layer table")
                    continue
                text = open(path, encoding="utf-8").read()
                if top in PRODUCT:
                    for number, line in enumerate(text.splitlines(), 1):
                        for hook in HOOK.findall(line):
                            problems.append(f"{path}:{number}: names {hook}, a test hook in "
                                            "product code: wrap the product in a fake from "
                                            "tests/testing/ instead (docs/architecture.md)")
                allowed = closure(folder) | {folder}
                for inc in INCLUDE.findall(text):
                    target = included_path(inc)
                    if not target.startswith(("client/", "server/", "common/", "include/",
                                              "proto/")):
                        continue  # third-party (absl, gloo, grpcpp, ...) or generated
                    dep = owner(os.path.dirname(target))
                    if dep is None:
                        continue  # generated beside its folder (etcd_records.pb.h)
                    if dep not in allowed:
                        problems.append(f'{path}: includes "{inc}" ({dep}), which {folder} may '
                                        "not depend on (docs/architecture.md)")
    return problems


# The self-test's seeds: (file to create or append to, text, what the report must name).
SEEDS = [
    ("client/comm/seeded_hook.h", "class FaultInjection;\n", "names FaultInjection"),
    ("server/core/seeded_hook.cc", "int ResetClockForTesting() { return 0; }\n",
     "names ResetClockForTesting"),
    ("common/seeded_hook.h", "// set_faults(FaultInjection::LosingNextCommit())\n",
     "names FaultInjection"),
    ("include/modelavg/client/seeded_hook.h", "bool InjectedForTesting();\n",
     "names InjectedForTesting"),
    ("client/base/seeded_include.cc", '#include "client/session/backends.h"\n',
     "which client/base may not depend on"),
]


def self_test(root):
    """0 when the rules hold on the tree and catch every seeded violation in a copy of it."""
    root = os.path.abspath(root)
    clean = check(root)
    if clean:
        print("self-test: the tree itself has violations:")
        for p in clean:
            print(p)
        return 1
    with tempfile.TemporaryDirectory(prefix="check_layers.") as tmp:
        for top in PRODUCT + ("proto",):
            shutil.copytree(os.path.join(root, top), os.path.join(tmp, top),
                            ignore=shutil.ignore_patterns("*.py", "*.txt", "*.md", "*.cmake"))
        for path, text, _ in SEEDS:
            with open(os.path.join(tmp, path), "a", encoding="utf-8") as f:
                f.write(text)
        seeded = check(tmp)
    missed = [(path, want) for path, _, want in SEEDS
              if not any(p.startswith(path) and want in p for p in seeded)]
    for path, want in missed:
        print(f"self-test: a seeded violation in {path} was not reported ({want})")
    if missed:
        return 1
    print(f"self-test: all {len(SEEDS)} seeded violations reported")
    return 0


def main():
    args = sys.argv[1:]
    if args and args[0] == "--self-test":
        rest = args[1:]
        return self_test(rest[0] if rest else os.path.join(os.path.dirname(__file__), "..", ".."))
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "..")
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} violation(s) of the house rules")
        return 1
    print(f"house rules hold: {len(LAYERS)} folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
