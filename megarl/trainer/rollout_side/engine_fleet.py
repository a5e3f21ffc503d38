"""A rollout fleet that survives its engines (split placement, synchronous RL; rollout.max_engine_restarts).

`EngineFleet` is the rollout engines' worker group with calls of its own for generation and the health probe, in
which each engine stands alone: an engine that dies, raises, serves the wrong weight version or does not answer
before its phase's deadline does not take the others down (as a failed `WorkerGroup.call` would: every rank
killed, the run restarted from its checkpoint). Instead:

1. that engine alone is killed (its worker, and its server's process groups on every node it spans: the new worker
   and its node actors reap them first);
2. a new worker starts on the same bundle (the same GPUs, the same rank), sets the engine up, fenced: it refuses to
   generate (workers/rollout_worker.py, EngineFenced) until
3. a full weight sync at the version the other engines hold (trainer/rollout_side/engine_sync.py, `sync_engine`);
4. meanwhile the requests it held are sent again to the healthy engines (with their seeds: the same samples), so
   every prompt of the step is generated exactly once in the batch that trains.

Every completion must carry the weight version of the last sync; one that does not is an engine failure too.
Each failure is recorded (engine, step, call, cause) and logged; past rollout.max_engine_restarts the run stops
with a RunFailure listing them all. Metrics: rollout/engine_restarts (this run so far), rollout/requeued_prompts
(requests sent again, this step). With max_restarts=0 (colocated placement, asynchronous RL, or the key set to
0; hybrid engines have no fleet) the callers (rollout_step.py, engine_health.py) make plain group calls: a failed
engine fails the step, and run.max_restarts restarts every role.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from megarl.cluster.deadline import call_limit, current_deadline, renewed_deadline
from megarl.cluster.errors import RankFailure, WorkerError
from megarl.cluster.worker_group import WorkerGroup, rank_failure
from megarl.errors import RunFailure
from megarl.rollout.config import RolloutConfig, SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest
from megarl.workers.rollout_worker import RolloutWorker

log = logging.getLogger("megarl")

KEY = "rollout.max_engine_restarts"
RESTARTED = "it was started again after a failure"


@dataclass(frozen=True)
class EngineFailure:
    engine: int
    step: int
    """The step it failed in, numbered as metrics.jsonl does (from 1; the first eval belongs to step 1)."""
    call: str
    cause: str

    def describe(self) -> str:
        return f"engine {self.engine} at step {self.step} ({self.call}: {self.cause})"


class EngineResync(Protocol):
    """What the fleet needs of the weight sync (engine_sync.WeightSync)."""

    num_syncs: int

    @property
    def version(self) -> int: ...

    @property
    def step(self) -> int: ...

    def sync_engine(self, rank: int) -> None: ...


class EngineFleet(WorkerGroup):
    """The rollout engines' RolloutWorker group; `generate` and `probe` survive a failed engine (module docstring).
    Every other call is the group's own."""

    def __init__(self, pool, role: str = "rollout", *, max_restarts: int = 0, **kwargs: Any):
        super().__init__(RolloutWorker, pool, role, **kwargs)
        self.max_restarts = max_restarts
        self.resync: EngineResync | None = None
        """Set by the weight sync (engine_sync.WeightSync): full syncs of one engine, the version to serve."""
        self.failures: list[EngineFailure] = []
        self.requeued = 0
        """Requests sent again since the last `take_metrics`."""
        self._setup: list[tuple[tuple, dict]] = []
        self._process_groups: list[tuple[list[int], list[list[int]]]] = []
        """Per engine: its server's process groups on its first node and on each other node (reaped when it is
        started again)."""
        self._starting: dict[int, Any] = {}
        """Engines started again, rank -> their setup call's ObjectRef."""

    @property
    def recovers(self) -> bool:
        return self.max_restarts > 0

    # -- set-up --------------------------------------------------------------------------------------------------

    def keep_setup(
        self,
        model_path: str,
        config: RolloutConfig,
        gpu_ids: list[list[str]] | None = None,
        nodes: list[list] | None = None,
    ) -> None:
        """What each engine's `setup` is given (roles.py), to set up an engine started again the same way."""
        kwargs: list[dict] = [{} for _ in range(self.world_size)]
        for name, values in (("gpu_ids", gpu_ids), ("nodes", nodes)):
            for rank, value in enumerate(values or []):
                kwargs[rank][name] = value
        self._setup = [((model_path, config), k) for k in kwargs]

    def started(self, results: list[dict]) -> None:
        """What `setup` answered on every engine (their own process groups, reaped when one is started again)."""
        self._process_groups = [_process_groups(result) for result in results]

    # -- calls that survive an engine ----------------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        """The completions of every request (request order), split evenly among the serving engines; the
        requests of an engine that fails go to the others."""
        results: list[list[Completion] | None] = [None] * len(requests)
        todo, deadline, again = list(range(len(requests))), current_deadline(), False
        while todo:
            shares = _split(todo, self._serving())
            with renewed_deadline(deadline) if again else nullcontext():
                calls = {r: ([requests[i] for i in share], sampling) for r, share in shares.items()}
                answers, failures = self._each("generate", calls)
            for rank, completions in answers.items():
                if (stale := self._stale(completions)) is not None:
                    failures[rank] = RankFailure(rank, "raised", stale)
                    continue
                for i, completion in zip(shares[rank], completions):
                    results[i] = completion
            todo = sorted(i for rank in failures for i in shares[rank])
            self.requeued += len(todo)
            again = again or bool(failures)
            self._fail(failures, "generate")
        with renewed_deadline(deadline) if again else nullcontext():
            self._finish_restarts()
        return results  # type: ignore[return-value]

    def probe(self, timeout_s: float) -> list[float]:
        """Every engine's health probe (seconds each took): one that fails it is started again (and synced)."""
        answers, failures = self._each("health_probe", {r: (timeout_s,) for r in range(self.world_size)})
        self._fail(failures, "health_probe")
        if failures:
            with renewed_deadline(current_deadline()):
                self._finish_restarts()
        return [answers[r] for r in sorted(answers)]

    def call_ranks(self, ranks: list[int], method: str, /, *args: Any) -> list[Any]:
        """`method` on the engines `ranks` only (their answers, in that order); WorkerError naming the ranks that
        failed (the sync of an engine started again: a failure there restarts every role)."""
        answers, failures = self._each(method, {rank: args for rank in ranks})
        if failures:
            raise WorkerError(self.role, f"call '{method}'", failures)
        return [answers[rank] for rank in ranks]

    def take_metrics(self) -> dict[str, float]:
        """rollout/engine_restarts (this run so far) and rollout/requeued_prompts (since the last call)."""
        requeued, self.requeued = self.requeued, 0
        return {"rollout/engine_restarts": float(len(self.failures)), "rollout/requeued_prompts": float(requeued)}

    # -- inside ----------------------------------------------------------------------------------------------------

    def _serving(self) -> list[int]:
        """Ranks that serve now; when none does, the engines starting again are made ready first."""
        ranks = [r for r in range(self.world_size) if r not in self._starting]
        if not ranks:
            self._finish_restarts()
            ranks = list(range(self.world_size))
        return ranks

    def _each(self, method: str, calls: dict[int, tuple]) -> tuple[dict[int, Any], dict[int, RankFailure]]:
        """`method` on each engine of `calls` (rank -> arguments): their answers, and how the others failed. Each
        engine stands alone: it has the call's whole limit (within the phase deadline) whatever the others do."""
        refs = {rank: self.workers[rank].call_method.remote(method, True, *args) for rank, args in calls.items()}
        return self._wait(f"call '{method}'", refs)

    def _wait(
        self, what: str, refs: dict[int, Any], start_up: bool = False
    ) -> tuple[dict[int, Any], dict[int, RankFailure]]:
        """The answers of `refs` (rank -> ObjectRef) within the call limit and the phase deadline (`start_up`: within
        the group's start-up limit, cluster.init_timeout_s, whatever the phase), and how the others failed."""
        if start_up:
            limit, bound = self.timeouts.init_s, None
        else:
            limit, bound = call_limit(self.timeouts.call_s, self.timeouts.failure_grace_s)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=limit) if refs else ([], [])
        answers, failures = {}, {}
        for rank, ref in refs.items():
            if ref not in ready:
                late = bound.describe() if bound is not None else f"No answer within {limit:g} s."
                failures[rank] = RankFailure(rank, "no answer", late)
                continue
            try:
                answers[rank] = ray.get(ref)
            except Exception as err:  # a RayTaskError carries the worker's traceback; ActorDiedError a death
                failures[rank] = rank_failure(rank, err)
        if any(f.kind == "raised" and "UserError:" in f.detail for f in failures.values()):
            self._kill(f"{what} failed on ranks {sorted(failures)}")  # bad input fails on every engine alike
            raise WorkerError(self.role, what, failures, "The group was shut down.")
        return answers, failures

    def _stale(self, completions: Sequence[list[Completion]]) -> str | None:
        """Why an engine's completions (per request) do not come from the weights of the last sync (None: they
        do)."""
        if self.resync is None or not self.resync.num_syncs:
            return None
        wrong = sorted({c.weight_version for group in completions for c in group} - {self.resync.version})
        if not wrong:
            return None
        return f"served weight version(s) {wrong}, the trainer's is {self.resync.version}"

    def _fail(self, failures: dict[int, RankFailure], call: str) -> None:
        """Record each failure, kill the failed engines, and start them again, or stop the run past the limit."""
        step = self.resync.step if self.resync is not None else 0
        new = [EngineFailure(rank, step, call, _cause(failure)) for rank, failure in sorted(failures.items())]
        self.failures.extend(new)
        for failure in new:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(self.workers[failure.engine], no_restart=True)
        if len(self.failures) > self.max_restarts:
            history = "; ".join(f.describe() for f in self.failures)
            raise RunFailure(
                f"rollout engines failed {len(self.failures)} times, more than {KEY}={self.max_restarts} restarts: "
                f"{history}. The last checkpoint stands: rerun the same command to resume (a larger {KEY} allows "
                "more restarts; the engines' own logs say why they failed)."
            )
        for failure in new:
            log.warning(
                "rollout %s: restarting it alone (%d of %s=%d)",
                failure.describe(),
                len(self.failures),
                KEY,
                self.max_restarts,
            )
            self._start_again(failure.engine)

    def _start_again(self, rank: int) -> None:
        """A new worker on rank `rank`'s bundle, its engine set up (fenced until its full sync) in the background."""
        self.relaunch_rank(rank, wait=False)
        args, kwargs = self._setup[rank]
        fenced = RESTARTED if self.resync is not None and self.resync.num_syncs else None
        reap, reap_nodes = self._process_groups[rank]
        kwargs = {**kwargs, "fenced": fenced, "reap": reap, "reap_nodes": reap_nodes}
        self._starting[rank] = self.workers[rank].call_method.remote("setup", True, *args, **kwargs)

    def _finish_restarts(self) -> None:
        """Wait for the engines starting again (one that fails to start is started again, within the limit), then
        give each a full weight sync, once none is starting (the sync asks every engine where it is): they serve."""
        ready: list[int] = []
        while self._starting:
            started, failures = self._wait("call 'setup'", dict(self._starting), start_up=True)
            self._starting = {}
            for rank, result in started.items():
                self._process_groups[rank] = _process_groups(result)
            ready += started
            self._fail(failures, "setup")
        for rank in sorted(ready):
            if self.resync is not None and self.resync.num_syncs:
                self.resync.sync_engine(rank)
            log.info("rollout engine %d serves again", rank)


def _process_groups(setup_result: dict) -> tuple[list[int], list[list[int]]]:
    return setup_result["process_groups"], setup_result["node_process_groups"]


def _split(indices: list[int], ranks: list[int]) -> dict[int, list[int]]:
    """Contiguous, even shares of `indices` for `ranks` (an engine prefills a prompt once for its n samples);
    ranks with an empty share are left out."""
    bounds = [len(indices) * i // len(ranks) for i in range(len(ranks) + 1)]
    shares = {rank: indices[bounds[i] : bounds[i + 1]] for i, rank in enumerate(ranks)}
    return {rank: share for rank, share in shares.items() if share}


def _cause(failure: RankFailure) -> str:
    """A failure in a line: `died`, `no answer: <the deadline>`, or the exception the engine raised."""
    lines = [line.strip() for line in failure.detail.splitlines() if line.strip()]
    if failure.kind != "raised":
        return f"{failure.kind}: {lines[0]}" if failure.kind == "no answer" and lines else failure.kind
    errors = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Fenced"))]
    return (errors[-1] if errors else lines[-1] if lines else "raised")[:300]
