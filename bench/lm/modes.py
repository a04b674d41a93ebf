"""How the benchmark's workers communicate: one class per mode, registered in MODES.

A mode wraps the model (wrap), may hook the optimizer once it exists (attach), acts after each
optimizer step (after_step, with the step's index from 0; modelavg's modes return its Decision),
gives the plain module back for evaluation (module) and closes its connections (close).
`synchronous` says whether its ranks stay in step (a stop must then come at a step all of them
reach; see worker.py); `paced` that its last level is paced (docs/paced.md: the ranks take
different steps and stop after a round). To add a mode, write a class and add it to MODES;
run.py lists MODES in its --modes help.

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


def _close_torch():
    """Every rank at a barrier first, then the process groups torn down: a rank that destroyed
    its groups (closing its Gloo pairs) while a peer was still in its last collective, or that
    exited with groups alive, aborted the peer ("terminate called without an active
    exception") now and then."""
    dist.barrier()
    dist.destroy_process_group()


def _init_torch(args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{TORCH_PORT}",
                            rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=300))


class Mode:
    synchronous = True
    paced = False

    def __init__(self, args):
        self.args = args

    @staticmethod
    def levels(args):
        """The averaging levels (period -> group size) of this mode."""
        return LEVELS

    def wrap(self, net):
        return net

    def attach(self, net, opt):
        """Called once the optimizer exists (after wrap): for modes that act in its step."""

    def module(self, net):
        return net

    def after_step(self, net, step):
        pass

    def bytes_sent(self):
        """Bytes this rank sent per averaging level so far (None: not measured)."""
        return None

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
        _close_torch()


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
        _close_torch()


class Modelavg(Mode):
    """modelavg's drop-in HierarchicalModelAverager with LEVELS (the coordinator on its own
    host, Gloo between the workers)."""

    def outer(self, modelavg):
        """The cross-site level's outer rule (None: a plain average)."""
        return None

    replacement = False  # True: join a running elastic job without RANK (bench/peers' restart)

    def wrap(self, net):
        os.environ.update(MODELAVG_COORDINATOR=self.args.coordinator,
                          MODELAVG_JOB=self.args.job, RANK=str(self.args.rank),
                          WORLD_SIZE=str(self.args.world_size),
                          MODELAVG_GLOO_HOSTNAME=self.args.address)
        if self.replacement:
            del os.environ["RANK"]  # admitted to the vacant rank, healed from its peers
        import modelavg
        import modelavg.torch
        levels = self.levels(self.args)
        outer = self.outer(modelavg)
        self.averager = modelavg.torch.HierarchicalModelAverager(
            period_group_size_dict=levels,
            **({"outer": {max(levels): outer}} if outer is not None else {}))
        return net

    def after_step(self, net, step):
        return self.averager.average_parameters(net.parameters())

    def bytes_sent(self):
        return [t.bytes_sent for t in self.averager.traffic()]


class DiLoCo(Modelavg):
    """modelavg's drop-in, the pairs inside a site averaging plainly every --diloco_site_period
    steps (2, as in LEVELS, by default), the cross-site level every --diloco_period steps an outer
    step (SGD with Nesterov momentum, --outer_lr and --outer_momentum, on the pseudo-gradient
    since the level's last sync)."""

    @staticmethod
    def levels(args):
        return collections.OrderedDict([(args.diloco_site_period, 2), (args.diloco_period, 4)])

    def outer(self, modelavg):
        return modelavg.OuterSGD(self.args.outer_lr, momentum=self.args.outer_momentum,
                                 nesterov=True)


class DiLoCoPaced(DiLoCo):
    """DiLoCo (the diloco mode's levels and outer step) with the cross-site level paced
    (docs/paced.md): each site's pair, which the level inside the site locks together, takes its
    own number of inner steps between two outer steps, so that a slow pair and a fast one arrive
    together; --diloco_period counts the slowest pair's; each outer step is the token-weighted
    mean of the pairs' pseudo-gradients. Used by bench/paced (one replica slower)."""
    paced = True

    def outer(self, modelavg):
        return modelavg.Level(self.args.diloco_period, 4, outer=super().outer(modelavg),
                              paced=True)


class DiLoCoPayload(DiLoCo):
    """DiLoCo (as the diloco mode) with the cross-site pseudo-gradient sent compressed
    (Level.payload) and, in the *_ef modes, error feedback with beta 1 (Level.error_feedback):
    docs/streaming.md. TOPK and TOPK_INT2 keep --topk_density of each block's entries."""
    payload = "INT8"
    error_feedback = 0.0

    def outer(self, modelavg):
        period = self.args.diloco_period
        return modelavg.Level(period, 4, outer=super().outer(modelavg), payload=self.payload,
                              error_feedback=self.error_feedback,
                              topk_density=self.args.topk_density
                              if self.payload in ("TOPK", "TOPK_INT2") else 0.0)


def _diloco_payload(payload, error_feedback):
    return type(f"DiLoCo{payload.title()}{'Feedback' if error_feedback else ''}",
                (DiLoCoPayload,), {"payload": payload, "error_feedback": error_feedback})


class Streaming(Modelavg):
    """The cross-site level synced a quarter of the parameters at a time (a fragment every 8
    steps, each once every 32), its all-reduce overlapping one step of training (sync_delay 1),
    the rule plain averaging (outer lr 1, no momentum): docs/streaming.md."""
    payload = "FP32"

    def outer(self, modelavg):
        period = max(LEVELS)
        return modelavg.Level(period, LEVELS[period], outer=modelavg.OuterSGD(1.0), fragments=4,
                              sync_delay=1, payload=self.payload)


class StreamingInt8(Streaming):
    """Streaming with the cross-site pseudo-gradients sent as INT8 (a quarter of the bytes)."""
    payload = "INT8"


MODES = {
    "none": NoCommunication,
    "ddp": DDP,
    "torch_avg": TorchAveragers,
    "modelavg": Modelavg,
    "diloco": DiLoCo,
    "diloco_paced": DiLoCoPaced,
    "streaming": Streaming,
    "int8": StreamingInt8,
    "diloco_int8": _diloco_payload("INT8", 0.0),
    "diloco_int4": _diloco_payload("INT4", 0.0),
    "diloco_int4_ef": _diloco_payload("INT4", 1.0),
    "diloco_topk": _diloco_payload("TOPK", 0.0),
    "diloco_topk_ef": _diloco_payload("TOPK", 1.0),
    "diloco_topk_int2_ef": _diloco_payload("TOPK_INT2", 1.0),
}
# Modes that need a modelavg coordinator (run.py starts one, and a job per run).
NEEDS_COORDINATOR = {"modelavg", "diloco", "streaming", "int8"} | {
    m for m in MODES if m.startswith("diloco_")}
