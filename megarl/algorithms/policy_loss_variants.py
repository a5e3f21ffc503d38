"""More per-token policy losses, under the names verl registers them with (so that a verl config maps by name):
sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl, dro.

Same signature and conventions as policy_loss.py (the POLICY_LOSSES registry imports both modules at its first
lookup): fn(logprobs_BS, old_logprobs_BS, advantages_BS, response_mask_BS, config: PolicyLossConfig)
-> (per_token_loss_BS, metrics); the loss is 0 outside the mask and aggregation is aggregation.py's. Where a loss
holds a batch statistic (clip_cov, kl_cov: a covariance over tokens), the batch is what one call sees: one
micro-batch on one data-parallel rank, as in verl.

Shapes: B samples, S token positions.
"""

from __future__ import annotations

import torch

from megarl.algorithms.config import PolicyLossConfig
from megarl.algorithms.policy_loss import MAX_LOG_RATIO, Metrics, approx_kl, clipped_surrogate, masked
from megarl.algorithms.registry import POLICY_LOSSES

_BINARY_KL_EPS = 1e-8  # keeps log(1 - p) finite for tokens of probability ~1 (dppo_kl)


def _log_ratio(logprobs_BS: torch.Tensor, old_logprobs_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """logp - old_logp, 0 outside the mask, clamped to [-20, 20] (carries the gradient of logp)."""
    return masked(logprobs_BS - old_logprobs_BS, mask_BS).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _ratio_metrics(log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor) -> Metrics:
    return {"ratio": masked(torch.exp(log_ratio_BS.detach()), mask_BS), "approx_kl": approx_kl(log_ratio_BS, mask_BS)}


@POLICY_LOSSES.register("sapo")
def sapo(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate instead of a
    hard clip. r_t = exp(logp_t - old_logp_t), tau = tau_pos where A_t > 0 else tau_neg,
    gate f(r) = sigmoid(tau * (r - 1)) * 4 / tau, loss_t = -f(r_t) * A_t. At r = 1 the gradient equals the policy
    gradient -A_t * grad logp_t; it fades (never drops to 0 at once) as r leaves 1, faster for larger tau. The paper
    pairs it with seq-mean-token-mean aggregation (verl forces that mode; here it is policy_loss.aggregation)."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    tau_BS = torch.full_like(advantages_BS, config.tau_neg).masked_fill(advantages_BS > 0, config.tau_pos)
    gate_BS = torch.sigmoid(tau_BS * (torch.exp(log_ratio_BS) - 1)) * (4.0 / tau_BS)
    return masked(-gate_BS * advantages_BS, mask_BS), _ratio_metrics(log_ratio_BS, mask_BS)


@POLICY_LOSSES.register("gpg")
def gpg(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546): the plain policy gradient, loss_t = -A_t * logp_t, with no ratio and no clip (old log-probs
    only feed the metrics). Paired with the gpg advantage estimator in the paper."""
    mask_BS = response_mask_BS.bool()
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    loss_BS = -advantages_BS * masked(logprobs_BS, mask_BS)
    return masked(loss_BS, mask_BS), _ratio_metrics(_log_ratio(logprobs_BS, old_logprobs_BS, mask_BS), mask_BS)


def _centered_covariance(advantages_BS: torch.Tensor, logprobs_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """(A_t - mean A) * (logp_t - mean logp), means over the masked tokens, detached; 0 outside the mask."""
    count = mask_BS.sum().clamp(min=1)
    logprobs_BS = masked(logprobs_BS.detach(), mask_BS)
    mean_advantage = advantages_BS.sum() / count
    mean_logprob = logprobs_BS.sum() / count
    return masked((advantages_BS - mean_advantage) * (logprobs_BS - mean_logprob), mask_BS)


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617): the PPO clipped loss, except that a few tokens with a large covariance between advantage and
    log-prob (the tokens that drive entropy down) get no gradient. cov_t = (A_t - mean A)(logp_t - mean logp) over
    the batch's tokens; among the tokens that the PPO clip left unclipped and whose cov_t lies in
    (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * tokens)) are drawn at random (torch's global generator)
    and their loss is set to 0. Metrics: clip_frac counts those tokens (PPO's own clipping is not counted)."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    loss_BS, metrics = clipped_surrogate(
        torch.exp(log_ratio_BS), advantages_BS, mask_BS, config.clip_low, config.clip_high
    )
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    cov_BS = _centered_covariance(advantages_BS, logprobs_BS, mask_BS)
    candidates_BS = (
        mask_BS & (metrics["clip_frac"] == 0) & (cov_BS > config.clip_cov_lb) & (cov_BS < config.clip_cov_ub)
    )
    positions = candidates_BS.flatten().nonzero().squeeze(1)
    num_chosen = max(int(config.clip_cov_ratio * int(mask_BS.sum())), 1)
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:num_chosen]]
    detached_BS = torch.zeros_like(mask_BS).flatten().index_fill(0, chosen, True).view_as(mask_BS)
    metrics["clip_frac"] = detached_BS.to(loss_BS.dtype)
    metrics["approx_kl"] = approx_kl(log_ratio_BS, mask_BS)
    return torch.where(detached_BS, 0.0, loss_BS), metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, as clip_cov): no clip; loss_t = -A_t * r_t, and on the
    max(1, int(kl_cov_ratio * tokens)) tokens of largest covariance cov_t = (A_t - mean A)(logp_t - mean logp)
    a KL penalty is added: loss_t += ppo_kl_coef * |logp_t - old_logp_t|. Metrics: kl_cov_frac (the penalized
    tokens)."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    cov_BS = _centered_covariance(advantages_BS, logprobs_BS, mask_BS)
    num_tokens = int(mask_BS.sum())
    num_chosen = min(max(int(num_tokens * config.kl_cov_ratio), 1), num_tokens)
    top = torch.where(mask_BS, cov_BS, -torch.inf).flatten().topk(num_chosen).indices
    penalized_BS = torch.zeros_like(mask_BS).flatten().index_fill(0, top, True).view_as(mask_BS)
    loss_BS = -advantages_BS * torch.exp(log_ratio_BS)
    loss_BS = loss_BS + torch.where(penalized_BS, config.ppo_kl_coef * log_ratio_BS.abs(), 0.0)
    metrics = _ratio_metrics(log_ratio_BS, mask_BS) | {"kl_cov_frac": penalized_BS.to(loss_BS.dtype)}
    return masked(loss_BS, mask_BS), metrics


@POLICY_LOSSES.register("geo_mean")
def geo_mean(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the sequence ratio is the
    geometric mean of the token ratios, each clipped in log space. With l_t = logp_t - old_logp_t and s = sign(A),
    l'_t = s * min(s * l_t, s * clip(l_t, -clip_low, clip_high)) (the clip binds only on the side that would raise
    the objective, as PPO's), R_i = exp(mean over sample i's tokens of l'_t), A_i = mean of its token advantages,
    loss_i = -A_i * R_i, placed on each of sample i's tokens. clip_low/clip_high are log-ratio bounds here (the
    paper uses 0.4 each). seq-mean-token-mean aggregation gives the paper's mean over sequences; the other modes
    weigh sequences by their length."""
    mask_BS = response_mask_BS.bool()
    mask_f_BS = mask_BS.to(logprobs_BS.dtype)
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    sign_BS = torch.sign(advantages_BS)
    bounded_BS = log_ratio_BS.clamp(-config.clip_low, config.clip_high)
    clipped_BS = sign_BS * torch.minimum(sign_BS * log_ratio_BS, sign_BS * bounded_BS)
    lengths_B = mask_f_BS.sum(dim=1).clamp(min=1)
    seq_ratio_B = torch.exp((clipped_BS * mask_f_BS).sum(dim=1) / lengths_B)
    seq_advantage_B = advantages_BS.sum(dim=1) / lengths_B
    loss_BS = (-seq_advantage_B * seq_ratio_B)[:, None] * mask_f_BS
    metrics = _ratio_metrics(log_ratio_BS, mask_BS)
    metrics["clip_frac"] = masked((bounded_BS != log_ratio_BS).to(loss_BS.dtype).detach(), mask_BS)
    return masked(loss_BS, mask_BS), metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): clip the importance weight, never the token.
    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t, r_t = exp(logp_t - old_logp_t): every
    token keeps a gradient, -clip(r_t) * A_t * grad logp_t. The paper clips only above (a large clip_low). The loss
    value is not a surrogate of the return (its gradient is). Metrics: clip_frac (tokens whose weight was clipped)."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    ratio_BS = torch.exp(log_ratio_BS.detach())
    weight_BS = ratio_BS.clamp(1 - config.clip_low, 1 + config.clip_high)
    loss_BS = -weight_BS * advantages_BS * masked(logprobs_BS, mask_BS)
    metrics = _ratio_metrics(log_ratio_BS, mask_BS)
    metrics["clip_frac"] = masked((weight_BS != ratio_BS).to(loss_BS.dtype), mask_BS)
    return masked(loss_BS, mask_BS), metrics


def _dppo(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    config: PolicyLossConfig,
    trusted_BS: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """The DPPO loss given the trust-region test: loss_t = -A_t * sg(min(r_t, clip_ratio_c)) * logp_t where the
    token is trusted, 0 elsewhere."""
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    weight_BS = torch.exp(log_ratio_BS.detach()).clamp(max=config.clip_ratio_c)
    loss_BS = -advantages_BS * weight_BS * masked(logprobs_BS, mask_BS)
    metrics = _ratio_metrics(log_ratio_BS, mask_BS)
    metrics["clip_frac"] = masked((~trusted_BS).to(loss_BS.dtype), mask_BS)
    return masked(torch.where(trusted_BS, loss_BS, 0.0), mask_BS), metrics


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (arXiv:2602.04879): the trust region is a bound on the change of the sampled token's
    probability, not on the ratio. With p = exp(logp), p_old = exp(old_logp): a token with A_t > 0 is trusted while
    p - p_old <= clip_high, one with A_t <= 0 while p - p_old >= -clip_low (clip_low/clip_high are probability
    differences here); loss_t = -A_t * sg(min(r_t, clip_ratio_c)) * logp_t on trusted tokens, 0 on the others
    (truncated importance weight, cap clip_ratio_c). Metrics: clip_frac (untrusted tokens)."""
    mask_BS = response_mask_BS.bool()
    change_BS = (torch.exp(logprobs_BS) - torch.exp(old_logprobs_BS)).detach()
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    trusted_BS = torch.where(advantages_BS > 0, change_BS <= config.clip_high, change_BS >= -config.clip_low)
    return _dppo(logprobs_BS, old_logprobs_BS, advantages_BS, mask_BS, config, trusted_BS)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv with the binary KL between the Bernoulli distributions
    (p_old, 1 - p_old) and (p, 1 - p) of the sampled token, D = p_old * log(p_old / p) + (1 - p_old) *
    log((1 - p_old + 1e-8) / (1 - p + 1e-8)). A token with A_t > 0 is trusted while D <= clip_high or p <= p_old; one
    with A_t <= 0 while D <= clip_low or p >= p_old (a move against the advantage is always allowed);
    loss_t = -A_t * sg(min(r_t, clip_ratio_c)) * logp_t on trusted tokens, 0 on the others."""
    mask_BS = response_mask_BS.bool()
    logp_BS = masked(logprobs_BS.detach(), mask_BS)
    old_BS = masked(old_logprobs_BS.to(logp_BS.dtype), mask_BS)
    p_BS, p_old_BS = torch.exp(logp_BS), torch.exp(old_BS)
    eps = _BINARY_KL_EPS
    divergence_BS = p_old_BS * (old_BS - logp_BS) + (1 - p_old_BS) * torch.log((1 - p_old_BS + eps) / (1 - p_BS + eps))
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    trusted_BS = torch.where(
        advantages_BS > 0,
        (divergence_BS <= config.clip_high) | (p_BS <= p_old_BS),
        (divergence_BS <= config.clip_low) | (p_BS >= p_old_BS),
    )
    return _dppo(logprobs_BS, old_logprobs_BS, advantages_BS, mask_BS, config, trusted_BS)


@POLICY_LOSSES.register("dro")
def dro(
    logprobs_BS: torch.Tensor,
    old_logprobs_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, Metrics]:
    """DRO (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language Models
    Alignment", arXiv:2405.19107), the on-policy form verl registers: a quadratic proximal penalty instead of a clip,
    loss_t = -(A_t * logp_t - dro_beta / 2 * (logp_t - old_logp_t)^2). Gradient: -(A_t - dro_beta * l_t) * grad
    logp_t with l_t the log-ratio, so a token stops moving once l_t = A_t / dro_beta."""
    mask_BS = response_mask_BS.bool()
    log_ratio_BS = _log_ratio(logprobs_BS, old_logprobs_BS, mask_BS)
    advantages_BS = masked(advantages_BS.to(logprobs_BS.dtype), mask_BS)
    loss_BS = -(advantages_BS * masked(logprobs_BS, mask_BS) - 0.5 * config.dro_beta * log_ratio_BS.square())
    return masked(loss_BS, mask_BS), _ratio_metrics(log_ratio_BS, mask_BS)
