"""Per-token estimators of KL(pi || pi_ref) from the log-probs of sampled tokens (John Schulman's k1 / k2 / k3).

The tokens were sampled from pi (or close to it), so each estimator is a one-sample estimate whose mean over tokens
approximates the KL; none sums over the vocabulary. Used as a reward penalty (KLConfig) or as a loss term
(PolicyLossConfig.kl_loss_coef).

Shapes: B samples, S token positions; inputs and output are [B, S] (column t is about token t).
"""

from __future__ import annotations

import torch

from megarl.algorithms.registry import KL_ESTIMATORS

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps k3 finite for tokens the ref model finds very unlikely (or likely)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs_BS: torch.Tensor, ref_logprobs_BS: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref. Unbiased for KL(pi || pi_ref), high variance, can be negative per token."""
    return logprobs_BS - ref_logprobs_BS


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs_BS: torch.Tensor, ref_logprobs_BS: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2. Biased, non-negative, low variance; as a loss its gradient is that of the
    reverse KL under on-policy samples."""
    return 0.5 * (logprobs_BS - ref_logprobs_BS).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs_BS: torch.Tensor, ref_logprobs_BS: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r with r = pi_ref / pi (verl's "low_var_kl"). Unbiased, non-negative, low variance. The log
    ratio is clamped to [-20, 20] before exp so that the estimate stays finite."""
    log_ratio = (ref_logprobs_BS - logprobs_BS).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - 1 - log_ratio


def kl_estimate(
    estimator: str,
    logprobs_BS: torch.Tensor,
    ref_logprobs_BS: torch.Tensor,
    clamp: float | None = None,
    key: str = "kl_estimator",
) -> torch.Tensor:
    """The registered estimator `estimator` per token, clamped to [-clamp, clamp] when clamp is given."""
    kl_BS = KL_ESTIMATORS.get(estimator, key)(logprobs_BS, ref_logprobs_BS)
    if clamp is not None:
        kl_BS = kl_BS.clamp(-clamp, clamp)
    return kl_BS


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, horizon: int, num_samples: int) -> float:
    """The next coefficient of the adaptive KL controller (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", arXiv:1909.08593, section 2.2): with the proportional error e = clip(KL / target_kl - 1,
    -0.2, 0.2), beta' = beta * (1 + e * num_samples / horizon). KL above the target raises the coefficient, below
    lowers it, by at most 20% per `horizon` samples. `current_kl` is the KL the policy showed on this batch."""
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)
