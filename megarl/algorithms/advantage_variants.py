"""More advantage estimators, under the names verl registers them with: grpo_passk, opo, remax, gpg,
optimal_token_baseline (reinforce_plus_plus and reinforce_plus_plus_baseline are advantages.py's reinforce_pp and
reinforce_pp_baseline under a second name).

Same signature and conventions as advantages.py (the ADVANTAGE_ESTIMATORS registry imports both modules at its
first lookup): fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages_BS, returns_BS), both 0
outside the response mask; a sample's score is the sum of its token rewards.

Shapes: B samples, S token positions, G prompt groups, K response-token index (the k-th response token of a sample).
"""

from __future__ import annotations

import torch

from megarl.algorithms.advantages import (
    AdvantageInputs,
    _broadcast,
    _float,
    _group_index,
    _mask,
    _require,
    _scores_B,
    discounted_advantages,
    group_mean_std,
)
from megarl.algorithms.config import AdvantageConfig
from megarl.algorithms.registry import ADVANTAGE_ESTIMATORS
from megarl.errors import UserError

_OTB_EPS = 1e-8  # keeps the optimal token baseline's division finite where every path weight is 0


def _group_sum(values_B: torch.Tensor, index_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    return values_B.new_zeros((num_groups, *values_B.shape[1:])).index_add_(0, index_B, values_B)


def _mean_or_zero_for_singletons(values_B: torch.Tensor, index_B: torch.Tensor, sizes_G: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean of `values_B`, 0 for a group of one (verl's convention for these estimators: the
    lone sample keeps its whole score as advantage)."""
    sums_G = _group_sum(values_B, index_B, len(sizes_G))
    means_G = torch.where(sizes_G > 1, sums_G / sizes_G.to(values_B.dtype), 0.0)
    return means_G[index_B]


def _reward_to_go(inputs: AdvantageInputs) -> torch.Tensor:
    """G_t = sum of the token rewards from t to the end of the response (no discount), 0 outside the mask."""
    mask_BS = _mask(inputs)
    rewards_BS = _float(inputs.token_rewards_BS) * mask_BS
    return discounted_advantages(rewards_BS, torch.zeros_like(rewards_BS), mask_BS, 1.0, 1.0)


@ADVANTAGE_ESTIMATORS.register("grpo_passk")
def grpo_passk(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using
    Reinforcement Learning", arXiv:2503.19595): only the best sample of each group learns, with advantage
    s_max - s_second (the gain of the best over the best of the rest), divided by std_g + eps when norm_by_std
    (unbiased std of the group's scores); every other sample gets 0. Ties: the first best sample in batch order.
    Needs at least 2 samples per group. Returns = advantages."""
    scores_B = _scores_B(inputs)
    index_B, sizes_G = _group_index(_require(inputs.group_ids_B, "group_ids", "grpo_passk"))
    if (sizes_G < 2).any():
        raise UserError(
            f"advantage estimator 'grpo_passk' needs at least 2 samples per prompt, got {int(sizes_G.min())}"
        )
    num_groups = len(sizes_G)
    best_G = scores_B.new_full((num_groups,), -torch.inf).scatter_reduce(0, index_B, scores_B, "amax")
    rows_B = torch.arange(len(scores_B), device=scores_B.device)
    at_best_B = scores_B == best_G[index_B]
    first_G = torch.full_like(sizes_G, len(scores_B)).scatter_reduce(
        0, index_B, torch.where(at_best_B, rows_B, len(scores_B)), "amin"
    )
    is_first_B = rows_B == first_G[index_B]
    rest_B = torch.where(is_first_B, -torch.inf, scores_B)
    second_G = scores_B.new_full((num_groups,), -torch.inf).scatter_reduce(0, index_B, rest_B, "amax")
    gain_B = torch.where(is_first_B, (best_G - second_G)[index_B], 0.0)
    if config.norm_by_std:
        _, std_B = group_mean_std(scores_B, inputs.group_ids_B)
        gain_B = torch.where(std_B > 0, gain_B / (std_B + config.eps), 0.0)
    return _broadcast(gain_B, inputs)


@ADVANTAGE_ESTIMATORS.register("opo")
def opo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585): the baseline is the
    length-weighted mean of the group's scores, b_g = sum_j L_j s_j / sum_j L_j (L_j: sample j's response tokens),
    the variance-minimizing baseline for a sequence-level reward; A_i = s_i - b_g on every response token. A group of
    one gets b = 0 (as verl). Returns = advantages."""
    scores_B = _scores_B(inputs)
    index_B, sizes_G = _group_index(_require(inputs.group_ids_B, "group_ids", "opo"))
    lengths_B = _mask(inputs).sum(dim=1)
    weighted_G = _group_sum(lengths_B * scores_B, index_B, len(sizes_G))
    total_length_G = _group_sum(lengths_B, index_B, len(sizes_G))
    baseline_G = torch.where((sizes_G > 1) & (total_length_G > 0), weighted_G / total_length_G.clamp(min=1), 0.0)
    return _broadcast(scores_B - baseline_G[index_B], inputs)


@ADVANTAGE_ESTIMATORS.register("remax")
def remax(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models", arXiv:2310.10505): the baseline is the score of the greedy response to the same prompt,
    b_i = reward(greedy response); A_t = G_t - b_i with G_t the reward-to-go (undiscounted sum of the token rewards
    from t on). Returns = G."""
    returns_BS = _reward_to_go(inputs)
    baselines_B = _float(_require(inputs.reward_baselines_B, "reward_baselines (greedy baseline scores)", "remax"))
    mask_BS = _mask(inputs)
    return (returns_BS - baselines_B.to(mask_BS.dtype)[:, None]) * mask_BS, returns_BS


