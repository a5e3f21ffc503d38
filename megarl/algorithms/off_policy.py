"""Off-policy corrections for rollouts from a lagging or numerically different engine (async RL).

Three policies meet here: pi_behav, the engine that sampled the tokens (`rollout_logprobs`); pi_prox, the trainer's
policy before this update (`old_logprobs`, recomputed by the actor); pi_theta, the policy being trained. The PPO
surrogate is taken w.r.t. pi_prox; each correction returns a detached per-token weight that multiplies it, a
function of the ratio rho = pi_prox / pi_behav:
- token level: rho_t = exp(old_t - rollout_t);
- sequence level: rho_i = exp(sum over sample i's response tokens of (old_t - rollout_t)), shared by its tokens.

Signature: fn(old_logprobs_BS, rollout_logprobs_BS, response_mask_BS, config: OffPolicyConfig) -> (weights_BS or
None, metrics); weights are 0 outside the mask. Metrics are detached per-token tensors: is_weight, is_clipped
(tis), is_masked (mis) and rollout_kl, a k3 estimate of KL(pi_behav || pi_prox) per token (the training-inference
mismatch).

Shapes: B samples, S token positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megarl.algorithms.config import OffPolicyConfig
from megarl.algorithms.registry import OFF_POLICY_CORRECTIONS

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: the largest uncapped weight (decoupled), so that sums of log-ratios stay finite

Metrics = dict[str, torch.Tensor]


def _token_log_ratio(log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return log_ratio_BS


def _sequence_log_ratio(log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BS, log_ratio_BS.sum(dim=1, keepdim=True).expand_as(log_ratio_BS), 0.0)


LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}
"""log rho per token from the token log-ratios, by OffPolicyConfig.level (config.OFF_POLICY_LEVELS names them)."""


def _log_rho(
    old_logprobs_BS: torch.Tensor, rollout_logprobs_BS: torch.Tensor, mask_BS: torch.Tensor, level: str
) -> tuple[torch.Tensor, Metrics]:
    """(log rho_BS at the configured level, {"rollout_kl": ...}), detached, 0 outside the mask."""
    token_log_ratio_BS = torch.where(mask_BS, _float(old_logprobs_BS - rollout_logprobs_BS).detach(), 0.0)
    rollout_kl_BS = torch.exp(token_log_ratio_BS.clamp(max=_MAX_LOG_RATIO)) - 1 - token_log_ratio_BS
    return LEVELS[level](token_log_ratio_BS, mask_BS), {"rollout_kl": torch.where(mask_BS, rollout_kl_BS, 0.0)}


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


@OFF_POLICY_CORRECTIONS.register("none")
def no_correction(
    old_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor | None,
    response_mask_BS: torch.Tensor,
    config: OffPolicyConfig,
) -> tuple[torch.Tensor | None, Metrics]:
    """No correction: the rollout is treated as sampled from pi_prox (on-policy or stale without correction)."""
    return None, {}


@OFF_POLICY_CORRECTIONS.register("tis")
def truncated_is(
    old_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: OffPolicyConfig,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"): weight = min(rho, C), C = config.clip. Biased (the truncated mass is dropped), bounded variance.
    is_clipped is 1 where rho > C."""
    mask_BS = response_mask_BS.bool()
    log_rho_BS, metrics = _log_rho(old_logprobs_BS, rollout_logprobs_BS, mask_BS, config.level)
    log_cap = _log(config.clip)
    weights_BS = torch.where(mask_BS, torch.exp(log_rho_BS.clamp(max=log_cap)), 0.0)
    metrics["is_weight"] = weights_BS
    metrics["is_clipped"] = (mask_BS & (log_rho_BS > log_cap)).to(weights_BS.dtype)
    return weights_BS, metrics


@OFF_POLICY_CORRECTIONS.register("mis")
def masked_is(
    old_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: OffPolicyConfig,
) -> tuple[torch.Tensor, Metrics]:
    """Masked importance sampling (as in IcePop / "When speed kills stability"): weight = rho where
    low <= rho <= high, else 0, so tokens (or whole sequences, at level=sequence) with an extreme mismatch are
    dropped from the policy gradient instead of truncated. Kept tokens keep their IS weight. is_masked is 1 where
    the weight was zeroed."""
    mask_BS = response_mask_BS.bool()
    log_rho_BS, metrics = _log_rho(old_logprobs_BS, rollout_logprobs_BS, mask_BS, config.level)
    log_low, log_high = _log(config.low), _log(config.high)
    kept_BS = mask_BS & (log_rho_BS >= log_low) & (log_rho_BS <= log_high)
    weights_BS = torch.where(kept_BS, torch.exp(log_rho_BS.clamp(log_low, log_high)), 0.0)
    metrics["is_weight"] = weights_BS
    metrics["is_masked"] = (mask_BS & ~kept_BS).to(weights_BS.dtype)
    return weights_BS, metrics


@OFF_POLICY_CORRECTIONS.register("decoupled")
def decoupled(
    old_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: OffPolicyConfig,
) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO (Hilton et al. 2022; AReaL): loss_t = -sg(pi_prox / pi_behav) * min(r_t A_t, clip(r_t) A_t)
    with r_t = pi_theta / pi_prox: the clipped surrogate around the proximal policy, weighted by the uncapped
    behavior ratio rho (log rho clamped to 20 only to stay finite). Unbiased but unbounded: use tis for a capped
    weight, mis to drop extreme tokens."""
    mask_BS = response_mask_BS.bool()
    log_rho_BS, metrics = _log_rho(old_logprobs_BS, rollout_logprobs_BS, mask_BS, config.level)
    weights_BS = torch.where(mask_BS, torch.exp(log_rho_BS.clamp(max=_MAX_LOG_RATIO)), 0.0)
    metrics["is_weight"] = weights_BS
    return weights_BS, metrics


def off_policy_weights(
    old_logprobs_BS: torch.Tensor,
    rollout_logprobs_BS: torch.Tensor | None,
    response_mask_BS: torch.Tensor,
    config: OffPolicyConfig,
    key: str = "algorithm.off_policy.mode",
) -> tuple[torch.Tensor | None, Metrics]:
    """The weights of the correction named by config.mode (None for mode none)."""
    return OFF_POLICY_CORRECTIONS.get(config.mode, key)(old_logprobs_BS, rollout_logprobs_BS, response_mask_BS, config)
