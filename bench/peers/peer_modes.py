"""The modes of bench/peers: torchft and modelavg on the same work, one class each.

Every mode is a bench/lm/modes.Mode (wrap, attach, after_step, module, bytes_sent, close), so
that bench/lm/worker.py runs them unchanged. All four workers are peers: one replica each, all
four averaging every --diloco_period steps with DiLoCo's outer step (SGD, --outer_lr,
--outer_momentum, Nesterov) on the pseudo-gradient; no level inside a site (torchft has none).

* ``ft_*``: torchft 0.2.0 — a TCPStore and a ``Manager`` per replica (a replica group of one
  process, its own ``replica_id``), ``ProcessGroupGloo``, the wheel's Lighthouse
  (``torchft_lighthouse``, started by run.py), ``torchft.local_sgd.DiLoCo`` on the optimizer.
  ``ft_streaming`` splits the model into 4 fragments (contiguous runs of parameters of about
  equal size), each with its own outer optimizer, ``fragment_sync_delay=1``. ``ft_int8`` asks
  for ``should_quantize=True``: torchft's quantized all-reduce (FP8, Triton kernels) runs only
  where Triton does; without it ``Manager.allreduce`` sends FP32 silently, so run.py refuses the
  mode and says why (``ft_quantization_unavailable``).
* ``ma_*``: modelavg's drop-in (``modelavg.torch.HierarchicalModelAverager`` with one level, all
  four every period), an elastic job (``MODELAVG_MIN_WORLD_SIZE``, set by run.py like torchft's
  ``min_replica_size``). ``ma_streaming``: ``Level(fragments=4, sync_delay=1)``; ``ma_int8``
  and ``ma_int4_ef``: the pseudo-gradient sent as INT8, and INT4 with error feedback.

With PEERS_EVENTS set, each mode appends a JSON line per cross-site sync to that file (wall
clock ``t``, ``step``, and for torchft whether the sync committed, the participants and whether
this replica was healing): run.py's recovery figures come from them. With PEERS_REJOIN=1 the
worker is a restarted replica: torchft heals it from a peer at its first quorum (HTTP), and
modelavg admits it to the vacant rank and overwrites it with its peers' average.
"""

import collections
import datetime
import json
import os
import socket
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "lm"))
import modes as lm_modes  # noqa: E402

STORE_PORT = 29600    # each replica's TCPStore (torchft's Manager needs one per replica group)
MANAGER_PORT = 29610  # each replica's ManagerServer
LIGHTHOUSE_PORT = 29510


