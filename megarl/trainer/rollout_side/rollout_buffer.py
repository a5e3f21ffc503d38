"""The bounded buffer between the rollout producer and the trainer in asynchronous RL, and its staleness rule.

Staleness of a sample: the actor's weight version when the trainer takes the sample, minus the oldest weight version
among the sample's tokens (a partial rollout resumed under newer weights keeps its older prefix, so it counts as
old as its first token). The trainer syncs once per step, so after step i of the loop the actor is at v0 + i + 1.

With max_staleness = k the rule holds in one of two ways (`policy`):
- wait: by construction. The producer starts its i-th batch of the loop only once the trainer has synced at least
  i - k times (the engines then hold version >= v0 + i - k, and every token of the batch is at least that new); the
  trainer takes that batch at its step i, at version v0 + i. So the producer runs at most k batches ahead of the
  trainer; k = 0 is the synchronous loop: generate, train, sync, generate...
- drop: the producer runs freely, bounded only by the buffer: max(k, 1) finished batches plus the one it is
  generating. When the trainer takes a batch, the prompt groups holding a sample more than k versions old are
  dropped (and counted); if fewer than `min_groups` groups are left (a mini-batch needs a whole group) the rest of
  the batch goes too and the trainer takes the next one. The producer never waits for the trainer's syncs, so a fresh
  batch always comes: the trainer cannot starve.
With k = 0 both policies wait (dropping would throw away every batch generated during an update).

The buffer holds only controller-side objects and never calls a worker; the producer thread and the trainer thread
meet here and in RolloutProducer's pause for weight sync.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megarl.cluster.deadline import PhaseTimeoutError, current_deadline
from megarl.data.batch import Batch

OLDEST_VERSION = "oldest_version"
"""Batch meta key: per sample, the oldest weight version among its tokens."""


class BufferClosed(Exception):
    """The buffer was closed: the producer stops; a trainer that still waits for a batch gets this."""


@dataclass
class ScoredBatch:
    """A rollout batch, scored, as the producer hands it to the trainer."""

    number: int
    """Global batch number: the request seeds derive from it (it equals the RL global step in the wait policy)."""
    batch: Batch
    """Rows grouped by prompt (`group_ids`), with token rewards and meta[OLDEST_VERSION]."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout and reward metrics of the batch."""
    num_tokens: int = 0
    """Generated tokens."""
    data_state: dict[str, Any] = field(default_factory=dict)
    """The prompt sampler's state right after this batch's prompts were drawn (what a checkpoint saves once the
    trainer has consumed the batch)."""


@dataclass
class TakenBatch:
    """What the trainer gets: the batch (too-stale groups removed) and what it took to get it."""

    item: ScoredBatch
    staleness: list[int]
    """Per consumed sample: actor version minus the sample's oldest token version."""
    dropped: list[int]
    """Staleness of every sample dropped to get this batch (from this and earlier, wholly dropped batches)."""
    num_dropped_batches: int
    """Batches dropped whole before this one."""
    wait_s: float
    """Seconds the trainer waited for a batch."""
    num_queued: int
    """Finished batches left in the buffer after this one was taken."""


