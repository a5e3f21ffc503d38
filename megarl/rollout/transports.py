"""Which road the weights take from the actor to the rollout engines (`rollout.weight_sync`), decided once per job.

- `ipc`: engines on the actor's GPUs (colocated). A sending rank hands each engine a CUDA IPC handle on a flattened
  copy of the bucket on its own GPU: no host copy. With SGLang the rank posts SGLang's flattened-bucket payload to
  the engine itself (update_weights_from_tensor, one payload per engine TP rank); with the hf engine the handle goes
  through Ray to the engine's worker. An engine on none of the sending ranks' GPUs gets the object-store road.
  SGLang engines across nodes take the per-node relay (megarl/workers/ipc_relay.py): the bucket's owners broadcast
  it to every trainer rank, each engine GPU opens the copy of the trainer rank under it by CUDA IPC, and the
  handle strings are gathered to the engine's first rank, which posts them: only handles cross the network. It
  resolves to the transport `ipc_relay`.
- `nccl`: SGLang engines on GPUs of their own (split), at any actor layout. Each sending rank (one per TP group:
  each PP stage its layers, each EP rank its experts) broadcasts each of its flattened buckets once to every engine
  GPU through a process group of its own with the engines, set up at its first bucket and kept between syncs
  (update_weights_from_distributed: SGLang receives from rank 0 of a group only). The senders take turns in one
  global order, actor rank 0 first (megarl/workers/nccl_senders.py): an engine serves one broadcast at a time, so
  no two groups can wait on each other.
- `object_store`: host copies through Ray's object store, to each engine's worker, which loads them (CPU, and the
  fallback for engines within a node).
- `disk`: each sending rank writes its buckets as safetensors files into a folder of the run directory (a file
  system every node shares); every engine then reads it (SGLang's update_weights_from_disk: all ranks of an engine,
  on every node). The road for engines across nodes when no broadcast group can be used: CUDA IPC handles and the
  rollout worker's host copies reach only the GPUs of its own node.
- `in_process`: not a choice of `rollout.weight_sync`: a hybrid engine's (rollout.hf.hybrid: the engine runs inside
  the one actor worker) weights are copied in place by that worker (megarl/job.py `weight_sync_transport`).
- `auto`: ipc for colocated engines within a node, ipc_relay for colocated SGLang engines across nodes, nccl for
  split SGLang engines (any actor layout, within a node or across nodes); otherwise object_store for engines within
  a node and disk for engines across nodes.
"""

from __future__ import annotations

from typing import Literal

from megarl.errors import UserError

Transport = Literal["ipc", "ipc_relay", "nccl", "object_store", "disk"]
TRANSPORTS = ("ipc", "nccl", "object_store", "disk")


def resolve_weight_sync(
    choice: str,
    backend: str,
    placement_mode: str,
    key: str = "rollout.weight_sync",
    engine_nodes: int = 1,
) -> Transport:
    """The transport for `choice` (rollout.weight_sync), or a UserError naming what rules it out. `engine_nodes`:
    the nodes one rollout engine spans."""
    colocated = placement_mode == "colocated"
    if choice == "auto":
        if backend == "sglang" and not colocated:
            return "nccl"
        if engine_nodes > 1:
            return "ipc_relay" if backend == "sglang" else "disk"
        return "ipc" if colocated else "object_store"
    if choice == "object_store" and engine_nodes > 1:
        raise UserError(
            f"{key}={choice} reaches only the GPUs of one node, and each rollout engine spans {engine_nodes} nodes; "
            "use disk, ipc (colocated SGLang: the per-node relay) or nccl (SGLang, placement.mode=split)"
        )
    if choice == "ipc" and engine_nodes > 1 and colocated:
        if backend != "sglang":
            raise UserError(
                f"{key}=ipc across nodes is the per-node relay into SGLang engines; rollout.backend={backend!r}: use "
                "disk"
            )
        return "ipc_relay"
    if choice == "ipc" and not colocated:
        raise UserError(
            f"{key}=ipc needs the engines on the actor's GPUs (placement.mode=colocated); with placement.mode="
            f"{placement_mode} use nccl (sglang) or object_store"
        )
    if choice == "nccl":
        if backend != "sglang":
            raise UserError(f"{key}=nccl broadcasts into SGLang servers; rollout.backend={backend!r}: use object_store")
        if colocated:
            raise UserError(f"{key}=nccl is for engines on GPUs of their own (placement.mode=split); colocated: ipc")
    if choice not in TRANSPORTS:
        raise UserError(f"{key}={choice!r}: valid are auto, {', '.join(TRANSPORTS)}")
    return choice  # type: ignore[return-value]
