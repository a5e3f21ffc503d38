"""The per-node CUDA-IPC relay: colocated SGLang engines that span nodes get the weights without disk.

slime's road, on SGLang's own API. Per bucket:
1. its owner (the rank the export stream yields it on: one per TP group, each PP stage its layers, each EP rank its
   experts) broadcasts it, flattened, to every actor rank over the actor's process group (NCCL on GPUs). Owners take
   turns in one global order, rank 0 first, each with all of its buckets and then an end mark, so no two broadcasts
   can cross: every rank runs the same sequence of collectives;
2. every rank now holds the bucket on its own GPU, under the engine GPU that SGLang's TP rank runs on (colocated:
   actor rank e * gpus_per_engine + r shares a GPU with TP rank r of engine e);
3. each rank serializes its copy for SGLang (a CUDA IPC handle: megarl/rollout/sglang_weights.py
   `sglang_serializer`), the handle strings are gathered over a gloo group of the ranks on the engine's GPUs, and the
   engine's first rank posts them as one `update_weights_from_tensor` (load_format "flattened_bucket", one payload
   per TP rank): only handles cross the network besides the broadcast;
4. a barrier on that group keeps every copy alive until the server has answered (has copied it into its weights).

The export stream's TP gathers are collectives of the TP group, interleaved differently on each stage; the relay's
broadcasts are collectives of the whole actor. So each rank runs its export on a producer thread that queues its
buckets, while this thread runs the relay: a stage's gathers never wait for another stage's turn. An owner holds
the buckets it exported before its turn (at most its own share of the model).
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.rollout.engine import VERIFY_PATTERN, Bucket
from megarl.rollout.sglang_weights import (
    FlatBucket,
    FlatEntry,
    flatten_bucket,
    pickle_serializer,
    sglang_serializer,
    unflatten,
)
from megarl.workers.bucket_transport import device_uuid
from megarl.workers.sync_route import SyncRoute

Serializer = Callable[[FlatBucket], str]
END = "end"
"""What the producer thread queues after this rank's last bucket (`export_on_thread`)."""
_FAILED = "failed"


@dataclass
class RelayGroups:
    """The gloo groups of the actor ranks on each engine's GPUs (created once, by every rank, in engine order)."""

    engine_index: int
    """The engine whose GPUs this rank shares."""
    group: object
    """The gloo group of this engine's ranks (its first rank posts to the server)."""
    first_rank: int
    num_ranks: int
    everyone: object
    """A gloo group of the whole actor: a failed post stops every rank, not only the engine's (no hang)."""


