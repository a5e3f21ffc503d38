"""Per-token policy-gradient surrogates (the PPO family), registered by name in POLICY_LOSSES.

Signature: fn(logprobs_BS, old_logprobs_BS, advantages_BS, response_mask_BS, config: PolicyLossConfig)
-> (per_token_loss_BS, metrics), with `logprobs_BS` carrying the gradient. The loss is a loss (to minimize): the
negative surrogate. It is 0 outside the response mask; metrics are detached per-token tensors [B, S] (0 outside the
mask) that the worker averages with the loss weights. Aggregation over tokens is not done here (aggregation.py).

Log-ratios are 0 at masked positions before exp (so that padding log-probs cannot make inf or NaN gradients) and
clamped to [-20, 20].

Shapes: B samples, S token positions.
"""

from __future__ import annotations

import torch

from megarl.algorithms.config import PolicyLossConfig
from megarl.algorithms.registry import POLICY_LOSSES

MAX_LOG_RATIO = 20.0

Metrics = dict[str, torch.Tensor]


def masked(x_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """x where the mask is set, 0 elsewhere (the gradient of x flows only through masked-in positions)."""
    return torch.where(mask_BS, x_BS, 0.0)


def clipped_surrogate(
    ratio_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)); with dual_clip c, where A < 0 the loss is
    min(loss, -A * c) (Ye et al. 2020), which bounds the loss of very large ratios on negative advantages."""
    advantages_BS = masked(advantages_BS.to(ratio_BS.dtype), mask_BS)
    unclipped_BS = -advantages_BS * ratio_BS
    clipped_BS = -advantages_BS * ratio_BS.clamp(1 - clip_low, 1 + clip_high)
    loss_BS = torch.maximum(unclipped_BS, clipped_BS)
    metrics = {"clip_frac": masked((clipped_BS > unclipped_BS).to(ratio_BS.dtype), mask_BS)}
    if dual_clip is not None:
        cap_BS = -advantages_BS * dual_clip
        dual_BS = (advantages_BS < 0) & (loss_BS > cap_BS)
        loss_BS = torch.where(dual_BS, cap_BS, loss_BS)
        metrics["dual_clip_frac"] = masked(dual_BS.to(ratio_BS.dtype), mask_BS)
    metrics["ratio"] = masked(ratio_BS.detach(), mask_BS)
    return masked(loss_BS, mask_BS), metrics


def approx_kl(log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi_theta) on tokens sampled from pi_old: r - 1 - log r, r = pi_theta / pi_old."""
    log_ratio_BS = log_ratio_BS.detach()
    return masked(torch.exp(log_ratio_BS) - 1 - log_ratio_BS, mask_BS)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with a token-level ratio r_t = exp(logp_t - old_logp_t):
    loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high)), asymmetric bounds allowed (DAPO
    clip-higher), optional dual clip for A_t < 0. Leaves out: KL and entropy terms (added by PolicyLoss) and
    off-policy weights (off_policy.py)."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = masked(logprobs_BS - old_logprobs_BS, mask_BS).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    loss_BS, metrics = clipped_surrogate(
        torch.exp(log_ratio_BS), advantages_BS, mask_BS, config.clip_low, config.clip_high, config.dual_clip
    )
    metrics["approx_kl"] = approx_kl(log_ratio_BS, mask_BS)
    return loss_BS, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025), token form ("GSPO-token"): sequence ratio s_i = exp(mean over sample i's response
    tokens of (logp - old_logp)), per token s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient
    s_i * grad logp_t), loss_t = max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - clip_low, 1 + clip_high)). Clipping is
    decided per sequence. With seq-mean-token-mean aggregation and one advantage per sequence the gradient equals
    the sequence-level GSPO gradient. The paper's clip ranges are tiny (about 3e-4 / 4e-4). Leaves out: dual clip.
    """
    mask_BS = response_mask_BS.bool()
    mask_f_BS = mask_BS.to(logprobs_BS.dtype)
    log_ratio_BS = masked(logprobs_BS - old_logprobs_BS, mask_BS)
    seq_log_ratio_B = log_ratio_BS.sum(dim=1) / mask_f_BS.sum(dim=1).clamp(min=1)
    seq_log_ratio_B = seq_log_ratio_B.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_log_ratio_BS = seq_log_ratio_B[:, None] + masked(logprobs_BS - logprobs_BS.detach(), mask_BS)
    loss_BS, metrics = clipped_surrogate(
        torch.exp(token_log_ratio_BS), advantages_BS, mask_BS, config.clip_low, config.clip_high
    )
    metrics["approx_kl"] = approx_kl(log_ratio_BS.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), mask_BS)
    return loss_BS, metrics
