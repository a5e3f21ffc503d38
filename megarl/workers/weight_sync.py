"""Weight sync, sending side: the actor's shards -> HF-named buckets -> every rollout engine.

Each actor rank runs the bridge's export stream (gathering TP shards is collective, so every rank iterates it; only
the senders get buckets: one rank per TP group, each PP stage its own layers, each EP rank its own experts). A
bucket goes into Ray's object store once (as NumPy views: megarl/workers/bucket_transport.py) and to every engine
by reference. Gathering the next bucket overlaps the
engines applying the current one; at most two buckets are in flight, which bounds the memory beyond the model.

An engine on the same GPU as the sending rank (colocated; `engine_devices` lists each engine's visible GPUs) gets a
CUDA IPC handle on a flattened copy of the bucket instead: no host copy, the engine copies device to device.

On GPU clusters with SGLang the transport is SGLang's own (update_weights_from_tensor when colocated, an NCCL
broadcast group when split: megarl/rollout/sglang_weights.py); this Ray path serves the embedded `hf` engine and
any engine behind a Ray worker.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from megarl.bridge.exporter import export_hf_weights
from megarl.checkpoint.model_io import LoadedModel
from megarl.workers.bucket_transport import device_uuid, pack_bucket, pack_bucket_ipc

MAX_BUCKETS_IN_FLIGHT = 2


def send_weights(
    model: LoadedModel, engines: list, version: int, bucket_bytes: int, engine_devices: list[list[str]] | None = None
) -> dict[str, float]:
    """Collective over the actor's ranks: send this rank's buckets to every engine (a Ray actor handle with
    `apply_packed_bucket(packed)` and `apply_ipc_bucket(packed)` methods). Returns {"bytes", "tensors", "buckets",
    "seconds", "ipc_engines"} of what this rank sent."""
    import ray

    start = time.perf_counter()
    in_flight: deque[tuple[list, object]] = deque()
    sent_bytes = sent_tensors = num_buckets = 0
    ipc = _same_gpu(engines, engine_devices)
    with torch.no_grad():
        for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes):
            while len(in_flight) >= MAX_BUCKETS_IN_FLIGHT:
                ray.get(in_flight.popleft()[0])
            calls, keep_alive = [], None
            if any(ipc):
                packed_ipc, keep_alive = pack_bucket_ipc(bucket)  # the buffer lives until the engines have copied
                calls += [engine.apply_ipc_bucket.remote(packed_ipc) for engine, on in zip(engines, ipc) if on]
            if not all(ipc):
                ref = ray.put(pack_bucket(bucket))  # copied into the object store: parameters may change afterwards
                calls += [engine.apply_packed_bucket.remote(ref) for engine, on in zip(engines, ipc) if not on]
            in_flight.append((calls, keep_alive))
            sent_bytes += sum(t.nbytes for _, t in bucket)
            sent_tensors += len(bucket)
            num_buckets += 1
    while in_flight:
        ray.get(in_flight.popleft()[0])
    return {
        "bytes": float(sent_bytes),
        "tensors": float(sent_tensors),
        "buckets": float(num_buckets),
        "seconds": time.perf_counter() - start,
        "ipc_engines": float(sum(ipc)),
    }


def _same_gpu(engines: list, engine_devices: list[list[str]] | None) -> list[bool]:
    """Per engine: does it see this rank's GPU (then a CUDA IPC handle reaches it without a host copy)?"""
    if not engine_devices or not torch.cuda.is_available():
        return [False] * len(engines)
    mine = device_uuid(torch.device("cuda", torch.cuda.current_device()))
    return [mine in devices for devices in engine_devices]
