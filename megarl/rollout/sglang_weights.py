"""Weight sync into SGLang servers: flattened buckets over CUDA IPC (colocated) and NCCL broadcast (split placement).

**The flattened bucket** (`flatten_bucket`): all tensors of a bucket as bytes in one uint8 tensor, with records of
name, shape, dtype and byte offsets, the layout of SGLang's `FlattenedTensorBucket` (sglang 0.5.23,
`srt/weight_sync/tensor_bucket.py`, multi-dtype). One bucket is one request, so one `load_weights` call in SGLang:
tensors SGLang fuses at load time (DeepSeek's q_a_proj + kv_a_proj_with_mqa) arrive together.

**Colocated (`update_weights_from_tensor`, load_format "flattened_bucket").** A request holds one payload per
tensor-parallel rank of the server (each rank's scheduler takes `serialized_named_tensors[tp_rank]`); each rank
loads the whole tensor and keeps its own shard, so every payload describes the same bucket.

The payload itself is a pickle stream that SGLang decodes with its own `MultiprocessingSerializer` (ForkingPickler
with a class allow-list); CUDA tensors travel as CUDA IPC handles whose device is rewritten to the GPU's UUID by
SGLang's torch patch and resolved back by the receiver's patched `rebuild_cuda_tensor`. That stream names SGLang's
own functions and classes, so megarl does not forge it: `sglang_serializer` imports SGLang's serializer at call
time. It only runs where CUDA IPC can work at all, a GPU process on the server's node, where SGLang is installed.
Any callable `(FlatBucket) -> str` can stand in (the CPU tests pass a pickle stand-in to a fake server).

**Delta buckets** (rollout.weight_sync_delta, megarl/workers/weight_delta.py): a bucket carrying a delta goes the
same colocated way, but to megarl's own loader (load_format `sglang_delta.DELTA_LOADER`, SGLang's
--custom-weight-loader hook): each payload is one named tensor, the flat bytes, its name holding the records
(sglang_delta.payload_name). Right after it an empty update asks for the loader's verdict: a delta the engine could
not apply or verify is refused there, and raises DeltaMismatch (megarl/rollout/sglang_delta.py says why it takes a
second request).

**Split (`init_weights_update_group` + `update_weights_from_distributed`).** The sender is rank 0 of a process group
that every GPU of every engine joins as `rank_offset + tp_rank`; it is created exactly as SGLang creates its side
(`init_custom_process_group`, srt/utils/common.py): TCP rendezvous at the master address, a PrefixStore named after
the group, `_new_process_group_helper`, ranks mapped one-to-one. Per bucket, every engine is asked to receive
(names, dtypes, shapes, load_format "flattened_bucket") while the sender broadcasts the flat byte tensor from rank 0,
once. `SGLangWeightSender` knows nothing of Ray: it takes buckets and engine endpoints (URL, number of GPUs).

Call order around either transport (SGLangEngine does it for its own server): pause generation and open SGLang's
weight-update session (begin_weight_update), send every bucket, close the session, set the weight version, flush the
cache, continue generation.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import pickle
import time
import types
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megarl.rollout.engine import Bucket
from megarl.rollout.sglang_client import SGLangClient, SGLangError

__all__ = [
    "FlatBucket",
    "FlatEntry",
    "SGLangEndpoint",
    "SGLangWeightSender",
    "create_weight_update_group",
    "flatten_bucket",
    "pickle_serializer",
    "send_flattened_bucket",
    "sglang_serializer",
    "unflatten",
]


# ---- flattening ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatEntry:
    """Where one tensor lies in a flattened bucket: bytes [start, end) of `FlatBucket.flat`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class FlatBucket:
    """A bucket's tensors laid end to end, as bytes, in one contiguous uint8 tensor (SGLang's flattened bucket)."""

    flat: torch.Tensor
    entries: list[FlatEntry]
    load_format: str = "flattened_bucket"
    """How SGLang loads it: "flattened_bucket", or megarl's delta loader (sglang_delta.DELTA_LOADER)."""

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def dtypes(self) -> list[str]:
        """dtype names as SGLang's requests carry them ("bfloat16")."""
        return [str(e.dtype).removeprefix("torch.") for e in self.entries]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(e.shape) for e in self.entries]


