"""Where a weight sync goes: the engines and the transport, decided once by the controller
(trainer/rollout_side/engine_sync.py) and handed to every sending rank (workers/weight_sync.py). Imports nothing
heavy: the controller builds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.rollout.sglang_weights import SGLangEndpoint

if TYPE_CHECKING:
    from megarl.rollout.shared_weights import SharedWeights


@dataclass(frozen=True)
class EngineTarget:
    """One rollout engine as a sending rank sees it."""

    worker: object
    """The engine's Ray worker (apply_packed_bucket / apply_ipc_bucket)."""
    devices: tuple[str, ...] = ()
    """UUIDs of the GPUs the engine runs on (empty on CPU)."""
    sglang: SGLangEndpoint | None = None
    """An SGLang engine's server, for the roads that reach it directly (ipc, nccl)."""
    takes_parts: bool = False
    """The engine takes parts of tensors (megarl/bridge/buckets.py `part_name`: the hf engine): on the object store
    road every TP rank then sends its own parts, with no gather (megarl/workers/weight_sync.py)."""
    shared_weights: SharedWeights | None = None
    """A CPU hf engine's weights in shared memory (megarl/rollout/shared_weights.py): the ranks on its node write
    into them in place instead of going through the object store."""


@dataclass(frozen=True)
class SyncRoute:
    """How this job's weights travel (decided once by the controller: trainer/rollout_side/engine_sync.py)."""

    transport: str
    """ipc, ipc_relay, nccl, object_store, disk or in_process (rollout.weight_sync resolved)."""
    engines: tuple[EngineTarget, ...]
    group_name: str = "megarl_weights"
    timeout_s: float = 600.0
    disk_dir: str | None = None
    """The disk transport: the folder (shared by every node) this sync's files go to."""
    delta: str = "off"
    """rollout.weight_sync_delta for this sync: off (whole tensors), full (whole, and the senders start a new
    snapshot) or delta (changed elements against the snapshot). Resolved by RolloutConfig.sync_delta: delta reaches
    the hf engine on any road but in_process, SGLang engines only on ipc and object_store (megarl's delta loader
    through update_weights_from_tensor: megarl/rollout/sglang_delta.py)."""
    gpus_per_engine: int = 1
    """GPUs of one engine (rollout.gpus_per_engine): the ipc_relay road's engine groups of actor ranks."""
    quantization: dict | None = None
    """The engines' weight format (rollout.weights_format resolved): a block-wise FP8 quantization_config makes the
    senders quantize each bucket into the FP8 checkpoint's names, shapes and dtypes; None sends the weights as
    they are."""

    @classmethod
    def to_workers(
        cls,
        workers: list,
        transport: str = "object_store",
        devices: list[list[str]] | None = None,
        shared: list[SharedWeights | None] | None = None,
    ):
        """A route to hf engine workers (tests and benchmarks); `shared`: each engine's shared weights, if any
        (RolloutWorker.shared_weights)."""
        devices = devices or [[] for _ in workers]
        shared = shared or [None for _ in workers]
        return cls(
            transport,
            tuple(
                EngineTarget(w, tuple(d), takes_parts=True, shared_weights=s)
                for w, d, s in zip(workers, devices, shared)
            ),
        )
