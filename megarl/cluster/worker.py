"""The base of every role worker: one process of an SPMD torch.distributed world, run by Ray.

A plain Python class: `WorkerGroup` wraps it with `ray.remote` and tells each process who it is through the
environment (MEGARL_ROLE, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), set before `__init__` runs, so a
subclass knows its rank in its own `__init__` whether or not it calls `super().__init__()`. Heavy set-up (models,
Megatron state) belongs in a method the controller calls after the group is built, once the process group exists.
Methods run one at a time on the process's main thread (Ray's default for actors), the thread that formed the
process group: the CPU compatibility layer for Megatron-Core is per thread.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

ROLE_ENV = "MEGARL_ROLE"


@dataclass(frozen=True)
class ParallelInfo:
    """Where a worker stands in data parallelism: which share of a batch it takes, and who reports results."""

    dp_rank: int
    """Data-parallel rank: workers with the same dp_rank receive the same part of a dp_split batch."""
    dp_size: int
    """Number of data-parallel ranks (parts a batch is split into)."""
    is_dp_leader: bool
    """Whether this worker's result stands for its DP rank (exactly one leader per dp_rank)."""


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once its process group is formed."""

    role: str
    rank: int
    local_rank: int
    node_ip: str
    pid: int
    gpu_ids: list[str]
    """GPU ids Ray assigned to the worker (logical ones on a CPU machine)."""
    cuda_visible_devices: str | None
    backend: str


class Worker:
    """Base class of role workers; the group runs one per rank. Subclasses add the role's methods."""

    process_group_backend: str | None = None
    """The group's torch.distributed backend: None = NCCL with CUDA, gloo without. A worker whose group only
    coordinates (no tensors on GPUs) sets "gloo": it then claims no CUDA device of its own."""

    @property
    def role(self) -> str:
        return os.environ.get(ROLE_ENV, "worker")

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def local_rank(self) -> int:
        """Index of this worker among its group's workers on the same node."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def node_ip_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it: rank 0 answers where the others meet it (rendezvous)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))  # all interfaces: ranks on other nodes connect to it
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, master_addr: str, master_port: int, timeout_s: float = 1800.0) -> WorkerInfo:
        """Join the group's torch.distributed world (`process_group_backend`: NCCL with CUDA, gloo without).

        The torchrun variables are exported too, for libraries that read them; CUDA_VISIBLE_DEVICES stays as Ray
        assigned it (one device per worker, so the device index is 0 whatever the local rank; rollout workers of
        multi-GPU engines see the whole node and use gloo).
        """
        import ray

        from megarl.runtime.distributed import init_distributed

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        dist_info = init_distributed(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            local_rank=self.local_rank,
            timeout_s=timeout_s,
            backend=self.process_group_backend,
        )
        return WorkerInfo(
            role=self.role,
            rank=self.rank,
            local_rank=self.local_rank,
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpu_ids=[str(gpu_id) for gpu_id in ray.get_gpu_ids()],
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            backend=dist_info.backend,
        )

    def parallel_info(self) -> ParallelInfo:
        """This worker's data-parallel place. Default: every rank is its own DP rank and a leader.

        Megatron role workers override it from `parallel_state` (DP rank; leader = TP rank 0 on the last pipeline
        stage, CP rank 0). The group asks once, on the first call that needs it, and keeps the answer: the layout
        must be set up by then (or call `WorkerGroup.refresh_parallel_info()` after changing it).
        """
        return ParallelInfo(dp_rank=self.rank, dp_size=self.world_size, is_dp_leader=True)

    def memory_stats(self) -> dict[str, float]:
        """This process's memory now, in GiB: resident host memory (`rss_gb`) and, once it uses CUDA, the peak
        allocated since the previous call (`peak_allocated_gb`, then reset), reserved (`reserved_gb`) and the
        device's used memory as NVML sees it, every process included (`device_used_gb`)."""
        import psutil
        import torch

        stats = {"rss_gb": psutil.Process().memory_info().rss / 2**30}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            stats["reserved_gb"] = torch.cuda.memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
            free, total = torch.cuda.mem_get_info()  # the driver's account: every process on the device
            stats["device_used_gb"] = (total - free) / 2**30
        return stats

    def ping(self) -> int:
        """Answers this worker's rank: the process is alive and not busy."""
        return self.rank

    def exit_now(self, exit_code: int = 1) -> None:
        """End the process at once, without clean-up (fault-tolerance tests)."""
        os._exit(exit_code)

    @property
    def device(self):
        """Where this worker computes: tensors of every call are moved there on entry and back to the CPU on exit
        (runtime/device.py). The CPU here; Megatron role workers use their GPU."""
        import torch

        return torch.device("cpu")

    def device_type(self) -> str:
        """Where this worker computes: "cuda" or "cpu" (the controller asks once, e.g. whether a handover frees
        anything)."""
        return self.device.type

    def call_method(self, method: str, keep_result: bool, /, *args: Any, **kwargs: Any) -> Any:
        """Run `method(*args, **kwargs)` for the group; return its result only where the collect mode uses it, so
        that ranks whose results are dropped (TP peers, early pipeline stages) send nothing back. The device
        boundary: tensors in the arguments go to `self.device`, tensors in the result come back to the CPU."""
        device = self.device
        if device.type != "cpu":
            from megarl.runtime.device import to_device, to_host

            args, kwargs = to_device(args, device), to_device(kwargs, device)
            result = getattr(self, method)(*args, **kwargs)
            return to_host(result) if keep_result else None
        result = getattr(self, method)(*args, **kwargs)
        return result if keep_result else None
