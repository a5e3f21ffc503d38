"""Weight sync, sending side: the actor's shards -> HF-named buckets -> every rollout engine, by the job's transport.

Each actor rank runs the bridge's export stream (gathering TP shards is collective, so every rank iterates it; only
the senders get buckets: one rank per TP group, each PP stage its own layers, each EP rank its own experts; on the
object store road into hf engines every TP rank, below). Per bucket and engine, the road
(megarl/rollout/transports.py):
- object store: the bucket goes into Ray's object store once (as NumPy views: megarl/workers/bucket_transport.py)
  and to every engine's worker by reference. Into engines that take parts of tensors (the hf engine), nothing is
  gathered: every TP rank sends its own part of each split tensor, cut from its shard (q/k/v per query group,
  gate/up halves, vocabulary rows: exporter.export_hf_weights `parts`), so both cores convert and put, and the
  engine copies each part straight into its slice of the parameter;
- shared memory, for a CPU hf engine on this rank's node (megarl/rollout/shared_weights.py): the engine's weights
  live in a shared-memory file this rank maps, and the rank copies each tensor or part straight from its shard into
  the engine's tensor, then tells the engine what it wrote: one copy per byte instead of the object store's two.
  What the file does not hold, and delta buckets (verified by the engine before applying), take the object store;
- ipc, for an engine on this rank's GPU: a CUDA IPC handle on a flattened copy, no host copy. An SGLang engine gets
  SGLang's own flattened-bucket payload posted straight to its server (update_weights_from_tensor, one payload per
  engine TP rank); the hf engine's worker gets the handle through Ray. Engines elsewhere take the object store;
- nccl (SGLang engines on GPUs of their own): each sending rank broadcasts each of its flattened buckets to every
  engine GPU through an SGLangWeightSender (a group of its own with the engines) it keeps between syncs (closed on
  any failure, so the next sync starts clean); with several actor ranks the senders take turns in one global order
  (megarl/workers/nccl_senders.py), so every engine receives from one group at a time;
- in_process (the hybrid engine: workers/hybrid_worker.py): the engine lives in the sending worker, which hands it
  each bucket directly (the engine copies the tensors into its model). With several actor workers (one engine
  each) every bucket first reaches every rank through the relay's broadcast below (`relay_buckets`);
- disk (engines across nodes, any number of sending ranks): each sending rank writes its buckets as safetensors
  files into the sync's folder on the run's shared file system; the controller then has every engine read it;
- ipc_relay (colocated SGLang engines across nodes: megarl/workers/ipc_relay.py): every bucket is broadcast from its
  owner to every actor rank in one global order, and each engine gets one CUDA IPC handle per TP rank, gathered over
  the gloo group of the ranks on its GPUs and posted by the first of them.
Gathering the next bucket overlaps the engines applying the current one, and on the host roads (object store, disk)
also the sending itself: a sender thread copies bucket k into the object store or writes its file while this
thread exports bucket k + 1. At most two buckets are in flight per sending rank, which bounds the memory beyond the
model. The norm weights (rollout/engine.py VERIFY_PATTERN; never split, so always sent whole) are kept, as sent, for
the controller to verify the engines against.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.bridge.exporter import export_hf_weights
from megarl.bridge.fp8 import BlockFP8, quantize_bucket
from megarl.checkpoint.model_io import LoadedModel
from megarl.rollout.engine import VERIFY_PATTERN, Bucket
from megarl.rollout.sglang_weights import unflatten
from megarl.rollout.shared_weights import SharedWeightsUnavailable, SharedWeightsWriter
from megarl.runtime import cpu_compat, faults
from megarl.workers.bucket_transport import device_uuid, pack_bucket, pack_bucket_ipc
from megarl.workers.ipc_relay import relay_each, relay_weights
from megarl.workers.nccl_senders import close_sender, connect_sender, kept_sender, send_in_turns
from megarl.workers.sync_route import SyncRoute
from megarl.workers.weight_delta import CHECKSUM_NAME, DeltaEncoder, delta_to_bucket

log = logging.getLogger(__name__)

MAX_BUCKETS_IN_FLIGHT = 2
HOST_ROADS = frozenset({"object_store", "disk"})
"""Roads whose sending is host work only (a copy into Ray's object store, a file write): it runs on a sender thread,
overlapped with the export of the next bucket. The GPU roads (ipc, nccl) and the in-process copy stay on the
exporting thread (one CUDA stream and one OpenMP team per process)."""
InFlight = tuple[list, object] | Future
"""A bucket on its way: what `_send_bucket` returned, or its future on the sender thread."""


@dataclass
class SenderState:
    """What a sending rank keeps between syncs: the NCCL group with the SGLang engines."""

    nccl: object | None = None
    """The nccl road: this rank's weight-update group with the engines (an SGLangWeightSender), from its first
    bucket on."""
    nccl_key: tuple | None = None
    """What `nccl` was set up for: (group name, the engines' endpoints) (nccl_senders.kept_sender)."""
    turns: object | None = None
    """The nccl road with several actor ranks: the gloo group of the whole actor that passes the senders' turns
    (megarl/workers/nccl_senders.py), created at the first sync."""
    local_engine: Callable[[Bucket], None] | None = None
    """The in_process road: the engine in this worker (workers/hybrid_worker.py), given each bucket directly."""
    files_written: int = 0
    """Bucket files this rank wrote for the disk transport (their names count up within a sync folder)."""
    delta: DeltaEncoder = field(default_factory=DeltaEncoder)
    """The delta road: what this rank last sent (megarl/workers/weight_delta.py)."""
    relay: object | None = None
    """The ipc_relay road: this rank's engine group (ipc_relay.RelayGroups), created at the first sync."""
    shared: dict[str, SharedWeightsWriter | None] = field(default_factory=dict)
    """The shared memory road: this rank's mapping of each engine's weights, by the file's token (None: the file
    cannot be opened from here; said once). Mappings of engines that are gone are dropped."""


def send_weights(
    model: LoadedModel, route: SyncRoute, version: int, bucket_bytes: int, state: SenderState, keep_samples: bool = True
) -> dict:
    """Collective over the actor's ranks: send this rank's buckets to every engine. Returns {"bytes", "tensors",
    "buckets", "seconds", "ipc_engines", "in_process_engines", "samples"} of what this rank sent ("samples": the
    norm weights, on CPU, when `keep_samples`: the controller verifies this sync)."""
    start = time.perf_counter()
    if route.transport == "ipc_relay":
        fp8 = BlockFP8.from_config(route.quantization, "rollout.weights_format") if route.quantization else None
        with torch.no_grad():
            sent = relay_weights(_exported(model, bucket_bytes, fp8), route, state, keep_samples)
        return sent | {"seconds": time.perf_counter() - start}
    if route.transport == "nccl" and dist.is_initialized() and dist.get_world_size() > 1:
        fp8 = BlockFP8.from_config(route.quantization, "rollout.weights_format") if route.quantization else None
        try:
            with torch.no_grad():
                sent = send_in_turns(_exported(model, bucket_bytes, fp8), route, state, keep_samples)
        except BaseException:
            close_sender(state)  # a half-used group is not reused: the next sync sets up fresh ones
            raise
        seconds = time.perf_counter() - start
        return sent | {"full_bytes": sent["bytes"], "seconds": seconds, "ipc_engines": 0.0, "in_process_engines": 0.0}
    if route.transport == "in_process" and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            sent = _relay_in_process(_exported(model, bucket_bytes, None), state, keep_samples)
        return sent | {"seconds": time.perf_counter() - start}
    in_flight: deque[InFlight] = deque()
    sent_bytes = sent_tensors = num_buckets = full_bytes = 0
    if route.delta == "full":
        state.delta.reset()
    roads = _roads(route, state)
    samples: Bucket = []
    verify = re.compile(VERIFY_PATTERN)
    fp8 = BlockFP8.from_config(route.quantization, "rollout.weights_format") if route.quantization else None
    sender = ThreadPoolExecutor(1, "megarl-weight-sender") if roads and set(roads) <= HOST_ROADS else None
    parts = _sends_parts(route, roads, fp8)
    try:
        # the export names no CUDA device: without cpu_compat's Python call on every op (a third of the CPU time
        # of an export in parts, tools/bench/refit.py)
        with torch.no_grad(), cpu_compat.paused():
            for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes, parts=parts):
                bucket = faults.tamper("sync.bucket", bucket)  # tests of the sync probe only
                if fp8 is not None:
                    bucket = quantize_bucket(bucket, fp8)
                full_bytes += sum(t.nbytes for _, t in bucket)
                sent_tensors += len(bucket)
                if keep_samples:
                    samples += [(name, t.detach().cpu().clone()) for name, t in bucket if verify.search(name)]
                if route.delta != "off":
                    bucket = delta_to_bucket(state.delta.encode(bucket))
                while len(in_flight) >= MAX_BUCKETS_IN_FLIGHT:
                    _wait(in_flight.popleft())
                if sender is not None:
                    in_flight.append(sender.submit(_send_bucket, bucket, route, roads, state))
                else:
                    in_flight.append(_send_bucket(bucket, route, roads, state))
                sent_bytes += sum(t.nbytes for _, t in bucket)
                num_buckets += 1
        while in_flight:
            _wait(in_flight.popleft())
    except BaseException:
        close_sender(state)  # a half-used NCCL group is not reused
        state.delta.reset()  # the engines may not hold what the snapshot says
        raise
    finally:
        if sender is not None:  # nothing left running after a failure: later buckets are dropped
            sender.shutdown(wait=True, cancel_futures=True)
    return {
        "bytes": float(sent_bytes),
        "full_bytes": float(full_bytes),
        "tensors": float(sent_tensors),
        "buckets": float(num_buckets),
        "seconds": time.perf_counter() - start,
        "ipc_engines": float(sum(road == "ipc" for road in roads)),
        "in_process_engines": float(sum(road == "in_process" for road in roads)),
        "shared_memory_engines": float(sum(road == "shared_memory" for road in roads)),
        "samples": samples,
    }


def _exported(model: LoadedModel, bucket_bytes: int, fp8: BlockFP8 | None):
    for bucket in export_hf_weights(model.bridge, model.hf_dtypes, bucket_bytes):
        bucket = faults.tamper("sync.bucket", bucket)  # tests of the sync probe only
        yield quantize_bucket(bucket, fp8) if fp8 is not None else bucket


def _relay_in_process(buckets, state: SenderState, keep_samples: bool) -> dict:
    """The in_process road with several actor workers, each hosting one engine (a hybrid engine at TP, PP or EP
    > 1): every bucket, whichever rank exports it, is broadcast to every rank in the relay's global order
    (ipc_relay.relay_each: no two broadcasts can cross), and each rank copies it into its own engine."""
    if state.local_engine is None:
        raise RuntimeError("rollout.weight_sync in_process: this actor worker hosts no engine (hybrid_worker.py)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sent = relay_each(buckets, device, lambda part: state.local_engine(unflatten(part)), keep_samples)
    return sent | {"full_bytes": sent["bytes"], "ipc_engines": 0.0, "in_process_engines": 1.0}


def _roads(route: SyncRoute, state: SenderState) -> list[str]:
    """Per engine: in_process, ipc (on this rank's GPU), nccl, disk, shared_memory (a CPU hf engine on this rank's
    node) or object_store."""
    if route.transport in ("nccl", "disk", "in_process"):
        return [route.transport] * len(route.engines)
    mine = device_uuid(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None
    _keep_shared(route, state)
    roads = []
    for engine in route.engines:
        if route.transport == "ipc" and mine is not None and mine in engine.devices:
            roads.append("ipc")
        elif _shared_writer(engine, state) is not None:
            roads.append("shared_memory")
        else:
            roads.append("object_store")
    return roads


def _keep_shared(route: SyncRoute, state: SenderState) -> None:
    """Unmap the shared weights of engines that are gone (replaced after a failure): their memory is freed once
    nobody maps it. (Not by the route: a sync into one restarted engine names that engine only.)"""
    current = {engine.shared_weights.token for engine in route.engines if engine.shared_weights is not None}
    for token, writer in list(state.shared.items()):
        if writer is None and token not in current:
            del state.shared[token]
        elif writer is not None and not writer.engine_alive():
            del state.shared[token]
            writer.close()


def _shared_writer(engine, state: SenderState) -> SharedWeightsWriter | None:
    """This rank's mapping of the engine's shared weights, opened at the first sync; None where there are none or
    they cannot be opened from here (the object store then, said once)."""
    shared = engine.shared_weights
    if shared is None:
        return None
    if shared.token not in state.shared:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "(no Ray node)"
        try:
            state.shared[shared.token] = SharedWeightsWriter(shared, node)
        except SharedWeightsUnavailable as err:
            log.info("weight sync: engine's shared weights not writable from this rank (%s): object store", err)
            state.shared[shared.token] = None
    return state.shared[shared.token]


def _sends_parts(route: SyncRoute, roads: list[str], fp8: BlockFP8 | None) -> bool:
    """Whether every TP rank sends its own parts of the tensors instead of gathering them to one sender
    (exporter.export_hf_weights `parts`): all engines take parts and are reached through the object store, and
    the tensors go as they are (FP8 blocks span the TP shards: FP8 syncs gather). Deltas too: each rank's snapshot
    then holds its own parts, and the engine checks each bucket's checksum over the parts it carries."""
    return (
        bool(roads)
        and all(road in ("object_store", "shared_memory") for road in roads)
        and all(engine.takes_parts for engine in route.engines)
        and fp8 is None
    )


def _send_bucket(bucket: Bucket, route: SyncRoute, roads: list[str], state: SenderState) -> tuple[list, object]:
    """Start sending one bucket on every engine's road; returns (Ray calls to wait for, what must stay alive)."""
    import ray

    from megarl.rollout.sglang_client import SGLangClient
    from megarl.rollout.sglang_weights import send_flattened_bucket

    calls, keep_alive = [], []
    if "in_process" in roads:  # the engine in this process copies the tensors into its model before returning
        if state.local_engine is None:
            raise RuntimeError("rollout.weight_sync in_process: this actor worker hosts no engine (hybrid_worker.py)")
        state.local_engine(bucket)
    if "disk" in roads:  # one file for every engine: they all read the folder
        _write_bucket(bucket, route.disk_dir, state)
    if "nccl" in roads:
        kept_sender(state, route, route.group_name, lambda: _connect_sender(route)).send_bucket(bucket)
    hf_ipc = [e for e, road in zip(route.engines, roads) if road == "ipc" and e.sglang is None]
    if hf_ipc:
        packed, buffer = pack_bucket_ipc(bucket)  # the buffer lives until the engines have copied
        calls += [engine.worker.apply_ipc_bucket.remote(packed) for engine in hf_ipc]
        keep_alive.append(buffer)
    for engine, road in zip(route.engines, roads):
        if road == "ipc" and engine.sglang is not None:  # SGLang's payload, straight to its server
            client = SGLangClient(engine.sglang.url, control_timeout_s=route.timeout_s)
            device = torch.device("cuda", torch.cuda.current_device())
            send_flattened_bucket(client, bucket, num_ranks=engine.sglang.num_ranks, device=device)
    by_store = [(e, bucket) for e, road in zip(route.engines, roads) if road == "object_store"]
    for engine, road in zip(route.engines, roads):
        if road != "shared_memory":
            continue
        if any(name == CHECKSUM_NAME for name, _ in bucket):  # a delta: the engine verifies it before applying
            by_store.append((engine, bucket))
            continue
        written, nbytes, rest = state.shared[engine.shared_weights.token].write(bucket)
        calls.append(engine.worker.apply_shared_writes.remote(written, nbytes))
        if rest:
            by_store.append((engine, rest))
    refs: dict[int, object] = {}  # one copy into the object store per distinct bucket
    for engine, entries in by_store:
        if id(entries) not in refs:
            refs[id(entries)] = ray.put(pack_bucket(entries))  # copied: parameters may change afterwards
        calls.append(engine.worker.apply_packed_bucket.remote(refs[id(entries)]))
    return calls, keep_alive


def _write_bucket(bucket: Bucket, folder: str, state: SenderState) -> None:
    """One bucket as a safetensors file, named by this rank and a running count (files never collide)."""
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(folder, f"rank{rank:05d}-{state.files_written:06d}.safetensors")
    save_file({name: t.detach().contiguous().cpu() for name, t in bucket}, path + ".tmp")
    os.replace(path + ".tmp", path)  # SGLang reads *.safetensors: never a half-written file
    state.files_written += 1


def _connect_sender(route: SyncRoute):
    """The one sending rank of a single-process actor: rank 0 of the group `route.group_name` with the engines."""
    return connect_sender(route, route.group_name)


def _wait(item: InFlight) -> None:
    """Until the engines have the bucket (a failure on the sender thread is raised here)."""
    calls = (item.result() if isinstance(item, Future) else item)[0]
    if not calls:  # (ray.get([]) would start a Ray instance in a process that has none)
        return
    import ray

    ray.get(calls)