def engine_groups(world_size: int, gpus_per_engine: int) -> RelayGroups:
    """Collective over the actor: one gloo group per engine (ranks [e * g, (e + 1) * g)); this rank's."""
    if world_size % gpus_per_engine:
        raise ValueError(
            f"the IPC relay needs the actor's {world_size} ranks to tile the engines of {gpus_per_engine} GPUs each "
            "(colocated placement: rollout.gpus_per_engine divides placement.train_gpus)"
        )
    rank = dist.get_rank()
    mine = None
    for first in range(0, world_size, gpus_per_engine):
        group = dist.new_group(list(range(first, first + gpus_per_engine)), backend="gloo")
        if first <= rank < first + gpus_per_engine:
            mine = (first // gpus_per_engine, group, first)
    everyone = dist.new_group(list(range(world_size)), backend="gloo")
    assert mine is not None
    return RelayGroups(*mine, gpus_per_engine, everyone)


def export_on_thread(buckets: Iterable[Bucket], device: torch.device | None) -> tuple[queue.Queue, threading.Thread]:
    """This rank's export stream consumed on a producer thread (started here), so that its TP gathers never wait
    for another rank's turn: (the queue of its buckets, then END or the exception that stopped the stream; the
    thread). The queue is unbounded: an owner holds the buckets it exported before its turn."""
    produced: queue.Queue = queue.Queue()
    producer = threading.Thread(
        target=_produce, args=(buckets, produced, device), name="megarl-relay-export", daemon=True
    )
    producer.start()
    return produced, producer


def _produce(buckets: Iterable[Bucket], out: queue.Queue, device: torch.device | None) -> None:
    """The producer thread: this rank's export stream into `out`, then an end mark (or the failure)."""
    try:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread
        for bucket in buckets:
            out.put(bucket)
        out.put(END)
    except BaseException as err:  # handed to the consuming thread, which tells every rank
        out.put(err)


def relay_buckets(
    own: Iterable[Bucket], device: torch.device, group: object = None
) -> Iterator[tuple[FlatBucket, bool]]:
    """Collective over `group` (default: the whole world): every bucket of every rank, flattened on `device`, in
    the global order (rank 0's buckets, then rank 1's, ...). Yields (bucket, whether this rank owns it). `own` is
    this rank's export stream (it may yield nothing); it is consumed on a producer thread."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    produced, producer = export_on_thread(own, device)
    failed = False
    try:
        for owner in range(world):
            src = dist.get_global_rank(group, owner) if group is not None else owner
            while True:
                item = produced.get() if owner == rank else None
                part, header = _announce(item, device, rank)
                box = [header]
                dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
                header = box[0]
                if isinstance(header, tuple):  # the owner's export failed: every rank stops here
                    failed = True
                    if isinstance(item, BaseException):
                        raise item
                    raise RuntimeError(f"weight sync (IPC relay): the export failed on {header[1]}")
                if header == END:
                    break
                if part is None:
                    entries = [FlatEntry(*entry) for entry in header]
                    part = FlatBucket(torch.empty(entries[-1].end, dtype=torch.uint8, device=device), entries)
                dist.broadcast(part.flat, src=src, group=group)
                yield part, owner == rank
    except BaseException:
        failed = True
        raise
    finally:
        if not failed:
            producer.join()


def _announce(item, device: torch.device, rank: int) -> tuple[FlatBucket | None, object]:
    """On the owner: (its flattened bucket, the header every rank receives: entries, the end mark or a failure)."""
    if item is None:
        return None, None
    if isinstance(item, BaseException):
        return None, (_FAILED, f"rank {rank}: {type(item).__name__}: {item}")
    part = None if isinstance(item, str) else flatten_bucket(item, device)
    if part is None:
        return None, END
    return part, [(e.name, e.shape, e.dtype, e.start, e.end) for e in part.entries]


def _object_device(device: torch.device) -> torch.device | None:
    return device if device.type == "cuda" else None


def post_to_engine(part: FlatBucket, groups: RelayGroups, post: Callable[[list[str]], None], serializer: Serializer):
    """Collective over the engine's ranks: each serializes its copy (a CUDA IPC handle on a GPU), the engine's first
    rank gathers the strings in TP-rank order and `post`s them (update_weights_from_tensor); a barrier keeps every
    copy alive until the server has answered. A failed post is raised on every rank of the actor (the engine's
    ranks name the error), so no rank waits for a broadcast that will not come."""
    payload = serializer(part)
    gathered: list[str | None] | None = [None] * groups.num_ranks if dist.get_rank() == groups.first_rank else None
    dist.gather_object(payload, gathered, dst=groups.first_rank, group=groups.group)
    outcome = [None]
    if gathered is not None:
        try:
            post([str(p) for p in gathered])
        except Exception as err:  # shared with the engine's other ranks below, raised everywhere
            outcome = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(outcome, src=groups.first_rank, group=groups.group)
    failed = torch.tensor([int(outcome[0] is not None)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=groups.everyone)
    if outcome[0] is not None:
        raise RuntimeError(f"weight sync (IPC relay) into engine {groups.engine_index} failed: {outcome[0]}")
    if failed.item():  # host tensor of a gloo group: no device sync
        raise RuntimeError("weight sync (IPC relay): the post into another engine failed (its ranks name the error)")


def relay_weights(buckets: Iterable[Bucket], route: SyncRoute, state, keep_samples: bool = True) -> dict:
    """The ipc_relay road (collective over the actor, workers/weight_sync.py): every bucket (this rank's export
    stream `buckets` among them) into the engine on this rank's GPUs; `state` (weight_sync.SenderState) keeps the
    engine groups between syncs. On a machine without CUDA the IPC handle is stood in by the same bytes over
    the host (sglang_weights.pickle_serializer: tests, and the CPU fakes of SGLang)."""
    from megarl.rollout.sglang_client import SGLangClient

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if state.relay is None:
        state.relay = engine_groups(dist.get_world_size(), route.gpus_per_engine)
        _check_relay_devices(route, state.relay, device)
    groups = state.relay
    engine = route.engines[groups.engine_index]
    if engine.sglang is None:
        raise RuntimeError("rollout.weight_sync ipc_relay reaches SGLang engines only; engine is not one")
    client = SGLangClient(engine.sglang.url, control_timeout_s=route.timeout_s)

    def post(payloads: list[str]) -> None:
        client.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=False)

    serializer = sglang_serializer if cuda else pickle_serializer
    sent = relay_each(buckets, device, lambda part: post_to_engine(part, groups, post, serializer), keep_samples)
    if cuda:
        torch.cuda.ipc_collect()
    return sent | {"ipc_engines": 1.0, "in_process_engines": 0.0}


def relay_each(
    buckets: Iterable[Bucket], device: torch.device, deliver: Callable[[FlatBucket], None], keep_samples: bool
) -> dict:
    """Collective over the actor: `relay_buckets`, each bucket handed to `deliver` on every rank. Returns {"bytes",
    "tensors", "buckets", "samples"} of what this rank owned: each tensor counted (and its norm weights sampled,
    when `keep_samples`) once, on its owner."""
    verify = re.compile(VERIFY_PATTERN)
    samples: Bucket = []
    sent_bytes = sent_tensors = num_buckets = 0
    for part, mine in relay_buckets(buckets, device):
        deliver(part)
        if mine:
            named = unflatten(part)
            sent_bytes += part.nbytes
            sent_tensors += len(named)
            num_buckets += 1
            if keep_samples:
                samples += [(name, t.detach().cpu().clone()) for name, t in named if verify.search(name)]
    return {
        "bytes": float(sent_bytes),
        "tensors": float(sent_tensors),
        "buckets": float(num_buckets),
        "samples": samples,
    }


def _check_relay_devices(route: SyncRoute, groups: RelayGroups, device: torch.device) -> None:
    """The relay's premise: actor rank first + r shares a GPU with TP rank r of the engine (colocated placement
    fills GPUs in the same order). Checked where the engine reports its GPUs (its first node's, in TP order)."""
    engine = route.engines[groups.engine_index]
    index = dist.get_rank() - groups.first_rank
    if engine.sglang is not None and engine.sglang.num_ranks != groups.num_ranks:
        raise RuntimeError(
            f"ipc_relay: engine {groups.engine_index} has {engine.sglang.num_ranks} TP ranks, the relay groups "
            f"{groups.num_ranks} actor ranks per engine (rollout.gpus_per_engine)"
        )
    if device.type == "cuda" and index < len(engine.devices) and engine.devices[index] != device_uuid(device):
        raise RuntimeError(
            f"ipc_relay: actor rank {dist.get_rank()} is on GPU {device_uuid(device)}, but TP rank {index} of engine "
            f"{groups.engine_index} runs on {engine.devices[index]}: the actor's ranks and the engine's GPUs are not "
            "in the same order; use rollout.weight_sync=disk"
        )