class RolloutBuffer:
    """Finished batches from one producer thread to one trainer thread, with the wait/drop staleness rule."""

    def __init__(self, max_staleness: int, policy: Literal["drop", "wait"] = "wait", min_groups: int = 1):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        self.max_staleness = max_staleness
        self.policy = "wait" if max_staleness == 0 else policy
        self.capacity = max_staleness + 1 if self.policy == "wait" else max(max_staleness, 1)
        """Finished batches the buffer holds at most (wait: never reached, the start rule is tighter)."""
        self.min_groups = min_groups
        self._queue: deque[ScoredBatch] = deque()
        self._cond = threading.Condition()
        self._num_started = 0
        self._num_synced = 0
        self._closed = False
        self._error: BaseException | None = None

    # -- producer side --------------------------------------------------------------------------------------------

    def wait_turn(self) -> float:
        """Block until the producer may start its next batch; returns the seconds waited. Raises BufferClosed."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._may_start())
            if self._closed:
                raise BufferClosed
            self._num_started += 1
        return time.perf_counter() - start

    def _may_start(self) -> bool:
        if self.policy == "drop":
            return True
        return self._num_synced >= self._num_started - self.max_staleness

    def put(self, item: ScoredBatch) -> float:
        """Add a finished batch, blocking while the buffer is full; returns the seconds waited. Raises BufferClosed."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._queue) < self.capacity)
            if self._closed:
                raise BufferClosed
            self._queue.append(item)
            self._cond.notify_all()
        return time.perf_counter() - start

    def fail(self, error: BaseException) -> None:
        """The producer failed: the trainer's next `take` raises `error`."""
        with self._cond:
            self._error = error
            self._closed = True
            self._cond.notify_all()

    # -- trainer side ---------------------------------------------------------------------------------------------

    def weights_synced(self) -> None:
        """The trainer pushed a new weight version to the engines (one per step)."""
        with self._cond:
            self._num_synced += 1
            self._cond.notify_all()

    def take(self, actor_version: int) -> TakenBatch:
        """The next batch fit for an actor at `actor_version` (blocking until there is one, at most until the
        current phase deadline: then PhaseTimeoutError, megarl/cluster/deadline.py)."""
        start = time.perf_counter()
        dropped: list[int] = []
        num_dropped_batches = 0
        deadline = current_deadline()
        while True:
            with self._cond:
                left = None if deadline is None else max(deadline.remaining(), 0.0)
                if not self._cond.wait_for(lambda: self._closed or bool(self._queue), timeout=left):
                    note = f"{deadline.describe()} The rollout producer delivered no batch in time."
                    raise PhaseTimeoutError("rollout", f"producer in phase '{deadline.phase}'", {}, note, deadline)
                if self._error is not None:
                    raise self._error
                if not self._queue:
                    raise BufferClosed
                item = self._queue.popleft()
                num_queued = len(self._queue)
                self._cond.notify_all()
            staleness = [actor_version - v for v in item.batch.meta[OLDEST_VERSION]]
            if self.policy == "wait":
                assert max(staleness) <= self.max_staleness, f"the wait rule let through staleness {staleness}"
                kept = item
            else:
                kept, staleness, too_old = self._drop_stale(item, staleness)
                dropped += too_old
                if kept is None:
                    num_dropped_batches += 1
                    continue
            wait_s = time.perf_counter() - start
            return TakenBatch(kept, staleness, dropped, num_dropped_batches, wait_s, num_queued)

    def _drop_stale(self, item: ScoredBatch, staleness: list[int]) -> tuple[ScoredBatch | None, list[int], list[int]]:
        """(the batch without its too-stale groups or None, kept staleness, dropped staleness)."""
        group_ids = item.batch["group_ids"]
        stale_B = torch.tensor(staleness) > self.max_staleness
        if not stale_B.any():
            return item, staleness, []
        stale_groups = group_ids[stale_B].unique()
        keep_B = ~torch.isin(group_ids, stale_groups)
        num_kept_groups = int(group_ids[keep_B].unique().numel())  # host values: the batch lives on the host
        if num_kept_groups < self.min_groups:
            return None, [], staleness
        rows = keep_B.nonzero().squeeze(1)
        batch = item.batch.select(rows)
        _, renumbered = torch.unique_consecutive(batch["group_ids"], return_inverse=True)
        batch = batch.with_tensors(group_ids=renumbered)
        kept = [s for s, stale in zip(staleness, stale_B.tolist()) if not stale]
        too_old = [s for s, stale in zip(staleness, stale_B.tolist()) if stale]
        return ScoredBatch(item.number, batch, item.metrics, item.num_tokens, item.data_state), kept, too_old

    def close(self) -> None:
        """Stop both sides: the producer's waits and the trainer's `take` raise BufferClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
