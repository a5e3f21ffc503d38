"""Delta weight sync (rollout.weight_sync_delta): after a full sync, send only the elements whose bytes changed.

Sending side (`DeltaEncoder`, one per sending rank): a host snapshot of every tensor as last sent. Per bucket, each
tensor's new bytes are compared with the snapshot as integers of the element's width (so the test is lossless:
-0.0 vs 0.0 and NaN payloads count as changes), and the changed elements travel as flat indices (int32 where the
tensor has fewer than 2^31 elements) and their values; a tensor whose delta would not be smaller travels whole, so
a delta sync never costs more than a full one (but a checksum per bucket). Each bucket carries a checksum of its
tensors' full new bytes (`bucket_checksum`): the engine applies the delta to what it holds and compares the
checksum of the result, so a lost, stale or misapplied delta cannot pass unnoticed.

Receiving side (`apply_delta`): for each entry, the engine's tensor (a view into its model; any dtype the sent
values convert to exactly, e.g. a bf16 delta into an fp32 engine) gets `values` at `indices`; then the checksum.
A mismatch raises `DeltaMismatch`: the controller fails the sync, quarantines the engine (it serves nothing until
a complete sync) and the next sync is full (`DeltaEncoder.reset`).

An engine that holds only a shard of each tensor (SGLang at tp > 1: megarl/rollout/sglang_delta.py) cannot check a
CRC over whole tensors, so every delta entry also carries `tensor_hash` of the tensor's full new bits and its shape:
an additive hash (a sum over elements of `element_mix(flat index, bits)`, wrapping int64), which any split of the
elements into parts sums back to, whatever part each rank holds.

A full sync is forced when there is no snapshot: the first sync, after any engine restart, a resume (a new
process: no snapshot), a layout change (a new encoder), or after a failed delta.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from megarl.rollout.engine import Bucket

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHECKSUM_NAME = "megarl.delta.checksum"
"""The wire format's marker (`delta_to_bucket`): a bucket holding it is a delta."""
_INDICES, _VALUES, _HASH = "@delta.indices", "@delta.values", "@delta.hash"
_MIX = (0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)
"""splitmix64's multipliers, as signed int64 (torch multiplies int64 wrapping)."""
_HASH_CHUNK = {"cpu": 2**16, "cuda": 2**24}
"""Elements hashed at once: on the host, what stays in cache (10x faster than large chunks); on a GPU, few kernel
launches with int64 temporaries of 128 MiB."""


class DeltaMismatch(RuntimeError):
    """The engine's weights after a delta do not match the sender's checksum."""


@dataclass
class DeltaEntry:
    """One tensor of a delta bucket: `indices`/`values` (a delta), or `full` (the whole tensor)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None
    full: torch.Tensor | None = None
    hash: int | None = None
    """A delta's `tensor_hash` of the full new tensor (engines holding a shard verify with it)."""

    @property
    def nbytes(self) -> int:
        if self.full is not None:
            return self.full.nbytes
        return self.indices.nbytes + self.values.nbytes


@dataclass
class DeltaBucket:
    entries: list[DeltaEntry]
    checksum: int
    """bucket_checksum of the tensors' full new bytes, in entry order."""
    full_bytes: int
    """What the bucket would have cost sent whole."""

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    @property
    def changed_elements(self) -> int:
        return sum(e.full.numel() if e.full is not None else e.indices.numel() for e in self.entries)


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def element_bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bits as int64 (the integer view of the element's width, sign-extended): what the hash mixes."""
    flat = values.detach().contiguous().reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)


def element_mix(indices: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Per element, a 64-bit mix of (flat index, bits) (int64 tensors on any device; splitmix64's finalizer over
    index * golden ratio + bits): the same torch ops on the sender and on every engine rank."""
    x = indices * _MIX[0] + bits
    x = (x ^ _lsr(x, 30)) * _MIX[1]
    x = (x ^ _lsr(x, 27)) * _MIX[2]
    return x ^ _lsr(x, 31)


def wrap64(value: int) -> int:
    """A Python int as the int64 that wrapping arithmetic gives."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def tensor_hash(tensor: torch.Tensor) -> int:
    """sum_i element_mix(i, bits_i) over the tensor's flat elements, wrapping int64, on the tensor's own device."""
    bits = tensor.detach().contiguous().reshape(-1)
    total = 0
    chunk = _HASH_CHUNK.get(bits.device.type, _HASH_CHUNK["cuda"])
    for start in range(0, bits.numel(), chunk):
        part = element_bits(bits[start : start + chunk])
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device)
        total += int(element_mix(index, part).sum())
    return wrap64(total)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def bucket_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 over the tensors' bytes, in order (on the host: zlib, no Python pass per element)."""
    crc = 0
    for tensor in tensors:
        data = _bytes(tensor.cpu() if tensor.device.type != "cpu" else tensor)
        crc = zlib.crc32(memoryview(data.numpy()), crc)
    return crc


