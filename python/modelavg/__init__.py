"""modelavg from Python: periodic and hierarchical model averaging with PyTorch's semantics.

A thin layer over modelavg's C++ client library: the coordinator owns each job's plan, the
library runs the all-reduces (Gloo over TCP for CPU tensors, NCCL for CUDA tensors). Tensors cross
as data pointer, element count, dtype and device; CUDA tensors are averaged on
``torch.cuda.current_stream()``. Nothing here links libtorch.

Two ways in:

* the drop-in — change one import, keep PyTorch's constructors::

      from modelavg.torch import PeriodicModelAverager, HierarchicalModelAverager

  (connects from ``MODELAVG_COORDINATOR``, ``MODELAVG_JOB``, ``RANK`` and ``WORLD_SIZE``, and
  creates the job from the constructor's arguments if it does not exist yet);

* explicit — connect, then build an averager on the client::

      with modelavg.connect("coordinator:50051", "resnet-7", rank=r) as client:
          averager = modelavg.HierarchicalModelAverager(client)
          for batch in loader:
              ...
              optimizer.step()
              averager.average_parameters(model.parameters())

Failures raise :class:`modelavg.Error` subclasses (see :mod:`modelavg.errors`). Every wait
(joining, an averaging step, an RPC) releases the GIL and is interrupted by Ctrl-C.

Streaming DiLoCo: ``modelavg.Level(period, group_size, outer=..., fragments=1, sync_delay=0,
mix=0.0, payload="FP32")`` syncs an outer level a fragment at a time, overlaps its all-reduce
with ``sync_delay`` steps of training and sends BF16 or INT8 pseudo-gradients
(docs/streaming.md); ``averager.traffic()`` gives the bytes sent and the time waited per level.

DiLoCo: a level may carry an outer optimizer,
``create_job(..., levels=[(2, 2), modelavg.Level(500, 8, outer=modelavg.OuterSGD(0.7,
momentum=0.9, nesterov=True))])``: its members then step an anchor with SGD on the averaged
pseudo-gradient instead of averaging parameters (docs/diloco.md). Checkpoint the averager with
``state_dict()`` / ``load_state_dict()``.

Elastic jobs (``create_job(..., min_world_size=m)``) keep running while ``m`` ranks are alive:
a dead member costs the survivors one retried averaging round inside ``average_parameters``
(the returned :class:`Decision` lists the ranks that actually averaged), and a worker that
connects to the running job without a rank is admitted as a replacement
(``Client.admission_step``; see :class:`ModelAverager`).
"""

import dataclasses
import datetime
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import errors
from .errors import (AlreadyExistsError, DeadlineExceededError, Error, FailedPreconditionError,
                     InvalidArgumentError, NotFoundError, PeerFailureError,
                     PermissionDeniedError, ResourceExhaustedError, UnavailableError,
                     UnimplementedError)
from . import _core
from ._core import Decision
from . import _params

__version__ = "0.1.0"

__all__ = [
    "connect", "Client", "ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager",
    "Decision", "Level", "LevelTraffic", "PAYLOADS", "OuterSGD", "JobSpec", "Job", "Member", "GenerationChange", "create_job", "get_job",
    "list_jobs", "delete_job", "Error", "PeerFailureError", "InvalidArgumentError",
    "NotFoundError", "AlreadyExistsError", "FailedPreconditionError", "DeadlineExceededError",
    "UnavailableError", "PermissionDeniedError", "ResourceExhaustedError", "UnimplementedError",
    "errors",
]

Duration = Union[float, int, datetime.timedelta]

# ClientOptions fields (client/client.h) that connect() takes as keywords, with their kinds.
_CLIENT_OPTIONS = {
    "worker_id": str, "auth_token": str, "tls": bool, "tls_ca_file": str, "tls_cert_file": str,
    "tls_key_file": str, "join_timeout": Duration, "rpc_timeout": Duration,
    "heartbeat_interval": Duration, "heartbeat_stream": bool, "collective_timeout": Duration,
    "schedule_window": int, "gloo_hostname": str, "gloo_in_place": bool,
}
# What the job-management calls take besides the coordinator's address.
_CONNECTION_OPTIONS = ("auth_token", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file",
                       "rpc_timeout")


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError("INVALID_ARGUMENT", message)


def _seconds(name: str, value: Duration) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise _invalid(f"{name}={value!r}: expected a positive number of seconds or a timedelta")
    return float(value)


