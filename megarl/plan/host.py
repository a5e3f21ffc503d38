"""Host memory of one node: what the offloaded roles, the worker processes and Ray keep in the node's RAM.

Terms (per node, GB = 2^30 bytes):
- offloaded states: each GPU's share of what its roles move to the host while another role has the GPU (colocated
  turns: bf16 parameters, and the optimizer when it is not already on the CPU) plus, with CPU optimizer offload,
  fp32 master weights, Adam moments and the fp32 gradient copy the CPU step reads (16 bytes per parameter of the
  GPU's optimizer shard) — megarl.plan.memory;
- pinned transfer buffers: Megatron's CPU optimizer moves gradients and parameters through page-locked buffers as
  large as the GPU's shard (fp32 both ways: 8 bytes per parameter of the shard);
- processes: every training worker and every SGLang tensor-parallel rank on the node is a Python process holding
  torch, CUDA's host-side state, Transformer Engine / SGLang kernels and NCCL's host buffers, PROCESS_HOST_GB each;
- Ray's object store, which Ray sizes at 30% of the node's RAM up to 200 GB unless cluster.object_store_memory_mb
  says otherwise (shared memory: it is reserved, if not all resident).

Calibration: issue 16 quotes 1.4-1.6 TB per node reported by teams running colocated DeepSeek-V3 671B RL with CPU
optimizer offload (verl's and slime's DeepSeek recipes; the pages were not re-read in this session, which had no
network). The previous model counted only the first term: about 750 GB for the 671B job. With the terms above, the
layout of slime's DeepSeek-R1 example (tp 8, pp 4 with 13 layers on the last stage, ep 32, 128 H100) plans at about
1416 GB (2^30 bytes) per node, 1.52 TB, inside the quoted range, and configs/grpo_deepseek_v3_671b.yaml (tp 2,
pp 16, ep 8) at about 1151 GB, 1.24 TB (tests/test_plan_configs.py pins both). PROCESS_HOST_GB is the
per-process figure that closes the gap, consistent with the 4-8 GB RSS commonly seen per Megatron or SGLang rank on
GPU nodes; to be measured on the first GPU run (tools/gpu/).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.memory import GB, HOST_OPTIMIZER_BYTES, RoleMemory

PROCESS_HOST_GB = 6.0
"""Host memory of one GPU worker process (training rank or SGLang rank): torch, CUDA host state, NCCL buffers."""
PINNED_BYTES_PER_SHARD_PARAM = 8
"""Page-locked fp32 gradient and parameter buffers of Megatron's CPU optimizer, per parameter of the GPU's shard."""
RAY_OBJECT_STORE_CAP = 200e9
RAY_OBJECT_STORE_FRACTION = 0.3


@dataclass(frozen=True)
class HostMemory:
    offloaded: float
    pinned: float
    processes: float
    object_store: float

    @property
    def total(self) -> float:
        return self.offloaded + self.pinned + self.processes + self.object_store

    def describe(self) -> str:
        parts = [
            ("offloaded states", self.offloaded),
            ("pinned optimizer buffers", self.pinned),
            ("worker processes", self.processes),
            ("Ray object store", self.object_store),
        ]
        return ", ".join(f"{name} {value / GB:.0f}" for name, value in parts if value >= 0.5 * GB)


def host_memory_per_node(
    memories: list[RoleMemory],
    gpus_on_node: int,
    engine_ranks_on_node: int,
    object_store_mb: int | None,
    host_memory_gb: float | None,
) -> HostMemory:
    """The node's host memory with `gpus_on_node` training GPUs (each running every role in `memories`) and
    `engine_ranks_on_node` SGLang ranks."""
    offloaded = sum(m.host_bytes_when_offloaded() for m in memories) * gpus_on_node
    pinned = (
        sum(m.optimizer_host_bytes / HOST_OPTIMIZER_BYTES * PINNED_BYTES_PER_SHARD_PARAM for m in memories)
        * gpus_on_node
    )
    processes = (len(memories) * gpus_on_node + engine_ranks_on_node) * PROCESS_HOST_GB * GB
    if object_store_mb is not None:
        store = object_store_mb * 2**20
    elif host_memory_gb is not None:
        store = min(RAY_OBJECT_STORE_CAP, RAY_OBJECT_STORE_FRACTION * host_memory_gb * GB)
    else:
        store = RAY_OBJECT_STORE_CAP
    return HostMemory(offloaded, pinned, processes, float(store))
