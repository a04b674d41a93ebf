"""The exceptions modelavg raises: one class per kind of failure a trainer handles differently.

Every exception is a :class:`modelavg.Error` that carries the status ``code`` (a name such as
``"NOT_FOUND"``), the library's ``message``, which says what went wrong and what to do, and,
from the library's typed errors, the ``kind`` of failure (``"PEER_FAILURE"``,
``"GENERATION_MOVED"``, ``"TIMEOUT"``, ``"LAYOUT_MISMATCH"``, ...; None when the error has none)
and the ``rank`` it blames (None when it blames none)::

    try:
        averager.average_parameters(model.parameters())
    except modelavg.PeerFailureError as e:  # a peer died, left or stalled: restart (checkpoint)
        print(f"rank {e.rank} is gone ({e.kind}): {e}")
    except modelavg.Error as e:
        print(e.code, e.message)

==========================  ===============================================  ===================
class                       when                                             also a
==========================  ===============================================  ===================
PeerFailureError            an averaging step failed because the job's       —
                            membership changed (a peer died, left or re-
                            joined), a peer did not take part in time, its
                            connection broke, or the coordinator is gone.
                            The client is no longer usable: connect again.
ReplicaLostError            (a PeerFailureError) sharded replicas: another   —
                            rank of this rank's replica died, left or
                            failed, so the replica was retired; restart
                            the replica's workers together.
InvalidArgumentError        a bad argument, option or job spec               ValueError
NotFoundError               no such job                                      LookupError
AlreadyExistsError          the job id, or the requested rank, is taken      —
FailedPreconditionError     the job is finished, or the wrong averager for   —
                            its mode, or (update_job) the job is not
                            running or an earlier update has not switched
DeadlineExceededError       a wait ran past its deadline (e.g. the world     TimeoutError
                            did not complete within join_timeout)
UnavailableError            the coordinator cannot be reached                ConnectionError
PermissionDeniedError       UNAUTHENTICATED / PERMISSION_DENIED (token,      PermissionError
                            TLS; create_job, update_job and delete_job
                            need the operator's)
ResourceExhaustedError      past one of the coordinator's bounds             —
UnimplementedError          e.g. CUDA tensors in a build without CUDA        NotImplementedError
Error                       anything else (INTERNAL, ...)                    —
==========================  ===============================================  ===================
"""

import re
from typing import Dict, Optional, Type

__all__ = [
    "Error", "PeerFailureError", "ReplicaLostError", "InvalidArgumentError", "NonFiniteError",
    "NotFoundError", "AlreadyExistsError", "FailedPreconditionError", "DeadlineExceededError",
    "UnavailableError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnimplementedError",
]

# absl::StatusCode numbers (the same as gRPC's).
_CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class Error(Exception):
    """A modelavg failure: ``code`` is the status code's name, ``message`` what to do, ``kind``
    the library's kind of failure (None: none), ``rank`` the rank it blames (None: none)."""

    code: str
    message: str
    kind: Optional[str]
    rank: Optional[int]

    def __init__(self, code: str, message: str, kind: Optional[str] = None,
                 rank: Optional[int] = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.kind = kind
        self.rank = rank


class PeerFailureError(Error):
    """An averaging step failed because a peer (or the coordinator) failed.

    ``rank`` is the rank the coordinator blamed for the membership change (None when the
    failure names none, e.g. the coordinator is gone); ``kind`` says what happened
    (``"GENERATION_MOVED"``, ``"PEER_FAILURE"``, ``"TIMEOUT"``, ...). The client cannot average
    any more: restart from the last checkpoint with a new client.
    """


class ReplicaLostError(PeerFailureError):
    """Sharded replicas (``replica_size``): another rank of this rank's replica died, left or
    failed, so the coordinator retired the whole replica from the job's generation (the other
    replicas go on). ``kind`` is ``"REPLICA_LOST"``, ``rank`` the rank that was lost and
    ``replica`` this rank's replica. The client cannot average any more: restart every worker
    of the replica, which re-join together as a replacement replica (each healing from its own
    shard of a live replica).
    """

    replica: Optional[int]

    def __init__(self, code: str, message: str, kind: Optional[str] = "REPLICA_LOST",
                 rank: Optional[int] = None, replica: Optional[int] = None) -> None:
        super().__init__(code, message, kind, rank)
        self.replica = replica
        if replica is None:
            m = re.search(r"\breplica (\d+)", message)
            self.replica = int(m.group(1)) if m else None


class InvalidArgumentError(Error, ValueError):
    """A bad argument, option or job spec; the message names it and the value."""


class NonFiniteError(InvalidArgumentError):
    """A member's values held a NaN or an Inf: they were kept out of the round, and no member's
    parameters changed in it. ``rank`` is the rank that contributed them; ``step``, ``level``,
    ``tensor`` (its index in the averaged list) and ``value`` (``"NaN"``, ``"+Inf"``, ``"-Inf"``)
    say where (None: not known). In an elastic job that rank is retired and only its call
    raises this (the others average without it); in a strict job every rank's call raises it.
    """

    step: Optional[int] = None
    level: Optional[int] = None
    tensor: Optional[int] = None
    value: Optional[str] = None


class NotFoundError(Error, LookupError):
    """No such job: create it first (``modelavg.create_job``, CreateJob or ``--jobs_file``)."""


class AlreadyExistsError(Error):
    """The job id, or the rank asked for, is already taken."""


class FailedPreconditionError(Error):
    """The request does not fit the job's state: finished, the other averager's mode, or
    (``update_job``) not RUNNING, or an earlier update whose switch step some member has not
    reached yet (retry once every member passed it)."""


class DeadlineExceededError(Error, TimeoutError):
    """A wait ran past its deadline (join, communicator set-up, one RPC)."""


class UnavailableError(Error, ConnectionError):
    """The coordinator cannot be reached (wrong address, not running, TLS on one side only)."""


class PermissionDeniedError(Error, PermissionError):
    """The coordinator refused the token or the TLS identity."""


class ResourceExhaustedError(Error):
    """Past one of the coordinator's bounds (jobs, ranks)."""


class UnimplementedError(Error, NotImplementedError):
    """Not supported by this build or this coordinator (e.g. CUDA tensors without CUDA)."""


_BY_CODE: Dict[str, Type[Error]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "UNAVAILABLE": UnavailableError,
    "UNAUTHENTICATED": PermissionDeniedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNIMPLEMENTED": UnimplementedError,
}

# What an averaging step reports when a peer or the coordinator failed.
_PEER_CODES = frozenset({"FAILED_PRECONDITION", "ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"})


def _from_status(code: int, message: str, averaging: bool = False, kind: Optional[str] = None,
                 rank: Optional[int] = None) -> Error:
    """The exception for a status (called by modelavg._core with the status's kind and rank)."""
    name = _CODE_NAMES.get(code, f"CODE_{code}")
    if kind == "NON_FINITE":
        return NonFiniteError(name, message, kind, rank)
    if kind == "REPLICA_LOST":  # client/base/error_kind.h: ErrorKind::kReplicaLost
        return ReplicaLostError(name, message, kind, rank)
    if averaging and name in _PEER_CODES:
        return PeerFailureError(name, message, kind, rank)
    return _BY_CODE.get(name, Error)(name, message, kind, rank)
