"""Registries of algorithm variants, looked up by the names that configs use.

One registry per kind (advantage estimators, policy losses, KL estimators, aggregation modes, off-policy
corrections). A variant is a function registered under a name, optionally with traits (plain facts the controller
reads, e.g. `needs_values=True` for an estimator that needs a critic), so that no `if name == ...` chain is needed.

This module imports no torch: config validation uses it. The built-in variants live in torch modules that register
themselves when imported; each registry imports its built-in module the first time a name is looked up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from megarl.config.suggest import unknown_choice
from megarl.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])


def check_choice(value: str, valid: Iterable[str], key: str, kind: str = "value") -> None:
    """Raise a UserError naming `key`, the valid values and the closest match when `value` is not among `valid`."""
    valid = list(valid)
    if value not in valid:
        raise UserError(unknown_choice(key, value, valid, problem=f"is not a known {kind}"))


class Registry(Generic[F]):
    """Functions of one kind by name. `builtins` are the modules that register the built-in entries (imported in
    order, the first time a name is looked up)."""

    def __init__(self, kind: str, builtins: str | tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._builtins = (builtins,) if isinstance(builtins, str) else builtins
        self._entries: dict[str, F] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        """Decorator: register a function under `name` with optional traits; re-registering a name is an error."""

        def decorate(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            self._traits[name] = dict(traits)
            return fn

        return decorate

    def _load_builtins(self) -> None:
        modules, self._builtins = self._builtins, ()
        for module in modules:
            importlib.import_module(module)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        self._load_builtins()
        return list(self._entries)

    def check(self, name: str, key: str) -> None:
        """Raise a UserError naming `key` and the valid names when `name` is not registered."""
        check_choice(name, self.names(), key, self.kind)

    def get(self, name: str, key: str = "name") -> F:
        """The function registered as `name`; a UserError naming `key`, the valid names and the closest match if
        there is none."""
        self.check(name, key)
        return self._entries[name]

    def traits(self, name: str, key: str = "name") -> dict[str, Any]:
        """The traits `name` was registered with (a copy)."""
        self.check(name, key)
        return dict(self._traits[name])

    def __contains__(self, name: str) -> bool:
        self._load_builtins()
        return name in self._entries


ADVANTAGE_ESTIMATORS: Registry = Registry(
    "advantage estimator", ("megarl.algorithms.advantages", "megarl.algorithms.advantage_variants")
)
"""fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages_BS, returns_BS). Traits: needs_values,
needs_groups (bool, default False), options (the AdvantageConfig fields it reads), aggregation (the aggregation mode
it is meant to be paired with, if any), needs_reward_baselines (a greedy response's score per prompt: remax),
needs_sum_pi_squared (sum over the vocabulary of p^2 per token from the actor's log-prob pass)."""
POLICY_LOSSES: Registry = Registry(
    "policy loss", ("megarl.algorithms.policy_loss", "megarl.algorithms.policy_loss_variants")
)
"""fn(logprobs_BS, old_logprobs_BS, advantages_BS, response_mask_BS, config: PolicyLossConfig)
-> (per_token_loss_BS, metrics). Traits: options (the PolicyLossConfig fields it reads beyond the shared ones)."""
KL_ESTIMATORS: Registry = Registry("KL estimator", "megarl.algorithms.kl")
"""fn(logprobs_BS, ref_logprobs_BS) -> kl_BS, an estimate of KL(pi || pi_ref) per token."""
AGGREGATIONS: Registry = Registry("loss aggregation mode", "megarl.algorithms.aggregation")
"""fn(mask_BS, norm_len) -> weights_BS with sum(weights * per_token_loss) = the aggregate loss."""
OFF_POLICY_CORRECTIONS: Registry = Registry("off-policy correction", "megarl.algorithms.off_policy")
"""fn(old_logprobs_BS, rollout_logprobs_BS, response_mask_BS, config: OffPolicyConfig) -> (weights_BS, metrics).
Traits: needs_rollout_logprobs (bool, default True), options (the OffPolicyConfig fields it reads)."""
