"""Cluster settings: where Ray runs, what one worker reserves, and how long the controller waits for workers.

Imports nothing heavy (no ray, no torch): the config loader reads it before anything starts.
"""

from __future__ import annotations

import glob
import re
import warnings
from dataclasses import dataclass, field
from typing import Literal

from megarl.errors import UserError

PlacementStrategy = Literal["per_node", "pack"]
_HOST_PORT = re.compile(r"^(ray://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class GroupTimeouts:
    """How long a worker group waits for its workers; the driver never waits longer than these."""

    init_s: float = 300.0
    """Start-up of a group: workers scheduled, `__init__` run, process group formed (imports included)."""
    call_s: float | None = 3600.0
    """Default limit of one `call`; None waits without limit (dead workers are still detected)."""
    failure_grace_s: float = 10.0
    """Once one rank failed, how long the others may still answer (to collect their tracebacks) before the group
    is killed: ranks waiting in a collective for the failed one would otherwise wait forever."""
    collective_s: float = 1800.0
    """torch.distributed timeout inside the workers: the longest one collective may wait for its peers."""


@dataclass
class ClusterConfig:
    """The Ray cluster the job runs on: a local instance (default, CPU-friendly) or a running cluster."""

    address: str | None = None
    """None: start a local Ray instance. "auto": join the cluster running on this machine (the Slurm/KubeRay
    templates start one). "host:port" (GCS address) or "ray://host:port" (Ray client): join that cluster."""
    num_nodes: int = 1
    """Nodes the job uses. A local Ray instance is one node."""
    gpus_per_node: int | None = None
    """GPUs per node the job uses; None: all each node has (a local instance without GPUs: `logical_gpus`)."""
    cpus_per_worker: float = 1.0
    """CPU cores each worker reserves next to its GPU; also its intra-op threads (OMP/MKL), at least 1."""
    logical_gpus: int | None = None
    """Local Ray only: how many GPUs `ray.init(num_gpus=N)` announces, so placement groups and bundles work on a
    machine without GPUs (workers then use gloo). None: the real GPUs when torch sees any, else
    num_nodes * gpus_per_node (1 when gpus_per_node is None)."""
    num_cpus: int | None = None
    """Local Ray only: CPUs Ray announces; None: the machine's cores, raised to what the logical GPUs' bundles need
    (cpus_per_worker each, plus one for the driver's own tasks)."""
    object_store_memory_mb: int | None = None
    """Local Ray only: size of the shared-memory object store in MiB; None: Ray's default (30% of RAM)."""
    namespace: str = "megarl"
    """Ray namespace of the job's workers and placement groups."""
    include_dashboard: bool = False
    """Local Ray only: start the Ray dashboard (slow to start, needs extra packages)."""
    log_to_driver: bool = True
    """Print the workers' stdout/stderr in the driver's output."""
    connect_timeout_s: float = 30.0
    """How long to try reaching `address` before giving up with an error."""
    init_timeout_s: float = 300.0
    """Start-up of a worker group (scheduling, `__init__`, process group) and of a resource pool's placement."""
    call_timeout_s: float | None = 3600.0
    """Default limit of one worker-group call; None: no limit (dead workers are still detected)."""
    failure_grace_s: float = 10.0
    """After one rank fails, how long the others may still answer before the group is killed."""
    collective_timeout_s: float = 1800.0
    """torch.distributed timeout inside the workers: the longest one collective (NCCL/gloo) may wait for its peers,
    e.g. while rank 0 writes a checkpoint."""
    placement: PlacementStrategy = "per_node"
    """How a resource pool reserves GPUs. "per_node": one STRICT_PACK placement group per node (ranks 0..g-1 on
    one node, g = GPUs per node). "pack": one PACK group over all bundles, Ray picking the nodes; bundles are
    then ordered by node."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Environment variables set in every worker process (e.g. {"NCCL_DEBUG": "WARN"})."""

    @property
    def is_local(self) -> bool:
        """Whether `start_ray` starts its own Ray instance rather than joining a cluster."""
        return self.address is None

    def timeouts(self) -> GroupTimeouts:
        """The worker-group timeouts these settings describe."""
        return GroupTimeouts(
            init_s=self.init_timeout_s,
            call_s=self.call_timeout_s,
            failure_grace_s=self.failure_grace_s,
            collective_s=self.collective_timeout_s,
        )

    def check(self, key: str) -> None:
        if self.address is not None and self.address != "auto" and not _HOST_PORT.match(self.address):
            raise UserError(
                f"{key}.address={self.address!r} is not a Ray address; valid: null (start a local instance), "
                f"'auto', 'host:port' or 'ray://host:port'"
            )
        if self.num_nodes < 1:
            raise UserError(f"{key}.num_nodes={self.num_nodes} must be >= 1")
        if self.is_local and self.num_nodes > 1:
            raise UserError(
                f"{key}.num_nodes={self.num_nodes} needs a Ray cluster: a local instance is one node; set "
                f"{key}.address ('auto' on the head node) or {key}.num_nodes=1"
            )
        for name in ("gpus_per_node", "logical_gpus", "num_cpus", "object_store_memory_mb"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{key}.{name}={value} must be >= 1 or null")
        if self.cpus_per_worker <= 0:
            raise UserError(f"{key}.cpus_per_worker={self.cpus_per_worker} must be > 0")
        for name in ("connect_timeout_s", "init_timeout_s", "call_timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"{key}.{name}={value} must be > 0" + (" or null" if name == "call_timeout_s" else ""))
        if self.failure_grace_s < 0:
            raise UserError(f"{key}.failure_grace_s={self.failure_grace_s} must be >= 0")
        if self.placement not in ("per_node", "pack"):
            raise UserError(f"{key}.placement={self.placement!r} is not known; valid: per_node, pack")
        if not self.is_local:
            local_only = ("logical_gpus", "num_cpus", "object_store_memory_mb")
            ignored = [name for name in local_only if getattr(self, name) is not None]
            if self.include_dashboard:
                ignored.append("include_dashboard")
            if ignored:
                warnings.warn(
                    f"{', '.join(f'{key}.{name}' for name in ignored)} only apply to a local Ray instance and have "
                    f"no effect with {key}.address={self.address!r}",
                    stacklevel=2,
                )


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch (2-3 s) on a machine with no NVIDIA device file."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    import torch

    return torch.cuda.is_available()