@ADVANTAGE_ESTIMATORS.register("gpg")
def gpg(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546): A_i = alpha * (s_i - mean_g), no std normalization, with the batch correction
    alpha = B / M, M the number of samples with a non-zero score (verl's count; at least 1), which rescales the
    gradient when many samples carry no signal. A group of one has mean 0. Pair with the gpg policy loss.
    Returns = advantages."""
    scores_B = _scores_B(inputs)
    index_B, sizes_G = _group_index(_require(inputs.group_ids_B, "group_ids", "gpg"))
    alpha = len(scores_B) / max(int(torch.count_nonzero(scores_B)), 1)
    return _broadcast(alpha * (scores_B - _mean_or_zero_for_singletons(scores_B, index_B, sizes_G)), inputs)


def _compact(values_BS: torch.Tensor, mask_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values_BK, position_BS): the masked values of each row moved to the front (k = 0, 1, ...), 0-padded, and each
    masked token's k (-1 elsewhere)."""
    position_BS = torch.where(mask_BS, mask_BS.long().cumsum(dim=1) - 1, -1)
    width = max(int(mask_BS.sum(dim=1).max()), 1) if mask_BS.numel() else 1
    rows_BS = torch.arange(mask_BS.shape[0], device=mask_BS.device)[:, None].expand_as(mask_BS)
    values_BK = values_BS.new_zeros(mask_BS.shape[0], width)
    values_BK[rows_BS[mask_BS], position_BS[mask_BS]] = values_BS[mask_BS]
    return values_BK, position_BS


@ADVANTAGE_ESTIMATORS.register("optimal_token_baseline")
def optimal_token_baseline(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (verl's OTB; the minimum-variance baseline of the policy gradient, as in Weaver & Tao
    2001, "The Optimal Reward Baseline for Gradient-Based Reinforcement Learning", per token): one baseline per
    response-token index k and prompt group, b_k = sum_i G_i,k W_i,k / (sum_i W_i,k + 1e-8), over the group's samples
    that have a k-th token; G_i,k the reward-to-go, W_i,k = sum_{j <= k} (1 - 2 pi_j + sum_v pi(v)^2) the cumulative
    squared norm of the log-prob's gradient w.r.t. the logits (pi_j the sampled token's probability). A_i,k = G_i,k -
    b_k; a group of one gets b = 0. Returns = G. Leaves out verl's handle_zero_tail and rollout-IS options."""
    mask_BS = _mask(inputs).bool()
    returns_BS = _reward_to_go(inputs)
    old_BS = _float(_require(inputs.old_logprobs_BS, "old_logprobs", "optimal_token_baseline"))
    sum_sq_BS = _float(_require(inputs.sum_pi_squared_BS, "sum_pi_squared", "optimal_token_baseline"))
    step_weight_BS = torch.where(mask_BS, 1 - 2 * torch.exp(old_BS) + sum_sq_BS, 0.0).to(returns_BS.dtype)
    path_weight_BS = step_weight_BS.cumsum(dim=1)
    returns_BK, position_BS = _compact(returns_BS, mask_BS)
    weights_BK, _ = _compact(path_weight_BS, mask_BS)
    index_B, sizes_G = _group_index(_require(inputs.group_ids_B, "group_ids", "optimal_token_baseline"))
    num_groups = len(sizes_G)
    baseline_GK = _group_sum(returns_BK * weights_BK, index_B, num_groups) / (
        _group_sum(weights_BK, index_B, num_groups) + _OTB_EPS
    )
    baseline_GK = torch.where((sizes_G > 1)[:, None], baseline_GK, 0.0)
    baseline_BS = baseline_GK[index_B].gather(1, position_BS.clamp(min=0))
    return torch.where(mask_BS, returns_BS - baseline_BS, 0.0), returns_BS
