"""Token lists to a Batch and back: one layout for RL rollouts, SFT examples and preference pairs.

Row i of the batch is prompt_i followed by response_i, right-padded to the longest row (B samples, S columns):
`input_ids` [B, S] long (padding is `pad_id`), `attention_mask` [B, S] long (1 on prompt and response tokens),
`response_mask` [B, S] long (1 on response tokens). A per-token value of response token j (its log-prob, a version)
sits in the column of that token, len(prompt_i) + j, as megarl/data/batch.py says; prompt columns, column 0 and
padding hold 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.data.batch import Batch

TOKEN_FIELDS = ("input_ids", "attention_mask", "response_mask")


def make_rl_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_id: int,
    *,
    meta: dict[str, list[Any]] | None = None,
    **per_token: Sequence[Sequence[float] | torch.Tensor],
) -> Batch:
    """The batch of samples prompt_i + response_i, with per-token tensors aligned to input_ids.

    Each keyword in `per_token` (e.g. `rollout_logprobs=`) gives one value per response token of each sample;
    lists become float32, tensors keep their dtype. `meta` is per-sample metadata carried as it is.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    clashes = set(per_token) & set(TOKEN_FIELDS)
    if clashes:
        raise ValueError(f"per-token fields may not be named {sorted(clashes)}")
    num_samples = len(prompt_ids)
    prompt_lengths = [len(ids) for ids in prompt_ids]
    if any(length == 0 for length in prompt_lengths):
        # Column 0 has no log-prob; a response starting there would lose its first token's.
        raise ValueError("every sample needs at least one prompt token (e.g. BOS) before its response")
    ends = [length + len(ids) for length, ids in zip(prompt_lengths, response_ids)]
    width = max(ends, default=0)

    input_ids = torch.full((num_samples, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num_samples, width), dtype=torch.long)
    response_mask = torch.zeros((num_samples, width), dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, : ends[i]] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention_mask[i, : ends[i]] = 1
        response_mask[i, prompt_lengths[i] : ends[i]] = 1
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}

    for name, rows in per_token.items():
        if len(rows) != num_samples:
            raise ValueError(f"{name} has {len(rows)} rows for {num_samples} samples")
        values = [row if isinstance(row, torch.Tensor) else torch.tensor(row, dtype=torch.float32) for row in rows]
        dtype = values[0].dtype if values else torch.float32
        aligned = torch.zeros((num_samples, width), dtype=dtype)
        for i, row in enumerate(values):
            if row.shape != (len(response_ids[i]),):
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(row.shape)}; expected one value per response token "
                    f"({len(response_ids[i])})"
                )
            aligned[i, prompt_lengths[i] : ends[i]] = row
        tensors[name] = aligned
    return Batch(tensors, dict(meta or {}))


def prompt_tokens(batch: Batch, i: int) -> list[int]:
    """Sample i's prompt ids, as given to make_rl_batch."""
    prompt = batch["attention_mask"][i].bool() & ~batch["response_mask"][i].bool()
    return batch["input_ids"][i][prompt].tolist()


def response_tokens(batch: Batch, i: int) -> list[int]:
    """Sample i's response ids, as given to make_rl_batch."""
    return batch["input_ids"][i][batch["response_mask"][i].bool()].tolist()


def response_values(batch: Batch, name: str, i: int) -> torch.Tensor:
    """Sample i's per-token values of `name` on its response tokens (one per token, in order)."""
    return batch[name][i][batch["response_mask"][i].bool()]
