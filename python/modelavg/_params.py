"""From what PyTorch's averagers accept to the tuples modelavg._core takes.

PyTorch's ``average_parameters`` accepts an iterable of ``torch.nn.Parameter`` or of optimizer
``param_groups`` dicts, and leaves out every parameter whose ``.grad`` is None
(``torch.distributed.algorithms.model_averaging.utils.get_params_to_average``). This module does
the same, then describes each tensor by its data pointer, element count, dtype, device and (CUDA)
the current stream — torch is never linked, only imported here.

Sharded replicas (docs/sharded.md): what a rank averages is what it holds. FSDP's parameters
(its flat parameters) are plain local tensors; a DTensor parameter (PyTorch 2's tensor
parallelism, FSDP2) is averaged through its local shard, ``to_local()``, which shares the
DTensor's storage: never a gathered copy.
"""

import sys
from typing import Any, Iterable, List, Tuple

_DTYPE_CODES = None  # torch dtype -> modelavg DType code (include/modelavg/client/tensor.h order)


def _torch():
    import torch
    return torch


def _dtype_codes():
    global _DTYPE_CODES
    if _DTYPE_CODES is None:
        torch = _torch()
        _DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
    return _DTYPE_CODES


def _dtensor_types() -> Tuple[type, ...]:
    """The DTensor classes of the modules already imported. A DTensor exists only once its
    module is imported, so nothing is imported here: importing torch.distributed.tensor takes
    about half a second, which an averaging call must not spend (nor be interrupted in) before
    it reaches its wait."""
    found = []
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found)


def local_tensor(t: Any) -> Any:
    """The tensor this rank holds of `t`: a DTensor's local shard (``to_local()``, the same
    storage), any other tensor itself."""
    types = _dtensor_types()
    if types and isinstance(t, types):
        return t.to_local()
    return t


def params_to_average(params: Iterable[Any]) -> List[Any]:
    """The parameters PyTorch would average: those whose ``.grad`` is not None."""
    torch = _torch()
    out = []
    for param in params:
        if isinstance(param, torch.nn.Parameter):
            if param.grad is not None:
                out.append(param)
        elif isinstance(param, dict):
            for p in param["params"]:
                if p.grad is not None:
                    out.append(p)
        else:
            # PyTorch raises the same for anything else (a plain tensor included).
            raise NotImplementedError(
                f"Parameter input of type {type(param)} is not supported: pass "
                "model.parameters() (torch.nn.Parameter) or optimizer.param_groups")
    return out


Spec = Tuple[int, int, int, int, int, int]


def describe(tensors: List[Any]) -> Tuple[List[Spec], List[Tuple[Any, Any]]]:
    """(data_ptr, numel, dtype, device kind, device index, stream) per tensor, and the
    (parameter, contiguous copy) pairs to copy back after averaging non-contiguous ones."""
    codes = _dtype_codes()
    specs: List[Spec] = []
    copy_back: List[Tuple[Any, Any]] = []
    streams = {}
    for i, p in enumerate(tensors):
        t = local_tensor(p.data)
        code = codes.get(t.dtype)
        if code is None:
            raise TypeError(f"parameter {i} has dtype {t.dtype}: modelavg averages float32, "
                            "float64, float16 and bfloat16 tensors")
        if t.layout != _torch().strided:
            raise TypeError(f"parameter {i} has layout {t.layout}: only dense (strided) "
                            "tensors can be averaged")
        if not t.is_contiguous():
            c = t.contiguous()
            copy_back.append((t, c))
            t = c
        dev = t.device
        if dev.type == "cpu":
            specs.append((t.data_ptr(), t.numel(), code, 0, 0, 0))
        elif dev.type == "cuda":
            stream = streams.get(dev.index)
            if stream is None:
                stream = _torch().cuda.current_stream(dev).cuda_stream
                streams[dev.index] = stream
            specs.append((t.data_ptr(), t.numel(), code, 1, dev.index, stream))
        else:
            raise TypeError(f"parameter {i} is on {dev}: modelavg averages CPU tensors (Gloo) "
                            "and CUDA tensors (NCCL)")
    return specs, copy_back
