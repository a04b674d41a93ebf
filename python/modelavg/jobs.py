"""Jobs: their spec (levels, outer optimizers, streaming), their record, and the calls that
create, read, list, update (a new plan for a running job) and delete them."""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _core
from ._options import _conn, _invalid
from .errors import Error, InvalidArgumentError


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
# The names and the fields each needs come from the binding (include/modelavg/common/payload.h).
PAYLOADS = tuple(_core.payload_names())
_NO_STREAMING = (1, 0, 0.0, "FP32", 0.0, 0.0)
_NO_PACING = (False, 0.0, 0)


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
    * ``payload`` "FP32" (default) or another of ``modelavg.jobs.PAYLOADS`` (the binding's
      table: "BF16", "INT8", "INT4", "TOPK", ...; outer levels): how the pseudo-gradient
      travels, each as docs/streaming.md describes; the sum is accumulated in float32. The
      top-k payloads ("TOPK", ...) send the ``topk_density`` (in (0, 1)) fraction of each
      block's entries of largest magnitude; the others need it 0.
    * ``error_feedback`` beta in [0, 1] (outer levels with a compressed payload; 0: off): each
      member sends U = beta * E + D, its residual E plus its pseudo-gradient D, and keeps
      E = U - decode(encode(U)), what the payload dropped, for the next sync.

    A delay, a mix or a compressed payload needs ``outer``: give a plain level
    ``outer=OuterSGD(1.0)`` (lr 1, momentum 0 averages the delta, which equals plain
    averaging). Raises InvalidArgumentError (a ValueError) naming the field otherwise; the
    coordinator checks the whole spec again.

    Paced rounds (docs/paced.md):

    * ``paced`` (the last level only): each group of the level takes its own number of inner
      steps between two rounds, ``period`` being the slowest group's.
    * ``max_lag`` (paced levels of an elastic job; 0: no bound, else in [1, 1e6]): a group more
      than max_lag times its expected round time behind is failed out as a straggler.
    * ``rounds`` (paced levels; 0: no bound): the job's length in rounds of the level; the
      averagers' ``budget_spent`` turns True after the last one.
    """

    period: int
    group_size: int
    outer: Optional[OuterSGD] = None
    fragments: int = 1
    sync_delay: int = 0
    mix: float = 0.0
    payload: str = "FP32"
    error_feedback: float = 0.0
    topk_density: float = 0.0
    paced: bool = False
    max_lag: float = 0.0
    rounds: int = 0

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
        if not isinstance(self.payload, str):
            raise _invalid(f"{where}: payload={self.payload!r}: expected one of "
                           f"{', '.join(PAYLOADS)}")
        object.__setattr__(self, "payload", self.payload.upper())
        if (isinstance(self.error_feedback, bool)
                or not isinstance(self.error_feedback, (int, float))
                or not 0.0 <= float(self.error_feedback) <= 1.0):
            raise _invalid(f"{where}: error_feedback={self.error_feedback!r}: expected a number "
                           "in [0, 1] (0: off, 1: classic error feedback)")
        object.__setattr__(self, "error_feedback", float(self.error_feedback))
        if (isinstance(self.topk_density, bool)
                or not isinstance(self.topk_density, (int, float))):
            raise _invalid(f"{where}: topk_density={self.topk_density!r}: expected a number")
        object.__setattr__(self, "topk_density", float(self.topk_density))
        if not isinstance(self.paced, bool):
            raise _invalid(f"{where}: paced={self.paced!r}: expected True or False")
        if (isinstance(self.max_lag, bool) or not isinstance(self.max_lag, (int, float))
                or not (self.max_lag == 0 or 1.0 <= float(self.max_lag) <= 1e6)):
            raise _invalid(f"{where}: max_lag={self.max_lag!r}: expected 0 (no bound) or a "
                           "number in [1, 1e6] (rounds a paced group may fall behind)")
        object.__setattr__(self, "max_lag", float(self.max_lag))
        if not _is_int(self.rounds) or not 0 <= self.rounds <= 1 << 40:
            raise _invalid(f"{where}: rounds={self.rounds!r}: expected an integer in [0, 2**40] "
                           "(0: no bound)")
        if self.rounds != 0 and not self.paced:
            raise _invalid(f"{where}: rounds={self.rounds!r} needs paced=True: only a paced job "
                           "is counted in rounds")
        if self.max_lag != 0.0 and not self.paced:
            raise _invalid(f"{where}: max_lag={self.max_lag!r} needs paced=True: it bounds how "
                           "far a paced group may fall behind its planned round")
        problem = _core.check_payload(where, self.payload, self.topk_density,
                                      self.error_feedback)
        if problem:
            raise _invalid(problem)
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
                      ("payload", self.payload, "FP32"),
                      ("error_feedback", self.error_feedback, 0.0)) if value != default]
            if asked:
                raise _invalid(
                    f"{where}: {', '.join(asked)} needs an outer level: a plain level averages "
                    "the parameters themselves. Use outer=modelavg.OuterSGD(1.0) (lr 1, "
                    "momentum 0), which averages the delta and equals plain averaging")

    @property
    def streaming(self) -> bool:
        """Whether any streaming field differs from its default."""
        return (self.fragments, self.sync_delay, self.mix, self.payload, self.error_feedback,
                self.topk_density) != _NO_STREAMING

    @property
    def pacing(self) -> bool:
        """Whether ``paced``, ``max_lag`` or ``rounds`` differs from its default."""
        return (self.paced, self.max_lag, self.rounds) != _NO_PACING


LevelLike = Union[Tuple[int, int], Level]


def _levels_from(d: Mapping[str, Any]) -> List[LevelLike]:
    """A spec dict's levels: (period, group_size) pairs, Level for those with an outer
    optimizer, streaming or pacing fields."""
    n = len(d["levels"])
    outer = d.get("outer") or [None] * n
    streaming = d.get("streaming") or [None] * n
    pacing = d.get("pacing") or [None] * n
    out: List[LevelLike] = []
    for (period, group_size), o, st, pc in zip(d["levels"], outer, streaming, pacing):
        fields = {}
        if st is not None and tuple(st) != _NO_STREAMING:
            fields = dict(zip(("fragments", "sync_delay", "mix", "payload", "error_feedback",
                               "topk_density"), st))
        if pc is not None and tuple(pc) != _NO_PACING:
            fields.update(zip(("paced", "max_lag", "rounds"), pc))
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
    ``replica_size`` S > 1: sharded replicas (docs/sharded.md) — S ranks hold one model replica,
    rank r shard r % S of replica r // S, and each level averages the ranks of its groups that
    hold the same shard; 0 or 1: every rank holds a whole replica.
    """

    job_id: str
    world_size: int
    mode: str
    levels: List[LevelLike]
    warmup_steps: int = 0
    heartbeat_timeout_ms: int = 0
    join_timeout_ms: int = 0
    min_world_size: int = 0
    replica_size: int = 0


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of a job's current generation. ``admitted_step``: the step a replacement was
    admitted at (elastic jobs), -1 for a member of the world that started the job. ``replica``
    and ``shard``: rank // replica_size and rank % replica_size. ``retired_by``: for a member
    whose replica was retired (state "RETIRED"), the rank whose loss retired it, else -1;
    ``retired_at_step``: its first step outside the averaging (0: at once)."""

    rank: int
    worker_id: str
    host: str
    last_step: int
    ms_since_heartbeat: int
    state: str
    generation: int
    admitted_step: int = -1
    replica: int = 0
    shard: int = 0
    retired_by: int = -1
    retired_at_step: int = 0


@dataclasses.dataclass(frozen=True)
class GenerationChange:
    """Why a job's generation last changed."""

    generation: int
    rank: int
    reason: str
    unix_ms: int


