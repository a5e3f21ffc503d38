"""The controller's side of a weight sync: the actor's weights into every rollout engine, as a new weight version."""

from __future__ import annotations

from megarl.trainer.roles import Roles
from megarl.trainer.run_checkpoint import TrainerState


class WeightSync:
    """`sync()` pushes the actor's weights into every engine as the next weight version; `sync(new_version=False)`
    pushes them again at the version they have (engines that restarted or released their weights)."""

    def __init__(self, roles: Roles, state: TrainerState, bucket_bytes: int):
        self.roles = roles
        self.state = state
        self.bucket_bytes = bucket_bytes
        self.engine_devices: list[list[str]] | None = None
        """The GPUs each engine sees (asked at the first sync; empty on CPU and with split placement): an actor
        rank on one of them sends CUDA IPC buckets."""

    def __call__(self, new_version: bool = True) -> dict[str, float]:
        version = self.state.weight_version + int(new_version)
        rollout, actor = self.roles.rollout, self.roles.actor
        if self.engine_devices is None:
            self.engine_devices = rollout.call("device_uuids") if self.roles.colocated else []
        rollout.call("begin_weight_update", version)
        sent = actor.call(
            "sync_weights", rollout.workers, version, self.bucket_bytes, self.engine_devices, collect="all"
        )
        received = rollout.call("finish_weight_update", version)
        self.state.weight_version = version
        return {
            "sync/bytes": sum(s["bytes"] for s in sent),
            "sync/seconds": max(s["seconds"] for s in sent),
            "sync/engine_seconds": max(r.seconds for r in received),
            "sync/weight_version": float(version),
            "sync/ipc_engines": max(s["ipc_engines"] for s in sent),
        }
