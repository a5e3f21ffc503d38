"""The rollout producer of asynchronous RL: a controller thread that keeps the rollout engines generating.

One thread draws prompts, generates on the engines, scores the completions and puts scored batches into the
RolloutBuffer (rollout_buffer.py, which also holds the staleness rule); the trainer (async_loop.py, the main
thread) takes them. What blocks what:
- the producer waits for its turn (wait policy: at most max_staleness batches ahead of the trainer) and for room in
  the buffer; the trainer waits for a batch. Both waits are timed (async/rollout_idle_s, async/trainer_wait_s).
- weight sync (`sync`, called by the trainer between steps): no new generate call starts; the one in flight is
  aborted (the engines return what they have, finish reason `abort`) and the trainer waits for it to return, which
  takes one decode step; then the weights go over, and the producer carries on. The rollout side stops for the sync
  and nothing more. Interrupted samples are resumed under the new weights with their tokens so far as a prefix
  (prefix_ids / prefix_logprobs / prefix_versions: the tokens keep the version that generated them), or, with
  partial_rollout=abort, generated again from scratch.
- nothing else is shared: the producer scores with its own reward runner (RewardRunner is not thread-safe), and the
  prompt sampler is the producer's alone while the loop runs.

Seeds: request i of batch number b carries seed request_seed(run seed, draw_key(b, draw), i), exactly as the
synchronous loop's step b, so max_staleness=0 gives the synchronous numbers. An interrupted sample j of a request
with seed s continues as a one-sample request with seed sample_seed(s, j): its remaining tokens come from a stream
of its own (reproducible given the same interruptions, which depend on timing).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from megarl.agents.config import AgentConfig
from megarl.agents.environment import Environment
from megarl.agents.episodes import run_episodes
from megarl.cluster.deadline import phase_deadline
from megarl.data.batch import Batch
from megarl.data.prompts import PromptSample, PromptSampler
from megarl.rollout.config import SamplingParams
from megarl.rollout.engine import Completion, GenerateRequest, sample_seed
from megarl.trainer.loops.deadlines import KEY as DEADLINES_KEY
from megarl.trainer.loops.dynamic_sampling import DynamicSampling, KeptGroups
from megarl.trainer.rollout_side.agent_rollout import collate_episodes
from megarl.trainer.rollout_side.rollout_buffer import (
    OLDEST_VERSION,
    BufferClosed,
    RolloutBuffer,
    ScoredBatch,
    TakenBatch,
)
from megarl.trainer.rollout_side.rollout_step import (
    RolloutResult,
    collate_rollout,
    draw_key,
    generate_on_engines,
    request_seed,
    rollout_metrics,
)
from megarl.trainer.rollout_side.routing import RoutingPlan

T = TypeVar("T")

Score = Callable[[Batch], tuple[Batch, dict[str, float]]]
"""Scores a collated rollout batch: (batch with `token_rewards` and `scores`, reward metrics)."""

_ABORT_RETRY_S = 0.05
"""How often the trainer repeats its abort while a generate call is still in flight (an abort that reaches an
engine before the call does is a no-op)."""
_JOIN_TIMEOUT_S = 60.0


class Engines(Protocol):
    """What the producer needs of the rollout engines (the Ray group, or a stand-in in tests)."""

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]: ...

    def abort(self) -> None: ...


class EngineGroup:
    """The rollout worker group as `Engines`: requests split evenly among the engines (contiguous shares, as the
    synchronous loop does; seeds make the split irrelevant to the numbers), abort broadcast to all of them. Each
    generate call has the rollout phase's deadline (`deadline_s`; None: only the group's call limit): the producer
    thread's own, as it is outside the trainer's phases."""

    def __init__(self, group, deadline_s: float | None = None):
        self.group = group
        self.deadline_s = deadline_s

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        with phase_deadline("rollout", self.deadline_s, f"{DEADLINES_KEY}.rollout"):
            return generate_on_engines(self.group, requests, sampling)

    def abort(self) -> None:
        self.group.call("abort", timeout_s=60)


class RolloutProducer:
    """The producer thread and the trainer's handle on it. Use as a context manager (starts and stops the thread).

    `first_number` is the global number of the first batch; `max_batches` stops the thread after that many (None:
    until closed). `score` runs in the producer thread.
    """

    def __init__(
        self,
        engines: Engines,
        sampler: PromptSampler,
        score: Score,
        tokenizer: Any,
        sampling: SamplingParams,
        buffer: RolloutBuffer,
        *,
        run_seed: int,
        first_number: int = 0,
        max_batches: int | None = None,
        partial_rollout: Literal["abort", "resume"] = "resume",
        dynamic_sampling: DynamicSampling | None = None,
        routing: RoutingPlan | None = None,
        agent: AgentEpisodes | None = None,
    ):
        self.engines = engines
        self.routing = routing
        """MoE models: the engines' routing goes into each batch (trainer/rollout_side/routing.py)."""
        self.agent = agent
        """Multi-turn episodes instead of single completions (agent.env set): their turns go through the same
        interruptible generate calls, each token keeps the version that sampled it."""
        self.sampler = sampler
        self.score = score
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.buffer = buffer
        self.run_seed = run_seed
        self.first_number = first_number
        self.max_batches = max_batches
        self.partial_rollout = partial_rollout
        self.dynamic_sampling = dynamic_sampling
        self._cond = threading.Condition()
        self._paused = False
        self._in_flight = False
        self._closed = False
        # Idle time: waiting for its turn, for room in the buffer, for a weight sync to end.
        self._idle_total_s = 0.0  # ever (read by the producer thread only)
        self._idle_s = 0.0  # since take_times last answered
        self._wait_start = 0.0  # start of the wait in progress
        self._idle_since: float | None = None  # start of its part not yet reported (None: not waiting)
        self._reported_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="megarl-rollout-producer", daemon=True)

    # -- the trainer's side ---------------------------------------------------------------------------------------

    def __enter__(self) -> RolloutProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_batch(self, actor_version: int) -> TakenBatch:
        """The next scored batch for an actor at `actor_version` (waits for one; re-raises a producer failure)."""
        return self.buffer.take(actor_version)

    def sync(self, update: Callable[[], T]) -> T:
        """Run `update` (the weight sync) with no generation in flight, then let the producer go on."""
        with self._paused_generation():
            result = update()
            self.buffer.weights_synced()
        return result

    def take_times(self) -> dict[str, float]:
        """Seconds the producer waited (idle) and worked (busy) since the last call: a step's async/rollout_*_s."""
        with self._cond:
            now = time.perf_counter()
            idle = self._idle_s
            if self._idle_since is not None:  # waiting now: count the wait up to now, the rest goes to next time
                idle += now - self._idle_since
                self._idle_since = now
            wall = now - self._reported_at
            self._idle_s, self._reported_at = 0.0, now
        return {"async/rollout_idle_s": idle, "async/rollout_busy_s": max(wall - idle, 0.0)}

    def close(self) -> None:
        """Stop the thread: no new work, the generate call in flight aborted; waits for the thread to end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.buffer.close()
        if self._thread.is_alive():
            self._abort_in_flight(deadline=time.monotonic() + _JOIN_TIMEOUT_S)
            self._thread.join(_JOIN_TIMEOUT_S)

    @property
    def stopped(self) -> bool:
        """Whether the thread has ended (after close, or on its own: max_batches reached or a failure)."""
        return not self._thread.is_alive()

    @contextmanager
    def _paused_generation(self) -> Iterator[None]:
        with self._cond:
            self._paused = True
        try:
            self._abort_in_flight()
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def _abort_in_flight(self, deadline: float | None = None) -> None:
        """Abort the generate call in flight and wait until it has returned (repeating the abort until then)."""
        while True:
            with self._cond:
                if not self._in_flight:
                    return
            if deadline is not None and time.monotonic() > deadline:
                return
            try:
                self.engines.abort()
            except Exception:  # the engines are gone (shutting down after a failure): nothing to wait for
                if deadline is not None:
                    return
                raise
            with self._cond:
                self._cond.wait_for(lambda: not self._in_flight, timeout=_ABORT_RETRY_S)

    # -- the producer thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for i in range(self.max_batches if self.max_batches is not None else 2**62):
                with self._idle():
                    self.buffer.wait_turn()
                item = self._produce(self.first_number + i)
                with self._idle():
                    self.buffer.put(item)
        except BufferClosed:
            return
        except BaseException as err:  # handed to the trainer, which re-raises it
            self.buffer.fail(err)

    @contextmanager
    def _idle(self) -> Iterator[None]:
        """Time the body as idle (the caller must not hold self._cond)."""
        with self._cond:
            self._begin_idle()
        try:
            yield
        finally:
            with self._cond:
                self._end_idle()

    def _begin_idle(self) -> None:
        self._wait_start = self._idle_since = time.perf_counter()

    def _end_idle(self) -> None:
        now = time.perf_counter()
        assert self._idle_since is not None
        self._idle_s += now - self._idle_since
        self._idle_total_s += now - self._wait_start
        self._idle_since = None

    def _produce(self, number: int) -> ScoredBatch:
        """One scored batch (with DAPO dynamic sampling: up to max_rounds draws of prompts, all-equal groups out)."""
        dynamic = self.dynamic_sampling
        kept = KeptGroups(dynamic.num_groups) if dynamic else None
        metrics, num_tokens = {}, 0
        generate_s = reward_s = 0.0
        num_interrupted = 0
        for draw in range(dynamic.max_rounds if dynamic else 1):
            samples = next(self.sampler)
            data_state = self.sampler.state_dict()
            start, idle_before = time.perf_counter(), self._idle_total_s
            result, interrupted = self._draw(samples, draw_key(number, draw))
            batch = result.batch
            scored_at = time.perf_counter()
            batch, reward_metrics = self.score(batch)
            generate_s += scored_at - start - (self._idle_total_s - idle_before)  # not the pauses for weight syncs
            reward_s += time.perf_counter() - scored_at
            num_tokens += result.num_tokens
            num_interrupted += interrupted
            if draw == 0:
                metrics = rollout_metrics(batch) | reward_metrics | result.metrics
            if kept is None or kept.add(batch):
                break
        if kept is not None:
            batch, dapo_metrics = kept.result()
            metrics |= dapo_metrics
        metrics |= {
            "async/generate_s": generate_s,
            "async/reward_s": reward_s,
            "async/interrupted": float(num_interrupted),
        }
        return ScoredBatch(number, batch, metrics, num_tokens, data_state)

    def _draw(self, samples: Sequence[PromptSample], seed_step: int) -> tuple[RolloutResult, int]:
        """The collated rollout of `samples` (completions, or agent episodes) with OLDEST_VERSION per sample; also
        how many generations weight syncs interrupted."""
        if self.agent is None:
            completions, interrupted = self._generate(samples, seed_step)
            result = collate_rollout(samples, completions, self.tokenizer, self.routing)
            versions = [oldest_version(c) for group in completions for c in group]
            return _with_versions(result, versions), interrupted
        counter = [0]

        def generate(requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
            completions, interrupted = self._generate_requests(requests, sampling)
            counter[0] += interrupted
            return completions

        agent = self.agent
        seeds = [request_seed(self.run_seed, seed_step, i) for i in range(len(samples))]
        episodes = run_episodes(generate, samples, seeds, agent.make_env, agent.config, self.sampling, self.tokenizer)
        result = collate_episodes(samples, episodes, self.tokenizer, agent.config)
        versions = [min((v for v in e.trajectory.versions if v >= 0), default=0) for g in episodes for e in g]
        return _with_versions(result, versions), counter[0]

    def _generate(self, samples: Sequence[PromptSample], seed_step: int) -> tuple[list[list[Completion]], int]:
        """`sampling.n` completions per prompt, through any number of interruptions by weight syncs; also returns
        how many sample interruptions there were."""
        requests = [
            GenerateRequest(s.prompt_ids, seed=request_seed(self.run_seed, seed_step, i), request_id=str(s.index))
            for i, s in enumerate(samples)
        ]
        return self._generate_requests(requests, self.sampling)

    def _generate_requests(
        self, requests: list[GenerateRequest], sampling: SamplingParams
    ) -> tuple[list[list[Completion]], int]:
        """`sampling.n` completions of each request, resumed (or redone) after every interruption."""
        n, base = sampling.n, sampling
        done: dict[tuple[int, int], Completion] = {}
        pending = [(request, [(i, j) for j in range(n)]) for i, request in enumerate(requests)]
        num_interrupted = 0
        while pending:
            outputs = self._engine_call([request for request, _ in pending], sampling)
            interrupted = []
            for (_, keys), completions in zip(pending, outputs):
                for (i, j), completion in zip(keys, completions):
                    if completion.finish_reason == "abort":
                        interrupted.append((self._continuation(requests[i], j, completion), [(i, j)]))
                    else:
                        done[i, j] = completion
            num_interrupted += len(interrupted)
            pending, sampling = interrupted, dataclasses.replace(base, n=1)
        return [[done[i, j] for j in range(n)] for i in range(len(requests))], num_interrupted

    def _continuation(self, request: GenerateRequest, j: int, partial: Completion) -> GenerateRequest:
        """Sample j of `request`, interrupted after `partial`: one request of its own, resumed or from scratch."""
        seed = sample_seed(request.seed, j) if request.seed is not None else None
        request_id = f"{request.request_id}/{j}"
        if self.partial_rollout == "abort":
            return GenerateRequest(request.prompt_ids, seed=seed, request_id=request_id)
        return GenerateRequest(
            request.prompt_ids,
            seed=seed,
            request_id=request_id,
            prefix_ids=list(partial.token_ids),
            prefix_logprobs=list(partial.logprobs),
            prefix_versions=_token_versions(partial),
        )

    def _engine_call(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[list[Completion]]:
        """One generate call on the engines, started only outside weight syncs (waiting is idle time)."""
        with self._cond:
            self._begin_idle()
            self._cond.wait_for(lambda: self._closed or not self._paused)
            self._end_idle()
            if self._closed:
                raise BufferClosed
            self._in_flight = True
        try:
            return self.engines.generate(requests, sampling)
        finally:
            with self._cond:
                self._in_flight = False
                self._cond.notify_all()


def _token_versions(completion: Completion) -> list[int]:
    """Per-token weight versions (engines that report none generated every token at the completion's version)."""
    if len(completion.token_versions) == len(completion.token_ids):
        return list(completion.token_versions)
    return [completion.weight_version] * len(completion.token_ids)


def oldest_version(completion: Completion) -> int:
    """The weight version a sample counts as for staleness: that of its oldest token."""
    return min(_token_versions(completion), default=completion.weight_version)


def _with_versions(result: RolloutResult, oldest: list[int]) -> RolloutResult:
    """The rollout with each sample's OLDEST_VERSION (the staleness rule's input)."""
    batch = Batch(result.batch.tensors, {**result.batch.meta, OLDEST_VERSION: oldest})
    return dataclasses.replace(result, batch=batch)


@dataclass(frozen=True)
class AgentEpisodes:
    """What the producer needs to play multi-turn episodes."""

    config: AgentConfig
    make_env: Callable[[], Environment]
