"""Grouping named tensors into buckets of bounded size, for streaming export and weight sync; the names of parts.

A bucket entry is a whole HF tensor under its checkpoint name, or one part of it under `part_name`:
"NAME@DIM:START:STOP" holds `NAME`'s elements START..STOP-1 along DIM (all of every other dim). Parts are what each
TP rank sends of its own shard when the engine can take them (megarl/bridge/exporter.py, `parts`); an
engine writes each part into its region of the tensor, and the tensor is complete once its parts cover it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

Bucket = list[tuple[str, torch.Tensor]]

DEFAULT_BUCKET_BYTES = 512 * 2**20

_PART = re.compile(r"(.+)@(\d+):(\d+):(\d+)")


def part_name(name: str, where: tuple[int, int, int]) -> str:
    """The entry name of the part (dim, start, stop) of HF tensor `name`."""
    dim, start, stop = where
    return f"{name}@{dim}:{start}:{stop}"


def split_part_name(name: str) -> tuple[str, tuple[int, int, int]] | None:
    """(HF tensor name, (dim, start, stop)) of a part's entry name; None for a whole tensor's."""
    match = _PART.fullmatch(name)
    return (match.group(1), (int(match.group(2)), int(match.group(3)), int(match.group(4)))) if match else None


def travel_groups(names: Iterable[str], suffix_groups: Iterable[tuple[str, ...]]) -> dict[str, frozenset[str]]:
    """Name -> the names it must share a bucket with, for every complete group among `names`.

    `suffix_groups` lists tensors an engine fuses at load time, as name suffixes under one common prefix (e.g.
    ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight") for each DeepSeek layer). A group applies
    only where all of its members are present (DeepSeek-V2-Lite has no q_a_proj: nothing to fuse).
    """
    present = set(names)
    together: dict[str, frozenset[str]] = {}
    for suffixes in suffix_groups:
        first = suffixes[0]
        for name in present:
            if not name.endswith(first):
                continue
            prefix = name[: -len(first)]
            members = frozenset(prefix + suffix for suffix in suffixes)
            if members <= present:
                together.update(dict.fromkeys(members, members))
    return together


class BucketBuilder:
    """Collects (name, tensor) pairs; hands out a bucket whenever the next tensor would push it past `max_bytes`.

    Tensors of one travel group (`together`, see travel_groups) always land in the same bucket: a bucket is cut only
    where no group is half-collected, which SGLang's DeepSeek loader needs (it fuses q_a_proj and kv_a_proj_with_mqa
    only when both arrive in one load call, and silently leaves them unloaded otherwise). A bucket exceeds
    `max_bytes` only by a tensor larger than it by itself, or by the rest of a group it must complete.
    """

    def __init__(self, max_bytes: int = DEFAULT_BUCKET_BYTES, together: Mapping[str, frozenset[str]] | None = None):
        if max_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.together = dict(together or {})
        self._items: Bucket = []
        self._bytes = 0
        self._open: dict[frozenset[str], set[str]] = {}
        """Groups with some members in the current bucket: the members still missing."""

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        """Add a tensor; return the previous bucket if this one did not fit into it."""
        full = None
        if self._items and not self._open and self._bytes + tensor.nbytes > self.max_bytes:
            full = self.flush()
        self._items.append((name, tensor))
        self._bytes += tensor.nbytes
        group = self.together.get(name)
        if group is not None:
            missing = self._open.setdefault(group, set(group))
            missing.discard(name)
            if not missing:
                del self._open[group]
        return full

    def flush(self) -> Bucket | None:
        """The bucket in progress (None if empty); starts a new one."""
        items, self._items, self._bytes, self._open = self._items, [], 0, {}
        return items or None
