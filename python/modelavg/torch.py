"""The drop-in: PyTorch's model averagers, with PyTorch's constructors, averaging through modelavg.

Change one import and keep the rest of the trainer::

    # from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from modelavg.torch import PeriodicModelAverager

    averager = PeriodicModelAverager(period=4, warmup_steps=100)
    ...
    averager.average_parameters(model.parameters())

The averagers connect from the environment — ``MODELAVG_COORDINATOR`` (host:port, or several comma-separated),
``MODELAVG_JOB`` (the job id), ``RANK`` and ``WORLD_SIZE`` as torchrun sets them, and optionally
``MODELAVG_GLOO_HOSTNAME`` (the address peers reach this process at; default 127.0.0.1),
``MODELAVG_AUTH_TOKEN_FILE`` and ``MODELAVG_TLS_CA_FILE`` (the connection variables of every
modelavg program, as :func:`modelavg.connect` reads them) — or from :func:`set_options`. If the
job does not exist yet, the first rank creates it from the constructor's arguments and ``WORLD_SIZE``; if it exists, its spec must
match them (``InvalidArgumentError``, a ``ValueError``, naming both otherwise). While the
coordinator cannot be reached, the averager retries until ``join_timeout`` (300 s unless set). One connection
per process serves every drop-in averager of the same job; it leaves the job at exit.

``torch.distributed.init_process_group`` is not needed; when a process group is passed it must be
the default (whole-world) group, since the job's world is what modelavg averages over.

Sharded replicas (docs/sharded.md): ``MODELAVG_REPLICA_SIZE`` (or
``set_options(replica_size=...)``) is the ``replica_size`` of the job the first rank creates
(and must match an existing job's): FSDP or HSDP inside each replica of that many ranks, and the
averagers average the local tensors each rank is given (FSDP's flat parameters, a DTensor's
local shard).

Elastic jobs: ``MODELAVG_MIN_WORLD_SIZE`` (or ``set_options(min_world_size=...)``) is the
``min_world_size`` of the job the first rank creates (and must match an existing job's). A
worker started without ``RANK`` while such a job runs with a vacant rank is admitted as a
replacement: its averager starts at ``averager.client.admission_step`` and its first
``average_parameters`` call overwrites the parameters with its peers' average; its optimizer
state starts fresh (reset it when ``averager.client.admission_step > 0``).

DiLoCo: the constructors' ``outer`` keyword (a :class:`modelavg.OuterSGD`) gives the job's last
level — or, for the hierarchical averager, ``{period: OuterSGD}`` the levels of those periods —
an outer optimizer; ``state_dict()`` / ``load_state_dict()`` checkpoint the averager. Streaming
sync: a :class:`modelavg.Level` with ``fragments``, ``sync_delay``, ``mix`` or ``payload`` in
place of an OuterSGD (its period and group size those of the level), e.g.
``PeriodicModelAverager(period=8, outer=modelavg.Level(8, world, outer=modelavg.OuterSGD(0.7,
momentum=0.9, nesterov=True), fragments=4, sync_delay=1, payload="INT8"))``.
"""

import atexit
import os
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import modelavg as _ma
from modelavg import _options as _ma_options

__all__ = ["PeriodicModelAverager", "HierarchicalModelAverager", "set_options"]

_lock = threading.Lock()
_clients: Dict[Tuple[str, str], "_ma.Client"] = {}
_options: Dict[str, Any] = {}


def set_options(**options: Any) -> None:
    """Connection options for the drop-in averagers created after this call: ``coordinator``,
    ``job_id``, ``rank``, ``min_world_size`` and ``replica_size`` (for the job the drop-in
    creates) and any keyword
    of :func:`modelavg.connect` (they take precedence over the environment)."""
    _options.update(options)


def _leave_all() -> None:
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        try:
            client.leave("finished")
        except _ma.Error:
            pass  # the coordinator may be gone at exit; nothing to do about it then


atexit.register(_leave_all)


def _check_process_group(process_group: Any) -> None:
    if process_group is None:
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if process_group is dist.group.WORLD or process_group == dist.group.WORLD:
            return
    raise _ma.InvalidArgumentError(
        "INVALID_ARGUMENT",
        f"process_group {process_group!r} is not the default process group: modelavg averages "
        "over the job's whole world (its levels' subgroups are consecutive blocks of ranks). "
        "Pass process_group=None, and describe the groups with the job's levels")