def _options(options: Mapping[str, Any], allowed: Iterable[str]) -> Dict[str, Any]:
    allowed = set(allowed)
    out: Dict[str, Any] = {}
    for name, value in options.items():
        if name not in allowed:
            raise TypeError(f"unknown option {name!r}; the options are: "
                            f"{', '.join(sorted(allowed))}")
        if value is None:
            continue
        kind = _CLIENT_OPTIONS[name]
        if kind is Duration:
            value = _seconds(name, value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise _invalid(f"{name}={value!r}: expected True or False")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _invalid(f"{name}={value!r}: expected an int")
        elif not isinstance(value, str):
            raise _invalid(f"{name}={value!r}: expected a string")
        out[name] = value
    return out


def _coordinator(coordinator: Optional[str]) -> str:
    coordinator = coordinator or os.environ.get("MODELAVG_COORDINATOR")
    if not coordinator:
        raise _invalid("no coordinator: pass coordinator='host:port' or set "
                       "MODELAVG_COORDINATOR")
    return coordinator


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise _invalid(f"environment variable {name}={text!r} is not an integer") from None


# ------------------------------------------------------------------------------------- client

class Client:
    """One rank's membership in one job (``connect`` makes one).

    While connected, a background thread heartbeats to the coordinator and learns of membership
    changes. Leave the job with :meth:`leave`, or use the client as a context manager; a client
    that is garbage-collected (or alive at exit) leaves with reason "client destroyed".
    """

    def __init__(self, core: "_core.Client") -> None:
        self._core = core

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 .. world_size - 1)."""
        return self._core.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the job."""
        return self._core.world_size

    @property
    def generation(self) -> int:
        """The membership generation this client averages in: the one it joined. In a strict
        job averaging works only while the job is still at it; in an elastic job it moves on
        with the job (a death, a departure, an admission) as long as this rank is a live
        member."""
        return self._core.generation

    @property
    def latest_generation(self) -> int:
        """The latest generation the heartbeat has seen (>= generation)."""
        return self._core.latest_generation

    @property
    def admission_step(self) -> int:
        """-1 for a member of the world that started the job; for a replacement that joined a
        RUNNING elastic job, the step it was admitted at (> 0). Its averagers start at that
        step, and their first ``average_parameters`` call overwrites the parameters with the
        average of the live members of its subgroup (``Decision.joining`` names this rank).
        Optimizer state (momentum, Adam moments) and everything else the trainer keeps starts
        fresh: reset or re-warm it when ``admission_step > 0``."""
        return self._core.admission_step

    @property
    def elastic(self) -> bool:
        """Whether the job is elastic (its ``min_world_size`` is below ``world_size``)."""
        return self._core.elastic

    @property
    def job_id(self) -> str:
        """The job this client joined."""
        return self._core.job_id

    @property
    def spec(self) -> "JobSpec":
        """The job's averaging plan, as the coordinator sent it at join (the timeouts and
        ``min_world_size`` are left 0: :func:`get_job` has them; :attr:`elastic` tells an
        elastic job)."""
        d = self._core.spec
        return JobSpec(job_id=d["job_id"], world_size=d["world_size"], mode=d["mode"],
                       levels=_levels_from(d), warmup_steps=d["warmup_steps"])

    def check_usable(self) -> None:
        """Raises PeerFailureError if the job's membership changed since this client joined
        (or the coordinator stopped answering); returns None otherwise."""
        self._core.check_usable()

    def leave(self, reason: str = "finished") -> None:
        """Tells the coordinator this worker is done. Idempotent.

        Raises UnavailableError / DeadlineExceededError (coordinator unreachable), NotFoundError
        (the job was deleted)."""
        self._core.leave(reason)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        reason = "finished" if exc_type is None else f"exception: {exc_type.__name__}"
        try:
            self.leave(reason)
        except Error:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        extra = ""
        if self.elastic:
            extra = ", elastic=True"
            if self.admission_step > 0:
                extra += f", admission_step={self.admission_step}"
        return (f"modelavg.Client(job_id={self.job_id!r}, rank={self.rank}, "
                f"world_size={self.world_size}, generation={self.generation}{extra})")


