"""Advantage estimators: token rewards (and critic values, prompt groups) -> per-token advantages and returns.

Every estimator has the signature fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages_BS,
returns_BS) and is registered by name in ADVANTAGE_ESTIMATORS. Both outputs are 0 outside the response mask.
The controller runs them on the whole batch, so "batch statistics" below are global (no distributed reduction).

Conventions: token_rewards_BS holds the scalar reward on the last response token (and, with KL in the reward, a
penalty on every response token); the sequence score of outcome estimators is the sum of a sample's token rewards
over its response. Masked positions inside a response (e.g. tool output in multi-turn rollouts) are skipped by the
recursions: the next response token follows directly, with one discount step.

Shapes: B samples, S token positions, G prompt groups. Statistics are computed in at least float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algorithms.config import AdvantageConfig, KLConfig
from megarl.algorithms.kl import kl_estimate
from megarl.algorithms.registry import ADVANTAGE_ESTIMATORS
from megarl.errors import UserError


@dataclass
class AdvantageInputs:
    token_rewards_BS: torch.Tensor
    """Reward per token (0 outside the response)."""
    response_mask_BS: torch.Tensor
    """1 on response tokens (any dtype)."""
    group_ids_B: torch.Tensor | None = None
    """Which prompt each sample came from (long, any values); needed by the group estimators."""
    values_BS: torch.Tensor | None = None
    """Critic values V(state before token t), aligned with the tokens; needed by gae."""
    reward_baselines_B: torch.Tensor | None = None
    """The score of a greedy (temperature 0) response to each sample's prompt; needed by remax."""
    old_logprobs_BS: torch.Tensor | None = None
    """Log-probs of the sampled tokens under the policy that sampled them; needed by optimal_token_baseline."""
    sum_pi_squared_BS: torch.Tensor | None = None
    """sum over the vocabulary of pi(v)^2 at each token's position; needed by optimal_token_baseline."""


