"""How many bytes one weight sync (actor -> rollout engines) moves, and a bandwidth bound on how long it takes.

What is sent: the actor's HF tensors (megarl/bridge export stream), B bytes in the checkpoint's dtype, MTP layers
excluded. Senders: per pipeline stage, one rank of the TP group sends the stage's dense tensors (after gathering
their TP shards) and each expert-parallel rank sends its own experts; data-parallel replicas send nothing. The
busiest sender's share is max over stages of dense_stage + experts_stage / ep. Experts stored stacked (gpt-oss: one
tensor per projection holds all of a layer's experts) travel whole from the first expert-parallel rank, which
gathers the others' rows first: that rank sends dense_stage + experts_stage, and the gather moves (ep - 1) / ep of
the stage's experts to it.

Time, as sums and maxima of bytes / bandwidth (PlanConfig: intra-node per GPU, inter-node per GPU):
- gather: the TP (and expert-TP) all-gather before sending, (tp - 1) / tp of the stage's dense bytes;
- ipc (colocated: CUDA IPC to the engine on the same GPUs), an engine within a node: an engine needs all B bytes; the
  part held on its own nodes (its share of the training nodes, weights assumed spread evenly) moves inside the node,
  the rest enters through the engine GPUs' network links; each engine GPU then reads its 1/tp slice over NVLink;
- ipc relay (colocated engines across nodes, megarl/workers/ipc_relay.py): the owners broadcast each bucket to every
  trainer rank, whose copy its engine GPU opens by CUDA IPC; every node needs the B bytes it does not hold, entering
  through all of its GPUs' network links at once (a multi-rail broadcast), and every GPU receives all B bytes
  (NVLink inside the node); only IPC handle strings cross the network besides;
- nccl (split: one broadcast per bucket from its sender to every engine GPU): all B bytes enter each rollout node
  through its GPUs' links (NVLink when training and rollout share one node), and every engine GPU receives whole
  tensors (B) from the node's fan-out. The senders (one per stage and expert rank) take turns, since an engine
  receives one broadcast at a time (megarl/workers/nccl_senders.py): all B bytes leave through one sender's link
  at a time, however many senders there are;
- object store (host copies): every byte crosses host memory at about HOST_GBPS on the sender and on each engine;
- disk (engines across nodes): the senders write all B bytes to the shared file system, then every node of every
  engine reads them once (its ranks share the node's page cache), at plan.shared_fs_gbps for the whole cluster,
  one after the other;
- in all, the busiest sender pushes its share once (a pipelined broadcast; nccl: the senders one after another);
- per bucket, a fixed cost (BUCKET_OVERHEAD_S): an engine applies updates one call at a time (the request,
  rebuilding tensors, the model's load_weights), so B / bucket_bytes calls add up.
With FP8 rollout (rollout.weights_format) the expert weights travel at one byte per element, the rest at the
checkpoint's width (attention projections are FP8 too: a slight overestimate). Bandwidths are ideal (every GPU's
link busy, no contention) and the pause / cache flush around the update is not counted: read the result as a lower
bound; measured syncs are typically 1.5-3x slower. The figures and their sources are one table:
megarl/plan/bandwidths.py (calibration: only the object-store road has been measured, on CPU; the GPU roads await
the GPU kit).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.plan.bandwidths import BUCKET_OVERHEAD_S, HOST_GBPS
from megarl.plan.memory import RoleLayout
from megarl.plan.model_size import ModelShape, hf_numel
from megarl.plan.placement import Placement


@dataclass(frozen=True)
class SyncEstimate:
    total_bytes: float
    num_senders: int
    max_sender_bytes: float
    num_buckets: int
    """Buckets the busiest sender fills (rollout.bucket_bytes each)."""
    transport: str
    """The resolved rollout.weight_sync: ipc, ipc_relay (ipc for engines across nodes), nccl, object_store, disk."""
    road: str
    """How the bytes travel, one line."""
    gather_s: float
    transfer_s: float
    overhead_s: float
    """BUCKET_OVERHEAD_S x the buckets an engine applies."""

    @property
    def seconds(self) -> float:
        return self.gather_s + self.transfer_s + self.overhead_s

    def as_dict(self) -> dict:
        """`megarl plan --json`'s "sync" object."""
        return {
            "transport": self.transport,
            "road": self.road,
            "bytes": self.total_bytes,
            "seconds": round(self.seconds, 3),
            "gather_s": round(self.gather_s, 3),
            "transfer_s": round(self.transfer_s, 3),
            "overhead_s": round(self.overhead_s, 3),
            "num_senders": self.num_senders,
            "max_sender_bytes": self.max_sender_bytes,
            "num_buckets": self.num_buckets,
        }


