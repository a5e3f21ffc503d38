"""The device boundary of a worker, in one place (docs/architecture.md: device boundary).

Batches cross the Ray boundary as CPU tensors. A worker moves what arrives to its device with `to_device` and
brings what it returns back with `to_host` (cluster/worker.py does both around every call), so schedule, loss and
algorithm code never call `.cuda()` or `.cpu()`. Tensors given to a collective live on the backend's device:
`collective_device()` (NCCL: the current CUDA device; gloo: the CPU).
"""

from __future__ import annotations

from typing import Any

import torch

PIN_MIN_BYTES = 1 << 20
"""Host tensors at least this large are pinned before an asynchronous copy to the GPU (smaller: not worth it)."""


def local_device() -> torch.device:
    """This process's compute device: its current CUDA device, or the CPU where CUDA is absent."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device(group: Any = None) -> torch.device:
    """Where tensors handed to a collective of `group` must live: CUDA for NCCL, the CPU for gloo."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor in `obj` (a Batch, tensor, or list / tuple / dict of them, nested) on `device`; anything else
    as it is. Large host tensors are pinned and copied asynchronously (the stream orders the copy before use)."""
    from megarl.data.batch import Batch

    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if device.type == "cuda" and obj.device.type == "cpu" and obj.nbytes >= PIN_MIN_BYTES:
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    if isinstance(obj, Batch):
        return Batch({name: to_device(t, device) for name, t in obj.tensors.items()}, obj.meta)
    if isinstance(obj, dict):
        return {key: to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(to_device(value, device) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(value, device) for value in obj)
    return obj


def to_host(obj: Any) -> Any:
    """`obj` with every tensor on the CPU: what a worker returns to the controller."""
    return to_device(obj, torch.device("cpu"))
