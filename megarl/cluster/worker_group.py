"""A role's workers: Ray processes pinned to a resource pool's bundles, forming one torch.distributed world.

The controller calls methods on all ranks at once (`call`, or `async_call` and later `.result()`), with a dispatch
mode for the arguments and a collect mode for the results (see dispatch.py).

Failure semantics (the driver never waits without bound):
- a rank that raises (in `__init__`, the process-group set-up or a method) or whose process dies fails the call
  with `WorkerError`, naming the role, the ranks and each failing rank's traceback;
- once one rank failed, the others get `failure_grace_s` to answer (ranks waiting for it in a collective never
  would); then the whole group is killed;
- a call that outlives its time limit with no failure raises `WorkerTimeoutError`, naming the ranks that did not
  answer, and kills the group too; inside a phase deadline (deadline.py) the limit is also what is left of the
  phase, every failure names the phase, and one past the phase's end is a `PhaseTimeoutError`;
after any failure `healthy` is False: `restart()` builds the group afresh (or build a new one).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.cluster.config import GroupTimeouts
from megarl.cluster.deadline import PhaseDeadline, PhaseTimeoutError, call_limit, current_deadline
from megarl.cluster.dispatch import COLLECT_MODES, DISPATCH_MODES, NEEDS_PARALLEL_INFO, check_parallel_infos
from megarl.cluster.errors import RankFailure, WorkerError, WorkerTimeoutError, clean_traceback
from megarl.cluster.ray_runtime import thread_env
from megarl.cluster.resource_pool import ResourcePool, local_ranks
from megarl.cluster.worker import ROLE_ENV, ParallelInfo, Worker, WorkerInfo

_KILL_WAIT_S = 10.0


class PendingCall:
    """A group call in flight. `refs` holds one ObjectRef per rank (rank order); `result()` waits for all ranks,
    with the group's failure handling, and combines their results by the call's collect mode."""

    def __init__(self, group: WorkerGroup, what: str, refs: list, combine: Callable[[list[Any]], Any]):
        self.group = group
        self.what = what
        self.refs = refs
        self._combine = combine
        self._generation = group._generation

    def done(self) -> bool:
        """Whether every rank has answered (or failed): `result()` would not wait."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait for every rank (at most `timeout_s`; None: the group's call timeout) and return the combined result."""
        group = self.group
        if self._generation != group._generation or not group.healthy:
            note = f"The group was shut down before the call ended ({group._down_reason})."
            raise WorkerError(group.role, self.what, {}, note)
        limit = group.timeouts.call_s if timeout_s is None else timeout_s
        values = group._gather(self.what, self.refs, list(range(len(self.refs))), *group._call_limit(limit))
        return self._combine(values)


