"""Balanced data parallelism: the rows of a batch ordered so that each data-parallel rank's contiguous share
(`Batch.split`) costs about the same, since the slowest rank sets the step time.

A row's cost is its tokens plus an attention term quadratic in its length (per layer, a transformer spends about
24 h^2 flops per token in its matmuls and 4 h L per token in attention: the ratio is L / 6h; h = 4096 here, so the
term matters for long rows only). Rows go, longest first, to the cheapest rank that still has room (each rank gets
exactly the row count `Batch.split` gives it, so nothing else changes): greedy longest-processing-time, within
4/3 of the best possible maximum.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

ATTENTION_TOKENS = 6 * 4096
"""Row length at which attention costs as much as the matmuls (6 x hidden size)."""


def row_cost(length: int) -> float:
    return length + length * length / ATTENTION_TOKENS


def balanced_partition(costs: Sequence[float], sizes: Sequence[int]) -> list[list[int]]:
    """Row indices per part: part i gets exactly sizes[i] rows, the largest part cost as small as the greedy finds."""
    if sum(sizes) != len(costs):
        raise ValueError(f"part sizes {list(sizes)} do not add up to {len(costs)} rows")
    parts: list[list[int]] = [[] for _ in sizes]
    heap = [(0.0, part) for part, size in enumerate(sizes) if size > 0]
    heapq.heapify(heap)
    for row in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, part = heapq.heappop(heap)
        parts[part].append(row)
        if len(parts[part]) < sizes[part]:
            heapq.heappush(heap, (load + costs[row], part))
    return [sorted(part) for part in parts]


def imbalance(costs: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """Largest part cost over the mean part cost (1.0: perfectly balanced)."""
    loads = [sum(costs[i] for i in part) for part in parts]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def dp_order(lengths: torch.Tensor, dp_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(order, inverse, metrics): `batch.select(order)` splits into balanced DP shares; results collected from the
    ranks in that order go back to the batch's order with `.select(inverse)`. Metrics: the imbalance (max / mean
    rank cost) with balancing and with the plain contiguous split."""
    costs = [row_cost(n) for n in lengths.tolist()]
    bounds = [len(costs) * i // dp_size for i in range(dp_size + 1)]
    sizes = [bounds[i + 1] - bounds[i] for i in range(dp_size)]
    parts = balanced_partition(costs, sizes)
    order = torch.tensor([row for part in parts for row in part], dtype=torch.long)
    contiguous = [range(bounds[i], bounds[i + 1]) for i in range(dp_size)]
    metrics = {
        "balance/dp_imbalance": imbalance(costs, parts),
        "balance/dp_imbalance_unbalanced": imbalance(costs, contiguous),
    }
    return order, torch.argsort(order), metrics


def balanced_for(batch, role, enabled: bool = True):
    """(batch in balanced order for `role`'s DP ranks, the inverse order or None, metrics); unchanged at DP=1."""
    dp_size = role.parallel_infos()[0].dp_size
    if not enabled or dp_size == 1:
        return batch, None, {}
    order, inverse, metrics = dp_order(batch.lengths, dp_size)
    return batch.select(order), inverse, metrics
