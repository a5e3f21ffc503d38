"""The Ray worker of a rollout engine: one engine per worker (megarl/rollout), built by name from a registry.

Engines are independent replicas: the controller splits requests among them. Weight updates arrive from the
actor's sending ranks as buckets (workers/weight_sync.py), framed by begin/finish calls from the controller.

An engine of several GPUs (rollout.gpus_per_engine > 1) has one worker, on the first of its bundles; the worker
sees the node's GPUs (trainer/lifecycle/roles.py) and `setup` gets the engine's GPU ids, which go to engines whose
constructor takes `gpu_ids`. An engine across nodes (SGLang --nnodes) is driven by the worker on its first node,
which starts one EngineNode actor on each other node (megarl/workers/engine_nodes.py) and stops with an error
naming the node when one of them is gone.

Calls run on threads (`max_concurrency`), so that `abort`, `health` and `weight_version` reach the worker while a
`generate` runs (asynchronous RL interrupts generation for weight syncs); every other engine call takes `_lock`,
so those still run one at a time, as on a single-threaded worker. The engine computes on one thread of its own
(`_compute`), whichever of Ray's threads took the call: every thread that runs torch ops gets an OpenMP team of its
own, and on a CPU the idle teams' spinning threads take the cores from the working one (a generate call from
Ray's changing threads took twice as long as from one thread: tools/bench/README.md, vs_trl).

Version fence: an engine started again after a failure (`setup(..., fenced=True)`), or whose weight update was
abandoned or did not finish, refuses to generate (EngineFenced, naming why) until a full weight update completes;
a delta update is refused while it is fenced (megarl/trainer/rollout_side/engine_fleet.py).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megarl.cluster.worker import Worker
from megarl.errors import UserError
from megarl.rollout.config import RolloutConfig, SamplingParams
from megarl.rollout.engine import Bucket, Completion, GenerateRequest, RolloutEngine, SyncStats
from megarl.rollout.sglang_server import NodePlace, reap_process_groups
from megarl.runtime import faults
from megarl.workers.bucket_transport import IpcBucket, PackedTensor, unpack_bucket, unpack_bucket_ipc
from megarl.workers.engine_nodes import EngineNodeSlot

log = logging.getLogger(__name__)

ENGINES = {
    "hf": "megarl.rollout.hf_engine:HFEngine",
    "sglang": "megarl.rollout.sglang_engine:SGLangEngine",
}


def build_engine(
    backend: str, model_path: str, config: RolloutConfig, gpu_ids: Sequence[str] | None = None, **kwargs: Any
) -> RolloutEngine:
    """The `backend` engine on `model_path`; `gpu_ids` (the engine's GPUs, as Ray numbers them) go to engines whose
    constructor takes them, and are an error for the others."""
    import importlib

    module_name, class_name = ENGINES[backend].split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    engine_config = getattr(config, backend)
    if gpu_ids is not None:
        if "gpu_ids" not in inspect.signature(engine_cls).parameters:
            raise UserError(
                f"rollout.backend={backend!r} runs on the one GPU of its worker, but was given GPUs {list(gpu_ids)}; "
                f"rollout.gpus_per_engine must be 1 for it"
            )
        kwargs["gpu_ids"] = list(gpu_ids)
    return engine_cls(model_path, engine_config, **kwargs)


def sglang_launch_kwargs(config: RolloutConfig, gpu_ids: Sequence[str] | None, model_path: str) -> dict[str, Any]:
    """How the worker launches its SGLang server, as `megarl plan` prints it (megarl/rollout/sglang_launch.py):
    listening on every interface at rollout.sglang.port + the engine's index on its node, dummy weights until the
    first sync, reached by other nodes at this node's address, told the format the weights arrive in."""
    import ray

    from megarl.rollout.sglang_launch import LISTEN_HOST, engine_port
    from megarl.rollout.weights_format import rollout_quantization

    ids = list(gpu_ids) if gpu_ids else [str(i) for i in ray.get_gpu_ids()]
    return {
        "host": LISTEN_HOST,
        "port": engine_port(config, min(int(i) for i in ids) if ids else 0),
        "load_format": "dummy",
        "advertise_host": ray.util.get_node_ip_address(),
        "quantization": rollout_quantization(config, model_path),
    }


class EngineFenced(RuntimeError):
    """The engine holds no complete weights of a known version: it generates again after a full weight sync."""


class RolloutWorker(Worker):
    process_group_backend = "gloo"
    """The engines run in their own processes; the group itself only coordinates (and an engine of several GPUs
    sees the whole node, so a NCCL device per worker would be a stray CUDA context)."""
    max_concurrency = 8
    """Calls at once (WorkerGroup's default for this class): a generate call, an abort, health checks, the weight
    buckets in flight (two per sending rank) and an evaluation waiting for the engine."""

    def __init__(self, engine_thread: bool = True):
        """engine_thread=False: engine calls run on the calling thread (a worker that hosts the engine on its own
        single thread: workers/hybrid_worker.py)."""
        self._lock = threading.Lock()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine") if engine_thread else None
        self._nodes: list = []
        self._node_slots: list[EngineNodeSlot] = []
        self._node_process_groups: list[list[int]] = []
        """Per other node of the engine, its SGLang process group there."""
        self._fence: str | None = None
        """Why the engine refuses to generate (None: it serves)."""

    def _on_engine_thread(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the engine's compute thread (one OpenMP team for the process), waiting for its result."""
        if self._compute is None:
            return fn(*args)
        return self._compute.submit(fn, *args).result()

    def setup(
        self,
        model_path: str,
        config: RolloutConfig,
        gpu_ids: Sequence[str] | None = None,
        nodes: Sequence[EngineNodeSlot] = (),
        fenced: str | None = None,
        reap: Sequence[int] = (),
        reap_nodes: Sequence[Sequence[int]] = (),
    ) -> dict[str, Any]:
        """Start the engine on `model_path`; a megarl checkpoint gives its HF config and tokenizer only (the
        weights arrive with the first sync). `gpu_ids`: the engine's GPUs on this node, for an engine of several
        (None: the engine uses what this worker sees). `nodes`: the engine's other nodes (node-rank 1, 2, ...).
        `fenced`: why the engine must not generate before a full weight sync (an engine started again). `reap`:
        process groups of the engine this one replaces, killed first (`reap_nodes`: those on its other nodes, per
        node). Returns the seconds it took and the engine's own process groups (`process_groups` on this node,
        `node_process_groups` on the others)."""
        from transformers.utils import logging as hf_logging

        from megarl.checkpoint.model_dir import hf_config_dir

        hf_logging.disable_progress_bar()  # one bar per engine in the driver's log says nothing
        start = time.perf_counter()
        reap_process_groups(reap)
        with self._lock:
            kwargs = sglang_launch_kwargs(config, gpu_ids, model_path) if config.backend == "sglang" else {}
            kwargs["record_routing"] = config.routed_experts == "auto"  # MoE models only: the engine checks
            if nodes:
                kwargs["node"] = self._start_other_nodes(model_path, config, kwargs, list(nodes), reap_nodes)
                kwargs["startup_watch"] = self.check_nodes  # a node that fails to start is named at once
            self.engine = self._on_engine_thread(
                lambda: build_engine(config.backend, str(hf_config_dir(model_path)), config, gpu_ids, **kwargs)
            )
            self._sync_start = 0.0
            self._sync_tensors = self._sync_bytes = 0
            self._fence = fenced
        return {
            "seconds": time.perf_counter() - start,
            "process_groups": self._process_groups(),
            "node_process_groups": self._node_process_groups,
        }

    def _process_groups(self) -> list[int]:
        """The engine's own server process group on this node (SGLang; none for the in-process hf engine)."""
        process = getattr(getattr(self.engine, "server", None), "process", None)
        return [process.pid] if process is not None else []

    def _check_fence(self) -> None:
        if self._fence is not None:
            raise EngineFenced(
                f"rollout engine {self.rank} refuses to generate: {self._fence}; it serves again after a full weight "
                "sync"
            )

    def _start_other_nodes(
        self, model_path: str, config: RolloutConfig, kwargs: dict, slots: list, reap: Sequence[Sequence[int]]
    ) -> NodePlace:
        """Launch node-ranks 1.. of this engine (one EngineNode actor each); returns node 0's place, where they
        meet (this node's address, the engine's rendezvous port: megarl/rollout/sglang_launch.py)."""
        from megarl.checkpoint.model_dir import hf_config_dir
        from megarl.rollout.routing import engine_routing_layout
        from megarl.rollout.sglang_launch import LISTEN_HOST, PORT_SPAN
        from megarl.rollout.sglang_server import build_server_command
        from megarl.workers.engine_nodes import NOSET_CUDA_VISIBLE_DEVICES, start_engine_nodes

        nnodes = len(slots) + 1
        meet = f"{kwargs['advertise_host']}:{kwargs['port'] + PORT_SPAN}"

        def command_for(node_rank: int) -> list[str]:
            return build_server_command(
                config.sglang,
                str(hf_config_dir(model_path)),
                host=LISTEN_HOST,
                port=kwargs["port"],
                load_format=kwargs["load_format"],
                node=NodePlace(nnodes, node_rank, meet),
                quantization=kwargs["quantization"],
                return_routed_experts=engine_routing_layout(config.routed_experts, model_path) is not None,
            )

        self._node_slots = slots
        # the node's processes see the node's GPUs (CUDA_VISIBLE_DEVICES is set for the server from the slot)
        env = {NOSET_CUDA_VISIBLE_DEVICES: "1"}
        self._nodes, self._node_process_groups = start_engine_nodes(slots, config.sglang, command_for, env, reap)
        return NodePlace(nnodes, 0, meet)

    def check_nodes(self) -> None:
        """Raise naming the node when a node of this (multi-node) engine is gone; nothing for one-node engines."""
        if self._nodes:
            from megarl.workers.engine_nodes import check_engine_nodes

            check_engine_nodes(self._nodes, self._node_slots, f"rollout engine {self.rank}")

    def _checked(self, call, *args):
        """Run an engine call on the compute thread; when it fails on a multi-node engine, a lost node is named
        first."""
        try:
            return self._on_engine_thread(call, *args)
        except BaseException:
            self.check_nodes()
            raise

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        faults.hit("rollout.generate")
        self._check_fence()
        self.check_nodes()
        with self._lock:
            return self._checked(self.engine.generate, requests, sampling)

    def abort(self) -> None:
        """Interrupt the generate call in progress (its unfinished completions return with finish reason `abort`);
        no effect when none runs. Does not wait for the lock."""
        self.engine.abort()

    def weight_version(self) -> int:
        """The version of the weights the engine serves (does not wait for a generate call)."""
        return int(self.engine.weight_version)

    def begin_weight_update(self, version: int, full: bool = True) -> None:
        """Open the update to `version`; `full`: whole tensors (False: deltas against the last full sync, refused by
        a fenced engine). Until it finishes, the engine refuses to generate."""
        if not full and self._fence is not None:
            raise EngineFenced(
                f"rollout engine {self.rank} refuses a delta weight update to version {version}: {self._fence}; it "
                "needs a full one"
            )
        with self._lock:
            self._fence = self._fence or f"the weight update to version {version} did not finish"
            self._sync_start = time.perf_counter()
            self._sync_tensors = self._sync_bytes = 0
            self.check_nodes()
            self._checked(self.engine.begin_weight_update, version)

    def apply_packed_bucket(self, packed: list[PackedTensor]) -> None:
        """A bucket as `send_weights` ships it (megarl/workers/bucket_transport.py)."""
        self.apply_bucket(unpack_bucket(packed))

    def apply_ipc_bucket(self, packed: IpcBucket) -> None:
        """A bucket shared from a colocated actor rank's GPU (CUDA IPC): copied into the engine before returning."""
        self.apply_bucket(unpack_bucket_ipc(packed))

    def shared_weights(self):
        """The engine's weights in shared memory, for the trainer's ranks on this node to write in place
        (megarl/rollout/shared_weights.py: a CPU hf engine); None for other engines, or where this machine offers no
        shared-memory file (the object store road then)."""
        share = getattr(self.engine, "share_weights", None)
        if share is None:
            return None
        if (known := self.engine.shared_weights) is not None:  # moved already: no wait for a generate call
            return known
        import ray

        with self._lock:
            try:
                return self._on_engine_thread(share, ray.get_runtime_context().get_node_id())
            except OSError as err:
                log.warning("rollout engine %d: weights not in shared memory (%s): object store road", self.rank, err)
                return None

    def apply_shared_writes(self, names: list[str], nbytes: int) -> None:
        """What a sending rank wrote into the engine's shared weights itself (`shared_weights`): checked and counted
        as a bucket's tensors."""
        faults.hit("rollout.sync_bucket")  # between buckets of a sync (tools/faults/engine_faults.py)
        with self._lock:
            self._checked(self.engine.apply_shared_writes, names)
            self._sync_tensors += len(names)
            self._sync_bytes += nbytes

    def device_uuids(self) -> list[str]:
        """The GPUs the engine runs on: actor ranks on one of them send CUDA IPC buckets instead of host copies."""
        from megarl.workers.bucket_transport import visible_device_uuids

        if hasattr(self.engine, "device_uuids"):
            return self.engine.device_uuids()
        return visible_device_uuids()

    def sglang_endpoint(self):
        """Where the trainer's ranks reach this engine's SGLang server directly (None for other engines)."""
        return getattr(self.engine, "endpoint", None)

    def abandon_weight_update(self, reason: str) -> None:
        """A sync failed on the sending side: the engine must not serve the mix of weights it may hold."""
        self._fence = f"a weight update was abandoned ({reason})"
        if hasattr(self.engine, "abandon_weight_update"):
            self.engine.abandon_weight_update(reason)

    def verify_weights(self, expected: Bucket) -> list[str]:
        """Differences between the engine's weights and `expected` (see RolloutEngine.verify_weights)."""
        with self._lock:
            return self._on_engine_thread(self.engine.verify_weights, expected)

    def apply_bucket(self, bucket: Bucket) -> None:
        faults.hit("rollout.sync_bucket")  # between buckets of a sync (tools/faults/engine_faults.py)
        with self._lock:
            self._checked(self.engine.apply_bucket, bucket)
            self._sync_tensors += len(bucket)
            self._sync_bytes += sum(t.nbytes for _, t in bucket)

    def load_weights_from_disk(self, folder: str) -> None:
        """The disk transport: the engine reads the bucket files the actor's ranks wrote into `folder`."""
        with self._lock:
            tensors, nbytes = self._checked(self.engine.load_weights_from_disk, folder)
            self._sync_tensors += tensors
            self._sync_bytes += nbytes

    def finish_weight_update(self, version: int) -> SyncStats:
        with self._lock:
            self._checked(self.engine.finish_weight_update, version)
            self._fence = None  # a full update, or a delta onto an engine that was not fenced
            seconds = time.perf_counter() - self._sync_start
            return SyncStats(version, self._sync_tensors, self._sync_bytes, seconds)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's accelerator memory (`tags` among rollout.engine.MEMORY_TAGS; None: all)."""
        with self._lock:
            self._on_engine_thread(self.engine.release_memory, tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        with self._lock:
            self._on_engine_thread(self.engine.resume_memory, tags)

    def health(self) -> dict[str, Any]:
        from megarl.errors import RunFailure

        info = self.engine.health()
        try:
            self.check_nodes()
        except RunFailure as err:
            info.update(ok=False, error=str(err))
        return info

    def health_probe(self, timeout_s: float) -> float:
        """Seconds the engine took to generate one token (SGLang: GET /health_generate); raises naming the problem
        when it cannot (a lost node, a dead server, a refused generate)."""
        faults.hit("rollout.health")
        start = time.perf_counter()
        self._check_fence()
        self.check_nodes()
        with self._lock:
            self._checked(self.engine.health_probe, timeout_s)
        return time.perf_counter() - start

    def shutdown_engine(self) -> None:
        from megarl.workers.engine_nodes import stop_engine_nodes

        self.engine.abort()  # a generate call in flight ends at its next decode step and frees the lock
        with self._lock:
            self._on_engine_thread(self.engine.shutdown)
            stop_engine_nodes(self._nodes)
            self._nodes = []