def connect(coordinator: Optional[str] = None, job_id: Optional[str] = None,
            rank: Optional[int] = None, **options: Any) -> Client:
    """Joins a job and returns its Client once every rank has joined.

    Args:
      coordinator: the coordinator's "host:port" (several comma-separated: coordinators on
        etcd, the client fails over to the leader); default: ``$MODELAVG_COORDINATOR``.
      job_id: the job to join (it must exist); default: ``$MODELAVG_JOB``.
      rank: the rank to take; default: ``$RANK`` (as torchrun sets it), else the coordinator
        picks the lowest free one.
      **options: any field of the C++ ``ClientOptions``: ``worker_id``, ``auth_token``, ``tls``,
        ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``, ``join_timeout`` (default 300 s),
        ``rpc_timeout`` (10 s), ``heartbeat_interval`` (0.1 s), ``heartbeat_stream`` (True),
        ``collective_timeout`` (60 s), ``schedule_window`` (4096), ``gloo_hostname``
        ("127.0.0.1"; the address peers reach this process at), ``gloo_in_place`` (False).
        Durations are seconds or ``datetime.timedelta``.

    Blocks (without the GIL; Ctrl-C interrupts it) until the world is complete. While the
    coordinator is unreachable, joining is retried until ``join_timeout``. On a RUNNING elastic
    job with a vacant rank it returns at once with a replacement's client: the vacant rank
    asked for, or (``rank`` None and no ``$RANK``) the lowest one, and ``admission_step`` > 0.

    Raises:
      NotFoundError: no such job. InvalidArgumentError: a bad option. AlreadyExistsError: the
      rank is taken. FailedPreconditionError: the job is full and running (an elastic job
      without a vacant rank), or finished.
      DeadlineExceededError: the world did not complete in time (the message names the missing
      ranks). UnavailableError: the coordinator cannot be reached. PermissionDeniedError.
    """
    opts = _options(options, _CLIENT_OPTIONS)
    opts["coordinator"] = _coordinator(coordinator)
    job_id = job_id or os.environ.get("MODELAVG_JOB")
    if not job_id:
        raise _invalid("no job: pass job_id='...' or set MODELAVG_JOB")
    opts["job_id"] = job_id
    if rank is None:
        rank = _env_int("RANK")
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise _invalid(f"rank={rank!r}: expected an int >= 0")
        opts["rank"] = rank
    return Client(_core.connect(opts))


# ------------------------------------------------------------------------------------- averagers

