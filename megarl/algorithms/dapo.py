"""DAPO's data-side tricks (Yu et al. 2025): dynamic sampling and overlong reward shaping.

The other two DAPO ingredients are settings elsewhere: clip-higher (policy_loss.clip_high, e.g. 0.28) and token-level
aggregation (policy_loss.aggregation=token-mean). The resampling loop of dynamic sampling is the trainer's; this module
only decides which groups to keep.

Shapes: B samples, S token positions.
"""

from __future__ import annotations

import torch

from megarl.algorithms.config import DapoConfig


def keep_groups(scores_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(keep_B, num_kept_groups): keep_B is True for samples whose prompt group has at least two different scores.
    A group whose scores are all equal (all correct, all wrong, or of size one) has zero group-relative advantage
    and no gradient signal. Scores are compared exactly (no tolerance)."""
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(index_B.max()) + 1 if index_B.numel() else 0  # host sync: the trainer needs the count anyway
    scores_B = scores_B.detach()
    high_G = scores_B.new_full((num_groups,), -torch.inf).scatter_reduce(0, index_B, scores_B, "amax")
    low_G = scores_B.new_full((num_groups,), torch.inf).scatter_reduce(0, index_B, scores_B, "amin")
    kept_G = high_G > low_G
    return kept_G[index_B], int(kept_G.sum())  # host sync (deliberate): the sampling loop branches on it


def overlong_penalty(
    response_lengths_B: torch.Tensor, max_response_len: int, buffer_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (a value <= 0 to add to the reward), with L_max = max_response_len,
    L_cache = buffer_len and |y| the response length:
        0                                     if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
        -1                                    if |y| > L_max
    times `penalty`. buffer_len 0 turns it off (all zeros)."""
    lengths_B = response_lengths_B.to(torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths_B)
    excess_B = (lengths_B - (max_response_len - buffer_len)) / buffer_len
    return -penalty * excess_B.clamp(0.0, 1.0)


def add_to_last_token(
    token_rewards_BS: torch.Tensor, response_mask_BS: torch.Tensor, values_B: torch.Tensor
) -> torch.Tensor:
    """token_rewards with values_B added on each sample's last response token (rows without one are unchanged)."""
    mask_BS = response_mask_BS.bool()
    positions_BS = torch.arange(mask_BS.shape[1], device=mask_BS.device).expand_as(mask_BS)
    last_B = torch.where(mask_BS, positions_BS, -1).max(dim=1).values
    has_response_B = last_B >= 0
    added_BS = torch.zeros_like(token_rewards_BS)
    rows_B = torch.arange(mask_BS.shape[0], device=mask_BS.device)
    added_BS[rows_B, last_B.clamp(min=0)] = torch.where(has_response_B, values_B.to(token_rewards_BS.dtype), 0.0)
    return token_rewards_BS + added_BS


def apply_overlong_penalty(
    token_rewards_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: DapoConfig,
    max_response_len: int,
    response_lengths_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(shaped token_rewards_BS, penalty_B): the overlong penalty of `config` added on the last response token.
    max_response_len is config.max_response_len or, when that is None, the caller's (rollout max_new_tokens);
    lengths default to the number of response tokens per row."""
    if response_lengths_B is None:
        response_lengths_B = response_mask_BS.to(torch.long).sum(dim=1)
    length = config.max_response_len if config.max_response_len is not None else max_response_len
    penalty_B = overlong_penalty(response_lengths_B, length, config.overlong_buffer_len, config.overlong_penalty)
    return add_to_last_token(token_rewards_BS, response_mask_BS, penalty_B), penalty_B
