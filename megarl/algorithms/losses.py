"""The loss objects the controller hands to the actor and critic workers.

Plain classes holding configs (picklable across Ray); variant functions are looked up by name on each call. For each
micro-batch a worker calls

    per_token_loss_BS, metrics = loss_fn(logprobs_BS, entropy_BS_or_None, micro_batch)     # actor
    per_token_loss_BS, metrics = loss_fn(values_BS, micro_batch)                           # critic
    (per_token_loss_BS * micro_batch["loss_weights"]).sum().backward()

and reduces each metric m as sum(m * loss_weights) / sum(loss_weights). `loss_weights` come from
aggregation.loss_weights over the whole mini-batch (the controller's job), so the sum over micro-batches and
data-parallel ranks is the mini-batch aggregate.

Micro-batch keys read: response_mask, old_logprobs, advantages; ref_logprobs when needs_ref; rollout_logprobs when
needs_rollout_logprobs; old_values, returns (critic).

Shapes: B samples, S token positions; all tensors [B, S], aligned with input_ids.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarl.algorithms.config import OffPolicyConfig, PolicyLossConfig, ValueLossConfig
from megarl.algorithms.kl import kl_estimate
from megarl.algorithms.off_policy import off_policy_weights
from megarl.algorithms.registry import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
)
from megarl.algorithms.value_loss import clipped_value_loss

Metrics = dict[str, torch.Tensor]


def _get(mb: Mapping[str, torch.Tensor], name: str, needed_by: str) -> torch.Tensor:
    if name not in mb:
        raise KeyError(f"the micro-batch has no {name!r}, needed by {needed_by}; it has: {', '.join(mb)}")
    return mb[name]


def _mismatch(old_BS: torch.Tensor, rollout_BS: torch.Tensor, mask_BS: torch.Tensor) -> Metrics:
    """Per-token training-inference mismatch (as trainer/rl_steps.mismatch_metrics; `_max` is reduced by max)."""
    delta_BS = torch.where(mask_BS, old_BS.float() - rollout_BS.float(), 0.0)
    ratio_BS = delta_BS.exp()
    return {
        "mismatch/abs_logprob_diff_mean": delta_BS.abs(),
        "mismatch/abs_logprob_diff_max": delta_BS.abs(),
        "mismatch/ratio_mean": ratio_BS,
        "mismatch/kl": ratio_BS - 1 - delta_BS,
    }


class PolicyLoss:
    """Actor loss per token: off-policy weight * surrogate + kl_loss_coef * KL(pi || pi_ref) - entropy_coef * entropy,
    0 outside the response mask. The off-policy weight multiplies the surrogate only (not the KL and entropy terms).

    Metrics: pg_loss (the weighted surrogate), clip_frac, ratio, approx_kl (and dual_clip_frac); kl_loss when the KL
    term is on; entropy whenever an entropy is given; is_weight, rollout_kl, is_clipped / is_masked with an
    off-policy correction.
    """

    def __init__(
        self,
        config: PolicyLossConfig,
        off_policy: OffPolicyConfig | None = None,
        key: str = "algorithm",
        old_from_current: bool = False,
    ) -> None:
        self.config = config
        self.old_from_current = old_from_current
        """One update per batch with no old-log-prob pass: the old log-probs are the current ones, detached (the
        ratio is exactly 1 and its gradient the policy gradient). The entropy and the engine mismatch, which that
        pass measured, are then reported from here (`mismatch/*` metrics, weighted by the loss weights)."""
        self.reports_entropy = old_from_current
        """The worker computes the entropy for the metrics even when the loss does not need it."""
        self.off_policy = off_policy if off_policy is not None else OffPolicyConfig()
        self.key = key
        POLICY_LOSSES.check(config.name, f"{key}.policy_loss.name")
        KL_ESTIMATORS.check(config.kl_estimator, f"{key}.policy_loss.kl_estimator")
        AGGREGATIONS.check(config.aggregation, f"{key}.policy_loss.aggregation")
        traits = OFF_POLICY_CORRECTIONS.traits(self.off_policy.mode, f"{key}.off_policy.mode")
        self.needs_entropy: bool = config.entropy_coef != 0
        """The worker must compute the entropy of each token's distribution (and pass it with its gradient)."""
        self.needs_ref: bool = config.kl_loss_coef != 0
        """The micro-batch must hold ref_logprobs."""
        self.needs_rollout_logprobs: bool = bool(traits.get("needs_rollout_logprobs", True))
        """The micro-batch must hold rollout_logprobs."""

    def __call__(
        self, logprobs_BS: torch.Tensor, entropy_BS: torch.Tensor | None, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        config = self.config
        mask_BS = _get(mb, "response_mask", "every policy loss").bool()
        if self.old_from_current:
            old_logprobs_BS = logprobs_BS.detach()
        else:
            old_logprobs_BS = _get(mb, "old_logprobs", "every policy loss")
        advantages_BS = _get(mb, "advantages", "every policy loss")
        surrogate = POLICY_LOSSES.get(config.name, f"{self.key}.policy_loss.name")
        loss_BS, metrics = surrogate(logprobs_BS, old_logprobs_BS, advantages_BS, mask_BS, config)

        if self.needs_rollout_logprobs:
            rollout_logprobs_BS = _get(mb, "rollout_logprobs", f"{self.key}.off_policy.mode={self.off_policy.mode!r}")
            weights_BS, is_metrics = off_policy_weights(
                old_logprobs_BS, rollout_logprobs_BS, mask_BS, self.off_policy, f"{self.key}.off_policy.mode"
            )
            if weights_BS is not None:
                loss_BS = loss_BS * weights_BS.to(loss_BS.dtype)
            metrics.update(is_metrics)
        metrics["pg_loss"] = loss_BS.detach()
        if self.old_from_current and "rollout_logprobs" in mb:
            metrics |= _mismatch(old_logprobs_BS, mb["rollout_logprobs"], mask_BS)

        if self.needs_ref:
            ref_logprobs_BS = _get(mb, "ref_logprobs", f"{self.key}.policy_loss.kl_loss_coef > 0")
            kl_BS = kl_estimate(  # inputs masked first: padding log-probs (even -inf) must not make NaN gradients
                config.kl_estimator,
                torch.where(mask_BS, logprobs_BS, 0.0),
                torch.where(mask_BS, ref_logprobs_BS.to(logprobs_BS.dtype), 0.0),
                config.kl_clamp,
                f"{self.key}.policy_loss.kl_estimator",
            )
            kl_BS = torch.where(mask_BS, kl_BS, 0.0)
            loss_BS = loss_BS + config.kl_loss_coef * kl_BS
            metrics["kl_loss"] = kl_BS.detach()

        if entropy_BS is not None:
            entropy_BS = torch.where(mask_BS, entropy_BS, 0.0)
            metrics["entropy"] = entropy_BS.detach()
            if self.needs_entropy:
                loss_BS = loss_BS - config.entropy_coef * entropy_BS
        elif self.needs_entropy:
            raise ValueError(f"{self.key}.policy_loss.entropy_coef={config.entropy_coef} needs the entropy per token")

        return torch.where(mask_BS, loss_BS, 0.0), metrics


class ValueLoss:
    """Critic loss per token: coef * clipped value loss (value_loss.clipped_value_loss), 0 outside the response mask.
    Reads `old_values` (the critic's values before this update, computed by the controller's critic pass) and
    `returns` from the micro-batch. Metrics: vf_loss, vf_clip_frac, values, vf_error."""

    def __init__(self, config: ValueLossConfig, key: str = "algorithm") -> None:
        self.config = config
        self.key = key
        AGGREGATIONS.check(config.aggregation, f"{key}.value_loss.aggregation")

    def __call__(self, values_BS: torch.Tensor, mb: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        loss_BS, metrics = clipped_value_loss(
            values_BS,
            _get(mb, "old_values", "the value loss"),
            _get(mb, "returns", "the value loss"),
            _get(mb, "response_mask", "the value loss"),
            self.config.clip,
        )
        loss_BS = self.config.coef * loss_BS
        metrics["vf_loss"] = loss_BS.detach()
        return loss_BS, metrics


class NLLLoss:
    """Supervised fine-tuning (SFT): per-token negative log-likelihood of the response tokens, -log p(token).
    Metrics: nll (per token)."""

    needs_entropy = False
    reports_entropy = False

    def __call__(
        self, logprobs_BS: torch.Tensor, entropy_BS: torch.Tensor | None, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Metrics]:
        mask_BS = _get(mb, "response_mask", "the SFT loss").bool()
        nll_BS = torch.where(mask_BS, -logprobs_BS, 0.0)
        return nll_BS, {"nll": nll_BS.detach()}
