"""Sequence packing: the samples of a micro-batch laid end to end in one row, no padding between them.

A packed micro-batch is Megatron's THD layout: token tensors [1, T] (T = the samples' real tokens, plus padding
at the end only where a fixed shape asks for it), `cu_seqlens` [n + 1] int32 (where each sample starts; padding is
a sample of its own), `position_ids` [1, T] counting from 0 in every sample and `sample_ends` [n] (each sample's
last token: a reward model's score). Attention never crosses a sample
boundary (Transformer Engine's THD kernels; on CPU megarl's SDPA core attention), RoPE restarts at each sample, so
every sample's numbers are those it would have alone in a padded batch.

Per-token tensors are those with the batch's token width as their second dimension; other tensors (one value per
row) keep one row per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive sample indices grouped so each group's total tokens stay within `max_tokens` (a longer sample
    gets a group of its own). Order is kept: the sums over a step are reproducible."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    groups: list[list[int]] = []
    total = 0
    for index, length in enumerate(lengths):
        if groups and total + length <= max_tokens:
            groups[-1].append(index)
            total += length
        else:
            groups.append([index])
            total = length
    return groups


def pack_rows(
    tensors: dict[str, torch.Tensor], lengths: Sequence[int], width: int | None = None, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """The rows of `tensors` (right-padded, [r, S, ...]) packed into one row of their real tokens; padded at the
    end to `width` tokens when given, else to a multiple of `multiple` (sequence parallelism splits T by TP)."""
    full = tensors["input_ids"].shape[1]
    total = sum(lengths)
    target = width if width is not None else -(-total // multiple) * multiple
    if target < total:
        raise ValueError(f"packed width {target} is shorter than the {total} tokens of its samples")
    packed = {}
    # the real tokens of every row, row after row: one indexing op per tensor (not one slice per row and tensor)
    real = torch.arange(full) < torch.tensor(list(lengths))[:, None]
    for name, t in tensors.items():
        if t.dim() >= 2 and t.shape[1] == full:
            row = t[real.to(t.device)]
            if target > total:
                row = torch.cat([row, row.new_zeros(target - total, *row.shape[1:])])
            packed[name] = row.unsqueeze(0)
        else:
            packed[name] = t
    bounds = [0, *torch.tensor(list(lengths)).cumsum(0).tolist()]
    if target > total:
        bounds.append(target)  # the padding: a sample of its own, attended by nobody else
    packed["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    packed["sample_ends"] = torch.tensor(bounds[1 : len(lengths) + 1]) - 1  # one per sample: its last token
    packed["position_ids"] = positions_in_samples(packed["cu_seqlens"], target).unsqueeze(0)
    return packed


def positions_in_samples(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's position within its sample [num_tokens] (on cu_seqlens' device, no host sync)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens.diff().long()
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts.repeat_interleave(
        lengths, output_size=num_tokens
    )


def unpacked_index(rows: Sequence[int], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in the right-padded batch of each token of a packed row whose samples are batch rows `rows`
    with `lengths` real tokens: `padded[row, column] = packed[0, :T]` unpacks it in one op."""
    sizes = torch.tensor(list(lengths))
    bounds = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    total = int(bounds[-1])
    return torch.tensor(list(rows)).repeat_interleave(sizes, output_size=total), positions_in_samples(bounds, total)


def packed_attention_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(index, samples, longest): token t of a packed row sits at `index[t]` of a [samples * longest] padded
    layout, sample by sample (megarl's CPU attention over packed rows runs on that layout)."""
    bounds = cu_seqlens.to("cpu", torch.long)
    lengths = bounds.diff()
    longest = int(lengths.max())
    sample = torch.arange(len(lengths)).repeat_interleave(lengths)
    return sample * longest + positions_in_samples(bounds, int(bounds[-1])), len(lengths), longest
