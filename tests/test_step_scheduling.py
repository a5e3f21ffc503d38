"""How an RL step orders its work: seeds of every generate round, mini-batches of every PPO epoch."""

from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.trainer.loops.rl_steps import mini_batches
from megarl.trainer.rollout_side.rollout_step import draw_key, request_seed


def test_draw_keys_never_repeat_across_steps():
    # The old key step * 1000 + draw gave step 1, draw 0 the seeds of step 0, draw 1000.
    keys = {draw_key(step, draw) for step in range(4) for draw in (0, 1, 999, 1000, 1001, 5000)}
    assert len(keys) == 4 * 6
    assert request_seed(7, draw_key(1, 0), 0) != request_seed(7, draw_key(0, 1000), 0)


def _groups_batch(num_groups: int, per_group: int) -> Batch:
    group_ids = torch.arange(num_groups).repeat_interleave(per_group)
    return Batch({"group_ids": group_ids, "row": torch.arange(num_groups * per_group)})


def _groups_of(minis: list[Batch]) -> list[list[int]]:
    return [torch.unique_consecutive(m["group_ids"]).tolist() for m in minis]


def test_mini_batches_in_order_without_a_seed():
    minis = list(mini_batches(_groups_batch(6, 2), 3))
    assert _groups_of(minis) == [[0, 1], [2, 3], [4, 5]]
    assert minis[0]["row"].tolist() == [0, 1, 2, 3]


def test_mini_batches_reshuffled_per_seed_with_whole_groups():
    batch = _groups_batch(8, 3)
    first = _groups_of(list(mini_batches(batch, 4, seed=1)))
    again = _groups_of(list(mini_batches(batch, 4, seed=1)))
    other = _groups_of(list(mini_batches(batch, 4, seed=2)))
    assert first == again  # reproducible from the seed
    assert first != other  # each epoch (seed) its own order
    for groups in (first, other):
        assert sorted(g for mini in groups for g in mini) == list(range(8))  # every group exactly once
        assert all(len(mini) == 2 for mini in groups)
    for mini in mini_batches(batch, 4, seed=1):  # whole groups, rows in batch order
        rows = mini["row"].tolist()
        assert rows == sorted(rows) and len(rows) == 6
        assert all((mini["group_ids"] == g).sum() == 3 for g in mini["group_ids"].unique())


def test_one_mini_batch_is_the_whole_batch_in_order():
    batch = _groups_batch(4, 2)
    (only,) = mini_batches(batch, 1, seed=3)
    assert only["row"].tolist() == list(range(8))


# ---- balanced data parallelism ----------------------------------------------------------------------------------


def test_balanced_partition_on_adversarial_lengths():
    from megarl.trainer.loops.dp_balance import balanced_partition, dp_order, imbalance, row_cost

    # Sorted lengths: the contiguous split gives one rank every long row.
    lengths = [4000, 3900, 3800, 3700, 100, 90, 80, 70]
    costs = [row_cost(n) for n in lengths]
    parts = balanced_partition(costs, [4, 4])
    assert sorted(len(p) for p in parts) == [4, 4]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert imbalance(costs, parts) < 1.01
    assert imbalance(costs, [range(4), range(4, 8)]) > 1.8
    # One giant row and many small ones: the giant row's rank gets nothing else it does not need.
    lengths = [8000] + [100] * 7
    order, inverse, metrics = dp_order(torch.tensor(lengths), 2)
    assert sorted(order.tolist()) == list(range(8))
    assert order[inverse].tolist() == list(range(8))  # results go back to the batch's order
    first_rank = order[:4].tolist()
    assert (0 in first_rank) and metrics["balance/dp_imbalance"] <= metrics["balance/dp_imbalance_unbalanced"]
    # Shares keep Batch.split's row counts (7 rows over 3 ranks: 2, 2, 3).
    parts = balanced_partition([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0], [2, 2, 3])
    assert [len(p) for p in parts] == [2, 2, 3]
    loads = sorted(sum([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0][i] for i in p) for p in parts)
    assert loads == [3.0, 6.0, 10.0]  # 9 + 1 | 5 + 1 | 1 + 1 + 1: the largest (10) cannot be avoided


def test_step_metrics_reduce_sums_and_maxima():
    from megarl.workers.train_step import _final

    assert _final("actor/pg_loss", 3.0, 4.0) == 0.75  # weighted sum / weight
    assert _final("loss", 3.0, 4.0) == 3.0  # the loss is already the mini-batch's objective
    assert _final("mismatch/abs_logprob_diff_max", 0.25, 1.0) == 0.25
    assert _final("mismatch/abs_logprob_diff_max", float("-inf"), 1.0) == 0.0  # no weighted token: 0, not -inf
