"""The averagers: PeriodicModelAverager and HierarchicalModelAverager with PyTorch's semantics."""

import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from . import _core
from . import _params
from ._core import Decision
from ._options import _backup_on_host, _invalid
from .client import Client


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

    ``backup_device`` (torchft's name): where the outer levels' anchors and momenta of CUDA
    parameters live — None, on the parameters' device; ``"cpu"``, in pinned host memory (two
    parameter-sized buffers per outer level move off the GPU; docs/diloco.md).
    """

    _hierarchical = False

    def __init__(self, client: Client, backup_device: Any = None) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"client must be a modelavg.Client (from modelavg.connect), not "
                            f"{type(client).__name__}")
        self.client = client
        self.backup_device = backup_device
        self._core = _core.Averager(client._core, self._hierarchical,
                                    _backup_on_host(backup_device))

    @property
    def step(self) -> int:
        """The step of the next average_parameters call."""
        return self._core.step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"step must be an int, not {type(value).__name__}")
        self._core.step = value

    @property
    def budget_spent(self) -> bool:
        """A paced job counted in rounds (the last level ``paced`` with ``rounds`` R > 0,
        docs/paced.md): True once this worker's call completed round R - 1, the job's last;
        stop training then. False before, and always for other jobs; restoring a checkpoint
        (``step``, ``load_state_dict``) makes it False again. Read-only."""
        return self._core.budget_spent

    def state_dict(self) -> Dict[str, Any]:
        """The averager's state, to save beside the model and the optimizer (PyTorch's
        convention): ``{"step": int, "anchors": {level: [tensor, ...]}, "momenta": {level:
        [tensor, ...]}}`` — for each level with an outer optimizer whose first averaging step
        has happened, its anchor (one flat CPU tensor per parameter, float32 for float16/bfloat16
        parameters, else their dtype) and, once set, its momentum buffer. Copies: later steps
        do not change them.

        A streaming outer level (``Level`` with fragments, sync_delay, mix or payload) keeps its
        state per fragment, under ``"fragments": {level: {fragment: {"anchor": [tensor, ...],
        "momentum": [tensor, ...]}}}`` (the fragment's tensors; "momentum" empty until set; with
        ``error_feedback``, "residual": the member's float32 residual E, empty until set), and
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
        for level, fragment, anchor, momentum, residual in d["fragments"]:
            entry = {"anchor": tensor_list(anchor), "momentum": tensor_list(momentum)}
            if residual:
                entry["residual"] = tensor_list(residual)
            fragments.setdefault(level, {})[fragment] = entry
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
                                  raw_list(entry.get("momentum") or [], f"{what}['momentum']"),
                                  raw_list(entry.get("residual") or [], f"{what}['residual']")))
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
          NonFiniteError: a member's parameters held a NaN or an Inf (``check_finite``): they
            were kept out of the round and no member's parameters changed in it. A strict job:
            every member raises it; an elastic job: only that member (retired; the others
            average without it inside the same call).
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
