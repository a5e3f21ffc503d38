"""Micro-batches by a token budget (dynamic batch size) instead of a fixed number of samples.

Cost follows padded tokens: a micro-batch of r samples whose longest has n tokens costs r x n. Samples are kept in
order (results and gradients do not depend on the grouping, but float sums are reproducible this way).
"""

from __future__ import annotations

from collections.abc import Sequence


def token_budget_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive sample indices grouped so rows x longest row stays within `max_tokens` (a sample longer than the
    budget gets a group of its own)."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    groups: list[list[int]] = []
    longest = 0
    for index, length in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, length) <= max_tokens:
            groups[-1].append(index)
            longest = max(longest, length)
        else:
            groups.append([index])
            longest = length
    return groups


def fixed_shape_groups(num_samples: int, width: int, max_tokens: int) -> list[list[int]]:
    """Groups of equal row count for pipeline parallelism, where every micro-batch of a call has one shape
    [rows, width]: as many rows as the budget allows at that width."""
    rows = max(1, max_tokens // max(width, 1))
    return [list(range(start, min(start + rows, num_samples))) for start in range(0, num_samples, rows)]
