"""How a weight bucket crosses Ray: each tensor as a NumPy view of its bytes, or, between processes on the same
GPU (a colocated engine), as a CUDA IPC handle on one flattened buffer.

Ray serializes NumPy arrays out of band: `ray.put` copies their bytes into the object store once, and a reader on
the same node maps them without a copy. A torch tensor instead goes through torch's own pickling (a serialized copy
on both sides). Measured by tools/bench/refit.py (1 GB model, TP=2, CPU): 2.2-3.6x faster syncs, and the engine's
extra memory during a sync went from 1.6-2.6 GB to nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from megarl.rollout.engine import Bucket


@dataclass(frozen=True)
class PackedTensor:
    name: str
    dtype: str
    """torch dtype name without the "torch." prefix (bfloat16 has no NumPy equivalent: bytes travel as uint8)."""
    shape: tuple[int, ...]
    data: np.ndarray
    """The tensor's bytes, uint8, one dimension."""


def pack_bucket(bucket: Bucket) -> list[PackedTensor]:
    """Views of the bucket's bytes (no copy here; `ray.put` makes the one copy)."""
    return [PackedTensor(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), _bytes(t)) for name, t in bucket]


def unpack_bucket(packed: list[PackedTensor]) -> Bucket:
    """Tensors viewing the packed bytes (read-only when they are the object store's: the engine copies from them)."""
    bucket = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch notes the buffers are read-only; they are only read
        for item in packed:
            tensor = torch.from_numpy(item.data).view(getattr(torch, item.dtype)).view(item.shape)
            bucket.append((item.name, tensor))
    return bucket


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.view(-1).view(torch.uint8).numpy()


# -- CUDA IPC: colocated engines on the same GPU ---------------------------------------------------------------------

_ALIGN = 16
"""Byte alignment of each tensor in a flattened bucket (every dtype's view needs its element size)."""


@dataclass(frozen=True)
class IpcBucket:
    """A bucket flattened into one CUDA buffer, shared through a CUDA IPC handle: the receiver maps the sender's
    memory on the same GPU, no host copy (docs/architecture.md: weight transports, colocated)."""

    device_uuid: str
    """The GPU holding the buffer (a receiver finds it among the devices it sees by this id)."""
    rebuild: tuple
    """(function, arguments) of torch.multiprocessing's CUDA tensor reduction."""
    items: list[tuple[str, str, tuple[int, ...], int]]
    """(name, dtype, shape, byte offset) of each tensor in the buffer."""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_device_uuids() -> list[str]:
    """The ids of the GPUs this process sees (which IPC buckets it can open)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def pack_bucket_ipc(bucket: Bucket) -> tuple[IpcBucket, torch.Tensor]:
    """(the shareable description, the flat buffer): the caller keeps the buffer alive until every receiver has
    copied from it."""
    from torch.multiprocessing.reductions import reduce_tensor

    offsets, total = [], 0
    for _, tensor in bucket:
        offsets.append(total)
        total += -(-tensor.nbytes // _ALIGN) * _ALIGN
    flat = torch.empty(total, dtype=torch.uint8, device=bucket[0][1].device)
    items = []
    for (name, tensor), offset in zip(bucket, offsets):
        flat[offset : offset + tensor.nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
        items.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
    torch.cuda.current_stream(flat.device).synchronize()  # the copies are complete before another process reads
    return IpcBucket(device_uuid(flat.device), reduce_tensor(flat), items), flat


def unpack_bucket_ipc(packed: IpcBucket) -> Bucket:
    """Tensors viewing the sender's buffer (valid until the receiving call returns: copy from them there)."""
    uuids = visible_device_uuids()
    if packed.device_uuid not in uuids:
        raise RuntimeError(f"CUDA IPC bucket on GPU {packed.device_uuid}, which this process does not see ({uuids})")
    function, args = packed.rebuild
    args = list(args)
    args[6] = uuids.index(packed.device_uuid)  # the storage's device index, as this process numbers its GPUs
    flat = function(*args)
    bucket = []
    for name, dtype, shape, offset in packed.items:
        element = getattr(torch, dtype)
        nbytes = element.itemsize * int(np.prod(shape, dtype=np.int64))
        bucket.append((name, flat[offset : offset + nbytes].view(element).view(shape)))
    return bucket
