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

A running job's plan can change: ``modelavg.update_job(job_id, levels=...)`` (or ``period=``,
``heartbeat_timeout_ms=``, a whole ``spec=``) returns the step from which every member follows
the new plan (docs/plan-updates.md).

Sharded replicas (``create_job(..., replica_size=S)``, docs/sharded.md): S ranks hold one model
replica (FSDP or HSDP inside it), rank r its shard r % S; each level averages, shard by shard,
the ranks of its groups that hold the same shard. Pass the averagers the local tensors each rank
holds (FSDP's flat parameters, a DTensor's local shard). In an elastic job a lost rank retires
its whole replica (its other ranks get :class:`ReplicaLostError`).
"""

# The package is split by concern; everything public is re-exported here, as before.
from . import errors
from .errors import (AlreadyExistsError, DeadlineExceededError, Error, FailedPreconditionError,
                     InvalidArgumentError, NonFiniteError, NotFoundError, PeerFailureError,
                     PermissionDeniedError, ReplicaLostError, ResourceExhaustedError, UnavailableError,
                     UnimplementedError)
from . import _native

_native.load()  # before any `from . import _core`: see _native's docstring
from . import _core  # noqa: E402
from ._core import Decision
from ._options import Duration
from .jobs import (PAYLOADS, GenerationChange, Job, JobSpec, JobUpdate, Level, LevelLike, Member,
                   OuterSGD, PlanChange, create_job, delete_job, get_job, list_jobs, update_job)
from .client import Client, connect
from .averagers import (HierarchicalModelAverager, LevelTraffic, ModelAverager,
                        PeriodicModelAverager)

__version__ = "0.1.0"

__all__ = [
    "connect", "Client", "ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager",
    "Decision", "Level", "LevelTraffic", "PAYLOADS", "OuterSGD", "JobSpec", "Job", "Member",
    "GenerationChange", "PlanChange", "JobUpdate", "create_job", "get_job", "list_jobs",
    "update_job", "delete_job", "Error",
    "PeerFailureError", "ReplicaLostError", "InvalidArgumentError",
    "NonFiniteError", "NotFoundError", "AlreadyExistsError", "FailedPreconditionError", "DeadlineExceededError",
    "UnavailableError", "PermissionDeniedError", "ResourceExhaustedError", "UnimplementedError",
    "errors",
]