def _event(**kv):
    path = os.environ.get("PEERS_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(t=time.time(), **kv)) + "\n")


def _rejoining():
    return os.environ.get("PEERS_REJOIN") == "1"


def fragments_of(net, n):
    """`net`'s parameters as `n` modules of contiguous parameters of about equal size (the
    same Parameter objects, registered under flattened names)."""
    named = list(net.named_parameters())
    total = sum(p.numel() for _, p in named)
    out, current, size = [], torch.nn.Module(), 0
    for i, (name, p) in enumerate(named):
        current.register_parameter(name.replace(".", "_"), p)
        size += p.numel()
        left = len(named) - i - 1
        if len(out) < n - 1 and (size >= total * (len(out) + 1) / n) and left >= n - 1 - len(out):
            out.append(current)
            current = torch.nn.Module()
    if list(current.parameters()):
        out.append(current)
    return out


class Torchft(lm_modes.Mode):
    """torchft's DiLoCo: one Manager per replica, Gloo, the Lighthouse at --coordinator."""
    fragments = 1
    sync_delay = 0
    quantize = False

    def wrap(self, net):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        # The HTTP checkpoint transport advertises socket.gethostname(), which every namespace
        # shares (the machine's name); peers must reach this host at its own address.
        address = self.args.address
        socket.gethostname = lambda: address
        from torch.distributed import TCPStore
        self.store = TCPStore(address, STORE_PORT, is_master=True, wait_for_workers=False)
        return net

    def attach(self, net, opt):
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
        a = self.args
        timeout = datetime.timedelta(seconds=120)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=int(os.environ.get("PEERS_MIN_REPLICAS", "3")),
            use_async_quorum=False,  # DiLoCo requires it
            load_state_dict=lambda sd: (net.load_state_dict(sd["model"]),
                                        opt.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
            replica_id=f"r{a.rank}", store_addr=a.address, store_port=STORE_PORT, rank=0,
            world_size=1, lighthouse_addr=f"http://{a.coordinator}", hostname=a.address,
            port=MANAGER_PORT, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=datetime.timedelta(seconds=30),
            init_sync=False)  # every replica starts from the same seed
        frags = fragments_of(net, self.fragments) if self.fragments > 1 else [net]
        outers = [torch.optim.SGD(f.parameters(), lr=a.outer_lr, momentum=a.outer_momentum,
                                  nesterov=True) for f in frags]
        self.diloco = DiLoCo(self.manager, frags, opt, outers, sync_every=a.diloco_period,
                             should_quantize=self.quantize,
                             fragment_sync_delay=self.sync_delay)
        self.diloco.__enter__()
        for k, frag in enumerate(self.diloco._fragments):
            frag.perform_sync = self._logged(frag.perform_sync, k)

    def _logged(self, perform_sync, fragment):
        def run():
            healing = self.manager._healing
            committed = perform_sync()
            _event(step=self.manager.current_step(), fragment=fragment, committed=committed,
                   participants=self.manager.num_participants(),
                   participating=self.manager.is_participating(), healing=healing)
            return committed
        return run

    def close(self):
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


class TorchftStreaming(Torchft):
    fragments = 4
    sync_delay = 1


class TorchftInt8(Torchft):
    quantize = True


def ft_quantization_unavailable():
    """Why torchft's quantized all-reduce cannot run here (None: it can)."""
    import torchft.manager
    no_gpu = not torch.cuda.is_available()
    if not torchft.manager.IS_TRITON_AVAILABLE:
        return ("torchft's should_quantize (FP8 through Triton kernels, torchft/collectives.py) "
                "needs the `triton` package, which is not installed" +
                (" (and Triton's kernels need a GPU, which this machine lacks)" if no_gpu else "") +
                "; without it Manager.allreduce silently sends FP32")
    if no_gpu:
        return "torchft's quantized all-reduce runs Triton kernels, which need a GPU"
    return None


class Modelavg(lm_modes.DiLoCo):
    """modelavg's drop-in: all four every --diloco_period steps, DiLoCo's outer step."""
    payload = "FP32"
    error_feedback = 0.0
    fragments = 1
    sync_delay = 0

    def __init__(self, args):
        super().__init__(args)
        self.replacement = _rejoining()

    @staticmethod
    def levels(args):
        return collections.OrderedDict([(args.diloco_period, 4)])

    def outer(self, modelavg):
        rule = super().outer(modelavg)
        if self.payload == "FP32" and self.fragments == 1:
            return rule
        return modelavg.Level(self.args.diloco_period, 4, outer=rule, payload=self.payload,
                              error_feedback=self.error_feedback, fragments=self.fragments,
                              sync_delay=self.sync_delay)

    def after_step(self, net, step):
        s = self.averager.step
        super().after_step(net, step)
        every = self.args.diloco_period // self.fragments
        if s % every == 0:
            _event(step=s, fragment=(s // every) % self.fragments, committed=True,
                   admission=self.averager.client.admission_step)


class ModelavgStreaming(Modelavg):
    fragments = 4
    sync_delay = 1


class ModelavgInt8(Modelavg):
    payload = "INT8"


class ModelavgInt4Feedback(Modelavg):
    payload = "INT4"
    error_feedback = 1.0


MODES = {
    "ft_diloco": Torchft,
    "ft_streaming": TorchftStreaming,
    "ft_int8": TorchftInt8,
    "ma_diloco": Modelavg,
    "ma_streaming": ModelavgStreaming,
    "ma_int8": ModelavgInt8,
    "ma_int4_ef": ModelavgInt4Feedback,
}
lm_modes.MODES.update(MODES)