def flatten_bucket(bucket: Bucket, device: torch.device | str | None = None) -> FlatBucket | None:
    """The bucket as SGLang's FlattenedTensorBucket lays it out (sglang 0.5.23, `srt/weight_sync/tensor_bucket.py`):
    every tensor's bytes back to back in one uint8 tensor, byte offsets in the entries; None for an empty bucket.

    Tensors go in order of decreasing element size (stable within a size), so every offset is a multiple of its
    tensor's element size: SGLang's receiving side of a broadcast (`FlattenedTensorBucket.empty`) refuses a misaligned
    one. Any layout is accepted (strided tensors are copied in logical order); values are copied bit-exactly.
    `device` moves the flat tensor there (None: the tensors' own device).
    """
    if not bucket:
        return None
    ordered = sorted(bucket, key=lambda item: -item[1].element_size())
    entries, pieces, offset = [], [], 0
    for name, tensor in ordered:
        piece = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append(FlatEntry(name, tuple(tensor.shape), tensor.dtype, offset, offset + piece.numel()))
        pieces.append(piece)
        offset += piece.numel()
    flat = torch.cat(pieces)  # where the tensors are, then one move: no second copy on the GPU
    return FlatBucket(flat if device is None else flat.to(device), entries)


def unflatten(part: FlatBucket) -> Bucket:
    """The tensors of a flattened bucket, as views into `part.flat`."""
    return [(e.name, part.flat[e.start : e.end].view(e.dtype).view(e.shape)) for e in part.entries]


# ---- serializers (the colocated transport's payload) -----------------------------------------------------------------
Serializer = Callable[[FlatBucket], str]


