#!/usr/bin/env python3
"""The house rules of the source tree (docs/architecture.md), checked from the code itself.

* Every product folder of client/ and server/ holds at most 16 source files directly.
* Each folder's files include (#include "...") only from the folder itself and the folders its
  row of docs/architecture.md's folder map lists: direct includes against the direct list, not
  anything reachable through another folder's list. The map is read from that page (its one
  copy); its lists must form no cycle. python/ and tools/ are checked as the product is.
* The public headers (include/modelavg/) include only each other, the generated API and
  third-party headers: nothing private.
* No test hook in product code (client/, server/, common/, include/): no `FaultInjection` and no
  `...ForTesting` name. Faults come from fakes that tests wrap around the product
  (tests/testing/), never from a switch inside it.

Usage: check_layers.py [REPO_ROOT] prints every violation and exits 1 if there is any.
check_layers.py --self-test [REPO_ROOT] checks that the rules catch seeded violations: it
copies the tree's checked folders and the map, seeds one of each kind, and expects every one
reported.
"""
import os
import re
import shutil
import sys
import tempfile

MAP = os.path.join("docs", "architecture.md")
# A row of the map: | `folder/` ... | target | what | `dep/`, `dep/`, ... |
ROW = re.compile(r"^\|\s*`([^`]+)`[^|]*\|.*\|([^|]*)\|\s*$")
MAX_FILES = 16
SOURCE = (".h", ".cc", ".cu", ".cuh", ".proto")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# Folders of the table that are a part of another's files, not a directory of their own.
VIRTUAL = {"proto/grpc"}
# Product code: what ships. Test hooks have no place in it.
PRODUCT = ("client", "server", "common", "include")
HOOK = re.compile(r"\b(FaultInjection\w*|\w*ForTesting\w*)\b")


def read_map(path):
    """folder -> the folders it may include from directly, read from the map; and problems."""
    layers, problems = {}, []
    with open(path, encoding="utf-8") as f:
        in_map = False
        for line in f:
            if line.startswith("## "):
                in_map = line.strip() == "## The folder map"
                continue
            m = ROW.match(line) if in_map else None
            if not m:
                continue
            folder = m.group(1).rstrip("/")
            deps = [d.rstrip("/") for d in re.findall(r"`([^`]+)`", m.group(2))]
            if not deps and "—" not in m.group(2):
                continue  # an aggregate row (`client/`: all of the above)
            if folder in layers:
                problems.append(f"{path}: {folder} has two rows in the folder map")
            layers[folder] = deps
    for folder, deps in layers.items():
        for d in deps:
            if d not in layers:
                problems.append(f"{path}: {folder} lists {d}, which has no row in the map")
    return layers, problems


def cycles(layers):
    """Each cycle of the map's lists, as 'a -> b -> a'."""
    found, state = [], {}

    def visit(f, stack):
        state[f] = 1
        stack.append(f)
        for d in layers.get(f, []):
            if state.get(d) == 1:
                found.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d in layers and not state.get(d):
                visit(d, stack)
        stack.pop()
        state[f] = 2

    for f in sorted(layers):
        if not state.get(f):
            visit(f, [])
    return found


def owner(path, layers):
    """The map's folder a repository path belongs to (the longest that contains it)."""
    best = None
    for f in layers:

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
    if not os.path.isfile(MAP):
        return [f"{MAP}: missing (the folder map)"]
    layers, problems = read_map(MAP)
    for c in cycles(layers):
        problems.append(f"{MAP}: the folder map's lists form a cycle: {c}")
    for folder in sorted(layers):
        if folder in VIRTUAL:
            continue
        if not os.path.isdir(folder):
            problems.append(f"{folder}: in the layer table but not in the tree")
            continue
        names = [n for n in os.listdir(folder) if n.endswith(SOURCE)]
        if folder.startswith(("client", "server")) and len(names) > MAX_FILES:
            problems.append(f"{folder}: {len(names)} source files directly (at most {MAX_FILES}):"
                            " split it along its seams")
    for top in ("client", "server", "common", "include", "proto", "python", "tools"):
        for dirpath, _, files in os.walk(top):
            for name in files:
                if not name.endswith(SOURCE):
                    continue
                path = os.path.join(dirpath, name)
                folder = owner(dirpath, layers)
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
                allowed = set(layers[folder]) | {folder}
                for inc in INCLUDE.findall(text):
                    target = included_path(inc)
                    if not target.startswith(("client/", "server/", "common/", "include/",
                                              "proto/", "python/", "tools/")):
                        continue  # third-party (absl, gloo, grpcpp, ...) or generated
                    dep = owner(os.path.dirname(target), layers)
                    if dep is None:
                        continue  # generated beside its folder (etcd_records.pb.h)
                    if dep not in allowed:
                        problems.append(f'{path}: includes "{inc}" ({dep}), which {folder} does '
                                        f"not list in {MAP}'s folder map: include from a "
                                        "listed folder, or add the arrow there")
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
     "which client/base does not list"),
    # Reachable through client/rpc's list, but not listed by client/flags itself.
    ("client/flags/seeded_direct.cc", '#include "client/base/error_kind.h"\n',
     "which client/flags does not list"),
    ("tools/seeded_tool.cc", '#include "server/core/job.h"\n', "which tools does not list"),
    ("python/seeded_binding.cc", '#include "client/session/client.h"\n',
     "which python does not list"),
]
# A seeded arrow in the map's copy: common/ listing client/base/, which lists common/.
MAP_SEED = ("| `common/` ", ", `client/base/` |",
            "form a cycle: client/base -> common -> client/base")


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
        for top in PRODUCT + ("proto", "python", "tools"):
            shutil.copytree(os.path.join(root, top), os.path.join(tmp, top),
                            ignore=shutil.ignore_patterns("*.py", "*.txt", "*.md", "*.cmake",
                                                          "*.toml", "*.map"))
        for path, text, _ in SEEDS:
            with open(os.path.join(tmp, path), "a", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(root, MAP), encoding="utf-8") as f:
            lines = f.read().split("\n")
        prefix, ending, _ = MAP_SEED
        row = next(i for i, line in enumerate(lines) if line.startswith(prefix))
        lines[row] = lines[row].rstrip().removesuffix(" |") + ending
        os.makedirs(os.path.join(tmp, "docs"))
        with open(os.path.join(tmp, MAP), "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        seeded = check(tmp)
    missed = [(path, want) for path, _, want in SEEDS
              if not any(p.startswith(path) and want in p for p in seeded)]
    if not any(p.startswith(MAP) and MAP_SEED[2] in p for p in seeded):
        missed.append((MAP, MAP_SEED[2]))
    for path, want in missed:
        print(f"self-test: a seeded violation in {path} was not reported ({want})")
    if missed:
        return 1
    print(f"self-test: all {len(SEEDS) + 1} seeded violations reported")
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
    print(f"house rules hold: {len(read_map(os.path.join(root, MAP))[0])} folders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