def compute_advantages(
    inputs: AdvantageInputs, config: AdvantageConfig, key: str = "algorithm.advantage.estimator"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named in `config` (advantages_BS, returns_BS)."""
    return ADVANTAGE_ESTIMATORS.get(config.estimator, key)(inputs, config)


# ---- helpers ---------------------------------------------------------------------------------------------------


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _mask(inputs: AdvantageInputs) -> torch.Tensor:
    return inputs.response_mask_BS.to(_float(inputs.token_rewards_BS).dtype)


def _scores_B(inputs: AdvantageInputs) -> torch.Tensor:
    return (_float(inputs.token_rewards_BS) * _mask(inputs)).sum(dim=1)


def _require(tensor: torch.Tensor | None, what: str, estimator: str) -> torch.Tensor:
    if tensor is None:
        raise UserError(f"advantage estimator {estimator!r} needs {what}, which the batch does not have")
    return tensor


def _group_index(group_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_B into 0..G-1, group sizes_G) for arbitrary group id values."""
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    return index_B, torch.bincount(index_B)


def group_mean_std(scores_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and unbiased (Bessel, n - 1) standard deviation of its group's scores; the std of a group of
    one is 0."""
    index_B, sizes_G = _group_index(group_ids_B)
    sizes_G = sizes_G.to(scores_B.dtype)
    sums_G = torch.zeros_like(sizes_G).index_add_(0, index_B, scores_B)
    mean_B = (sums_G / sizes_G)[index_B]
    squares_G = torch.zeros_like(sizes_G).index_add_(0, index_B, (scores_B - mean_B).square())
    std_G = (squares_G / (sizes_G - 1).clamp(min=1)).sqrt()
    return mean_B, std_G[index_B]


def masked_whiten(x_BS: torch.Tensor, mask_BS: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (unbiased std; 0 for a single entry); 0 outside the mask."""
    mask_BS = mask_BS.to(x_BS.dtype)
    count = mask_BS.sum()
    mean = (x_BS * mask_BS).sum() / count.clamp(min=1)
    std = (((x_BS - mean).square() * mask_BS).sum() / (count - 1).clamp(min=1)).sqrt()
    # std 0 means all entries are equal (or there is one): the result is exactly 0 whatever eps
    return torch.where(std > 0, (x_BS - mean) / (std + eps), 0.0) * mask_BS


def discounted_advantages(
    rewards_BS: torch.Tensor, values_BS: torch.Tensor, mask_BS: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE over the masked positions of each row, right to left: delta_t = r_t + gamma * V_next - V_t,
    A_t = delta_t + gamma * lam * A_next, where "next" is the next masked position (V_next = 0 and A_next = 0 after
    the last one). With values 0 and lam 1 this is the discounted return. 0 outside the mask."""
    mask_BS = mask_BS.bool()
    advantages_BS = torch.zeros_like(rewards_BS)
    num_rows = rewards_BS.shape[0]
    next_value_B = rewards_BS.new_zeros(num_rows)
    next_advantage_B = rewards_BS.new_zeros(num_rows)
    columns = mask_BS.any(dim=0).nonzero().flatten().tolist()  # host sync (once): loop only over response columns
    for t in reversed(columns):
        m_B = mask_BS[:, t]
        delta_B = rewards_BS[:, t] + gamma * next_value_B - values_BS[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages_BS[:, t] = torch.where(m_B, advantage_B, 0.0)
        next_advantage_B = torch.where(m_B, advantage_B, next_advantage_B)
        next_value_B = torch.where(m_B, values_BS[:, t], next_value_B)
    return advantages_BS


# ---- estimators ------------------------------------------------------------------------------------------------


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's generalized advantage estimation with a critic (Schulman et al. 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t over response tokens (V after the last token = 0),
    A_t = delta_t + gamma * lam * A_{t+1}, returns R_t = A_t + V_t (the critic's target, never whitened).
    With config.gae_whiten the advantages are then whitened over all response tokens of the batch.
    Leaves out: bootstrapping from a value after a truncated response (a cut-off response ends with V = 0).
    """
    mask_BS = _mask(inputs)
    values_BS = _float(_require(inputs.values_BS, "critic values", "gae")).to(mask_BS.dtype) * mask_BS
    rewards_BS = _float(inputs.token_rewards_BS) * mask_BS
    advantages_BS = discounted_advantages(rewards_BS, values_BS, mask_BS, config.gamma, config.lam)
    returns_BS = (advantages_BS + values_BS) * mask_BS
    if config.gae_whiten:
        advantages_BS = masked_whiten(advantages_BS, mask_BS, config.eps)
    return advantages_BS, returns_BS


def _broadcast(per_sample_B: torch.Tensor, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    advantages_BS = per_sample_B[:, None] * _mask(inputs)
    return advantages_BS, advantages_BS.clone()


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (DeepSeekMath): A_i = (s_i - mean_g) / (std_g + eps) on every response token, s_i the
    sum of sample i's token rewards, mean/std over its prompt group g. std is the unbiased (n - 1) one, as in verl,
    TRL and OpenRLHF; a group of one has std 0 and advantage 0. norm_by_std=False drops the division (Dr.GRPO).
    Leaves out: per-token (process) rewards, discounting. Returns = advantages."""
    scores_B = _scores_B(inputs)
    mean_B, std_B = group_mean_std(scores_B, _require(inputs.group_ids_B, "group_ids", "grpo"))
    centered_B = scores_B - mean_B
    if config.norm_by_std:  # a group with std 0 has all scores equal: advantage exactly 0 whatever eps
        centered_B = torch.where(std_B > 0, centered_B / (std_B + config.eps), 0.0)
    return _broadcast(centered_B, inputs)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = s_i - mean_g, no std normalization.
    Its other half, no length normalization, is the aggregation mode seq-mean-token-sum-norm. Returns = advantages."""
    scores_B = _scores_B(inputs)
    mean_B, _ = group_mean_std(scores_B, _require(inputs.group_ids_B, "group_ids", "dr_grpo"))
    return _broadcast(scores_B - mean_B, inputs)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): A_i = s_i - mean of the other samples' scores in its group
    = n / (n - 1) * (s_i - mean_g); a group of one gets 0. No std normalization. Returns = advantages."""
    scores_B = _scores_B(inputs)
    group_ids_B = _require(inputs.group_ids_B, "group_ids", "rloo")
    mean_B, _ = group_mean_std(scores_B, group_ids_B)
    index_B, sizes_G = _group_index(group_ids_B)
    sizes_B = sizes_G[index_B].to(scores_B.dtype)
    return _broadcast((scores_B - mean_B) * sizes_B / (sizes_B - 1).clamp(min=1), inputs)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262; also registered under verl's name reinforce_plus_plus): discounted
    returns G_t = r_t + gamma * G_{t+1} over response tokens, advantages =
    G whitened over all response tokens of the batch (global baseline, no critic, no groups). Returns = G."""
    mask_BS = _mask(inputs)
    rewards_BS = _float(inputs.token_rewards_BS) * mask_BS
    returns_BS = discounted_advantages(rewards_BS, torch.zeros_like(rewards_BS), mask_BS, config.gamma, 1.0)
    return masked_whiten(returns_BS, mask_BS, config.eps), returns_BS


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs, config: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262; also registered under verl's name
    reinforce_plus_plus_baseline): c_i = s_i - mean_g (group mean baseline) on every response token, then whitened over
    all response tokens of the batch. No discounting. Returns = c (before whitening)."""
    scores_B = _scores_B(inputs)
    mean_B, _ = group_mean_std(scores_B, _require(inputs.group_ids_B, "group_ids", "reinforce_pp_baseline"))
    centered_BS, _ = _broadcast(scores_B - mean_B, inputs)
    return masked_whiten(centered_BS, _mask(inputs), config.eps), centered_BS


# ---- KL as a reward penalty ------------------------------------------------------------------------------------


def apply_kl_penalty(
    token_rewards_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    ref_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: KLConfig,
    key: str = "algorithm.kl.estimator",
    coef: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_rewards - coef * kl_t on response tokens, kl_BS): KL(pi_old || pi_ref) per token as a reward penalty,
    with the estimator and clamp of `config`; `coef` (the adaptive controller's current value) replaces config.coef
    when given. kl_BS is 0 outside the mask, for logging and the controller."""
    mask_BS = response_mask_BS.to(_float(token_rewards_BS).dtype)
    kl_BS = kl_estimate(config.estimator, _float(old_logprobs_BS), _float(ref_logprobs_BS), config.clamp, key)
    kl_BS = torch.where(mask_BS.bool(), kl_BS.to(mask_BS.dtype), 0.0)
    return _float(token_rewards_BS) - (config.coef if coef is None else coef) * kl_BS, kl_BS
