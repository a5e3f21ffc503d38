"""The hybrid engine: each of the actor's Megatron workers also hosts a rollout engine (rollout.hf.hybrid; verl's
"hybrid engine"), for a colocated job of one-GPU hf engines: engine i lives in actor worker i (the quickstart's
TP=2 actor hosts its two engines; tools/bench/vs_trl.py's one worker its one).

Why: on a machine of few cores, an engine in a worker of its own costs a Ray call per handover, bucket and
generate call, a host copy of every weight through the object store, and a second OpenMP thread team that takes
the cores from the first (tools/bench/README.md, vs_trl), and on a small machine each engine worker's start-up
(its imports) competes with the actor's. Here the engine computes on the actor's own thread and a weight sync is
one in-process copy of each exported tensor into the engine's model (with several workers, after the relay's
broadcast gives every rank every bucket: workers/weight_sync.py).

The controller sees two groups as before: `roles.actor` (this worker's Megatron methods) and `roles.rollout`, an
`EngineView` of the same workers whose calls go to the `engine_*` methods: the embedded `RolloutWorker`'s (same
locks, same checks), run inline on the actor's thread.
"""

from __future__ import annotations

from typing import Any

from megarl.cluster.worker_group import PendingCall, WorkerGroup
from megarl.runtime import cpu_compat
from megarl.workers.megatron_worker import MegatronWorker
from megarl.workers.rollout_worker import RolloutWorker

ENGINE_METHODS = (
    "setup",
    "generate",
    "abort",
    "weight_version",
    "begin_weight_update",
    "apply_bucket",
    "finish_weight_update",
    "abandon_weight_update",
    "verify_weights",
    "device_uuids",
    "sglang_endpoint",
    "release_memory",
    "resume_memory",
    "health",
    "health_probe",
    "shutdown_engine",
)
"""The rollout worker's methods the controller calls (trainer/: rollout_step, engine_sync, handover, roles)."""
PREFIX = "engine_"


class HybridActorWorker(MegatronWorker):
    """A Megatron role worker (the actor) with a rollout engine of its own: `engine_<method>` runs the embedded
    RolloutWorker's `<method>`."""

    def __init__(self):
        from megarl.runtime.quiet import silence_expected_warnings

        silence_expected_warnings()  # weight_sync imports Megatron's optimizer, which warns at import (no TE/Apex)
        from megarl.workers.weight_sync import SenderState

        super().__init__()
        self.engine_side = RolloutWorker(engine_thread=False)  # this worker's thread: one OpenMP team
        # the in_process road of sync_weights hands each bucket to the engine here
        self._sender_state = SenderState(local_engine=self.engine_side.apply_bucket)

    def sync_into_engine(self, route, version: int, bucket_bytes: int, keep_samples: bool = True) -> dict:
        """A whole weight sync into the embedded engine, in one call: begin, every bucket, finish (a failure makes
        the engine abandon the update: it refuses to generate until a complete sync). Returns {"sent": as
        sync_weights, "received": the engine's SyncStats}."""
        engine = self.engine_side
        engine.begin_weight_update(version)
        try:
            sent = self.sync_weights(route, version, bucket_bytes, keep_samples)
        except BaseException as err:
            engine.abandon_weight_update(str(err).splitlines()[0][:300])
            raise
        return {"sent": sent, "received": engine.finish_weight_update(version)}


def _delegate(name: str):
    def method(self, *args: Any, **kwargs: Any) -> Any:
        with cpu_compat.paused():  # the engine never names CUDA: no Python call per op for Megatron's CPU mode
            return getattr(self.engine_side, name)(*args, **kwargs)

    method.__name__ = PREFIX + name
    method.__doc__ = f"The embedded engine's `{name}` (RolloutWorker.{name})."
    return method


for _name in ENGINE_METHODS:
    setattr(HybridActorWorker, PREFIX + _name, _delegate(_name))


class EngineView:
    """The rollout engines of a hybrid job as the controller's `roles.rollout`: the actor group's workers, each
    call sent to `engine_<method>`. The actor group owns the workers (shutdown is its)."""

    role = "rollout"

    def __init__(self, group: WorkerGroup):
        self.group = group

    @property
    def workers(self) -> list:
        return self.group.workers

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return self.group.call(PREFIX + method, *args, **kwargs)

    def async_call(self, method: str, /, *args: Any, **kwargs: Any) -> PendingCall:
        return self.group.async_call(PREFIX + method, *args, **kwargs)

    def shutdown(self) -> None:
        """Nothing of its own to stop: the actor group's shutdown ends the workers."""
