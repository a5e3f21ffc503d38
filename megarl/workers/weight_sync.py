"""Weight sync, sending side: the actor's shards -> HF-named buckets -> every rollout engine.

Each actor rank runs the bridge's export stream (gathering TP shards is collective, so every rank iterates it; only
the senders get buckets: one rank per TP group, each PP stage its own layers, each EP rank its own experts). A
bucket goes into Ray's object store once (as NumPy views: megarl/workers/bucket_transport.py) and to every engine
by reference. Gathering the next bucket overlaps the
engines applying the current one; at most two buckets are in flight, which bounds the memory beyond the model.

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
from megarl.workers.bucket_transport import pack_bucket

MAX_BUCKETS_IN_FLIGHT = 2


def send_weights(model: LoadedModel, engines: list, version: int, bucket_bytes: int) -> dict[str, float]:
    """Collective over the actor's ranks: send this rank's buckets to every engine (a Ray actor handle with an
    `apply_packed_bucket(packed)` method). Returns {"bytes", "tensors", "buckets", "seconds"} of what this rank sent."""
    import ray

    start = time.perf_counter()
    in_flight: deque[list] = deque()
    sent_bytes = sent_tensors = num_buckets = 0
    with torch.no_grad():
        for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes):
            while len(in_flight) >= MAX_BUCKETS_IN_FLIGHT:
                ray.get(in_flight.popleft())
            ref = ray.put(pack_bucket(bucket))  # copied into the object store: the parameters may change afterwards
            in_flight.append([engine.apply_packed_bucket.remote(ref) for engine in engines])
            sent_bytes += sum(t.nbytes for _, t in bucket)
            sent_tensors += len(bucket)
            num_buckets += 1
    while in_flight:
        ray.get(in_flight.popleft())
    return {
        "bytes": float(sent_bytes),
        "tensors": float(sent_tensors),
        "buckets": float(num_buckets),
        "seconds": time.perf_counter() - start,
    }
