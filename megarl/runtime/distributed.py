"""Process-group setup: torch.distributed (NCCL with CUDA, gloo without) and Megatron-Core's parallel state."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.runtime import cpu_compat
from megarl.runtime.parallel import ParallelConfig
from megarl.runtime.quiet import silence_expected_warnings
from megarl.runtime.seed import set_seed


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
    backend: str | None = None,
    timeout_s: float = 1800.0,
) -> DistInfo:
    """Join the default process group.

    Arguments left as None come from the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT); a single process with none of them set forms a world of one. The CPU compatibility layer for
    Megatron-Core is switched on by `init_model_parallel` (processes without Megatron, e.g. rollout engines, skip
    the Megatron import it costs).
    """
    silence_expected_warnings()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if world_size == 1 and master_port is None:
            # A world of one needs no rendezvous: an in-process store avoids claiming a port.
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = master_port or int(os.environ["MASTER_PORT"])
            dist.init_process_group(
                backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size, timeout=timeout
            )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """`dist.all_reduce` in place, skipped for a group of one (on gloo a collective of one rank still costs a
    round through the backend: ~0.1 ms, eight of them per update step of a one-rank role). Returns `tensor`."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def init_model_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Create Megatron-Core's TP/PP/EP/CP/DP groups over the default group, and seed its RNG tracker. Without CUDA
    the CPU compatibility layer is switched on first (from the calling thread: the one that will run the model)."""
    parallel.check()  # a job config's layout was checked with its key already; this guards layouts built in code
    cpu_compat.activate()
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world} is not a multiple of tp*pp*cp={parallel.model_parallel_size} "
            f"(tp={parallel.tp}, pp={parallel.pp}, cp={parallel.cp})"
        )
    _groups_before_megatron.clear()
    _groups_before_megatron.update(process_groups())
    parallel_state.initialize_model_parallel(**parallel.megatron_sizes())
    set_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down Megatron's parallel state and the process groups it created.

    Megatron forgets its groups without destroying them: a process that changes layout many times (a rank pool
    running a test suite) would pile up thousands of gloo threads and sockets.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _groups_before_megatron:
        destroy_groups_since(_groups_before_megatron)
    _groups_before_megatron.clear()


_groups_before_megatron: set = set()


def process_groups() -> set:
    """The process groups of this process's world (the default group included)."""
    if not dist.is_initialized():
        return set()
    return set(dist.distributed_c10d._world.pg_map)  # no public listing of groups exists


def destroy_groups_since(before: set) -> None:
    """Destroy every process group created since `before` (a `process_groups()` snapshot)."""
    for group in process_groups() - before:
        dist.destroy_process_group(group)


@contextmanager
def single_process_megatron() -> Iterator[None]:
    """Megatron-Core state for one process holding a whole model (TP=PP=1), e.g. for offline conversion.

    Reuses an existing world of one; a process group created here is destroyed on exit.
    """
    created = not dist.is_initialized()
    if created:
        init_distributed(rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"single_process_megatron needs a world of one process, not {dist.get_world_size()}")
    init_model_parallel(ParallelConfig())
    try:
        yield
    finally:
        destroy_model_parallel()
        if created:
            dist.destroy_process_group()
