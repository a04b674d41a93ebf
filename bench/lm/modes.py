"""How the benchmark's workers communicate: one class per mode, registered in MODES.

A mode wraps the model (wrap), acts after each optimizer step (after_step, with the step's
index from 0), gives the plain module back for evaluation (module) and closes its connections
(close). `synchronous` says whether its ranks stay in step (a stop must then come at a step all
of them reach; see worker.py). To add a mode, write a class and add it to MODES; run.py lists
MODES in its --modes help.

The averaging modes share one schedule, LEVELS: pairs (a site's two workers) every 2 steps, all
four every 32. Ranks 0, 1 are site a and 2, 3 site b (run.py), so only the every-32 average
crosses the shaped link.
"""

import collections
import contextlib
import datetime
import os

import torch
import torch.distributed as dist

LEVELS = collections.OrderedDict([(2, 2), (32, 4)])  # period -> group size (PyTorch's order)
TORCH_PORT = 29500


def _init_torch(args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{TORCH_PORT}",
                            rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=300))


class Mode:
    synchronous = True

    def __init__(self, args):
        self.args = args

    def wrap(self, net):
        return net

    def module(self, net):
        return net

    def after_step(self, net, step):
        pass

    def close(self):
        pass


class NoCommunication(Mode):
    """Every worker trains alone: its seconds per step are the compute floor."""
    synchronous = False


class DDP(Mode):
    """PyTorch DistributedDataParallel (gloo): gradients all-reduced every step."""

    def wrap(self, net):
        _init_torch(self.args)
        return torch.nn.parallel.DistributedDataParallel(net)

    def module(self, net):
        return net.module

    def close(self):
        dist.destroy_process_group()


@contextlib.contextmanager
def _subgroups_without_cuda():
    """PyTorch 1.13's dist.new_subgroups refuses to run without CUDA ("Subgroups can only be
    created when CUDA is available"), which HierarchicalModelAverager calls for every level
    below the world. On CPU the check guards nothing: here the same consecutive blocks of ranks
    are made with dist.new_group, exactly as new_subgroups would make them."""
    original = dist.new_subgroups

    def new_subgroups(group_size=None, group=None, timeout=None, backend=None,
                      pg_options=None):
        world = dist.get_world_size()
        mine, groups = None, []
        for start in range(0, world, group_size):
            ranks = list(range(start, start + group_size))
            g = dist.new_group(ranks=ranks)
            groups.append(g)
            if dist.get_rank() in ranks:
                mine = g
        return mine, groups

    dist.new_subgroups = new_subgroups
    try:
        yield
    finally:
        dist.new_subgroups = original


class TorchAveragers(Mode):
    """PyTorch's HierarchicalModelAverager (gloo) with LEVELS, after each optimizer step."""

    def wrap(self, net):
        _init_torch(self.args)
        from torch.distributed.algorithms.model_averaging import hierarchical_model_averager
        with _subgroups_without_cuda():
            self.averager = hierarchical_model_averager.HierarchicalModelAverager(
                period_group_size_dict=LEVELS)
        return net

    def after_step(self, net, step):
        self.averager.average_parameters(net.parameters())

    def close(self):
        dist.destroy_process_group()


class Modelavg(Mode):
    """modelavg's drop-in HierarchicalModelAverager with LEVELS (the coordinator on its own
    host, Gloo between the workers)."""

    def wrap(self, net):
        os.environ.update(MODELAVG_COORDINATOR=self.args.coordinator,
                          MODELAVG_JOB=self.args.job, RANK=str(self.args.rank),
                          WORLD_SIZE=str(self.args.world_size),
                          MODELAVG_GLOO_HOSTNAME=self.args.address)
        import modelavg.torch
        self.averager = modelavg.torch.HierarchicalModelAverager(period_group_size_dict=LEVELS)
        return net

    def after_step(self, net, step):
        self.averager.average_parameters(net.parameters())


class DiLoCo(Modelavg):
    """modelavg's drop-in with LEVELS, the cross-site level an outer step (DiLoCo's recipe:
    SGD, lr 0.7, Nesterov momentum 0.9, on the pseudo-gradient since the level's last sync);
    the pairs inside a site average plainly."""

    def wrap(self, net):
        os.environ.update(MODELAVG_COORDINATOR=self.args.coordinator,
                          MODELAVG_JOB=self.args.job, RANK=str(self.args.rank),
                          WORLD_SIZE=str(self.args.world_size),
                          MODELAVG_GLOO_HOSTNAME=self.args.address)
        import modelavg
        import modelavg.torch
        outer = modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)
        self.averager = modelavg.torch.HierarchicalModelAverager(
            period_group_size_dict=LEVELS, outer={max(LEVELS): outer})
        return net


MODES = {
    "none": NoCommunication,
    "ddp": DDP,
    "torch_avg": TorchAveragers,
    "modelavg": Modelavg,
    "diloco": DiLoCo,
}
# Modes that need a modelavg coordinator (run.py starts one, and a job per run).
NEEDS_COORDINATOR = {"modelavg", "diloco"}
