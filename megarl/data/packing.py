"""Sequence packing: the samples of a micro-batch laid end to end in one row, no padding between them.

A packed micro-batch is Megatron's THD layout: token tensors [1, T] (T = the samples' real tokens, plus padding
at the end only where a fixed shape asks for it), `cu_seqlens` [n + 1] int32 (where each sample starts; padding is
a sample of its own), `position_ids` [1, T] counting from 0 in every sample and `sample_ends` [n] (each sample's
last token: a reward model's score). Attention never crosses a sample
boundary (Transformer Engine's THD kernels; on CPU megarl's SDPA core attention), RoPE restarts at each sample, so
every sample's numbers are those it would have alone in a padded batch.

Per-token tensors are those with the batch's token width as their second dimension; other tensors (one value per
row) keep one row per sample.

Shared prompts (GRPO's n samples of a prompt side by side): a row that begins with the same prompt tokens as the
row before it lays only what follows all but the last of them (`shared` tokens fewer); its attention reads the
shared tokens' keys and values from its root (the nearest row before it that lays all its tokens), and its RoPE
positions start at `shared`. Every response token is still predicted inside the row's own segment (the last
prompt token is laid again), and the numbers are those of the row alone. `segment_shared` [n] and `segment_root`
[n] (the root's sample index) say so; `position_ids` count from 0 in every segment, as without sharing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedPrefix:
    """A packed row's shared prompts, per sample (segment): tokens taken from the root, the root's sample index."""

    shared: torch.Tensor
    root: torch.Tensor


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


def shared_prompt_lengths(input_ids: torch.Tensor, lengths: Sequence[int], response_mask: torch.Tensor) -> list[int]:
    """For rows to be laid in this order: the leading tokens each row can take from its root instead of laying
    them again (0: the row is a root). A row shares all but the last of the prompt tokens it has in common with the
    row before it and, through it, with their root. It is a root itself when it has fewer than two in common, or
    fewer than the rows before it share with their root: a new prompt group (GRPO's next prompt after a common
    template such as "Q: What is") lays its whole prompt once rather than each of its samples the part after the
    template."""
    width = input_ids.shape[1]
    has_response = response_mask.bool().any(dim=1)
    prompt = torch.where(has_response, response_mask.bool().int().argmax(dim=1), torch.tensor(list(lengths)))
    limit = torch.minimum(prompt[1:], prompt[:-1])[:, None]
    same = (input_ids[1:] == input_ids[:-1]) & (torch.arange(width) < limit)
    common = same.int().cumprod(dim=1).sum(dim=1).tolist()  # tokens row i has in common with row i - 1
    shared, with_root = [0], None  # with_root: tokens the previous row has in common with its root
    for tokens in common:
        if with_root is not None and tokens < with_root:
            tokens = 0  # the row leaves its predecessors' prompt early: a root of its own group
        tokens = tokens if with_root is None else min(tokens, with_root)
        if tokens >= 2:
            shared.append(tokens - 1)
            with_root = tokens
        else:
            shared.append(0)
            with_root = None
    return shared


def pack_rows(
    tensors: dict[str, torch.Tensor],
    lengths: Sequence[int],
    width: int | None = None,
    multiple: int = 1,
    shared: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """The rows of `tensors` (right-padded, [r, S, ...]) packed into one row of their real tokens; padded at the
    end to `width` tokens when given, else to a multiple of `multiple` (sequence parallelism splits T by TP).
    shared: tokens each row takes from its root (`shared_prompt_lengths`), not laid again."""
    full = tensors["input_ids"].shape[1]
    skip = list(shared) if shared is not None else [0] * len(lengths)
    laid = [length - k for length, k in zip(lengths, skip)]
    total = sum(laid)
    target = width if width is not None else -(-total // multiple) * multiple
    if target < total:
        raise ValueError(f"packed width {target} is shorter than the {total} tokens of its samples")
    packed = {}
    # the laid tokens of every row, row after row: one indexing op per tensor (not one slice per row and tensor)
    columns = torch.arange(full)
    real = (columns < torch.tensor(list(lengths))[:, None]) & (columns >= torch.tensor(skip)[:, None])
    for name, t in tensors.items():
        if t.dim() >= 2 and t.shape[1] == full:
            row = t[real.to(t.device)]
            if target > total:
                row = torch.cat([row, row.new_zeros(target - total, *row.shape[1:])])
            packed[name] = row.unsqueeze(0)
        else:
            packed[name] = t
    bounds = [0, *torch.tensor(laid).cumsum(0).tolist()]
    if target > total:
        bounds.append(target)  # the padding: a sample of its own, attended by nobody else
    packed["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    packed["sample_ends"] = torch.tensor(bounds[1 : len(lengths) + 1]) - 1  # one per sample: its last token
    packed["position_ids"] = positions_in_samples(packed["cu_seqlens"], target).unsqueeze(0)
    if any(skip):
        roots = []
        for index, k in enumerate(skip):
            roots.append(index if k == 0 else roots[-1])
        padding = [0] * (len(bounds) - 1 - len(lengths))  # the padding sample shares nothing
        packed["segment_shared"] = torch.tensor(skip + padding)
        packed["segment_root"] = torch.tensor(roots + list(range(len(lengths), len(bounds) - 1)))
    return packed


def positions_in_samples(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's position within its sample [num_tokens] (on cu_seqlens' device, no host sync)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens.diff().long()
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts.repeat_interleave(
        lengths, output_size=num_tokens
    )


def unpacked_index(
    rows: Sequence[int], lengths: Sequence[int], shared: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, source) for every real token of batch rows `rows` (`lengths` tokens each, packed in that
    order): `padded[row, column] = packed[0, source]` unpacks a packed row in one op. With `shared` prompts a row's
    first `shared + 1` columns come from its root (the values the row would have alone; its own first laid token
    was predicted from the sample before it)."""
    sizes = torch.tensor(list(lengths))
    skip = torch.tensor(list(shared)) if shared is not None else torch.zeros_like(sizes)
    bounds = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    total = int(bounds[-1])
    sample = torch.arange(len(sizes)).repeat_interleave(sizes, output_size=total)
    columns = positions_in_samples(bounds, total)
    starts = torch.cat([sizes.new_zeros(1), (sizes - skip).cumsum(0)[:-1]])  # where each row's segment begins
    roots = torch.cummax(torch.where(skip == 0, torch.arange(len(sizes)), 0), dim=0).values
    k = skip[sample]
    source = torch.where(columns <= k, starts[roots][sample] + columns, starts[sample] + columns - k)
    return torch.tensor(list(rows)).repeat_interleave(sizes, output_size=total), columns, source


def packed_attention_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(index, samples, longest): token t of a packed row sits at `index[t]` of a [samples * longest] padded
    layout, sample by sample (megarl's CPU attention over packed rows runs on that layout)."""
    bounds = cu_seqlens.to("cpu", torch.long)
    lengths = bounds.diff()
    longest = int(lengths.max())
    sample = torch.arange(len(lengths)).repeat_interleave(lengths)
    return sample * longest + positions_in_samples(bounds, int(bounds[-1])), len(lengths), longest
