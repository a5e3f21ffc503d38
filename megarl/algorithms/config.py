"""Settings of the RL algorithm: advantage estimator, policy and value losses, KL, DAPO tricks, off-policy correction.

Imports no torch at module level (the config loader imports every config module). Names of variants (estimator,
loss, KL estimator, aggregation, off-policy mode) are checked against the registries in megarl/algorithms/registry.py;
that check imports the torch modules that register the built-in variants, so a user-registered variant is valid too.

The loader calls `check(key)` on every nested dataclass with its key path; `AlgorithmConfig.check` only adds the
checks that involve several sections.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

from megarl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    check_choice,
)
from megarl.errors import UserError

OFF_POLICY_LEVELS = ("token", "sequence")
KL_CONTROLLERS = ("fixed", "adaptive")  # megarl.algorithms.kl imports torch: the names are repeated here
ROUTING_REPLAY_MODES = ("off", "rollout", "old_logprob")


def _prefix(key: str) -> str:
    """ "key." for a field of the section at `key` ("" at the top level, where the loader passes key "")."""
    return f"{key}." if key else ""


def _warn_unused(config: object, key: str, used: frozenset[str] | None, skip: tuple[str, ...], variant: str) -> None:
    """Warn about fields changed from their default that the selected variant does not read (used=None: unknown,
    e.g. a user-registered variant that declares no `options` trait)."""
    if used is None:
        return
    default = type(config)()
    for f in fields(config):  # type: ignore[arg-type]
        if f.name in skip or f.name in used:
            continue
        value = getattr(config, f.name)
        if value != getattr(default, f.name):
            warnings.warn(f"{_prefix(key)}{f.name}={value!r} has no effect with {variant}", UserWarning, stacklevel=3)


def _check_range(
    key: str, value: float, low: float | None = None, high: float | None = None, *, low_open=False, high_open=False
) -> None:
    """Raise a UserError naming `key` unless `value` lies in the interval (bounds None = unbounded)."""
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    if not (above and below):
        left = f"{'(' if low_open or low is None else '['}{'-inf' if low is None else low}"
        right = f"{'inf' if high is None else high}{')' if high_open or high is None else ']'}"
        raise UserError(f"{key}={value} must be in {left}, {right}")


@dataclass
class AdvantageConfig:
    """How advantages (and critic returns) are computed from token rewards."""

    estimator: str = "grpo"
    """Advantage estimator: gae (PPO with a critic), grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline."""
    gamma: float = 1.0
    """Discount per response token (gae, reinforce_pp)."""
    lam: float = 1.0
    """GAE lambda: 1.0 is the Monte-Carlo return minus the value, 0.0 the one-step TD error (gae)."""
    norm_by_std: bool = True
    """grpo: divide by the group's standard deviation (False gives Dr.GRPO's advantage)."""
    gae_whiten: bool = True
    """gae: whiten the advantages over all response tokens of the batch (PPO practice); returns are not whitened."""
    eps: float = 1e-6
    """Added to standard deviations before dividing (grpo, whitening)."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        ADVANTAGE_ESTIMATORS.check(self.estimator, f"{p}estimator")
        _check_range(f"{p}gamma", self.gamma, 0.0, 1.0)
        _check_range(f"{p}lam", self.lam, 0.0, 1.0)
        _check_range(f"{p}eps", self.eps, 0.0, low_open=True)
        used = ADVANTAGE_ESTIMATORS.traits(self.estimator).get("options")
        _warn_unused(self, key, used, ("estimator",), f"{p}estimator={self.estimator!r}")


