"""The colocated handover: training roles and rollout engines take turns on the same GPUs (docs/architecture.md,
Colocated handover).

Whoever needs the GPUs asks first: `to_training()` before role compute (log-probs, updates, checkpoints),
`to_rollout(sync)` before generation. Each call is a no-op when the GPUs are already theirs, and with split
placement always (the engines have GPUs of their own; `to_rollout` then only runs `sync` when one is given), as on
a CPU machine unless placement.handover=always.

To the engines, with the weight sync in the middle, so that it runs while the actor's and the engine's weights are
both resident and the KV cache is not:

    roles offload grads + optimizer -> engines resume weights -> sync -> roles offload params -> engines resume KV

Back to training: engines release KV cache and weights -> roles onload. What the roles offload is
`placement.offload` (params / grads / optimizer). An engine that released its weights may have lost them (SGLang
without a CPU backup), so a handover to the engines always syncs: the new version after an update, else the same
version again (`resync`).

`calls` records every handover call in order (what the CPU tests check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from megarl.rollout.engine import MEMORY_TAGS
from megarl.trainer.lifecycle.roles import Roles

if TYPE_CHECKING:
    from megarl.job import OffloadConfig

Sync = Callable[[], dict[str, float]]
Holder = Literal["both", "training", "rollout"]


class Handover:
    def __init__(self, roles: Roles, offload: OffloadConfig, resync: Sync, enabled: bool = True):
        self.roles = roles
        self.offload = offload
        self.resync = resync
        """Re-sends the weights the engines should hold (same version): after they released them."""
        self.enabled = roles.colocated and enabled
        """`enabled` is False on a CPU machine unless placement.handover=always: everything lives in host memory."""
        self.holder: Holder = "both"
        """Who holds the GPUs: at start-up both have loaded their models."""
        self.calls: list[str] = []

    def to_training(self) -> None:
        """The engines release the GPUs (KV cache and weights); the training roles take them back."""
        if not self.enabled or self.holder == "training":
            return
        self._call(self.roles.rollout, "release_memory", list(MEMORY_TAGS))
        if self.holder == "rollout":
            for group in self.roles.sharing_groups():
                self._call(group, "onload")
        self.holder = "training"

    def to_rollout(self, sync: Sync | None = None) -> dict[str, float]:
        """The engines take the GPUs, with fresh weights: `sync` (a new weight version) when given, else the same
        version again if they released theirs. Returns the sync's metrics ({} when none ran)."""
        if not self.enabled:
            return sync() if sync is not None else {}
        if self.holder == "rollout":
            return sync() if sync is not None else {}  # the engines hold the GPUs already (KV cache resident)
        offload = self.offload
        released = self.holder == "training"  # the engines gave their weights back at the last handover
        for group in self.roles.sharing_groups():
            self._call(group, "offload", False, offload.grads, offload.optimizer)
        if released:
            self._call(self.roles.rollout, "resume_memory", ["weights"])
        metrics = {}
        if sync is not None or released:
            self.calls.append("sync")
            metrics = (sync or self.resync)()
        for group in self.roles.sharing_groups():
            self._call(group, "offload", offload.params, offload.grads, offload.optimizer)
        if released:
            self._call(self.roles.rollout, "resume_memory", ["kv_cache"])
        self.holder = "rollout"
        return metrics

    def _call(self, group, method: str, *args) -> None:
        self.calls.append(f"{group.role}.{method}" + (f"({', '.join(map(_short, args))})" if args else ""))
        group.call(method, *args)


def _short(value) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)
