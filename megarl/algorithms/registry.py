"""Registries of algorithm variants, looked up by the names that configs use.

One registry per kind (advantage estimators, policy losses, KL estimators, aggregation modes, off-policy
corrections). A variant is a function registered under a name, with traits (plain facts the controller reads, e.g.
`needs_values=True` for an estimator that needs a critic), so that no `if name == ...` chain is needed.

This module imports no torch: config validation reads it, and `megarl train` starts Ray right after the config is
checked, so a torch import here would hold Ray's start back by 2 s. The built-in variants are therefore listed
below, each name with its traits and the torch module that implements it (`@REGISTRY.register(name)` there); that
module is imported the first time its function is asked for. A variant of one's own registers with its traits:
`@POLICY_LOSSES.register("my_loss", options=frozenset({"clip_low"}))`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from megarl.config.suggest import unknown_choice
from megarl.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])


def check_choice(value: str, valid: Iterable[str], key: str, kind: str = "value") -> None:
    """Raise a UserError naming `key`, the valid values and the closest match when `value` is not among `valid`."""
    valid = list(valid)
    if value not in valid:
        raise UserError(unknown_choice(key, value, valid, problem=f"is not a known {kind}"))


@dataclass(frozen=True)
class Builtin:
    """A built-in variant: the module whose `@register(name)` implements it, and its traits."""

    module: str
    traits: dict[str, Any] = field(default_factory=dict)


def builtins(module: str, **variants: dict[str, Any]) -> dict[str, Builtin]:
    """{name: Builtin(module, traits)} for variants implemented in one module."""
    return {name: Builtin(module, traits) for name, traits in variants.items()}


class Registry(Generic[F]):
    """Functions of one kind by name. `builtins`: the built-in names, each with its traits and implementing module
    (imported the first time the function is looked up)."""

    def __init__(self, kind: str, builtins: dict[str, Builtin] | None = None) -> None:
        self.kind = kind
        self._builtins = dict(builtins or {})
        self._entries: dict[str, F] = {}
        self._traits: dict[str, dict[str, Any]] = {name: dict(b.traits) for name, b in self._builtins.items()}

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        """Decorator: register a function under `name` with optional traits; re-registering a name is an error. A
        built-in name takes its traits from the list in megarl/algorithms/registry.py, not from here."""

        def decorate(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            builtin = self._builtins.get(name)
            if builtin is not None and (traits or fn.__module__ != builtin.module):
                raise ValueError(
                    f"{self.kind} {name!r} is built in ({builtin.module}, traits listed in "
                    "megarl/algorithms/registry.py): register a variant of one's own under another name"
                )
            self._entries[name] = fn
            if builtin is None:
                self._traits[name] = dict(traits)
            return fn

        return decorate

    def names(self) -> list[str]:
        """Registered names: the built-in ones, then those registered since."""
        return list(dict.fromkeys([*self._builtins, *self._entries]))

    def check(self, name: str, key: str) -> None:
        """Raise a UserError naming `key` and the valid names when `name` is not registered."""
        check_choice(name, self.names(), key, self.kind)

    def get(self, name: str, key: str = "name") -> F:
        """The function registered as `name` (importing its built-in module the first time); a UserError naming
        `key`, the valid names and the closest match if there is none."""
        self.check(name, key)
        if name not in self._entries:
            importlib.import_module(self._builtins[name].module)
        return self._entries[name]

    def traits(self, name: str, key: str = "name") -> dict[str, Any]:
        """The traits `name` was registered with (a copy)."""
        self.check(name, key)
        return dict(self._traits[name])

    def __contains__(self, name: str) -> bool:
        return name in self._builtins or name in self._entries


_ADV = "megarl.algorithms.advantages"
_ADV_VARIANTS = "megarl.algorithms.advantage_variants"
_GROUP = dict(needs_values=False, needs_groups=True)  # an outcome baseline over each prompt's group
_NO_GROUP = dict(needs_values=False, needs_groups=False)
_LOSS = "megarl.algorithms.policy_loss"
_LOSS_VARIANTS = "megarl.algorithms.policy_loss_variants"
_CLIP = frozenset({"clip_low", "clip_high"})
_OFF_POLICY = "megarl.algorithms.off_policy"

ADVANTAGE_ESTIMATORS: Registry = Registry(
    "advantage estimator",
    {
        **builtins(
            _ADV,
            gae=dict(needs_values=True, needs_groups=False, options=frozenset({"gamma", "lam", "gae_whiten", "eps"})),
            grpo=dict(**_GROUP, options=frozenset({"norm_by_std", "eps"})),
            dr_grpo=dict(**_GROUP, options=frozenset(), aggregation="seq-mean-token-sum-norm"),
            rloo=dict(**_GROUP, options=frozenset()),
            reinforce_plus_plus=dict(**_NO_GROUP, options=frozenset({"gamma", "eps"})),
            reinforce_pp=dict(**_NO_GROUP, options=frozenset({"gamma", "eps"})),
            reinforce_plus_plus_baseline=dict(**_GROUP, options=frozenset({"eps"})),
            reinforce_pp_baseline=dict(**_GROUP, options=frozenset({"eps"})),
        ),
        **builtins(
            _ADV_VARIANTS,
            grpo_passk=dict(**_GROUP, options=frozenset({"norm_by_std", "eps"})),
            opo=dict(**_GROUP, options=frozenset()),
            remax=dict(**_NO_GROUP, options=frozenset(), needs_reward_baselines=True),
            gpg=dict(**_GROUP, options=frozenset()),
            optimal_token_baseline=dict(**_GROUP, options=frozenset(), needs_sum_pi_squared=True),
        ),
    },
)
"""fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages_BS, returns_BS). Traits: needs_values,
needs_groups (bool, default False), options (the AdvantageConfig fields it reads), aggregation (the aggregation mode
it is meant to be paired with, if any), needs_reward_baselines (a greedy response's score per prompt: remax),
needs_sum_pi_squared (sum over the vocabulary of p^2 per token from the actor's log-prob pass)."""
POLICY_LOSSES: Registry = Registry(
    "policy loss",
    {
        **builtins(_LOSS, ppo_clip=dict(options=_CLIP | {"dual_clip"}), gspo=dict(options=_CLIP)),
        **builtins(
            _LOSS_VARIANTS,
            sapo=dict(options=frozenset({"tau_pos", "tau_neg"})),
            gpg=dict(options=frozenset()),
            clip_cov=dict(options=_CLIP | {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"}),
            kl_cov=dict(options=frozenset({"kl_cov_ratio", "ppo_kl_coef"})),
            geo_mean=dict(options=_CLIP),
            cispo=dict(options=_CLIP),
            dppo_tv=dict(options=_CLIP | {"clip_ratio_c"}),
            dppo_kl=dict(options=_CLIP | {"clip_ratio_c"}),
            dro=dict(options=frozenset({"dro_beta"})),
        ),
    },
)
"""fn(logprobs_BS, old_logprobs_BS, advantages_BS, response_mask_BS, config: PolicyLossConfig)
-> (per_token_loss_BS, metrics). Traits: options (the PolicyLossConfig fields it reads beyond the shared ones)."""
KL_ESTIMATORS: Registry = Registry("KL estimator", builtins("megarl.algorithms.kl", k1={}, k2={}, k3={}))
"""fn(logprobs_BS, ref_logprobs_BS) -> kl_BS, an estimate of KL(pi || pi_ref) per token."""
AGGREGATIONS: Registry = Registry(
    "loss aggregation mode",
    {
        name: Builtin("megarl.algorithms.aggregation")
        for name in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    },
)
"""fn(mask_BS, norm_len) -> weights_BS with sum(weights * per_token_loss) = the aggregate loss."""
OFF_POLICY_CORRECTIONS: Registry = Registry(
    "off-policy correction",
    builtins(
        _OFF_POLICY,
        none=dict(needs_rollout_logprobs=False, options=frozenset()),
        tis=dict(needs_rollout_logprobs=True, options=frozenset({"level", "clip"})),
        mis=dict(needs_rollout_logprobs=True, options=frozenset({"level", "low", "high"})),
        decoupled=dict(needs_rollout_logprobs=True, options=frozenset({"level"})),
    ),
)
"""fn(old_logprobs_BS, rollout_logprobs_BS, response_mask_BS, config: OffPolicyConfig) -> (weights_BS, metrics).
Traits: needs_rollout_logprobs (bool, default True), options (the OffPolicyConfig fields it reads)."""
