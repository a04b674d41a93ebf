"""``import torch`` and ``import modelavg`` in one process, in either order.

libtorch carries its own Gloo (and NCCL, Protobuf); the modelavg extension links Debian's Gloo,
gRPC, Protobuf and Abseil into the same process. Nothing of one may step on the other:

* ``exports``: the compiled module exports nothing but its ``PyInit__core`` (a symbol it
  exported could take the place of libtorch's, or libtorch's of its own, wherever the dynamic
  linker looks a name up globally);
* ``torch_first``, ``modelavg_first``: two fresh processes of a 2-rank job import the two in that
  order, then run a torch.distributed Gloo all_reduce, a modelavg averaging round (explicit
  API) and another all_reduce, each result checked exactly; ``*_rtld_global`` the same with
  libtorch in the global scope (``TORCH_USE_RTLD_GLOBAL=1``: its Gloo's symbols are then what
  a global lookup finds; python/modelavg/_native.py); ``torchft`` with torchft imported after
  modelavg (its Manager's process groups are torch's Gloo).

  pytest tests/python/torch_import_test.py           (conftest.py: which build)
"""

import json
import os
import subprocess
import sys

import pytest

import modelavg_testing as mt

WORLD = 2

RANK_SCRIPT = r"""
import json, os, sys
order = os.environ["IMPORT_ORDER"]
if order.startswith("torch_first"):
    import torch, torch.distributed as dist
    import modelavg
elif order.startswith("modelavg_first"):
    import modelavg
    import torch, torch.distributed as dist
else:  # torchft
    import modelavg
    import torchft
    import torch, torch.distributed as dist
import modelavg_testing as mt
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mt.join_rank_group(torch, dist, int(os.environ["STORE_PORT"]), rank, world)
out = {"rank": rank, "torch": torch.__version__}
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)  # torch's Gloo: 1 + 2
out["torch_sum"] = t.tolist()
client = mt.connect_rank(modelavg, os.environ["COORDINATOR"], os.environ["JOB"], rank)
averager = modelavg.PeriodicModelAverager(client)
p = torch.nn.Parameter(torch.full((7,), 2.0 * rank))
p.grad = torch.zeros_like(p)
decision = averager.average_parameters([p])  # modelavg's Gloo: (0 + 2) / 2
out["modelavg_average"] = p.detach().tolist()
out["ranks"] = list(decision.ranks)
t = torch.full((3,), float(10 * rank))
dist.all_reduce(t)  # torch's Gloo again, after modelavg's: 0 + 10
out["torch_sum_after"] = t.tolist()
dist.destroy_process_group()
client.leave()
print(json.dumps(out), flush=True)
"""


def extension_path(python_dir):
    package = os.path.join(python_dir, "modelavg")
    names = [n for n in os.listdir(package) if n.startswith("_core") and n.endswith(".so")]
    assert len(names) == 1, names
    return os.path.join(package, names[0])


def check_exports(python_dir):
    """The module's dynamic symbol table defines PyInit__core and nothing else of its own."""
    so = extension_path(python_dir)
    nm = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True,
                        timeout=60)
    if nm.returncode != 0:
        mt.fail(f"nm -D {so}: {nm.stderr}")
    names = [line.split()[-1] for line in nm.stdout.splitlines() if line.strip()]
    # The linker's own section markers are no code of ours.
    extra = sorted(n for n in names if n not in ("PyInit__core", "_init", "_fini", "_edata",
                                                 "_end", "__bss_start"))
    if "PyInit__core" not in names or extra:
        mt.fail(f"{so} exports {len(extra)} symbol(s) besides PyInit__core, e.g. {extra[:12]}")
    print(f"PASS exports: {os.path.basename(so)} exports PyInit__core only")


def run_order(order, args):
    import torch.distributed as dist
    import modelavg
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin)
        job = f"import-{order.replace('_', '-')}"
        modelavg.create_job(job, WORLD, "PERIODIC", [(1, WORLD)],
                            coordinator=coordinator.address)
        store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, True, wait_for_workers=False)
        tools = os.path.join(mt.REPO_ROOT, "tests", "tools")
        procs = []
        for rank in range(WORLD):
            env = dict(os.environ, IMPORT_ORDER=order, RANK=str(rank), WORLD_SIZE=str(WORLD),
                       STORE_PORT=str(store.port), COORDINATOR=coordinator.address, JOB=job,
                       GLOO_SOCKET_IFNAME="lo",
                       TORCH_USE_RTLD_GLOBAL="1" if order.endswith("_rtld_global") else "",
                       PYTHONPATH=os.pathsep.join([args.python_dir, tools]))
            procs.append(group.start([sys.executable, "-c", RANK_SCRIPT], f"rank {rank}",
                                     env=env))
        results = mt.wait_all(procs, args.timeout_s)
        for name, (rc, out, err) in results.items():
            if rc != 0:
                mt.fail(f"{order}, {name} exited {rc}:\n{err[-3000:]}\ncoordinator log:\n"
                        f"{coordinator.log_tail()}")
            line = json.loads(out.strip().splitlines()[-1])
            rank = line["rank"]
            want = {"torch_sum": [3.0] * 5, "modelavg_average": [1.0] * 7,
                    "ranks": list(range(WORLD)), "torch_sum_after": [10.0] * 3}
            got = {k: line[k] for k in want}
            if got != want:
                mt.fail(f"{order}, rank {rank}: {got}, expected {want}")
        print(f"PASS {order}: torch {line['torch']}: Gloo all_reduce, a modelavg round, "
              "all_reduce again, in both ranks")


@pytest.mark.parametrize("case", ["exports", "torch_first", "modelavg_first",
                                  "torch_first_rtld_global", "modelavg_first_rtld_global",
                                  "torchft"])
def test_torch_import(case, suite_args):
    if case == "exports":
        check_exports(suite_args.python_dir)
    else:
        run_order(case, suite_args)
