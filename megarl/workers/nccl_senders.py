"""The nccl road at any actor layout: every sending rank broadcasts its own buckets into the split SGLang engines.

The senders are the export stream's (megarl/bridge/exporter.py): per pipeline stage, the first rank of the TP group
sends the stage's dense tensors (after gathering their TP shards), each expert-parallel rank its own experts. Two
facts of SGLang's side (sglang 0.5.23, model_runner_components/weight_updater.py) shape the road:
- an engine receives a bucket by broadcast from rank 0 of a named group only (`update_weights_from_distributed`:
  `broadcast(src=0, group=...)`), so each sending rank is rank 0 of a group of its own with every GPU of every
  engine, named `<route.group_name>_r<actor rank>` (`init_weights_update_group`: engine GPU `rank_offset +
  tp_rank`), set up at its first bucket and kept between syncs;
- an engine's scheduler serves one request at a time and sits in the broadcast until it completes, so two senders
  broadcasting at once could each hold an engine the other needs. The senders therefore take turns in the IPC
  relay's global order (megarl/workers/ipc_relay.py): actor rank 0 with all of its buckets, then rank 1, ... Each
  owner's turn ends with a mark (or its failure) broadcast to every rank over a gloo group of the whole actor, so a
  rank starts its turn only once the previous owner's last bucket is in every engine: every engine receives from
  the senders in that one order, and at most one group is in use at any time.
As in the relay, each rank's export runs on a producer thread (ipc_relay.export_on_thread), so its TP gathers never
wait for another stage's turn; a sender holds the buckets it exported before its turn (at most its own share of
the model) and sends them one broadcast each when its turn comes. Ranks with nothing to send (TP ranks past the
first, data-parallel replicas) only pass the turn on.

A failure on a sender (an engine refused a bucket, the export failed) is broadcast as its turn's mark: every rank
raises, every rank closes its group (a half-used group is never reused: the next sync sets up fresh ones), and the
controller quarantines the engines (trainer/rollout_side/engine_sync.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from megarl.rollout.engine import VERIFY_PATTERN, Bucket
from megarl.workers.ipc_relay import END, export_on_thread
from megarl.workers.sync_route import SyncRoute


def sender_group_name(route: SyncRoute, rank: int) -> str:
    """The name of the broadcast group of actor rank `rank` with the engines."""
    return f"{route.group_name}_r{rank}"


def kept_sender(state, route: SyncRoute, group_name: str, connect: Callable[[], object]):
    """This rank's weight-update group (`state.nccl`) for `route` under `group_name`: the one kept from earlier syncs
    when it reaches the same engines under the same name, else a new one from `connect()` (the kept one is left
    first: an engine was started again, or this sync goes to one engine only)."""
    key = (group_name, tuple(engine.sglang for engine in route.engines))
    if state.nccl is not None and state.nccl_key != key:
        close_sender(state)
    if state.nccl is None:
        state.nccl, state.nccl_key = connect(), key
    return state.nccl


def close_sender(state) -> None:
    """Leave this rank's weight-update group, if it has one (on the engines too)."""
    if state.nccl is not None:
        try:
            state.nccl.close()
        finally:
            state.nccl = state.nccl_key = None


def connect_sender(route: SyncRoute, group_name: str):
    """This rank as rank 0 of a new weight-update group `group_name` with every engine GPU (SGLangWeightSender)."""
    import ray

    from megarl.rollout.sglang_weights import SGLangWeightSender

    endpoints = [engine.sglang for engine in route.engines]
    if any(endpoint is None for endpoint in endpoints):
        raise RuntimeError("rollout.weight_sync=nccl reaches SGLang engines only; an engine here is not one")
    sender = SGLangWeightSender(
        endpoints,
        master_address=ray.util.get_node_ip_address(),
        backend="nccl" if torch.cuda.is_available() else "gloo",
        group_name=group_name,
        timeout_s=route.timeout_s,
    )
    try:
        sender.connect()
    except BaseException:
        sender.close()
        raise
    return sender


def send_in_turns(buckets: Iterable[Bucket], route: SyncRoute, state, keep_samples: bool = True) -> dict:
    """Collective over the actor (workers/weight_sync.py, transport nccl with several ranks): this rank's export
    stream `buckets` into every engine, in its turn. `state` (weight_sync.SenderState) keeps this rank's group with
    the engines (`nccl`) and the actor's gloo group for the turns (`turns`) between syncs. Returns {"bytes",
    "tensors", "buckets", "samples"} of what this rank sent."""
    if route.delta != "off":
        raise RuntimeError(f"rollout.weight_sync=nccl sends whole tensors; this sync asks for delta={route.delta}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if state.turns is None:  # collective: every rank makes it at its first sync
        state.turns = dist.new_group(list(range(world)), backend="gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    produced, producer = export_on_thread(buckets, device)
    tally = _Tally(keep_samples)
    failed = False
    try:
        for owner in range(world):
            error: BaseException | None = None
            mark: list[str | None] = [None]
            if owner == rank:
                error = _my_turn(produced, route, state, tally)
                mark = [None if error is None else f"rank {rank}: {type(error).__name__}: {error}"]
            dist.broadcast_object_list(mark, src=owner, group=state.turns)
            if error is not None:
                failed = True
                raise error
            if mark[0] is not None:
                failed = True
                raise RuntimeError(f"weight sync (nccl): the sender failed on {mark[0]}")
    finally:
        if not failed:
            producer.join()
    return tally.as_dict()


def _my_turn(produced, route: SyncRoute, state, tally: _Tally) -> BaseException | None:
    """Send every bucket this rank exports, one broadcast each; the failure that stopped it, or None."""
    name = sender_group_name(route, dist.get_rank())
    try:
        while (item := produced.get()) is not END:
            if isinstance(item, BaseException):
                return item
            kept_sender(state, route, name, lambda: connect_sender(route, name)).send_bucket(item)
            tally.add(item)
    except Exception as err:  # told to every rank by the caller, then raised here
        return err
    return None


class _Tally:
    """What this rank sent, and (when `keep_samples`) its norm weights on CPU for the controller's check."""

    def __init__(self, keep_samples: bool):
        self.keep_samples = keep_samples
        self.verify = re.compile(VERIFY_PATTERN)
        self.bytes = self.tensors = self.buckets = 0
        self.samples: Bucket = []

    def add(self, bucket: Bucket) -> None:
        self.bytes += sum(t.nbytes for _, t in bucket)
        self.tensors += len(bucket)
        self.buckets += 1
        if self.keep_samples:
            self.samples += [(name, t.detach().cpu().clone()) for name, t in bucket if self.verify.search(name)]

    def as_dict(self) -> dict:
        return {
            "bytes": float(self.bytes),
            "tensors": float(self.tensors),
            "buckets": float(self.buckets),
            "samples": self.samples,
        }
