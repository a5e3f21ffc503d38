"""Toy workers for the cluster tests: real Ray processes in a gloo world, with no model.

They live in the package (not in tests/) so that Ray worker processes can import them by module name.
"""

from __future__ import annotations

import os
import time

import ray
import torch
import torch.distributed as dist

from megarl.cluster.worker import ParallelInfo, Worker
from megarl.data.batch import Batch


class ToyWorker(Worker):
    """Every rank its own DP rank (the base layout). `fail_in_init_on_rank` makes that rank's `__init__` raise."""

    def __init__(self, tag: str = "", fail_in_init_on_rank: int | None = None):
        if self.rank == fail_in_init_on_rank:
            raise RuntimeError(f"toy worker {self.role} rank {self.rank} refuses to start")
        self.tag = tag

    def all_reduce_sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.item()

    def echo(self, *args, **kwargs) -> dict:
        return {"rank": self.rank, "tag": self.tag, "args": args, "kwargs": kwargs}

    def placement(self) -> dict:
        """Where Ray put this worker: its process, GPU ids and the environment the group set."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        names += ("OMP_NUM_THREADS",)
        return {
            "rank": self.rank,
            "role": self.role,
            "pid": os.getpid(),
            "gpu_ids": [str(gpu_id) for gpu_id in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
            "assigned_resources": ray.get_runtime_context().get_assigned_resources(),
            "env": {name: os.environ.get(name) for name in names},
            "dist_rank": dist.get_rank(),
            "dist_world_size": dist.get_world_size(),
        }

    def tag_batch(self, batch: Batch) -> Batch:
        """The batch with columns saying which rank and DP rank processed each sample, and x doubled."""
        info = self.parallel_info()
        num_samples = len(batch)
        return batch.with_tensors(
            x2=batch["x"] * 2,
            by_rank=torch.full((num_samples,), self.rank),
            by_dp_rank=torch.full((num_samples,), info.dp_rank),
        )

    def raise_on_rank(self, failing_rank: int) -> float:
        """`failing_rank` raises; the others wait for it in an all_reduce that never completes."""
        if self.rank == failing_rank:
            raise ValueError(f"toy failure on rank {self.rank}")
        return self.all_reduce_sum(1.0)

    def exit_on_rank(self, dying_rank: int) -> float:
        """`dying_rank`'s process ends at once; the others wait for it in an all_reduce."""
        if self.rank == dying_rank:
            self.exit_now(3)
        return self.all_reduce_sum(1.0)

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class DataTensorToyWorker(ToyWorker):
    """A DP x "TP" = (world/2) x 2 layout: ranks 2d and 2d+1 form DP rank d; the even one is its leader."""

    def parallel_info(self) -> ParallelInfo:
        return ParallelInfo(dp_rank=self.rank // 2, dp_size=self.world_size // 2, is_dp_leader=self.rank % 2 == 0)