class ModelAverager:
    """What PeriodicModelAverager and HierarchicalModelAverager share (PyTorch's ModelAverager).

    ``step`` is the step of the next ``average_parameters`` call: it starts at 0 and every call
    first decides, then increments it — in warm-up, on skipped and on averaging steps alike.
    Set it when resuming from a checkpoint (warm-up is not replayed).

    In an elastic job a replacement (``client.admission_step > 0``) starts at its admission
    step instead (do not set ``step`` then). Its first ``average_parameters`` call receives the
    parameters: they are overwritten with the average of the live members of its subgroup at
    that step (the returned decision's ``joining`` is ``[client.rank]``), and from then on it
    averages like everyone else. Whatever else the trainer keeps starts fresh in a replacement
    — optimizer state, learning-rate schedule, data position — so reset it from
    ``client.admission_step`` (the drop-in averagers have ``client`` too), e.g.::

        if averager.client.admission_step > 0:      # a replacement
            optimizer = make_optimizer(model)       # fresh momentum / moments
        for step in range(averager.step, total_steps):
            ...
            averager.average_parameters(model.parameters())
    """

    _hierarchical = False

    def __init__(self, client: Client) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a modelavg.Client (from modelavg.connect), not "
                            f"{type(client).__name__}")
        self.client = client
        self._core = _core.Averager(client._core, self._hierarchical)

    @property
    def step(self) -> int:
        """The step of the next average_parameters call."""
        return self._core.step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"step must be an int, not {type(value).__name__}")
        self._core.step = value

    def state_dict(self) -> Dict[str, Any]:
        """The averager's state, to save beside the model and the optimizer (PyTorch's
        convention): ``{"step": int, "anchors": {level: [tensor, ...]}, "momenta": {level:
        [tensor, ...]}}`` — for each level with an outer optimizer whose first averaging step
        has happened, its anchor (one flat CPU tensor per parameter, float32 for float16/bfloat16
        parameters, else their dtype) and, once set, its momentum buffer. Copies: later steps
        do not change them.

        A streaming outer level (``Level`` with fragments, sync_delay, mix or payload) keeps its
        state per fragment, under ``"fragments": {level: {fragment: {"anchor": [tensor, ...],
        "momentum": [tensor, ...]}}}`` (the fragment's tensors; "momentum" empty until set), and
        its background all-reduces not applied yet under ``"pending": [{"level", "fragment",
        "start_step", "apply_step", "first", "result": [tensor, ...]}]`` (the group's mean,
        applied at ``apply_step`` by the resumed run). This call waits for those to end (at
        most collective_timeout); one that failed carries ``"error"``, and loading it fails."""
        import torch
        d = self._core.state_dict()
        kinds = {code: dtype for dtype, code in _params._dtype_codes().items()}

        def tensor_list(items: List[Any]) -> List[Any]:
            return [torch.frombuffer(bytearray(raw), dtype=kinds[code]).reshape(numel)
                    if numel > 0 else torch.empty(0, dtype=kinds[code])
                    for code, numel, raw in items]

        def tensors(m: Dict[int, Any]) -> Dict[int, List[Any]]:
            return {level: tensor_list(items) for level, items in m.items()}

        fragments: Dict[int, Dict[int, Dict[str, List[Any]]]] = {}
        for level, fragment, anchor, momentum in d["fragments"]:
            fragments.setdefault(level, {})[fragment] = {"anchor": tensor_list(anchor),
                                                         "momentum": tensor_list(momentum)}
        pending = []
        for p in d["pending"]:
            entry = {k: p[k] for k in ("level", "fragment", "start_step", "apply_step", "first")}
            entry["result"] = tensor_list(p["result"])
            if p["error"]:
                entry["error"] = p["error"]
            pending.append(entry)
        out = {"step": d["step"], "anchors": tensors(d["anchors"]),
               "momenta": tensors(d["momenta"])}
        if fragments or pending:
            out["fragments"] = fragments
            out["pending"] = pending
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` (the step and every outer level's anchor and momentum):
        a run resumed from it in a new process — same job spec, same parameters restored —
        continues exactly as the uninterrupted run. Tensors may be on any device.

        Raises InvalidArgumentError (a level without an outer optimizer in this job, tensors
        that do not fit: counts, dtypes, sizes; fragments or pending syncs the job's levels do
        not have), FailedPreconditionError (a pending sync that had failed) and
        TypeError/KeyError for a malformed dict; nothing changes then."""
        import ctypes
        import torch
        if not isinstance(state_dict, Mapping) or "step" not in state_dict:
            raise TypeError("state_dict must be a dict from ModelAverager.state_dict() (with "
                            "'step', 'anchors', 'momenta')")
        codes = _params._dtype_codes()

        def raw_list(items: Sequence[Any], what: str) -> List[Any]:
            out = []
            for i, t in enumerate(items or []):
                if not isinstance(t, torch.Tensor) or t.dtype not in codes:
                    raise _invalid(f"{what}[{i}]: expected a float tensor, got "
                                   f"{type(t).__name__}")
                t = t.detach().to("cpu").contiguous()
                n = t.numel()
                data = ctypes.string_at(t.data_ptr(), n * t.element_size()) if n else b""
                out.append((codes[t.dtype], n, data))
            return out

        def raw(m: Mapping[int, Any], what: str) -> Dict[int, List[Any]]:
            return {int(level): raw_list(items, f"{what}[{level}]")
                    for level, items in (m or {}).items()}

        step = state_dict["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"state_dict['step'] must be an int, not {type(step).__name__}")
        fragments = []
        for level, per_fragment in (state_dict.get("fragments") or {}).items():
            for fragment, entry in per_fragment.items():
                what = f"fragments[{level}][{fragment}]"
                fragments.append((int(level), int(fragment),
                                  raw_list(entry["anchor"], f"{what}['anchor']"),
                                  raw_list(entry.get("momentum") or [], f"{what}['momentum']")))
        pending = []
        for i, entry in enumerate(state_dict.get("pending") or []):
            p = {k: entry[k] for k in ("level", "fragment", "start_step", "apply_step", "first")}
            p["result"] = raw_list(entry["result"], f"pending[{i}]['result']")
            p["error"] = str(entry.get("error") or "")
            pending.append(p)
        self._core.load_state_dict(step, raw(state_dict.get("anchors", {}), "anchors"),
                                   raw(state_dict.get("momenta", {}), "momenta"), fragments,
                                   pending)

    def traffic(self) -> List["LevelTraffic"]:
        """Per level of the job (its index), what this member's averaging cost so far: the
        bytes it handed to the transport in the level's rounds, and the seconds its calls
        waited for a fragment's background all-reduce (streaming sync with ``sync_delay``;
        0.0 otherwise). Counts since the averager was made (not in ``state_dict``)."""
        return [LevelTraffic(level=i, bytes_sent=b, waited_s=w)
                for i, (b, w) in enumerate(self._core.traffic())]

    def average_parameters(self, params: Iterable[Any]) -> Decision:
        """Averages ``params`` in place with this rank's subgroup if the schedule says so at
        ``step``, then increments ``step``. Returns the decision taken.

        ``params`` is what PyTorch's averagers take: ``model.parameters()`` or an optimizer's
        ``param_groups``; parameters whose ``.grad`` is None are left out, as PyTorch does. On a
        skip step ``params`` is not even iterated (unless a fragment's background all-reduce
        is applied at that step: streaming sync with ``sync_delay``). Tensors: float32, float64, float16 or
        bfloat16, all on the CPU (Gloo) or all on one CUDA device (NCCL, ordered on the current
        stream); a non-contiguous tensor is averaged through a contiguous copy.

        If averaging fails the parameters are left averaged or untouched, never half-written,
        and ``step`` has advanced; an input refused before averaging (NotImplementedError,
        TypeError) leaves ``step`` as it was, as PyTorch's averagers do.

        In an elastic job a member that dies during the call does not make it fail: the round
        is retried with the live members inside the same call (the decision's ``ranks`` lists
        them), and later calls average over the live members of each subgroup.

        Raises:
          PeerFailureError: a peer died, left or stalled past collective_timeout, or the
            coordinator is gone (the message names the rank and the reason); connect again.
            In an elastic job: only once fewer than ``min_world_size`` ranks are alive, or
            when this worker itself was declared dead.
          InvalidArgumentError: tensors on mixed devices, or members that pass different
            layouts (total size or dtypes).
          NotImplementedError / TypeError: inputs PyTorch's averagers would not take either, or
            dtypes modelavg does not average.
        """
        decision = self._core.take_skip()
        if decision is not None:
            return decision
        tensors = _params.params_to_average(params)
        specs, copy_back = _params.describe(tensors)
        decision = self._core.average(specs, tensors if not copy_back else (tensors, copy_back))
        if copy_back and decision.average:
            import torch
            with torch.no_grad():
                for dst, src in copy_back:
                    dst.copy_(src)
        return decision


@dataclasses.dataclass(frozen=True)
class LevelTraffic:
    """One level's entry of :meth:`ModelAverager.traffic`: ``bytes_sent`` by this member in the
    level's rounds, ``waited_s`` seconds its calls waited for background all-reduces."""

    level: int
    bytes_sent: int
    waited_s: float


class PeriodicModelAverager(ModelAverager):
    """PyTorch's PeriodicModelAverager on a PERIODIC job: at step ``s`` average over the whole
    world iff ``s >= warmup_steps and (s - warmup_steps) % period == 0``.

    Raises FailedPreconditionError if the job is HIERARCHICAL.
    """

    _hierarchical = False


class HierarchicalModelAverager(ModelAverager):
    """PyTorch's HierarchicalModelAverager on a HIERARCHICAL job: at step ``s >= warmup_steps``
    the last level (in the job's order) whose period divides ``s`` averages within its subgroup
    (consecutive blocks of ranks of the level's group size).

    Raises FailedPreconditionError if the job is PERIODIC.
    """

    _hierarchical = True


# ------------------------------------------------------------------------------------- jobs

@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """A level's outer optimizer (DiLoCo; proto ``modelavg.v1.OuterOptimizer``): PyTorch's
    ``torch.optim.SGD(lr, momentum, nesterov)`` stepping each member's anchor with the group's
    mean pseudo-gradient (anchor - parameters) as the gradient; the parameters then become the
    anchor. ``OuterSGD(1.0)`` is plain averaging; DiLoCo's recipe is
    ``OuterSGD(0.7, momentum=0.9, nesterov=True)``. Checked by the coordinator: lr finite and
    > 0, 0 <= momentum < 1, nesterov needs momentum > 0."""

    lr: float
    momentum: float = 0.0
    nesterov: bool = False


# Level.payload: how an outer level's pseudo-gradients travel (proto enum modelavg.v1.Payload).
PAYLOADS = ("FP32", "BF16", "INT8")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Level:
    """One averaging level with an update rule: every ``period`` steps, blocks of
    ``group_size`` consecutive ranks average (``outer`` None, PyTorch's averagers) or take an
    outer optimizer step (``outer`` an :class:`OuterSGD`). ``create_job(levels=...)`` takes
    these beside (period, group_size) pairs.

    Streaming sync (docs/streaming.md):

    * ``fragments`` F >= 1, dividing ``period``: the parameters are split into F runs of whole
      tensors of about equal bytes; the level acts every period / F steps on fragment
      (s / (period / F)) mod F (each fragment still syncs once every ``period`` steps).
    * ``sync_delay`` tau, 0 <= tau < period / F (outer levels): the call at a sync step s starts
      the fragment's all-reduce in the background and returns; the call at s + tau applies it.
    * ``mix`` alpha in [0, 1] (outer levels): the fragment then becomes
      (1 - alpha) * anchor + alpha * the parameters passed to that call.
    * ``payload`` "FP32" (default), "BF16" or "INT8" (outer levels): how the pseudo-gradient
      travels; the sum is accumulated in float32.

    A delay, a mix or a compressed payload needs ``outer``: give a plain level
    ``outer=OuterSGD(1.0)`` (lr 1, momentum 0 averages the delta, which equals plain
    averaging). Raises InvalidArgumentError (a ValueError) naming the field otherwise; the
    coordinator checks the whole spec again.
    """

    period: int
    group_size: int
    outer: Optional[OuterSGD] = None
    fragments: int = 1
    sync_delay: int = 0
    mix: float = 0.0
    payload: str = "FP32"

    def __post_init__(self) -> None:
        where = f"Level(period={self.period!r}, group_size={self.group_size!r})"
        if not _is_int(self.fragments) or self.fragments < 1:
            raise _invalid(f"{where}: fragments={self.fragments!r}: expected an int >= 1 that "
                           "divides the period (1: the whole model at once)")
        if not _is_int(self.sync_delay) or self.sync_delay < 0:
            raise _invalid(f"{where}: sync_delay={self.sync_delay!r}: expected an int >= 0 "
                           "(steps between a fragment's sync step and the step it is applied "
                           "at; 0 blocks)")
        if (isinstance(self.mix, bool) or not isinstance(self.mix, (int, float))
                or not 0.0 <= float(self.mix) <= 1.0):
            raise _invalid(f"{where}: mix={self.mix!r}: expected a number in [0, 1]")
        object.__setattr__(self, "mix", float(self.mix))
        if not isinstance(self.payload, str) or self.payload.upper() not in PAYLOADS:
            raise _invalid(f"{where}: payload={self.payload!r}: expected one of "
                           f"{', '.join(PAYLOADS)}")
        object.__setattr__(self, "payload", self.payload.upper())
        if _is_int(self.period) and self.period > 0:
            if self.period % self.fragments != 0:
                raise _invalid(f"{where}: fragments={self.fragments} does not divide the period "
                               f"{self.period}: each fragment must sync once every period")
            if self.sync_delay >= self.period // self.fragments:
                raise _invalid(
                    f"{where}: sync_delay={self.sync_delay} must be below period / fragments = "
                    f"{self.period // self.fragments} (a fragment's result is applied before "
                    "the level's next sync)")
        if self.outer is None:
            asked = [f"{name}={value!r}" for name, value, default in
                     (("sync_delay", self.sync_delay, 0), ("mix", self.mix, 0.0),
                      ("payload", self.payload, "FP32")) if value != default]
            if asked:
                raise _invalid(
                    f"{where}: {', '.join(asked)} needs an outer level: a plain level averages "
                    "the parameters themselves. Use outer=modelavg.OuterSGD(1.0) (lr 1, "
                    "momentum 0), which averages the delta and equals plain averaging")

    @property
    def streaming(self) -> bool:
        """Whether any streaming field differs from its default."""
        return (self.fragments, self.sync_delay, self.mix, self.payload) != (1, 0, 0.0, "FP32")


LevelLike = Union[Tuple[int, int], Level]


def _levels_from(d: Mapping[str, Any]) -> List[LevelLike]:
    """A spec dict's levels: (period, group_size) pairs, Level for those with an outer
    optimizer or streaming fields."""
    n = len(d["levels"])
    outer = d.get("outer") or [None] * n
    streaming = d.get("streaming") or [None] * n
    out: List[LevelLike] = []
    for (period, group_size), o, st in zip(d["levels"], outer, streaming):
        fields = {}
        if st is not None and tuple(st) != (1, 0, 0.0, "FP32"):
            fields = dict(zip(("fragments", "sync_delay", "mix", "payload"), st))
        if o is None and not fields:
            out.append((period, group_size))
            continue
        sgd = None if o is None else OuterSGD(o[0], momentum=o[1], nesterov=o[2])
        try:
            out.append(Level(period, group_size, sgd, **fields))
        except InvalidArgumentError:
            # A spec the coordinator accepted: show it as it is rather than fail to read it.
            level = Level(period, group_size, sgd)
            for name, value in fields.items():
                object.__setattr__(level, name, value)
            out.append(level)
    return out


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job's averaging plan (proto ``modelavg.v1.JobSpec``).

    ``mode`` is "PERIODIC" or "HIERARCHICAL"; ``levels`` are (period, group_size) pairs in
    PyTorch's order (the OrderedDict's), a :class:`Level` for a level with an outer optimizer;
    0 timeouts mean the coordinator's defaults.
    ``min_world_size`` (1..world_size) makes the job elastic: it keeps running while that many
    ranks are alive; 0 (or world_size) is a strict job.
    """

    job_id: str
    world_size: int
    mode: str
    levels: List[LevelLike]
    warmup_steps: int = 0
    heartbeat_timeout_ms: int = 0
    join_timeout_ms: int = 0
    min_world_size: int = 0


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a job's current generation. ``admitted_step``: the step a replacement was
    admitted at (elastic jobs), -1 for a member of the world that started the job."""

    rank: int
    worker_id: str
    host: str
    last_step: int
    ms_since_heartbeat: int
    state: str
    generation: int
    admitted_step: int = -1


@dataclasses.dataclass(frozen=True)
class GenerationChange:
    """Why a job's generation last changed."""

    generation: int
    rank: int
    reason: str
    unix_ms: int


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as the coordinator reports it (proto ``modelavg.v1.Job``).

    ``live_world_size``: ranks alive in the current generation; ``vacant_ranks``: ranks of a
    running elastic job that no live worker holds; ``deaths``: members declared dead;
    ``admissions``: replacements admitted into the running elastic job.
    """

    spec: JobSpec
    state: str
    generation: int
    members: List[Member]
    min_step: int
    max_step: int
    warnings: List[str]
    created_unix_ms: int
    last_change: Optional[GenerationChange]
    live_world_size: int = 0
    vacant_ranks: List[int] = dataclasses.field(default_factory=list)
    deaths: int = 0
    admissions: int = 0


def _job(d: Dict[str, Any]) -> Job:
    s = d["spec"]
    spec = JobSpec(job_id=s["job_id"], world_size=s["world_size"], mode=s["mode"],
                   levels=_levels_from(s), warmup_steps=s["warmup_steps"],
                   heartbeat_timeout_ms=s["heartbeat_timeout_ms"],
                   join_timeout_ms=s["join_timeout_ms"], min_world_size=s["min_world_size"])
    change = d["last_change"]
    return Job(spec=spec, state=d["state"], generation=d["generation"],
               members=[Member(**m) for m in d["members"]], min_step=d["min_step"],
               max_step=d["max_step"], warnings=list(d["warnings"]),
               created_unix_ms=d["created_unix_ms"],
               last_change=GenerationChange(**change) if change else None,
               live_world_size=d["live_world_size"], vacant_ranks=list(d["vacant_ranks"]),
               deaths=d["deaths"], admissions=d["admissions"])


def _conn(coordinator: Optional[str], options: Mapping[str, Any]) -> Dict[str, Any]:
    conn = _options(options, _CONNECTION_OPTIONS)
    conn["coordinator"] = _coordinator(coordinator)
    return conn


def _outer_tuple(item: Any, outer: Any) -> Optional[Tuple[float, float, bool]]:
    if outer is None:
        return None
    if not isinstance(outer, OuterSGD):
        raise _invalid(f"level {item!r}: outer must be a modelavg.OuterSGD, not "
                       f"{type(outer).__name__}")
    try:
        lr, momentum = float(outer.lr), float(outer.momentum)
    except (TypeError, ValueError):
        raise _invalid(f"level {item!r}: OuterSGD lr and momentum must be numbers") from None
    if not isinstance(outer.nesterov, bool):
        raise _invalid(f"level {item!r}: OuterSGD nesterov must be True or False")
    return (lr, momentum, outer.nesterov)


StreamingTuple = Tuple[int, int, float, str]


def _levels(levels: Union[Mapping[int, int], Sequence[LevelLike]]
            ) -> Tuple[List[Tuple[int, int]], List[Optional[Tuple[float, float, bool]]],
                       List[StreamingTuple]]:
    """(period, group_size) pairs and, per level, None or (lr, momentum, nesterov), and
    (fragments, sync_delay, mix, payload)."""
    items = list(levels.items()) if isinstance(levels, Mapping) else list(levels)
    pairs, outer, streaming = [], [], []
    for item in items:
        if isinstance(item, Level):
            pairs.append((int(item.period), int(item.group_size)))
            outer.append(_outer_tuple(item, item.outer))
            streaming.append((item.fragments, item.sync_delay, item.mix, item.payload))
            continue
        try:
            period, group_size = item
            pairs.append((int(period), int(group_size)))
            outer.append(None)
            streaming.append((1, 0, 0.0, "FP32"))
        except (TypeError, ValueError):
            raise _invalid(f"level {item!r}: expected a (period, group_size) pair or a "
                           "modelavg.Level") from None
    return pairs, outer, streaming


def create_job(job_id: str, world_size: int, mode: str = "HIERARCHICAL",
               levels: Optional[Union[Mapping[int, int], Sequence[Tuple[int, int]]]] = None, *,
               period: Optional[int] = None, warmup_steps: int = 0,
               heartbeat_timeout_ms: int = 0, join_timeout_ms: int = 0,
               min_world_size: int = 0, coordinator: Optional[str] = None,
               **options: Any) -> Job:
    """Registers a job with the coordinator and returns it.

    Args:
      job_id: 1-128 characters of [A-Za-z0-9._-].
      world_size: the number of worker processes.
      mode: "PERIODIC" or "HIERARCHICAL" (any case).
      levels: (period, group_size) pairs, or PyTorch's ``period_group_size_dict``, in order;
        a :class:`Level` in the list gives its level an outer optimizer
        (``Level(period, group_size, outer=OuterSGD(lr, momentum=0.0, nesterov=False))``)
        and streaming sync (``fragments=1, sync_delay=0, mix=0.0, payload="FP32"``).
      period: for PERIODIC, instead of levels: one level over the whole world.
      warmup_steps, heartbeat_timeout_ms, join_timeout_ms: as in the JobSpec (0 timeouts: the
        coordinator's defaults).
      min_world_size: 1..world_size makes the job elastic: it keeps running while that many
        ranks are alive, and admits replacements into vacant ranks. 0 (or world_size): strict.
      coordinator: "host:port" (or several, comma-separated); default ``$MODELAVG_COORDINATOR``.
      **options: auth_token, tls, tls_ca_file, tls_cert_file, tls_key_file, rpc_timeout.

    Raises InvalidArgumentError (bad spec: the message names the field and the value),
    AlreadyExistsError, ResourceExhaustedError, UnavailableError.
    """
    mode = str(mode).upper()
    if period is not None:
        if levels is not None:
            raise _invalid("pass levels or period, not both")
        levels = [(period, world_size)]
    if levels is None:
        raise _invalid("no levels: pass levels=[(period, group_size), ...] (or period= for "
                       "a PERIODIC job)")
    pairs, outer, streaming = _levels(levels)
    spec = {"job_id": job_id, "world_size": world_size, "mode": mode, "levels": pairs,
            "outer": outer, "streaming": streaming,
            "warmup_steps": warmup_steps, "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "join_timeout_ms": join_timeout_ms, "min_world_size": min_world_size}
    try:
        return _job(_core.create_job(_conn(coordinator, options), spec))
    except (ValueError, RuntimeError, TypeError) as e:
        if isinstance(e, Error):
            raise
        raise _invalid(f"job spec {spec}: {e}") from None


def get_job(job_id: str, *, coordinator: Optional[str] = None, **options: Any) -> Job:
    """The job's spec, state, generation and members. Raises NotFoundError if unknown."""
    return _job(_core.get_job(_conn(coordinator, options), job_id))


def list_jobs(*, coordinator: Optional[str] = None, **options: Any) -> List[Job]:
    """Every job of the coordinator, in job id order."""
    return [_job(j) for j in _core.list_jobs(_conn(coordinator, options))]


def delete_job(job_id: str, *, coordinator: Optional[str] = None, **options: Any) -> None:
    """Removes a job; its pending waits fail. Raises NotFoundError if unknown."""
    _core.delete_job(_conn(coordinator, options), job_id)
