"""Micro-batches of one rank's batch as the schedules need them: trimmed token-budget groups, or (pipelines without
variable shapes, MoE's allgather dispatcher) one shape per call, padded with zero-weight rows only as far as the
largest group, never to the budget's row count."""

from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.workers.schedule import ScheduleShape, split_micro_batches


def batch_of(lengths: list[int], width: int = 8) -> Batch:
    rows = len(lengths)
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return Batch(
        {
            "input_ids": torch.arange(rows * width).view(rows, width) * attention,
            "attention_mask": attention,
            "loss_weights": attention.float(),
        }
    )


def test_token_budget_groups_are_trimmed_to_their_longest_row():
    micro = split_micro_batches(batch_of([5, 3, 4, 2]), max_tokens=10)  # 2 rows x 5 tokens, then 2 x 4
    assert [mb.rows for mb in micro] == [[0, 1], [2, 3]]
    assert [tuple(mb.tensors["input_ids"].shape) for mb in micro] == [(2, 5), (2, 4)]


def test_fixed_shape_pads_to_the_largest_group_not_to_the_budget():
    fixed = ScheduleShape(fixed_shape=True)
    # A budget of 1000 tokens at width 5 allows 200 rows; the rank has 3: one micro-batch of 3 rows, no padding.
    (only,) = split_micro_batches(batch_of([5, 3, 4]), max_tokens=1000, shape=fixed)
    assert only.rows == [0, 1, 2] and only.tensors["input_ids"].shape == (3, 5)
    # A budget of 10 tokens: groups of 2 rows; the last (1 row) gets one zero-weight row.
    micro = split_micro_batches(batch_of([5, 3, 4]), max_tokens=10, shape=fixed)
    assert [mb.rows for mb in micro] == [[0, 1], [2]]
    assert all(mb.tensors["input_ids"].shape == (2, 5) for mb in micro)
    assert micro[1].tensors["loss_weights"][1].sum() == 0  # the padding row weighs nothing


def test_interleaved_pipelines_get_a_multiple_of_the_pipeline_size():
    micro = split_micro_batches(batch_of([5, 3, 4]), max_tokens=5, shape=ScheduleShape(multiple_of=2))
    assert len(micro) == 4 and micro[-1].rows == []  # three real micro-batches and one filler
    assert micro[-1].tensors["loss_weights"].sum() == 0