@dataclasses.dataclass(frozen=True)
class PlanChange:
    """One plan of a job (proto ``modelavg.v1.PlanChange``): ``version`` 0 is the spec the job
    was created with, then 1, 2, ... for each :func:`update_job`; every member follows it from
    ``switch_step`` on (0 for version 0). ``unix_ms``: when the coordinator accepted it (0 for
    version 0: see ``Job.created_unix_ms``)."""

    version: int
    switch_step: int
    spec: JobSpec
    unix_ms: int


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as the coordinator reports it (proto ``modelavg.v1.Job``).

    ``live_world_size``: ranks alive in the current generation; ``vacant_ranks``: ranks of a
    running elastic job that no live worker holds; ``deaths``: members declared dead;
    ``admissions``: replacements admitted into the running elastic job; ``waiting_ranks``:
    ranks of a replacement replica (sharded replicas) that joined and wait for the rest of it.
    ``plan_history``: every plan of the job, version 0 first (docs/plan-updates.md);
    ``plan_version``: the version of ``spec``, the plan in force at the members' smallest step;
    ``pending_plan``: a plan :func:`update_job` accepted that some member has not reached yet.
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
    waiting_ranks: List[int] = dataclasses.field(default_factory=list)
    plan_history: List[PlanChange] = dataclasses.field(default_factory=list)
    plan_version: int = 0
    pending_plan: Optional[PlanChange] = None


