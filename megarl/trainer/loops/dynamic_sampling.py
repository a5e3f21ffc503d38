"""DAPO's dynamic sampling, for both loops (trainer/loops/rl_loop.py and the asynchronous
trainer/rollout_side/rollout_producer.py).

A prompt group whose completions all scored the same carries no signal for group-relative advantages: it is dropped
and more prompts are drawn, up to `max_rounds` draws; the kept groups are renumbered so that groups of different
draws stay distinct, and a full batch holds the first `num_groups` of them (a short batch is used as it is after the
last draw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.algorithms.dapo import keep_groups
from megarl.data.batch import Batch


@dataclass
class DynamicSampling:
    """DAPO dynamic sampling: drop groups whose completions all scored the same, draw again, up to `max_rounds`."""

    max_rounds: int
    num_groups: int
    """Groups a full batch has (rl.prompts_per_step)."""


@dataclass
class KeptGroups:
    """The informative groups of the draws so far (`add` each scored draw, then `result`)."""

    num_groups: int
    parts: list[Batch] = field(default_factory=list)
    kept: int = 0
    draws: int = 0

    def add(self, batch: Batch) -> bool:
        """Keep the groups of `batch` (with `scores` and `group_ids`) whose scores differ; whether a full batch
        is kept now."""
        keep, kept = keep_groups(batch["scores"], batch["group_ids"])
        batch = batch.select(keep.nonzero().squeeze(1))
        self.parts.append(batch.with_tensors(group_ids=renumber_groups(batch["group_ids"], self.kept)))
        self.kept += kept
        self.draws += 1
        return self.kept >= self.num_groups

    def result(self) -> tuple[Batch, dict[str, float]]:
        """The batch of the first `num_groups` kept groups, and the dapo/* metrics."""
        batch = Batch.concat(self.parts)
        batch = batch.select((batch["group_ids"] < self.num_groups).nonzero().squeeze(1))
        return batch, {"dapo/kept_groups": float(min(self.kept, self.num_groups)), "dapo/draws": float(self.draws)}


def renumber_groups(group_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Group ids 0.. in order of appearance, shifted by `offset` (kept groups of several draws stay distinct)."""
    _, inverse = torch.unique_consecutive(group_ids, return_inverse=True)
    return inverse + offset
