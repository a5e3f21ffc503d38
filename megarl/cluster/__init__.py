"""Ray resource pools on placement groups and SPMD worker groups; nothing here knows about models.

The controller is one Python process; each role (actor, critic, ref, reward, rollout) is a `WorkerGroup`: Ray
worker processes pinned to a `ResourcePool`'s bundles and forming one torch.distributed world. Role workers
subclass `Worker`.

The public names are imported lazily, so that `megarl.cluster.config` stays light for the config loader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClusterConfig": "megarl.cluster.config",
    "GroupTimeouts": "megarl.cluster.config",
    "RayInfo": "megarl.cluster.ray_runtime",
    "NodeInfo": "megarl.cluster.ray_runtime",
    "start_ray": "megarl.cluster.ray_runtime",
    "stop_ray": "megarl.cluster.ray_runtime",
    "ResourcePool": "megarl.cluster.resource_pool",
    "Worker": "megarl.cluster.worker",
    "ParallelInfo": "megarl.cluster.worker",
    "WorkerInfo": "megarl.cluster.worker",
    "WorkerGroup": "megarl.cluster.worker_group",
    "PendingCall": "megarl.cluster.worker_group",
    "start_groups": "megarl.cluster.worker_group",
    "WorkerError": "megarl.cluster.errors",
    "WorkerTimeoutError": "megarl.cluster.errors",
    "PhaseTimeoutError": "megarl.cluster.deadline",
    "phase_deadline": "megarl.cluster.deadline",
    "RankFailure": "megarl.cluster.errors",
    "DISPATCH_MODES": "megarl.cluster.dispatch",
    "COLLECT_MODES": "megarl.cluster.dispatch",
}
__all__ = [
    "COLLECT_MODES",
    "DISPATCH_MODES",
    "ClusterConfig",
    "GroupTimeouts",
    "NodeInfo",
    "ParallelInfo",
    "PendingCall",
    "PhaseTimeoutError",
    "RankFailure",
    "RayInfo",
    "ResourcePool",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerTimeoutError",
    "phase_deadline",
    "start_groups",
    "start_ray",
    "stop_ray",
]

if TYPE_CHECKING:
    from megarl.cluster.config import ClusterConfig, GroupTimeouts
    from megarl.cluster.deadline import PhaseTimeoutError, phase_deadline
    from megarl.cluster.dispatch import COLLECT_MODES, DISPATCH_MODES
    from megarl.cluster.errors import RankFailure, WorkerError, WorkerTimeoutError
    from megarl.cluster.ray_runtime import NodeInfo, RayInfo, start_ray, stop_ray
    from megarl.cluster.resource_pool import ResourcePool
    from megarl.cluster.worker import ParallelInfo, Worker, WorkerInfo
    from megarl.cluster.worker_group import PendingCall, WorkerGroup, start_groups


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megarl.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
