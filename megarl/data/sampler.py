"""Batches of dataset items, epoch after epoch, resumable exactly.

Epoch e visits the items in a permutation drawn from (seed, e) alone, so the order of any epoch can be recomputed
without replaying earlier ones. The state is (epoch, position in that epoch's order): a sampler loaded from the state
saved after k batches yields exactly the batches an uninterrupted run would have yielded next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from megarl.errors import UserError

T = TypeVar("T")


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The item indices in the order epoch `epoch` visits them."""
    if not shuffle:
        return list(range(num_items))
    return np.random.default_rng([seed, epoch]).permutation(num_items).tolist()


class EpochSampler(Generic[T]):
    """Yields lists of `batch_size` items forever, a fresh order each epoch.

    With `drop_last` (training), every batch is full: the items left at the end of an epoch, fewer than a batch,
    are skipped that epoch (another order puts them elsewhere next time), and a batch never mixes two epochs.
    Without it, an epoch ends with a shorter batch.
    """

    def __init__(
        self, items: Sequence[T], batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True
    ):
        if batch_size < 1:
            raise UserError(f"the batch size must be >= 1, got {batch_size}")
        if not items:
            raise UserError("there is nothing to sample from: the dataset is empty")
        if drop_last and batch_size > len(items):
            raise UserError(
                f"a batch of {batch_size} needs at least that many items; the dataset has {len(items)} "
                "(after filtering): lower the batch size or add data"
            )
        self.items = items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) of the current epoch

    @property
    def num_batches_per_epoch(self) -> int:
        full, rest = divmod(len(self.items), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        return [self.items[index] for index in self.next_indices()]

    def next_indices(self) -> list[int]:
        """The item indices of the next batch (advances the sampler)."""
        remaining = len(self.items) - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
        indices = self._epoch_order()[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return indices

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(len(self.items), self.seed, self.epoch, self.shuffle))
        return self._order[1]

    # -- checkpointing -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler is (JSON-serializable), with what the order depends on so a resume can check it."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_items": len(self.items),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state. The dataset size, seed and shuffling must be those it was saved with:
        otherwise the same position would name other items."""
        saved = (state["num_items"], state["seed"], state["shuffle"])
        if saved != (len(self.items), self.seed, self.shuffle):
            raise UserError(
                f"the saved data position is for {saved[0]} items with seed={saved[1]}, shuffle={saved[2]}; this "
                f"dataset has {len(self.items)} items with seed={self.seed}, shuffle={self.shuffle}. A resumed run "
                "must use the same data files, filters, seed and shuffle to continue where it stopped"
            )
        if not 0 <= state["position"] <= len(self.items) or state["epoch"] < 0:
            raise UserError(f"the saved data position {state} is out of range for {len(self.items)} items")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class SampledDataset(Generic[T]):
    """What every dataset offers on top of its list of samples: indexing, a training sampler, an evaluation pass."""

    samples: list[T]
    seed: int = 0
    shuffle: bool = True
    sampler_cls: type[EpochSampler] = EpochSampler

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> T:
        return self.samples[index]

    def sampler(self, batch_size: int, drop_last: bool = True) -> EpochSampler[T]:
        """Training batches of `batch_size` samples, in a fresh order each epoch (if `shuffle`), resumable."""
        return self.sampler_cls(self.samples, batch_size, self.seed, self.shuffle, drop_last)

    def batches(self, batch_size: int) -> Iterator[list[T]]:
        """One pass in file order, the last batch possibly shorter (evaluation)."""
        return ordered_batches(self.samples, batch_size)


def ordered_batches(items: Sequence[T], batch_size: int) -> Iterator[list[T]]:
    """One pass over `items` in order, the last batch possibly shorter (evaluation)."""
    if batch_size < 1:
        raise UserError(f"the batch size must be >= 1, got {batch_size}")
    for start in range(0, len(items), batch_size):
        yield list(items[start : start + batch_size])