def _level_key(level: Any) -> Tuple[Any, ...]:
    """A level as (period, group_size), then (lr, momentum, nesterov) with an outer optimizer,
    then (fragments, sync_delay, mix, payload) with streaming fields, then ("paced", max_lag)
    with pacing fields."""
    if isinstance(level, _ma.Level):
        key: Tuple[Any, ...] = (level.period, level.group_size)
        if level.outer is not None:
            o = level.outer
            key += (float(o.lr), float(o.momentum), o.nesterov)
        if level.streaming:
            key += (level.fragments, level.sync_delay, level.mix, level.payload,
                    level.error_feedback, level.topk_density)
        if level.pacing:
            key += ("paced" if level.paced else "unpaced", level.max_lag)
        return key
    return tuple(level)


def _describe(spec: "_ma.JobSpec") -> str:
    return (f"{spec.mode} world_size={spec.world_size} warmup_steps={spec.warmup_steps} "
            f"levels(period, group_size[, outer lr, momentum, nesterov][, fragments, "
            f"sync_delay, mix, payload])={[_level_key(l) for l in spec.levels]}")


def _with_outer(levels: List[Tuple[int, int]], outer: Any) -> List[Any]:
    """The levels with the drop-in's ``outer`` keyword applied: an OuterSGD or a Level for the
    last level (the world), or {period: OuterSGD or Level} for the levels of those periods. A
    Level (streaming sync: fragments, sync_delay, mix, payload) must have that level's period
    and group size."""
    if outer is None:
        return list(levels)
    if isinstance(outer, (_ma.OuterSGD, _ma.Level)):
        outer = {levels[-1][0]: outer}
    if not isinstance(outer, dict):
        raise TypeError("outer must be a modelavg.OuterSGD or modelavg.Level (for the last "
                        "level) or a dict {period: OuterSGD or Level}, not "
                        f"{type(outer).__name__}")
    periods = [p for p, _ in levels]
    for p in outer:
        if p not in periods:
            raise ValueError(f"outer names period {p}, which is not one of the levels' periods "
                             f"{periods}")
    out: List[Any] = []
    for p, g in levels:
        o = outer.get(p)
        if o is None:
            out.append((p, g))
        elif isinstance(o, _ma.Level):
            if (o.period, o.group_size) != (p, g):
                raise ValueError(
                    f"outer[{p}] is {o}, but that level is period {p}, group_size {g}: give the "
                    f"Level the level's period and group size (the world size, {g}, for the "
                    "last level)")
            out.append(o)
        elif isinstance(o, _ma.OuterSGD):
            out.append(_ma.Level(p, g, o))
        else:
            raise TypeError(f"outer[{p}] must be a modelavg.OuterSGD or modelavg.Level, not "
                            f"{type(o).__name__}")
    return out