@dataclass
class DeltaEncoder:
    """A sending rank's snapshot of what it last sent, and the encoder of the next bucket against it."""

    snapshot: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> the bytes last sent (host, flat, the element's integer view)."""

    def reset(self) -> None:
        """Forget the snapshot: the next sync is full (restart, resume, layout change, failed delta)."""
        self.snapshot.clear()

    def encode(self, bucket: Bucket) -> DeltaBucket:
        """The bucket as a delta against the snapshot (whole tensors where there is none), and update the snapshot.
        The snapshot changes only here: call `reset` when the receiving side did not apply the result."""
        entries, full_bytes = [], 0
        for name, tensor in bucket:
            host = tensor.detach().cpu().contiguous()
            bits = host.reshape(-1).view(_INT_VIEW[host.element_size()])
            full_bytes += host.nbytes
            old = self.snapshot.get(name)
            if old is None or old.shape != bits.shape or old.dtype != bits.dtype:
                entries.append(DeltaEntry(name, tuple(host.shape), host.dtype, full=host.clone()))
                self.snapshot[name] = bits.clone()
                continue
            changed = torch.nonzero(bits != old).reshape(-1)
            index_dtype = torch.int32 if bits.numel() < 2**31 else torch.int64
            record = 8 * (1 + host.dim())  # its @delta.hash record (delta_to_bucket)
            if changed.numel() * (index_dtype.itemsize + host.element_size()) + record >= host.nbytes:
                entries.append(DeltaEntry(name, tuple(host.shape), host.dtype, full=host.clone()))
                old.copy_(bits)  # most elements moved: the whole tensor is cheaper
                continue
            old[changed] = bits[changed]  # the snapshot follows in place: no copy of the whole tensor
            values = host.reshape(-1)[changed]
            digest = tensor_hash(tensor)  # where the tensor is (the GPU on a sending rank): one pass, no copy
            entries.append(
                DeltaEntry(name, tuple(host.shape), host.dtype, changed.to(index_dtype), values, hash=digest)
            )
        return DeltaBucket(entries, bucket_checksum(t for _, t in bucket), full_bytes)


def apply_delta(delta: DeltaBucket, target_of: Callable[[str], torch.Tensor]) -> None:
    """Apply a delta bucket in place: `target_of(name)` is the engine's tensor for a sent name (a view into its
    model, of the sent shape). Raises DeltaMismatch naming the bucket when the result's checksum differs."""
    results = []
    for entry in delta.entries:
        target = target_of(entry.name)
        if tuple(target.shape) != entry.shape:
            raise DeltaMismatch(f"{entry.name}: the engine holds shape {tuple(target.shape)}, the sender {entry.shape}")
        if entry.full is not None:
            target.copy_(entry.full)
        else:
            flat = target.view(-1) if target.is_contiguous() else target.contiguous().view(-1)
            flat[entry.indices.to(torch.int64)] = entry.values.to(device=flat.device, dtype=flat.dtype)
            if flat.data_ptr() != target.data_ptr():
                target.copy_(flat.view(target.shape))
        results.append(target.detach().to(entry.dtype))
    got = bucket_checksum(results)
    if got != delta.checksum:
        names = ", ".join(e.name for e in delta.entries[:3])
        raise DeltaMismatch(
            f"delta weight sync: checksum {got:#010x} of the engine's tensors after the delta differs from the "
            f"sender's {delta.checksum:#010x} (bucket of {len(delta.entries)} tensors: {names}, ...)"
        )


def delta_to_bucket(delta: DeltaBucket) -> Bucket:
    """A delta as a plain bucket of named tensors, so every road carries it as it carries weights: whole tensors
    under their names, deltas as `NAME@delta.indices` / `NAME@delta.values` / `NAME@delta.hash` (int64: the
    tensor_hash, then the shape), the checksum as CHECKSUM_NAME. A bucket of whole tensors only is a plain weight
    bucket, byte for byte what a sync without deltas sends: whole tensors overwrite, so there is nothing for a
    checksum to check."""
    bucket: Bucket = []
    for entry in delta.entries:
        if entry.full is not None:
            bucket.append((entry.name, entry.full))
        else:
            bucket += [(entry.name + _INDICES, entry.indices), (entry.name + _VALUES, entry.values)]
            meta = torch.tensor([entry.hash if entry.hash is not None else 0, *entry.shape], dtype=torch.int64)
            bucket.append((entry.name + _HASH, meta))
    if any(entry.full is None for entry in delta.entries):
        bucket.append((CHECKSUM_NAME, torch.tensor([delta.checksum], dtype=torch.int64)))
    return bucket


def is_delta_bucket(names: Iterable[str]) -> bool:
    """Whether a bucket (its names) is a delta (`delta_to_bucket`'s marker)."""
    return CHECKSUM_NAME in names


def bucket_to_delta(bucket: Bucket, shape_of: Callable[[str], tuple[int, ...]] | None = None) -> DeltaBucket | None:
    """The delta a bucket carries (None for a plain weight bucket). A delta entry's shape is the one it was sent
    with; `shape_of(name)` (the engine's shape for a name) stands in for a bucket without `@delta.hash` records."""
    tensors = dict(bucket)
    if CHECKSUM_NAME not in tensors:
        return None
    entries = []
    for name, tensor in bucket:
        if name == CHECKSUM_NAME or name.endswith(_VALUES) or name.endswith(_HASH):
            continue
        if name.endswith(_INDICES):
            base = name.removesuffix(_INDICES)
            values, meta = tensors[base + _VALUES], tensors.get(base + _HASH)
            if meta is not None:
                meta = [int(v) for v in meta.cpu()]
                shape, digest = tuple(meta[1:]), meta[0]
            elif shape_of is not None:
                shape, digest = shape_of(base), None
            else:
                raise DeltaMismatch(f"delta weight sync: {base!r} came without its {_HASH} record (shape, hash)")
            entries.append(DeltaEntry(base, shape, values.dtype, tensor, values, hash=digest))
        else:
            entries.append(DeltaEntry(name, tuple(tensor.shape), tensor.dtype, full=tensor))
    full_bytes = 0  # not known on the receiving side
    return DeltaBucket(entries, int(tensors[CHECKSUM_NAME][0]), full_bytes)
