"""A CPU hf engine's weights in shared memory, written in place by the trainer's ranks on its node: one copy per byte.

On the object store road every weight is copied twice: a sending rank copies it into Ray's object store, the engine
copies it from there into its model (tools/bench/refit.py: the two copies of every byte share the node's memory
bandwidth). A CPU hf engine can instead keep its weights in one shared-memory file: `move_to_shared_memory` moves
the model's tensors into a memfd (freed with the last process mapping it, and not bounded by the size of /dev/shm)
and `SharedWeights` says where each checkpoint tensor lies in it. A sending rank on the same node maps the file
(`SharedWeightsWriter`), copies each tensor or part of a bucket straight from its shard into its region, and tells
the engine what it wrote, which the engine checks and counts as it counts a bucket (megarl/rollout/hf_weights.py:
names, bounds, parts disjoint and covering each tensor). The CPU counterpart of the CUDA IPC road, with the roles
turned around: the sender opens the engine's memory.

Writes happen only inside a weight update (begin_weight_update .. finish_weight_update), while the engine's worker
refuses to generate: never under a forward pass. What the file does not hold (derived buffers, layers the engine
drops) and delta buckets (the engine verifies their checksum before applying them: megarl/workers/weight_delta.py)
still travel through the object store. A rank that cannot open the file (another node or another pid namespace:
the token in the file's first bytes must match) falls back to the object store, saying so once.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megarl.bridge.buckets import Bucket, split_part_name
from megarl.errors import UserError

log = logging.getLogger(__name__)

_ALIGN = 64
"""Byte alignment of each storage in the file (every dtype's view needs its element size; 64: a cache line)."""
_HEADER = 64
"""The file's first bytes: the token a writer checks."""


@dataclass(frozen=True)
class Region:
    """One checkpoint tensor's place in the file: a strided view of `dtype` elements."""

    dtype: str
    """torch dtype name without the "torch." prefix."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """In elements of `dtype`, from the file's start."""


@dataclass(frozen=True)
class SharedWeights:
    """Where an engine's weights lie in shared memory: handed to every sending rank with the sync route."""

    node_id: str
    """The Ray node of the engine: only ranks on it can open the file."""
    path: str
    """/proc/<engine pid>/fd/<memfd>: opening it opens the engine's file (as long as the engine lives)."""
    nbytes: int
    token: str
    """Random, written at the file's start: a writer that opened `path` checks it has this engine's file."""
    regions: dict[str, Region]
    """Checkpoint name -> its region."""


def move_to_shared_memory(model: torch.nn.Module, targets: Iterable[torch.Tensor]) -> tuple[mmap.mmap, int, str]:
    """Move the storages of `targets` into one new memfd, and every tensor of `model` viewing them (tied weights
    stay tied; each tensor keeps its identity, shape and strides): returns (the engine's mapping, the memfd, the
    token). One storage at a time, each freed once its tensors point into the file: the memory needed beyond the
    model is its largest storage."""
    targets = list(targets)
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in targets:
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    viewing: dict[int, list[torch.Tensor]] = {ptr: [] for ptr in storages}
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if (ptr := tensor.untyped_storage().data_ptr()) in viewing:
            viewing[ptr].append(tensor)
    offsets, total = {}, _HEADER
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    fd = os.memfd_create("megarl-engine-weights")
    try:
        os.ftruncate(fd, total)
        mapping = mmap.mmap(fd, total)
    except BaseException:
        os.close(fd)
        raise
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    token = secrets.token_hex(16)
    flat[: len(token)].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
    shared = flat.untyped_storage()
    with torch.no_grad():
        for ptr in list(storages):
            storage, base = storages.pop(ptr), offsets[ptr]
            flat[base : base + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            del storage
            for tensor in viewing.pop(ptr):
                offset = base // tensor.element_size() + tensor.storage_offset()
                tensor.set_(shared, offset, tensor.shape, tensor.stride())
    if any(t.untyped_storage().data_ptr() != shared.data_ptr() for t in targets):  # writes would go nowhere
        raise RuntimeError("shared weights: a tensor to be written is not a parameter or buffer of the model")
    return mapping, fd, token


def region_of(tensor: torch.Tensor) -> Region:
    """The region of a view of the shared file (the file's storage: offsets count from its start)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return Region(dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


class SharedWeightsUnavailable(RuntimeError):
    """The file cannot be opened from this process (another node or pid namespace, no permission)."""


class SharedWeightsWriter:
    """A sending rank's mapping of one engine's file (kept between syncs, dropped when the engine is replaced)."""

    def __init__(self, shared: SharedWeights, node_id: str):
        if shared.node_id != node_id:
            raise SharedWeightsUnavailable(f"the engine runs on node {shared.node_id}, this rank on {node_id}")
        try:
            fd = os.open(shared.path, os.O_RDWR)
        except OSError as err:
            raise SharedWeightsUnavailable(f"cannot open {shared.path}: {err}") from err
        try:
            stat = os.fstat(fd)
            if stat.st_size != shared.nbytes:
                raise SharedWeightsUnavailable(f"{shared.path} is not the engine's file (another size)")
            self._file = (stat.st_dev, stat.st_ino)
            # MAP_POPULATE: the page table is filled here, once, not by faults during the first sync's copies
            self._mapping = mmap.mmap(fd, shared.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._flat = torch.frombuffer(self._mapping, dtype=torch.uint8)
        if bytes(self._flat[: len(shared.token)].tolist()) != shared.token.encode():
            raise SharedWeightsUnavailable(f"{shared.path} is not the engine's file (another token)")
        self.shared = shared
        self._typed: dict[str, torch.Tensor] = {}

    def region(self, name: str) -> torch.Tensor | None:
        """The engine's tensor (a view of the file) for checkpoint name `name`; None if the file does not hold it."""
        region = self.shared.regions.get(name)
        if region is None:
            return None
        typed = self._typed.get(region.dtype)
        if typed is None:
            dtype = getattr(torch, region.dtype)
            usable = self._flat.numel() // dtype.itemsize * dtype.itemsize
            typed = self._typed[region.dtype] = self._flat[:usable].view(dtype)
        return typed.as_strided(region.shape, region.stride, region.offset)

    @torch.no_grad()
    def write(self, bucket: Bucket) -> tuple[list[str], int, Bucket]:
        """Copy each entry of `bucket` (whole tensors and `NAME@DIM:START:STOP` parts) into its region, cast to the
        engine's dtype. Returns (the entry names written, their bytes, the entries the file does not hold, for the
        object store). Every name's shape is checked before the first copy."""
        writes, rest = [], []
        for name, tensor in bucket:
            split = split_part_name(name)
            base, part = split if split is not None else (name, None)
            region = self.region(base)
            if region is None:
                rest.append((name, tensor))
                continue
            if part is not None:
                dim, start, stop = part
                if not (dim < region.dim() and 0 <= start < stop <= region.shape[dim]):
                    raise UserError(f"weight update: part {name!r} lies outside {base!r}, of shape {region.shape}")
                region = region.narrow(dim, start, stop - start)
            if tensor.shape != region.shape:
                raise UserError(
                    f"weight update: tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
                    f"{tuple(region.shape)}"
                )
            writes.append((name, region, tensor))
        for _, region, tensor in writes:
            region.copy_(tensor)
        return [name for name, _, _ in writes], sum(t.nbytes for _, _, t in writes), rest

    def engine_alive(self) -> bool:
        """Whether the engine still holds the file (its process lives): else this mapping is all that keeps the
        memory, and it should be closed."""
        try:
            stat = os.stat(self.shared.path)
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self._file

    def close(self) -> None:
        """Unmap the file (the engine's memory is freed once no process maps it)."""
        self._typed.clear()
        del self._flat
        try:
            self._mapping.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            log.debug("shared weights: mapping of %s still in use, left to the garbage collector", self.shared.path)