def estimate_sync(
    shape: ModelShape,
    layout: RoleLayout,
    placement: Placement,
    intra_gbps: float,
    inter_gbps: float,
    bucket_bytes: int,
    engine_tp: int,
    transport: str = "auto",
    fp8: bool = False,
    shared_fs_gbps: float = 20.0,
) -> SyncEstimate:
    """`transport`: the resolved rollout.weight_sync (ipc, ipc_relay, nccl, object_store, disk); auto: ipc
    colocated, nccl split (any actor layout). fp8: the engines take FP8 weights (rollout.weights_format
    resolved)."""
    if transport == "auto":
        transport = "ipc" if placement.mode == "colocated" else "nccl"
    nbytes = shape.hf_dtype_bytes
    expert_bytes = 1 if fp8 else nbytes
    dense_total, expert_total = hf_numel(shape)
    total = dense_total * nbytes + expert_total * expert_bytes
    extra = dense_total + expert_total - sum(hf_numel(shape, layers=range(shape.num_layers)))  # embedding, norm, head
    shares, gathers = [], []
    intra, inter = intra_gbps * 1e9, inter_gbps * 1e9
    gpn = placement.gpus_per_node
    stacked = bool(shape.moe and shape.moe.get("stacked"))
    expert_senders = 1 if stacked else layout.ep  # a stacked tensor is sent whole, by one rank
    for stage in range(layout.pp):
        dense, expert = hf_numel(shape, layers=layout.stages.stage_layers(shape.num_layers, stage))
        dense += extra if layout.pp == 1 else (extra / 2 if stage in (0, layout.pp - 1) else 0)
        shares.append(dense * nbytes + expert / expert_senders * expert_bytes)
        tp_bw = intra if layout.tp <= gpn else inter
        etp_bw = intra if layout.etp <= gpn else inter
        gather = dense * nbytes * (layout.tp - 1) / layout.tp / tp_bw
        gather += expert / layout.ep * nbytes * (layout.etp - 1) / layout.etp / etp_bw
        if stacked:  # the other expert ranks' rows to the first one
            gather += (
                expert * nbytes * (layout.ep - 1) / layout.ep / (intra if layout.ep * layout.etp <= gpn else inter)
            )
        gathers.append(gather)
    max_share = max(shares)
    if transport == "object_store":
        road = "host copies through Ray's object store, loaded by each engine's worker"
        transfer = max(total / (HOST_GBPS * 1e9), max_share / (HOST_GBPS * 1e9))
    elif transport == "disk":
        road = "safetensors files in the run directory, read by every node of every engine"
        engine_nodes = placement.num_engines * placement.engine_nodes
        transfer = total * (1 + engine_nodes) / (shared_fs_gbps * 1e9)
    elif transport == "ipc_relay":
        road = (
            "per-node relay: each bucket broadcast from its owners to every trainer rank in one global sender "
            "order, opened by the engine GPU under it through CUDA IPC; only handles cross the network"
        )
        remote = total * (1 - 1 / max(1, placement.train_nodes))
        transfer = max(remote / (gpn * inter), total / intra, max_share / inter)
    elif transport == "ipc":
        road = "CUDA IPC into the engines on the same GPUs (update_weights_from_tensor)"
        local_fraction = min(1.0, placement.engine_nodes / max(1, placement.train_nodes))
        remote = total * (1 - local_fraction)
        network = remote / (placement.gpus_per_engine * inter) if remote else 0.0
        send = max_share / inter if placement.train_nodes > placement.engine_nodes else max_share / intra
        transfer = max(network, send, total / engine_tp / intra)
    else:
        road = (
            "one broadcast per bucket from its sender to every engine GPU (update_weights_from_distributed), the "
            "senders taking turns in one global order"
        )
        link = intra if placement.single_node else inter
        ingress = total / (min(gpn, placement.gpus_per_engine) * link)
        transfer = max(ingress, total / link, total / intra)  # the senders' turns: every byte through one link
    return SyncEstimate(
        total_bytes=total,
        num_senders=layout.pp * expert_senders,
        max_sender_bytes=max_share,
        num_buckets=int(-(-max_share // bucket_bytes)),
        transport=transport,
        road=road,
        gather_s=max(gathers),
        transfer_s=transfer,
        overhead_s=-(-total // bucket_bytes) * BUCKET_OVERHEAD_S,
    )