@dataclass
class PolicyLossConfig:
    """The actor's per-token loss: clipped surrogate, optional KL-to-ref loss and entropy bonus."""

    name: str = "ppo_clip"
    """Surrogate objective (docs/algorithms.md): ppo_clip (token-level ratio), gspo (sequence-level ratio), sapo,
    gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl, dro (verl's names)."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low (GSPO uses about 3e-4). geo_mean: the log-ratio bound; dppo_tv:
    the largest drop of the token's probability; dppo_kl: the largest binary KL (verl's clip_ratio_low)."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high (DAPO clip-higher: 0.28; GSPO about 4e-4); geo_mean, dppo_tv,
    dppo_kl: as clip_low, upwards (verl's clip_ratio_high)."""
    dual_clip: float | None = None
    """ppo_clip: for negative advantages, cap the loss at -advantage * dual_clip (e.g. 3.0; > 1); None turns it off
    (verl's clip_ratio_c, which verl always applies)."""
    tau_pos: float = 1.0
    """sapo: gate temperature for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """sapo: gate temperature for tokens with a negative advantage (larger: the gate closes faster)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the fraction of the batch's tokens whose gradient is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens whose advantage-log-prob covariance exceeds this are candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: only tokens whose covariance is below this are candidates."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the fraction of the batch's tokens (largest covariance) that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log-ratio| penalty on those tokens."""
    clip_ratio_c: float = 20.0
    """dppo_tv, dppo_kl: cap on the (detached) importance weight, a truncated IS weight (the DPPO paper recommends a
    large one)."""
    dro_beta: float = 0.1
    """dro: strength of the quadratic penalty on the log-ratio (> 0)."""
    aggregation: str = "token-mean"
    """How per-token losses become one number: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (Dr.GRPO)."""
    norm_len: int | None = None
    """seq-mean-token-sum-norm: the constant length each sequence's token sum is divided by; None uses the rollout's
    max_new_tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef * entropy per token; 0 turns it off (no entropy is computed)."""
    kl_loss_coef: float = 0.0
    """KL-to-ref as a loss term (GRPO style): + kl_loss_coef * KL estimate per token; 0 turns it off."""
    kl_estimator: str = "k3"
    """Estimator of the KL loss term: k1, k2 or k3 (k3 is verl's low_var_kl)."""
    kl_clamp: float | None = 10.0
    """Clamp each token's KL loss estimate to [-kl_clamp, kl_clamp]; None: no clamp."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        POLICY_LOSSES.check(self.name, f"{p}name")
        AGGREGATIONS.check(self.aggregation, f"{p}aggregation")
        KL_ESTIMATORS.check(self.kl_estimator, f"{p}kl_estimator")
        _check_range(f"{p}clip_low", self.clip_low, 0.0, 1.0, high_open=True)
        _check_range(f"{p}clip_high", self.clip_high, 0.0)
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise UserError(f"{p}dual_clip={self.dual_clip} must be > 1 (e.g. 3.0) or None")
        if self.norm_len is not None and self.norm_len < 1:
            raise UserError(f"{p}norm_len={self.norm_len} must be >= 1 or None (the rollout's max_new_tokens)")
        _check_range(f"{p}entropy_coef", self.entropy_coef, 0.0)
        _check_range(f"{p}kl_loss_coef", self.kl_loss_coef, 0.0)
        for name in ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio", "dro_beta"):
            _check_range(f"{p}{name}", getattr(self, name), 0.0, low_open=True)
        _check_range(f"{p}clip_ratio_c", self.clip_ratio_c, 1.0, low_open=True)
        _check_range(f"{p}ppo_kl_coef", self.ppo_kl_coef, 0.0)
        if self.clip_cov_ub <= self.clip_cov_lb:
            raise UserError(f"{p}clip_cov_ub={self.clip_cov_ub} must be greater than {p}clip_cov_lb={self.clip_cov_lb}")
        if self.kl_clamp is not None:
            _check_range(f"{p}kl_clamp", self.kl_clamp, 0.0, low_open=True)
        used = POLICY_LOSSES.traits(self.name).get("options")
        shared = ("name", "aggregation", "norm_len", "entropy_coef", "kl_loss_coef", "kl_estimator", "kl_clamp")
        _warn_unused(self, key, used, shared, f"{p}name={self.name!r}")


@dataclass
class KLConfig:
    """KL to the ref model as a per-token reward penalty (PPO-RLHF style): reward_t -= coef * KL estimate_t."""

    coef: float = 0.0
    """Penalty coefficient (the adaptive controller's starting value, algorithm.kl_ctrl); 0 turns the penalty off."""
    estimator: str = "k1"
    """KL estimator: k1 (log-ratio), k2, k3."""
    clamp: float | None = None
    """Clamp each token's KL estimate to [-clamp, clamp]; None: no clamp."""
    target_kl: float = 0.1
    """kl_ctrl=adaptive: the KL (mean over samples of each one's per-token mean) the controller steers towards."""
    horizon: int = 10000
    """kl_ctrl=adaptive: samples over which the coefficient changes by at most 20% (Ziegler et al. 2019)."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        KL_ESTIMATORS.check(self.estimator, f"{p}estimator")
        _check_range(f"{p}coef", self.coef, 0.0)
        if self.clamp is not None:
            _check_range(f"{p}clamp", self.clamp, 0.0, low_open=True)
        _check_range(f"{p}target_kl", self.target_kl, 0.0, low_open=True)
        if self.horizon < 1:
            raise UserError(f"{p}horizon={self.horizon} must be >= 1 (samples)")


@dataclass
class ValueLossConfig:
    """The critic's per-token loss: 0.5 * squared error to the returns, optionally clipped around the old values."""

    clip: float | None = 0.2
    """New values are clipped to old values +- clip in the second branch of the clipped loss; None: plain MSE."""
    coef: float = 0.5
    """Multiplies the value loss."""
    aggregation: str = "token-mean"
    """Aggregation mode of the value loss (same modes as the policy loss)."""
    norm_len: int | None = None
    """seq-mean-token-sum-norm: constant sequence length; None uses the rollout's max_new_tokens."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        AGGREGATIONS.check(self.aggregation, f"{p}aggregation")
        if self.clip is not None:
            _check_range(f"{p}clip", self.clip, 0.0, low_open=True)
        _check_range(f"{p}coef", self.coef, 0.0, low_open=True)
        if self.norm_len is not None and self.norm_len < 1:
            raise UserError(f"{p}norm_len={self.norm_len} must be >= 1 or None (the rollout's max_new_tokens)")


@dataclass
class DapoConfig:
    """DAPO's data-side tricks: dynamic sampling and overlong reward shaping (clip-higher is policy_loss.clip_high,
    token-level aggregation is policy_loss.aggregation=token-mean)."""

    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards are all equal (zero advantage) and sample more until the batch is full."""
    max_sampling_rounds: int = 10
    """Dynamic sampling: most generate rounds per step; the step trains on what it has after that."""
    overlong_buffer_len: int = 0
    """Overlong shaping: linear penalty over the last this-many tokens before max_response_len; 0 turns it off."""
    overlong_penalty: float = 1.0
    """Overlong shaping: the penalty at (and beyond) max_response_len."""
    max_response_len: int | None = None
    """Overlong shaping: the length at which the full penalty applies; None uses the rollout's max_new_tokens."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        if self.max_sampling_rounds < 1:
            raise UserError(f"{p}max_sampling_rounds={self.max_sampling_rounds} must be >= 1")
        if self.max_sampling_rounds > 2**32:
            raise UserError(f"{p}max_sampling_rounds={self.max_sampling_rounds} must be <= 2**32 (seeds per draw)")
        if self.overlong_buffer_len < 0:
            raise UserError(f"{p}overlong_buffer_len={self.overlong_buffer_len} must be >= 0 (0 = off)")
        _check_range(f"{p}overlong_penalty", self.overlong_penalty, 0.0)
        if self.max_response_len is not None and self.max_response_len <= self.overlong_buffer_len:
            raise UserError(
                f"{p}max_response_len={self.max_response_len} must be greater than "
                f"{p}overlong_buffer_len={self.overlong_buffer_len}"
            )


@dataclass
class OffPolicyConfig:
    """Correction for rollouts sampled by a lagging or numerically different engine (async RL): importance weights
    between the engine's `rollout_logprobs` (behavior policy) and the trainer's `old_logprobs` (proximal policy)."""

    mode: str = "none"
    """none; tis (truncated IS: weight min(ratio, clip)); mis (masked IS: ratio inside [low, high], else 0);
    decoupled (decoupled PPO: uncapped weight pi_prox / pi_behav)."""
    level: str = "token"
    """token: one ratio per token; sequence: the product of a sequence's token ratios, shared by its tokens."""
    clip: float = 2.0
    """tis: the cap C on the importance weight."""
    low: float = 0.5
    """mis: tokens (or sequences) with a ratio below this get weight 0."""
    high: float = 2.0
    """mis: tokens (or sequences) with a ratio above this get weight 0."""

    def check(self, key: str) -> None:
        p = _prefix(key)
        OFF_POLICY_CORRECTIONS.check(self.mode, f"{p}mode")
        check_choice(self.level, OFF_POLICY_LEVELS, f"{p}level", "off-policy level")
        _check_range(f"{p}clip", self.clip, 0.0, low_open=True)
        _check_range(f"{p}low", self.low, 0.0)
        if self.high <= self.low:
            raise UserError(f"{p}high={self.high} must be greater than {p}low={self.low}")
        used = OFF_POLICY_CORRECTIONS.traits(self.mode).get("options")
        _warn_unused(self, key, used, ("mode",), f"{p}mode={self.mode!r}")


@dataclass
class AlgorithmConfig:
    """The whole algorithm. E.g. GRPO: defaults; PPO: advantage.estimator=gae; DAPO: dapo.dynamic_sampling=true,
    policy_loss.clip_high=0.28, dapo.overlong_buffer_len=...; Dr.GRPO: advantage.estimator=dr_grpo,
    policy_loss.aggregation=seq-mean-token-sum-norm."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Actor loss."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL to the ref model as a reward penalty (for KL as a loss term see policy_loss.kl_loss_coef)."""
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Critic loss (used when the estimator needs values, i.e. gae)."""
    dapo: DapoConfig = field(default_factory=DapoConfig)
    """DAPO dynamic sampling and overlong shaping."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Importance-sampling correction against the rollout engine's log-probs."""
    kl_ctrl: str = "fixed"
    """The KL reward penalty's coefficient: `fixed` (kl.coef throughout) or `adaptive` (Ziegler et al. 2019: starts
    at kl.coef, steered each step towards kl.target_kl over kl.horizon samples; logged as kl/coef and kept in run
    checkpoints, so a resumed run continues it)."""
    distill_coef: float = 0.0
    """On-policy distillation (docs/algorithms.md): weight of each response token's distillation advantage, log
    pi_teacher - log pi_student (the per-token reverse KL, negated), added to the reward's advantage; the teacher is
    the `teacher` section's model. 0 turns distillation off (no teacher is loaded)."""
    distill_reward_coef: float = 1.0
    """With distill_coef > 0: weight of the verifier's reward advantage (advantage.estimator) in that sum; 0 is pure
    distillation (the reward is still computed and logged)."""
    routing_replay: str = "off"
    """MoE models: which expert choices the trainer's forward passes use (workers/routing_replay.py). `rollout`
    (R3): the experts the rollout engine chose for every token, in the old-log-prob pass and every update (the
    routing weights still come from the live router, so the router learns); `old_logprob`: the choices of the
    actor's own old-log-prob pass, replayed in the updates; `off`: live routing everywhere."""
    min_routing_agreement: float = 0.0
    """MoE models: stop the run when rollout/routing_agreement (the trainer's live routing against the engine's)
    falls below this: the two serve different weights, or the routing records are misaligned; 0 = never stop."""
    routing_invalid: str = "error"
    """A sample whose recorded routing cannot be replayed (wrong shape, expert ids out of range, not recorded):
    `error` stops the run naming the sample and layer; `live` routes that sample live and counts it
    (rollout/routing_fallback_samples)."""

    def check(self, key: str) -> None:
        """Checks across sections (the loader checks each section itself)."""
        p = _prefix(key)
        check_choice(self.kl_ctrl, KL_CONTROLLERS, f"{p}kl_ctrl", "KL controller")
        if self.kl_ctrl == "adaptive" and self.kl.coef <= 0:
            raise UserError(
                f"{p}kl_ctrl=adaptive scales {p}kl.coef, which is {self.kl.coef}: set {p}kl.coef > 0 (the starting "
                "coefficient, e.g. 0.05)"
            )
        _check_range(f"{p}distill_coef", self.distill_coef, 0.0)
        _check_range(f"{p}distill_reward_coef", self.distill_reward_coef, 0.0)
        if self.distill_coef == 0 and self.distill_reward_coef != 1.0:
            warnings.warn(
                f"{p}distill_reward_coef={self.distill_reward_coef} has no effect with {p}distill_coef=0 (no "
                "distillation)",
                UserWarning,
                stacklevel=2,
            )
        if self.distill_coef > 0 and self.distill_reward_coef == 0 and self.dapo.dynamic_sampling:
            warnings.warn(
                f"{p}dapo.dynamic_sampling drops prompt groups whose rewards are all equal, but pure distillation "
                f"({p}distill_reward_coef=0) learns from them too; turn dynamic sampling off",
                UserWarning,
                stacklevel=2,
            )
        for name, valid in (("routing_replay", ROUTING_REPLAY_MODES), ("routing_invalid", ("error", "live"))):
            if getattr(self, name) not in valid:
                raise UserError(f"{p}{name}={getattr(self, name)!r}: valid are {', '.join(valid)}")
        if not 0.0 <= self.min_routing_agreement <= 1.0:
            raise UserError(f"{p}min_routing_agreement={self.min_routing_agreement} must be in [0, 1] (0 = never stop)")
        estimator = self.advantage.estimator
        ADVANTAGE_ESTIMATORS.check(estimator, f"{p}advantage.estimator")
        if self.dapo.dynamic_sampling and not ADVANTAGE_ESTIMATORS.traits(estimator).get("needs_groups", False):
            groupwise = [
                n for n in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.traits(n).get("needs_groups", False)
            ]
            raise UserError(
                f"{p}dapo.dynamic_sampling=true filters prompt groups, which {p}advantage.estimator="
                f"{estimator!r} does not use; use one of: {', '.join(groupwise)}"
            )
        paired = ADVANTAGE_ESTIMATORS.traits(estimator).get("aggregation")
        if paired is not None and self.policy_loss.aggregation != paired:
            warnings.warn(
                f"{p}advantage.estimator={estimator!r} is meant to be paired with {p}policy_loss.aggregation="
                f"{paired!r}; got {self.policy_loss.aggregation!r}",
                UserWarning,
                stacklevel=2,
            )
        if self.kl.coef > 0 and self.policy_loss.kl_loss_coef > 0:
            warnings.warn(
                f"both {p}kl.coef (KL in the reward) and {p}policy_loss.kl_loss_coef (KL as a loss) are set; "
                "usually one is used",
                UserWarning,
                stacklevel=2,
            )

    def needs_critic(self) -> bool:
        """Whether the advantage estimator reads critic values."""
        return bool(ADVANTAGE_ESTIMATORS.traits(self.advantage.estimator).get("needs_values", False))

    def needs_reward_baselines(self) -> bool:
        """Whether the estimator needs a greedy baseline response per prompt (remax)."""
        return bool(ADVANTAGE_ESTIMATORS.traits(self.advantage.estimator).get("needs_reward_baselines", False))

    def needs_sum_pi_squared(self) -> bool:
        """Whether the estimator needs sum over the vocabulary of p^2 per token from the actor's log-prob pass."""
        return bool(ADVANTAGE_ESTIMATORS.traits(self.advantage.estimator).get("needs_sum_pi_squared", False))

    def needs_ref(self) -> bool:
        """Whether ref log-probs are needed (KL in the reward or as a loss)."""
        return self.kl.coef > 0 or self.policy_loss.kl_loss_coef > 0

    def needs_teacher(self) -> bool:
        """Whether teacher log-probs are needed (on-policy distillation)."""
        return self.distill_coef > 0

    def needs_rollout_logprobs(self) -> bool:
        """Whether the engine's log-probs are needed by the off-policy correction."""
        return bool(OFF_POLICY_CORRECTIONS.traits(self.off_policy.mode).get("needs_rollout_logprobs", True))
