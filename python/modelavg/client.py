"""A rank's membership in a job: :class:`Client` and :func:`connect`."""

import os
from typing import Any, Optional

from . import _core
from ._options import (_CLIENT_OPTIONS, _coordinator, _env_int, _invalid, _options,
                       _with_environment)
from .errors import Error
from .jobs import JobSpec, _levels_from


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
    def replica_size(self) -> int:
        """The ranks of one model replica (the job's ``replica_size``; 1: every rank holds a
        whole one)."""
        return self._core.replica_size

    @property
    def replica(self) -> int:
        """The replica this rank belongs to: ``rank // replica_size``."""
        return self._core.replica

    @property
    def shard(self) -> int:
        """The shard of its replica this rank holds: ``rank % replica_size``."""
        return self._core.shard

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
                       levels=_levels_from(d), warmup_steps=d["warmup_steps"],
                       replica_size=d["replica_size"])

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
        if self.replica_size > 1:
            extra = f", replica={self.replica}, shard={self.shard}"
        if self.elastic:
            extra += ", elastic=True"
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
      **options: any field of the C++ ``ClientOptions``: ``worker_id``, ``auth_token`` or
        ``auth_token_file`` (default ``$MODELAVG_AUTH_TOKEN_FILE``), ``tls`` (``$MODELAVG_TLS``),
        ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file`` (``$MODELAVG_TLS_CA_FILE``, ...;
        a TLS file implies ``tls``), ``join_timeout`` (default 300 s),
        ``rpc_timeout`` (10 s), ``heartbeat_interval`` (0.1 s), ``heartbeat_stream`` (True),
        ``share_heartbeat_stream`` (False: the ranks of this process in one stream),
        ``heartbeat_relay_dir`` (default ``$MODELAVG_HEARTBEAT_RELAY_DIR``; "" for none: the
        processes of this host in one stream, through a relay in that directory of yours,
        mode 0700), ``collective_timeout`` (60 s), ``leave_timeout`` (20 s),
        ``coordinator_outage_timeout`` (300 s), ``schedule_window`` (4096), ``gloo_hostname``
        ("127.0.0.1"; the address peers reach this process at), ``gloo_in_place`` (False),
        ``gloo_scatter_max_bytes`` (0: rounds of more than two members above 256 KiB on Gloo's
        ring; up to this many bytes on the scatter-gather exchange instead, for members on one
        flat network, not across a slow link between sites: docs/benchmarks.md),
        ``check_finite`` (True: a member whose values hold a NaN or an Inf is kept out of the
        round and raises ``NonFiniteError``; every worker of a job sets it alike),
        ``tokens_per_step`` (default ``$MODELAVG_TOKENS_PER_STEP``, else 1: the tokens one local
        step processes, a number in (0, 1e12]; a paced level weighs each member's rounds by its
        steps times this, docs/paced.md).
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
    _with_environment(opts)
    if "heartbeat_relay_dir" not in opts and os.environ.get("MODELAVG_HEARTBEAT_RELAY_DIR"):
        opts["heartbeat_relay_dir"] = os.environ["MODELAVG_HEARTBEAT_RELAY_DIR"]
    if "tokens_per_step" not in opts and os.environ.get("MODELAVG_TOKENS_PER_STEP"):
        # Checked like the C++ programs' (TokensPerStepFromEnvironment): a number in (0, 1e12].
        opts["tokens_per_step"] = _core.tokens_per_step_from_environment()
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