def named_payload(part: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """A bucket for a custom loader (SGLang hands it named tensors): the flat bytes under a name that carries the
    records; no entries: an empty list (the delta loader's verdict request)."""
    from megarl.rollout.sglang_delta import payload_name

    if not part.entries:
        return []
    return [(payload_name([(e.name, e.shape, e.dtype, e.start, e.end) for e in part.entries]), part.flat)]


def sglang_serializer(part: FlatBucket) -> str:
    """The payload SGLang's update_weights_from_tensor decodes for load_format "flattened_bucket": its
    MultiprocessingSerializer over {"flattened_tensor", "metadata": [FlattenedTensorMetadata]}, base64-encoded.

    Imports SGLang here, at call time, and patches torch's tensor reductions the way SGLang's receiver expects
    (CUDA IPC handles carry GPU UUIDs, so sender and server may number their visible GPUs differently). A bucket
    for a custom loader (`part.load_format`) is serialized as its `named_payload`.
    """
    if part.entries and not part.flat.is_cuda:
        raise SGLangError(
            f"the colocated weight sync sends CUDA IPC handles, so the flattened tensors must be on a GPU; got "
            f"{part.flat.device} (give SGLangEngine an ipc_device)"
        )
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as e:
        raise SGLangError(
            f"the colocated weight sync serializes with SGLang's own serializer, but sglang cannot be imported here "
            f"({e}); install sglang in the rollout worker's environment"
        ) from e
    monkey_patch_torch_reductions()
    if part.load_format != "flattened_bucket":
        return MultiprocessingSerializer.serialize(named_payload(part), output_str=True)
    metadata = [
        FlattenedTensorMetadata(
            name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.nbytes
        )
        for e in part.entries
    ]
    return MultiprocessingSerializer.serialize({"flattened_tensor": part.flat, "metadata": metadata}, output_str=True)


def pickle_serializer(part: FlatBucket) -> str:
    """A stand-in for tests and CPU fakes: the same dict, plain pickle of a CPU copy, metadata as SimpleNamespace
    records with SGLang's field names; a custom loader's bucket as its `named_payload`."""
    if part.load_format != "flattened_bucket":
        named = [(name, flat.detach().cpu()) for name, flat in named_payload(part)]
        return base64.b64encode(pickle.dumps(named)).decode()
    metadata = [
        types.SimpleNamespace(
            name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start, end_idx=e.end, numel=e.nbytes
        )
        for e in part.entries
    ]
    payload = {"flattened_tensor": part.flat.detach().cpu(), "metadata": metadata}
    return base64.b64encode(pickle.dumps(payload)).decode()


def send_flattened_bucket(
    client: SGLangClient,
    bucket: Bucket,
    *,
    num_ranks: int,
    serializer: Serializer = sglang_serializer,
    device: torch.device | str | None = None,
    rank_devices: Sequence[torch.device | str] | None = None,
) -> None:
    """Load one bucket into the server at `client` through update_weights_from_tensor: one call, so one
    load_weights call in SGLang, which keeps fused groups together (bridge/buckets.py).

    SGLang's request carries one payload per tensor-parallel rank; rank r loads `serialized_named_tensors[r]`
    (its scheduler's `update_weights_from_tensor`), so there are `num_ranks` (the server's tp) payloads, each
    serialized for its rank: torch counts the IPC references it hands out, one per serialization. Without
    `rank_devices` every payload points at the one copy on `device` (as SGLang's own Engine does: ranks on other
    GPUs read it across devices, opening a CUDA context on that GPU each); with them, rank r's payload points at a
    copy on `rank_devices[r]`, the GPU that rank runs on, so every rank loads from its own GPU. The flattened tensors
    stay referenced until the server has answered, i.e. has copied them into its weights.

    A delta bucket (weight_delta.delta_to_bucket) goes to megarl's delta loader, then an empty request asks for its
    verdict: DeltaMismatch when the engine refused it (module docstring).
    """
    from megarl.rollout.sglang_delta import DELTA_LOADER
    from megarl.workers.weight_delta import is_delta_bucket

    if rank_devices is not None and len(rank_devices) != num_ranks:
        raise ValueError(f"rank_devices={list(rank_devices)} must name one device per rank ({num_ranks})")
    first_device = device if rank_devices is None else rank_devices[0]
    part = flatten_bucket(bucket, first_device)
    if part is None:
        return
    if is_delta_bucket(part.names):
        part.load_format = DELTA_LOADER
    if rank_devices is None:
        copies = [part] * num_ranks
    else:  # from the first GPU on: device-to-device copies, no second trip over the host link
        copies = [FlatBucket(part.flat.to(rank_device), part.entries, part.load_format) for rank_device in rank_devices]
    payloads = [serializer(copy) for copy in copies]
    with _delta_refusals():
        client.update_weights_from_tensor(payloads, load_format=part.load_format, flush_cache=False)
        if part.load_format == DELTA_LOADER:  # the verdict: refused here when the loader could not apply it
            verdict = serializer(FlatBucket(part.flat[:0], [], DELTA_LOADER))
            client.update_weights_from_tensor([verdict] * num_ranks, load_format=DELTA_LOADER, flush_cache=False)
    del payloads, copies, part
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # release IPC blocks the server has let go of


@contextlib.contextmanager
def _delta_refusals():
    """An update refused with the delta loader's verdict raises DeltaMismatch (the sync fails, the engines are
    quarantined, the next sync is full); other errors pass unchanged."""
    from megarl.rollout.sglang_delta import VERDICT_PREFIX
    from megarl.workers.weight_delta import DeltaMismatch

    try:
        yield
    except SGLangError as err:
        if VERDICT_PREFIX in str(err):
            raise DeltaMismatch(str(err)) from err
        raise


# ---- split placement: a process group shared with the servers --------------------------------------------------------
def create_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> torch.distributed.ProcessGroup:
    """Join the weight-update group the way SGLang's workers do, outside the default process group.

    The same steps as SGLang's `init_custom_process_group`, so both sides meet in one store under the same prefix:
    rendezvous at tcp://master (rank 0 hosts the TCP store), a PrefixStore named after the group, torch's
    `_new_process_group_helper` (private, as on SGLang's side: a second group beside the default world), and a
    one-to-one rank map so `broadcast(src=0, group=...)` addresses rank 0 of this group.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@dataclass(frozen=True)
class SGLangEndpoint:
    """One SGLang server as the weight sender sees it."""

    url: str
    """http://host:port of the server."""
    num_ranks: int
    """GPUs of the server (its tp size): each joins the weight-update group."""


class SGLangWeightSender:
    """Rank 0 of a weight-update group with SGLang servers: broadcasts buckets to all of them at once.

    Usage: `connect()` once (all servers join), then per update `send(buckets)` between the engines'
    begin_weight_update and finish_weight_update, `close()` at the end. Runs on the trainer's sending rank; tensors
    are moved to `device` (the current CUDA device for nccl) before they are broadcast.
    """

    def __init__(
        self,
        endpoints: Sequence[SGLangEndpoint],
        *,
        master_address: str,
        master_port: int = 0,
        backend: str = "nccl",
        group_name: str = "megarl_weights",
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("SGLangWeightSender needs at least one engine endpoint")
        self.endpoints = list(endpoints)
        self.clients = [SGLangClient(e.url, control_timeout_s=timeout_s) for e in self.endpoints]
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.timeout_s = timeout_s
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.world_size = 1 + sum(e.num_ranks for e in self.endpoints)
        self.group: torch.distributed.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="sglang-weights")

    def rank_offsets(self) -> list[int]:
        """The first group rank of each engine (the sender is rank 0)."""
        offsets, next_rank = [], 1
        for endpoint in self.endpoints:
            offsets.append(next_rank)
            next_rank += endpoint.num_ranks
        return offsets

    def connect(self) -> None:
        """Ask every server to join, join as rank 0, and wait until all of them report success."""
        if self.group is not None:
            return
        if self.master_port == 0:
            from megarl.runtime.ports import find_free_port

            self.master_port = find_free_port(self.master_address)
        futures = [
            self._pool.submit(
                client.init_weights_update_group,
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=offset,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for client, offset in zip(self.clients, self.rank_offsets())
        ]
        self.group = create_weight_update_group(
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        self._results(futures, "init_weights_update_group")

    def send_bucket(self, bucket: Bucket) -> None:
        """All servers receive one bucket: metadata over HTTP, tensors by broadcast from rank 0, in bucket order."""
        if self.group is None:
            raise RuntimeError("SGLangWeightSender.send_bucket before connect()")
        part = flatten_bucket(bucket, self.device)
        if part is None:
            return
        futures = [
            self._pool.submit(
                client.update_weights_from_distributed,
                names=part.names,
                dtypes=part.dtypes,
                shapes=part.shapes,
                group_name=self.group_name,
                flush_cache=False,
                load_format="flattened_bucket",
            )
            for client in self.clients
        ]
        # one broadcast per bucket: SGLang receives it into FlattenedTensorBucket.empty(names, dtypes, shapes)
        works = [torch.distributed.broadcast(part.flat, src=0, group=self.group, async_op=True)]
        self._wait(works, futures)
        self._results(futures, "update_weights_from_distributed")

    def send(self, buckets: Iterable[Bucket]) -> tuple[int, int]:
        """Send every bucket; returns (number of tensors, bytes)."""
        num_tensors = num_bytes = 0
        for bucket in buckets:
            self.send_bucket(bucket)
            num_tensors += len(bucket)
            num_bytes += sum(t.nbytes for _, t in bucket)
        return num_tensors, num_bytes

    def close(self) -> None:
        """Leave the group on every server and here. Errors from servers that are gone are ignored."""
        if self.group is not None:
            futures = [self._pool.submit(c.destroy_weights_update_group, self.group_name) for c in self.clients]
            for future in futures:
                with contextlib.suppress(Exception):  # a dead server has no group left to destroy
                    future.result(timeout=self.timeout_s)
            torch.distributed.destroy_process_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False)

    def __enter__(self) -> SGLangWeightSender:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- waiting without hanging -----------------------------------------------------------------------------------
    def _wait(self, works: list, futures: list[Future]) -> None:
        """Wait for the broadcasts, but fail as soon as a server refuses the bucket (it then never joins the
        broadcast, which would otherwise block until the group's timeout)."""
        deadline = time.monotonic() + self.timeout_s
        while not all(w.is_completed() for w in works):
            for endpoint, future in zip(self.endpoints, futures):
                if future.done() and future.exception() is not None:
                    raise SGLangError(
                        f"{future.exception()}; the weight-update group {self.group_name!r} is now unusable: "
                        f"close() the sender and connect() again",
                        url=endpoint.url,
                    )
            if time.monotonic() > deadline:
                raise SGLangError(f"weight broadcast to {self.group_name!r} not done after {self.timeout_s:g} s")
            time.sleep(0.005)
        for w in works:
            w.wait()

    def _results(self, futures: list[Future], what: str) -> None:
        errors = []
        for endpoint, future in zip(self.endpoints, futures):
            try:
                future.result(timeout=self.timeout_s)
            except Exception as e:  # collected and raised together below
                errors.append(f"{endpoint.url}: {e}")
        if errors:
            raise SGLangError(f"{what} failed on {len(errors)} of {len(futures)} engines: " + "; ".join(errors))