@dataclasses.dataclass(frozen=True)
class JobUpdate:
    """What :func:`update_job` answers: every member follows the new plan (version
    ``plan_version``) from step ``switch_step`` on, and none averages under the old plan at or
    past it; ``job`` is the job once the plan was accepted (its ``pending_plan`` is the new
    plan until every member has reached the switch step)."""

    switch_step: int
    plan_version: int
    job: Job


def _spec(s: Dict[str, Any]) -> JobSpec:
    return JobSpec(job_id=s["job_id"], world_size=s["world_size"], mode=s["mode"],
                   levels=_levels_from(s), warmup_steps=s["warmup_steps"],
                   heartbeat_timeout_ms=s["heartbeat_timeout_ms"],
                   join_timeout_ms=s["join_timeout_ms"], min_world_size=s["min_world_size"],
                   replica_size=s["replica_size"])


def _plan_change(d: Optional[Dict[str, Any]]) -> Optional[PlanChange]:
    if d is None:
        return None
    return PlanChange(version=d["version"], switch_step=d["switch_step"], spec=_spec(d["spec"]),
                      unix_ms=d["unix_ms"])


def _job(d: Dict[str, Any]) -> Job:
    spec = _spec(d["spec"])
    change = d["last_change"]
    return Job(spec=spec, state=d["state"], generation=d["generation"],
               members=[Member(**m) for m in d["members"]], min_step=d["min_step"],
               max_step=d["max_step"], warnings=list(d["warnings"]),
               created_unix_ms=d["created_unix_ms"],
               last_change=GenerationChange(**change) if change else None,
               live_world_size=d["live_world_size"], vacant_ranks=list(d["vacant_ranks"]),
               deaths=d["deaths"], admissions=d["admissions"],
               waiting_ranks=list(d["waiting_ranks"]),
               plan_history=[_plan_change(c) for c in d.get("plan_history", [])],
               plan_version=d.get("plan_version", 0),
               pending_plan=_plan_change(d.get("pending_plan")))


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


StreamingTuple = Tuple[int, int, float, str, float, float]
PacingTuple = Tuple[bool, float, int]


def _levels(levels: Union[Mapping[int, int], Sequence[LevelLike]]
            ) -> Tuple[List[Tuple[int, int]], List[Optional[Tuple[float, float, bool]]],
                       List[StreamingTuple], List[PacingTuple]]:
    """(period, group_size) pairs and, per level, None or (lr, momentum, nesterov),
    (fragments, sync_delay, mix, payload, error_feedback, topk_density) and (paced, max_lag,
    rounds)."""
    items = list(levels.items()) if isinstance(levels, Mapping) else list(levels)
    pairs, outer, streaming, pacing = [], [], [], []
    for item in items:
        if isinstance(item, Level):
            pairs.append((int(item.period), int(item.group_size)))
            outer.append(_outer_tuple(item, item.outer))
            streaming.append((item.fragments, item.sync_delay, item.mix, item.payload,
                              item.error_feedback, item.topk_density))
            pacing.append((item.paced, item.max_lag, item.rounds))
            continue
        try:
            period, group_size = item
            pairs.append((int(period), int(group_size)))
            outer.append(None)
            streaming.append(_NO_STREAMING)
            pacing.append(_NO_PACING)
        except (TypeError, ValueError):
            raise _invalid(f"level {item!r}: expected a (period, group_size) pair or a "
                           "modelavg.Level") from None
    return pairs, outer, streaming, pacing