def _job_client(mode: str, warmup_steps: int, levels_for: Any) -> "_ma.Client":
    """The process's client of the job, creating the job if needed and checking its spec.
    levels_for(world_size) -> the levels the constructor's arguments mean in that world."""
    opts = dict(_options)
    coordinator = _ma_options._coordinator(opts.pop("coordinator", None))
    job_id = opts.pop("job_id", None) or os.environ.get("MODELAVG_JOB")
    if not job_id:
        raise _ma.InvalidArgumentError(
            "INVALID_ARGUMENT", "no job: set MODELAVG_JOB (or modelavg.torch.set_options(job_id=...))")
    rank = opts.pop("rank", None)
    min_world = opts.pop("min_world_size", None)
    if min_world is None:
        min_world = _ma_options._env_int("MODELAVG_MIN_WORLD_SIZE")
    replica_size = opts.pop("replica_size", None)
    if replica_size is None:
        replica_size = _ma_options._env_int("MODELAVG_REPLICA_SIZE")
    world_env = _ma_options._env_int("WORLD_SIZE")
    if "gloo_hostname" not in opts and os.environ.get("MODELAVG_GLOO_HOSTNAME"):
        opts["gloo_hostname"] = os.environ["MODELAVG_GLOO_HOSTNAME"]
    conn = {k: v for k, v in opts.items() if k in _ma_options._CONNECTION_OPTIONS}

    def find_or_create() -> "_ma.Job":
        try:
            return _ma.get_job(job_id, coordinator=coordinator, **conn)
        except _ma.NotFoundError:
            if world_env is None:
                raise _ma.NotFoundError(
                    "NOT_FOUND",
                    f"no job {job_id!r} on {coordinator}, and WORLD_SIZE is not set to create "
                    "it: set WORLD_SIZE (torchrun does), or create the job first") from None
            try:
                return _ma.create_job(job_id, world_env, mode, levels_for(world_env),
                                      warmup_steps=warmup_steps,
                                      min_world_size=min_world or 0,
                                      replica_size=replica_size or 0,
                                      coordinator=coordinator, **conn)
            except _ma.AlreadyExistsError:  # another rank created it first
                return _ma.get_job(job_id, coordinator=coordinator, **conn)

    with _lock:
        key = (coordinator, job_id)
        client = _clients.get(key)
        if client is None:
            # Like connect(): while the coordinator is unreachable (not started yet, restarting,
            # overloaded), retry with backoff until join_timeout.
            join_timeout = _ma_options._seconds("join_timeout", opts.get("join_timeout", 300.0))
            deadline = time.monotonic() + join_timeout
            backoff = 0.1
            while True:
                try:
                    job = find_or_create()
                    break
                except (_ma.UnavailableError, _ma.DeadlineExceededError) as e:
                    if time.monotonic() + backoff > deadline:
                        raise type(e)(e.code, f"{e.message} (retried for {join_timeout:g} s, "
                                              "the join_timeout)") from None
                    time.sleep(backoff)
                    backoff = min(2 * backoff, 2.0)
            _check_spec(job.spec, mode, warmup_steps, levels_for, world_env, coordinator)
            _check_min_world(job.spec, min_world, coordinator)
            _check_replica_size(job.spec, replica_size, coordinator)
            client = _ma.connect(coordinator, job_id, rank, **opts)
            _clients[key] = client
        else:
            _check_spec(client.spec, mode, warmup_steps, levels_for, world_env, coordinator)
    return client


def _check_spec(spec: "_ma.JobSpec", mode: str, warmup_steps: int, levels_for: Any,
                world_env: Optional[int], coordinator: str) -> None:
    world = world_env if world_env is not None else spec.world_size
    wanted = _ma.JobSpec(job_id=spec.job_id, world_size=world, mode=mode,
                         levels=levels_for(world), warmup_steps=warmup_steps)
    if (spec.mode != wanted.mode or spec.world_size != wanted.world_size
            or spec.warmup_steps != wanted.warmup_steps
            or [_level_key(l) for l in spec.levels] != [_level_key(l) for l in wanted.levels]):
        raise _ma.InvalidArgumentError(
            "INVALID_ARGUMENT",
            f"job {spec.job_id!r} on {coordinator} is {_describe(spec)}, but this averager's "
            f"arguments (and WORLD_SIZE) ask for {_describe(wanted)}: use a new job id, delete "
            "the job, or construct the averager with the job's plan")


def _check_min_world(spec: "_ma.JobSpec", min_world: Optional[int], coordinator: str) -> None:
    """With min_world_size asked for: the existing job's must be the same (0 and world_size
    both mean a strict job)."""
    if min_world is None:
        return

    def strict(m: int) -> int:
        return spec.world_size if m in (0, spec.world_size) else m

    if strict(spec.min_world_size) != strict(min_world):
        raise _ma.InvalidArgumentError(
            "INVALID_ARGUMENT",
            f"job {spec.job_id!r} on {coordinator} has min_world_size={spec.min_world_size}, but "
            f"this averager asks for min_world_size={min_world} (MODELAVG_MIN_WORLD_SIZE or "
            "set_options): use a new job id, delete the job, or ask for the job's value")


def _check_replica_size(spec: "_ma.JobSpec", replica_size: Optional[int],
                        coordinator: str) -> None:
    """With replica_size asked for: the existing job's must be the same (0 and 1 both mean
    whole replicas)."""
    if replica_size is None or max(1, spec.replica_size) == max(1, replica_size):
        return
    raise _ma.InvalidArgumentError(
        "INVALID_ARGUMENT",
        f"job {spec.job_id!r} on {coordinator} has replica_size={spec.replica_size}, but this "
        f"averager asks for replica_size={replica_size} (MODELAVG_REPLICA_SIZE or set_options): "
        "use a new job id, delete the job, or ask for the job's value")