class WorkerGroup:
    """`world_size` workers of class `worker_cls` (a `Worker` subclass) on the first bundles of `pool`.

    `bundle_stride` s > 1 puts rank k on bundle k * s instead: each worker stands for s GPUs (bundles k*s ..
    k*s+s-1), e.g. a rollout engine that starts an s-GPU server of its own. Ray reserves only the worker's bundle;
    the group books the whole span in the pool, and LOCAL_RANK / LOCAL_WORLD_SIZE count the group's workers on a node.

    `num_gpus_per_worker` below one lets groups share the pool's GPUs (colocation: 0.5 each for two roles); each
    worker also reserves that share of its bundle's CPUs unless `num_cpus_per_worker` says otherwise. `env` is
    set in every worker process before `__init__(*init_args, **init_kwargs)` runs. `max_concurrency` is Ray's:
    how many calls a worker runs at once, on threads of its own (None: the worker class's `max_concurrency`
    attribute, else 1: one call at a time on the main thread); above 1 the worker must be thread-safe. Building
    the group starts the workers and forms their process group; it raises `WorkerError` (and leaves nothing
    running) if that fails.
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        pool: ResourcePool,
        role: str,
        *,
        world_size: int | None = None,
        num_gpus_per_worker: float = 1.0,
        num_cpus_per_worker: float | None = None,
        init_args: tuple = (),
        init_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        timeouts: GroupTimeouts | None = None,
        max_concurrency: int | None = None,
        bundle_stride: int = 1,
        start: bool = True,
    ):
        """`start=False`: the workers start later, with `start_groups` (several groups side by side)."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"{role}: worker_cls must be a subclass of megarl.cluster.Worker, not {worker_cls!r}")
        if not 0 < num_gpus_per_worker <= 1:
            raise ValueError(f"{role}: num_gpus_per_worker={num_gpus_per_worker} must be in (0, 1]")
        if world_size is not None and world_size < 1:
            raise ValueError(f"{role}: world_size={world_size} must be >= 1 (or None: the pool's size)")
        if bundle_stride < 1:
            raise ValueError(f"{role}: bundle_stride={bundle_stride} must be >= 1")
        self.worker_cls = worker_cls
        self._remote_cls: Any = None
        self.pool = pool
        self.role = role
        self.bundle_stride = bundle_stride
        self.world_size = pool.world_size // bundle_stride if world_size is None else world_size
        if self.world_size < 1:
            raise ValueError(f"{role}: bundle_stride={bundle_stride} exceeds the {pool.world_size} bundles of the pool")
        self.num_gpus_per_worker = num_gpus_per_worker
        self.num_cpus_per_worker = (
            pool.cpus_per_bundle * num_gpus_per_worker if num_cpus_per_worker is None else num_cpus_per_worker
        )
        self.init_args = tuple(init_args)
        self.init_kwargs = dict(init_kwargs or {})
        self.env = dict(env or {})
        self.timeouts = timeouts or GroupTimeouts()
        if max_concurrency is None:
            max_concurrency = getattr(worker_cls, "max_concurrency", 1)
        self.max_concurrency = max_concurrency
        if self.max_concurrency < 1:
            raise ValueError(f"{role}: max_concurrency={self.max_concurrency} must be >= 1")
        self.workers: list = []
        """Ray handles in rank order, for direct calls (e.g. one group passing another's handles for weight sync)."""
        self.worker_info: list[WorkerInfo] = []
        self._parallel: list[ParallelInfo] | None = None
        self._healthy = False
        self._down_reason = "not started"
        self._generation = 0
        weakref.finalize(self, pool.release, id(self))  # a group dropped without shutdown() frees its share too
        if start:
            self._start()

    # -- life cycle ----------------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Whether the workers are up and no call has failed since they started."""
        return self._healthy

    def restart(self) -> None:
        """Kill the workers (if any are left) and start the group afresh: new processes, new process group."""
        self._kill("restarted")
        self._start()

    def shutdown(self) -> None:
        """Kill the workers; the group's share of its pool is free again."""
        self._kill("shut down")

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "healthy" if self._healthy else f"down: {self._down_reason}"
        workers = f"{self.worker_cls.__name__} x {self.world_size}"
        return f"WorkerGroup({self.role!r}, {workers} on pool {self.pool.name!r}, {state})"

    @property
    def bundle_indices(self) -> list[int]:
        """The pool bundle each rank runs in (rank order)."""
        return [rank * self.bundle_stride for rank in range(self.world_size)]

    def _start(self) -> None:
        self._launch()
        self._join()

    def _launch(self) -> None:
        """Reserve the group's bundles and create its workers: their processes start in the background."""
        self._generation += 1
        self._parallel = None
        label = f"role {self.role}"
        if self.bundle_stride > 1:
            label += f" (bundle_stride={self.bundle_stride})"
        num_bundles = self.bundle_indices[-1] + 1  # the span the workers lie in
        self.pool.reserve(id(self), label, num_bundles, self.num_gpus_per_worker, self.num_cpus_per_worker)
        try:
            self.workers = self._build_workers()
        except BaseException:
            self._kill("start-up failed")
            raise

    def _join(self) -> None:
        """Wait for every worker's `__init__`, then form the group's process group."""
        try:
            self.worker_info = self._build_process_group()
        except BaseException:
            self._kill("start-up failed")
            raise
        self._healthy = True
        self._down_reason = ""

    def _build_workers(self) -> list:
        return [self._build_worker(rank) for rank in range(self.world_size)]

    def _build_worker(self, rank: int):
        """Create rank `rank`'s worker on its bundle (its process starts in the background)."""
        node_ids = [self.pool.node_ids[bundle] for bundle in self.bundle_indices]
        ranks_on_node = local_ranks(node_ids)
        placement_group, bundle_index = self.pool.bundles[self.bundle_indices[rank]]
        env = {
            **thread_env(self.pool.cpus_per_bundle),  # colocated roles take turns: each may use the whole bundle
            **self.env,
            ROLE_ENV: self.role,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(ranks_on_node[rank]),
            "LOCAL_WORLD_SIZE": str(node_ids.count(node_ids[rank])),
        }
        options = dict(
            num_gpus=self.num_gpus_per_worker,
            num_cpus=self.num_cpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=bundle_index
            ),
            runtime_env={"env_vars": env},
            max_restarts=0,
            max_task_retries=0,
        )
        if self.max_concurrency > 1:  # threaded worker; 1 keeps Ray's default (calls on the main thread)
            options["max_concurrency"] = self.max_concurrency
        if self._remote_cls is None:  # one actor class for every rank (Ray exports it once)
            self._remote_cls = ray.remote(self.worker_cls)
        return self._remote_cls.options(**options).remote(*self.init_args, **self.init_kwargs)

    def relaunch_rank(self, rank: int, wait: bool = True) -> None:
        """Kill rank `rank`'s worker and start a fresh one on the same bundle, the other ranks going on; `wait`: for
        its `__init__` (else calls made now run once it is up). For groups whose workers make no collective calls
        (independent rollout engines): the new worker does not join the group's process group."""
        with contextlib.suppress(Exception):  # already dead
            ray.kill(self.workers[rank], no_restart=True)
        ray.wait([self.workers[rank].ping.remote()], timeout=_KILL_WAIT_S)  # its share of the bundle is free again
        self.workers[rank] = self._build_worker(rank)
        if wait:
            self._gather("start-up (__init__)", [self.workers[rank].ping.remote()], [rank], self.timeouts.init_s)

    def _build_process_group(self) -> list[WorkerInfo]:
        """Wait for every `__init__` (a ping each), then form the world around the address rank 0 picks."""
        ranks = list(range(self.world_size))
        limit = self.timeouts.init_s
        refs = [worker.ping.remote() for worker in self.workers]
        refs.append(self.workers[0].node_ip_and_free_port.remote())
        *_, (master_addr, master_port) = self._gather("start-up (__init__)", refs, [*ranks, 0], limit)
        collective_s = self.timeouts.collective_s
        refs = [worker.init_process_group.remote(master_addr, master_port, collective_s) for worker in self.workers]
        return self._gather("start-up (init_process_group)", refs, ranks, limit)

    def _kill(self, reason: str) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(worker, no_restart=True)
        if self.workers:
            # A call to a killed worker fails once Ray has processed its death: waiting for that (boundedly) means
            # that when this returns, the workers are gone and their share of the pool is free for the next group.
            probes = [worker.ping.remote() for worker in self.workers]
            ray.wait(probes, num_returns=len(probes), timeout=_KILL_WAIT_S)
        self.workers = []
        self.worker_info = []
        self._healthy = False
        self._down_reason = reason
        self._parallel = None
        self.pool.release(id(self))

    # -- calls ---------------------------------------------------------------------------------------------------

    def call(
        self,
        method: str,
        /,
        *args: Any,
        dispatch: str = "broadcast",
        collect: str = "all",
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run `method` on every rank and wait for them all (at most `timeout_s`; None: the group's call timeout).

        dispatch: "broadcast" (same arguments everywhere), "dp_split" (first argument split by DP rank) or
        "per_rank" (each argument a list, one item per rank). collect: "all" (list in rank order), "dp_leaders"
        (DP leaders' results in DP-rank order, joined with `type(x).concat` where it exists) or "rank0".
        The names dispatch, collect and timeout_s are taken: a worker method cannot receive them as keywords.
        """
        return self.async_call(method, *args, dispatch=dispatch, collect=collect, **kwargs).result(timeout_s)

    def async_call(
        self, method: str, /, *args: Any, dispatch: str = "broadcast", collect: str = "all", **kwargs: Any
    ) -> PendingCall:
        """Start `method` on every rank without waiting; the returned `PendingCall` holds the ObjectRefs.

        The first call that needs the DP layout (dp_split, dp_leaders) asks the workers for it, and waits for that.
        """
        if not self._healthy:
            note = f"The group is down ({self._down_reason}): call restart()."
            raise WorkerError(self.role, f"call '{method}'", {}, note)
        if not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.role}: {self.worker_cls.__name__} has no method {method!r}")
        dispatch_fn = _lookup(DISPATCH_MODES, dispatch, "dispatch")
        collect_mode = _lookup(COLLECT_MODES, collect, "collect")
        parallel = None
        if dispatch in NEEDS_PARALLEL_INFO or collect_mode.needs_parallel_info:
            parallel = self.parallel_infos()
        rank_args = dispatch_fn(args, kwargs, self.world_size, parallel, self._put)
        keep = collect_mode.keep(self.world_size, parallel)
        refs = [
            worker.call_method.remote(method, keep[rank], *rank_args[rank][0], **rank_args[rank][1])
            for rank, worker in enumerate(self.workers)
        ]
        return PendingCall(self, f"call '{method}'", refs, lambda results: collect_mode.combine(results, parallel))

    def parallel_infos(self) -> list[ParallelInfo]:
        """Every rank's `parallel_info()`, asked once and kept (see `refresh_parallel_info`)."""
        if self._parallel is None:
            refs = [worker.parallel_info.remote() for worker in self.workers]
            ranks = list(range(self.world_size))
            parallel = self._gather("call 'parallel_info'", refs, ranks, *self._call_limit(self.timeouts.call_s))
            check_parallel_infos(self.role, parallel)
            self._parallel = parallel
        return self._parallel

    def refresh_parallel_info(self) -> list[ParallelInfo]:
        """Ask the workers again for their DP layout (after they changed it, e.g. built Megatron's groups anew)."""
        self._parallel = None
        return self.parallel_infos()

    def _put(self, value: Any) -> Any:
        """Store an argument once for all ranks (Ray would otherwise serialize it again for every rank)."""
        if self.world_size == 1 or isinstance(value, ray.ObjectRef):
            return value
        return ray.put(value)

    def _call_limit(self, limit: float | None) -> tuple[float | None, PhaseDeadline | None]:
        """A call's limit within the current phase deadline, and that deadline when it is the tighter bound."""
        return call_limit(limit, self.timeouts.failure_grace_s)

    def _gather(
        self, what: str, refs: list, ranks: list[int], timeout_s: float | None, bound: PhaseDeadline | None = None
    ) -> list[Any]:
        """The values of `refs` (ranks[i] runs refs[i]), or WorkerError once a rank failed, died or stayed silent.

        After the first failure the others get `failure_grace_s`; on any failure or timeout the group is killed.
        `bound`: the phase deadline that set `timeout_s` (its passing raises PhaseTimeoutError).
        """
        index_of = {ref: i for i, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        failures: dict[int, RankFailure] = {}
        first_failed: int | None = None
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _ = ray.wait(pending, num_returns=1, timeout=None if math.isinf(remaining) else remaining)
            if not ready:
                continue
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            for ref in ready:
                i = index_of[ref]
                try:
                    values[i] = ray.get(ref)
                except Exception as err:  # a RayTaskError carries the worker's traceback; ActorDiedError a death
                    failures.setdefault(ranks[i], rank_failure(ranks[i], err))
                    if first_failed is None:
                        first_failed = ranks[i]
                        deadline = min(deadline, time.monotonic() + self.timeouts.failure_grace_s)
        if not failures and not pending:
            return values
        silent = sorted({ranks[index_of[ref]] for ref in pending} - set(failures))
        failures.update({rank: RankFailure(rank, "no answer", "") for rank in silent})
        if (phase := current_deadline()) is not None:
            what = f"{what} in phase '{phase.phase}'"
        if first_failed is None:
            notes = [bound.describe() if bound is not None else f"No answer within {timeout_s:g} s."]
            if what.startswith("start-up"):
                notes.append("Workers that never started may be waiting for resources held elsewhere (`ray status`).")
            error_cls = WorkerTimeoutError if bound is None else PhaseTimeoutError
        else:
            notes = [f"First failure: rank {first_failed}."]
            if silent:
                notes.append(
                    f"Ranks still running {self.timeouts.failure_grace_s:g} s later were killed (a rank waiting in a "
                    f"collective for a failed one never returns)."
                )
            error_cls = WorkerError
        self._kill(f"{what} failed on ranks {sorted(failures)}")
        notes.append("The group was shut down: call restart() or build a new one.")
        note = " ".join(notes)
        if error_cls is PhaseTimeoutError:
            raise PhaseTimeoutError(self.role, what, failures, note, bound)
        raise error_cls(self.role, what, failures, note)


def start_groups(groups: Sequence[WorkerGroup]) -> None:
    """Start groups built with `start=False` side by side: every group's workers are created before any is waited
    for, so their processes start (Ray's worker start-up, the imports of `__init__`) together rather than one group
    after another. If one group fails to start, every group is shut down and the error raised."""
    try:
        for group in groups:
            group._launch()
        for group in groups:
            group._join()
    except BaseException:
        for group in groups:
            group.shutdown()
        raise


def rank_failure(rank: int, err: Exception) -> RankFailure:
    """How rank `rank`'s call failed, from the exception `ray.get` raised: it raised (with its traceback), or died."""
    text = clean_traceback(str(err))
    if isinstance(err, ray.exceptions.RayTaskError):
        return RankFailure(rank, "raised", text)
    if isinstance(err, ray.exceptions.RayActorError):
        # A worker whose __init__ raised is reported as dead with its creation traceback in the message.
        return RankFailure(rank, "raised" if "creation task" in text else "died", text)
    return RankFailure(rank, "raised", f"{type(err).__name__}: {text}")


def _lookup(registry: dict, name: str, what: str) -> Any:
    if name not in registry:
        raise ValueError(f"{what}={name!r} is not known; valid: {', '.join(registry)}")
    return registry[name]
