"""Grouping named tensors into buckets of bounded size, for streaming export and weight sync."""

from __future__ import annotations

import torch

Bucket = list[tuple[str, torch.Tensor]]

DEFAULT_BUCKET_BYTES = 512 * 2**20


class BucketBuilder:
    """Collects (name, tensor) pairs; hands out a bucket whenever the next tensor would push it past `max_bytes`.

    A bucket exceeds `max_bytes` only when it holds a single tensor that is larger by itself.
    """

    def __init__(self, max_bytes: int = DEFAULT_BUCKET_BYTES):
        if max_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: Bucket = []
        self._bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        """Add a tensor; return the previous bucket if this one did not fit into it."""
        full = None
        if self._items and self._bytes + tensor.nbytes > self.max_bytes:
            full = self.flush()
        self._items.append((name, tensor))
        self._bytes += tensor.nbytes
        return full

    def flush(self) -> Bucket | None:
        """The bucket in progress (None if empty); starts a new one."""
        items, self._items, self._bytes = self._items, [], 0
        return items or None