class PeriodicModelAverager(_ma.PeriodicModelAverager):
    """``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``, through
    modelavg: averages over the whole world at step ``s`` iff ``s >= warmup_steps`` and
    ``(s - warmup_steps) % period == 0``.

    Args:
      period: steps per averaging (>= 1; 1 warns, as in PyTorch).
      warmup_steps: steps without averaging (>= 0).
      process_group: None (or the default group).
      outer: (modelavg only) a :class:`modelavg.OuterSGD`: DiLoCo — instead of averaging the
        parameters, each averaging step after the first steps an anchor with SGD on the
        world's mean pseudo-gradient (docs/diloco.md); or a :class:`modelavg.Level` of
        ``period`` and the world size with streaming fields (``fragments``, ``sync_delay``,
        ``mix``, ``payload``; docs/streaming.md).
      backup_device: (modelavg only, torchft's name) None or ``"cpu"``: where the outer
        state of CUDA parameters lives (``"cpu"``: pinned host memory).

    Raises ValueError for the same arguments PyTorch refuses, InvalidArgumentError (a ValueError)
    when the existing job's spec differs, and the errors of :func:`modelavg.connect`.
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: Any = None,
                 outer: Any = None, backup_device: Any = None) -> None:
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        if period < 1:
            raise ValueError("Arg ``period`` must be a positive value.")
        elif period == 1:
            warnings.warn(
                "When period is 1, no need to use model averaging because the communication cost "
                "of all-reducing parameters will be no less than the cost of all-reducing "
                "gradients by DistributedDataParallel in the backward pass. Therefore, only "
                "DistributedDataParallel should be used for this case.")
        _check_process_group(process_group)
        self.period = period
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.outer = outer
        _ma_options._backup_on_host(backup_device)  # a bad value fails before the job is joined
        client = _job_client("PERIODIC", warmup_steps,
                             lambda world: _with_outer([(period, world)], outer))
        super().__init__(client, backup_device=backup_device)


class HierarchicalModelAverager(_ma.HierarchicalModelAverager):
    """``torch.distributed.algorithms.model_averaging.hierarchical_model_averager.
    HierarchicalModelAverager``, through modelavg: at step ``s >= warmup_steps`` the last period
    (in the dict's order) that divides ``s`` averages within consecutive blocks of its group size.

    Args:
      period_group_size_dict: an ordered dict {period: group_size}; the last group size must be
        the world size.
      warmup_steps: steps without averaging (>= 0).
      process_group: None (or the default group).
      outer: (modelavg only) DiLoCo's outer optimizer: a :class:`modelavg.OuterSGD` for the
        last level (the world), or ``{period: OuterSGD}`` for the levels of those periods
        (docs/diloco.md); a :class:`modelavg.Level` (of that period and group size) in place
        of an OuterSGD adds streaming sync (docs/streaming.md).
      backup_device: (modelavg only, torchft's name) None or ``"cpu"``: where the outer
        state of CUDA parameters lives (``"cpu"``: pinned host memory).

    Raises ValueError for the same arguments PyTorch refuses, InvalidArgumentError (a ValueError)
    when the existing job's spec differs, and the errors of :func:`modelavg.connect`.
    """

    def __init__(self, period_group_size_dict: Optional[Dict[int, int]] = None,
                 warmup_steps: int = 0, process_group: Any = None,
                 outer: Any = None, backup_device: Any = None) -> None:
        if not period_group_size_dict:
            raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
        levels: List[Tuple[int, int]] = [(int(p), int(g))
                                         for p, g in period_group_size_dict.items()]
        if levels[0][0] <= 0:
            raise ValueError("The minimum period in arg ``period_group_size_dict`` must be a "
                             "positive value.")
        elif levels[-1][0] == 1:
            warnings.warn(
                "When the maximum period in arg ``period_group_size_dict`` is 1, no need to use "
                "model averaging because the communication cost of all-reducing parameters will "
                "be no less than the cost of all-reducing gradients by DistributedDataParallel "
                "in the backward pass. Therefore, only DistributedDataParallel should be used "
                "for this case.")
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        _check_process_group(process_group)
        self.period_group_size_dict = period_group_size_dict
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.outer = outer
        with_outer = _with_outer(levels, outer)
        _ma_options._backup_on_host(backup_device)  # a bad value fails before the job is joined
        client = _job_client("HIERARCHICAL", warmup_steps, lambda world: with_outer)
        super().__init__(client, backup_device=backup_device)