def _with_pacing(spec: Dict[str, Any], pacing: List[PacingTuple]) -> Dict[str, Any]:
    """`spec` with the levels' (paced, max_lag, rounds) under "pacing" when a level has any: a spec
    without pacing is sent exactly as before the fields existed."""
    if any(p != _NO_PACING for p in pacing):
        spec["pacing"] = pacing
    return spec


def create_job(job_id: str, world_size: int, mode: str = "HIERARCHICAL",
               levels: Optional[Union[Mapping[int, int], Sequence[Tuple[int, int]]]] = None, *,
               period: Optional[int] = None, warmup_steps: int = 0,
               heartbeat_timeout_ms: int = 0, join_timeout_ms: int = 0,
               min_world_size: int = 0, replica_size: int = 0,
               coordinator: Optional[str] = None,
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
      replica_size: sharded replicas (docs/sharded.md): the ranks of one model replica (FSDP or
        HSDP inside it, modelavg across replicas); rank r holds shard r % replica_size. It must
        divide world_size, every group size and min_world_size. 0 or 1: every rank holds a
        whole replica.
      coordinator: "host:port" (or several, comma-separated); default ``$MODELAVG_COORDINATOR``.
      **options: auth_token or auth_token_file, tls, tls_ca_file, tls_cert_file, tls_key_file,
        rpc_timeout (default: the environment, as connect() reads it).

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
    pairs, outer, streaming, pacing = _levels(levels)
    spec = _with_pacing(
        {"job_id": job_id, "world_size": world_size, "mode": mode, "levels": pairs,
         "outer": outer, "streaming": streaming,
         "warmup_steps": warmup_steps, "heartbeat_timeout_ms": heartbeat_timeout_ms,
         "join_timeout_ms": join_timeout_ms, "min_world_size": min_world_size,
         "replica_size": replica_size}, pacing)
    try:
        return _job(_core.create_job(_conn(coordinator, options), spec))
    except (ValueError, RuntimeError, TypeError) as e:
        if isinstance(e, Error):
            raise
        raise _invalid(f"job spec {spec}: {e}") from None


def _spec_dict(spec: JobSpec) -> Dict[str, Any]:
    """A JobSpec as the binding takes it (the keys create_job sends)."""
    pairs, outer, streaming, pacing = _levels(spec.levels)
    return _with_pacing(
        {"job_id": spec.job_id, "world_size": spec.world_size, "mode": str(spec.mode).upper(),
         "levels": pairs, "outer": outer, "streaming": streaming,
         "warmup_steps": spec.warmup_steps, "heartbeat_timeout_ms": spec.heartbeat_timeout_ms,
         "join_timeout_ms": spec.join_timeout_ms, "min_world_size": spec.min_world_size,
         "replica_size": spec.replica_size}, pacing)


def update_job(job_id: str, spec: Optional[JobSpec] = None, *, mode: Optional[str] = None,
               world_size: Optional[int] = None,
               levels: Optional[Union[Mapping[int, int], Sequence[LevelLike]]] = None,
               period: Optional[int] = None, warmup_steps: Optional[int] = None,
               heartbeat_timeout_ms: Optional[int] = None,
               min_world_size: Optional[int] = None, replica_size: Optional[int] = None,
               coordinator: Optional[str] = None, **options: Any) -> JobUpdate:
    """Gives the RUNNING job a new plan, switched at one step on every member, and returns the
    :class:`JobUpdate` (its ``switch_step``, ``plan_version`` and the ``job``).

    The new plan is ``spec`` (a whole :class:`JobSpec`; its ``job_id`` must be ``job_id`` or
    empty), or the job's latest plan (the last of ``get_job(job_id).plan_history``) with the
    keyword arguments given changed — the same as :func:`create_job`'s: ``levels`` (or
    ``period``: the last level's period), ``warmup_steps``, ``heartbeat_timeout_ms``,
    ``min_world_size``, and ``mode``, ``world_size``, ``replica_size``, which may not change::

        job = modelavg.get_job("diloco")
        levels = list(job.spec.levels)
        levels[-1] = dataclasses.replace(levels[-1], outer=modelavg.OuterSGD(0.35, momentum=0.9,
                                                                              nesterov=True))
        update = modelavg.update_job("diloco", levels=levels)
        print(update.switch_step, update.plan_version)

    What may change, how the switch step is chosen and what an outer level keeps across it:
    docs/plan-updates.md. The call waits for the members to give back their prefetched
    decisions: a few heartbeat intervals, at most about 5 s.

    Raises InvalidArgumentError (a bad spec, or a change of job_id, world_size, mode,
    replica_size or whether the job is elastic: the message names the field),
    FailedPreconditionError (the job is not RUNNING; an earlier update has not switched yet:
    retry once every member passed it; warmup_steps changed after a member passed it),
    UnavailableError (the coordinator restarted recently and its members are re-attaching:
    retry), PermissionDeniedError (a worker's token: the operator role is needed),
    NotFoundError, and Error with code ABORTED (the job left RUNNING meanwhile).
    """
    asked = {"mode": mode, "world_size": world_size, "levels": levels, "period": period,
             "warmup_steps": warmup_steps, "heartbeat_timeout_ms": heartbeat_timeout_ms,
             "min_world_size": min_world_size, "replica_size": replica_size}
    given = {k: v for k, v in asked.items() if v is not None}
    if spec is not None:
        if given:
            raise _invalid(f"pass a whole spec or the fields to change, not both (spec and "
                           f"{', '.join(sorted(given))})")
        if not isinstance(spec, JobSpec):
            raise _invalid(f"spec must be a modelavg.JobSpec, not {type(spec).__name__}")
        if spec.job_id not in ("", job_id):
            raise _invalid(f"spec.job_id {spec.job_id!r} is not {job_id!r}: a job's id may not "
                           "change")
        new = spec
    else:
        if not given:
            raise _invalid("nothing to change: pass spec= or the fields to change (levels=, "
                           "period=, warmup_steps=, heartbeat_timeout_ms=, min_world_size=)")
        if levels is not None and period is not None:
            raise _invalid("pass levels or period, not both")
        current = get_job(job_id, coordinator=coordinator, **options)
        new = current.plan_history[-1].spec if current.plan_history else current.spec
        changes = {k: v for k, v in given.items() if k != "period"}
        if period is not None:
            last = new.levels[-1]
            changes["levels"] = list(new.levels[:-1]) + [
                dataclasses.replace(last, period=period) if isinstance(last, Level)
                else (period, last[1])]
        new = dataclasses.replace(new, **changes)
    d = _spec_dict(dataclasses.replace(new, job_id=job_id))
    try:
        r = _core.update_job(_conn(coordinator, options), job_id, d)
    except (ValueError, RuntimeError, TypeError) as e:
        if isinstance(e, Error):
            raise
        raise _invalid(f"job spec {d}: {e}") from None
    return JobUpdate(switch_step=r["switch_step"], plan_version=r["plan_version"],
                     job=_job(r["job"]))


def get_job(job_id: str, *, coordinator: Optional[str] = None, **options: Any) -> Job:
    """The job's spec, state, generation and members. Raises NotFoundError if unknown."""
    return _job(_core.get_job(_conn(coordinator, options), job_id))


def list_jobs(*, coordinator: Optional[str] = None, **options: Any) -> List[Job]:
    """Every job of the coordinator, in job id order."""
    return [_job(j) for j in _core.list_jobs(_conn(coordinator, options))]


def delete_job(job_id: str, *, coordinator: Optional[str] = None, **options: Any) -> None:
    """Removes a job; its pending waits fail. Raises NotFoundError if unknown."""
    _core.delete_job(_conn(coordinator, options), job_id)
