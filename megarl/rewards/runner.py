"""Call the reward function on a rollout batch so that one bad sample costs only itself, never the RL step.

The controller calls `RewardRunner.score(samples)` once per step with the decoded batch. The runner splits it into
calls of `batch_size` samples and sends them to long-lived worker processes (spawned: the driver holds torch and Ray
threads, which must not be forked). A call that raises, dies or passes `timeout_s` (its worker is killed and
replaced) is re-run one sample at a time; only the samples that fail alone get `default_reward`, and are counted
(`num_failed`, `num_timeout`, `fraction_default`). A function that returns the wrong thing (wrong length, not a
number) has a bug that every step would hit, so that stops the run with RewardFunctionError. NaN or inf scores
count as failed. Worst case per step: about `timeout_s * (1 + hanging samples / num_workers)`.

Rule rewards and reward-model scores: a neural reward model is scored elsewhere, by the reward worker group
(megarl/workers) on token ids. The trainer combines the two per sample (by default their sum, each with its own
weight in the trainer's config) before it places the scalar on the last response token (`token_rewards`); this
package knows nothing about the model, and the model knows nothing about these rules.

Workers are daemon processes, so a reward function may use threads or subprocesses but not `multiprocessing`
children of its own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.errors import UserError
from megarl.rewards.config import RewardConfig
from megarl.rewards.plugins import absolute_spec, load_reward_fn
from megarl.rewards.types import RewardFunctionError, RewardResult, RewardSample, normalize_outputs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""Longest a worker may take to import the reward function before the runner gives up."""
_POLL_S = 0.5
_MAX_TRACEBACK_CHARS = 4000


def _call(fn: Any, fn_name: str, samples: list[RewardSample], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """One call of the reward function: ("ok", (scores, extras)), ("error", traceback) or ("bad_return", message)."""
    try:
        outputs = fn(samples, **kwargs)
    except Exception:
        return "error", traceback.format_exc()[-_MAX_TRACEBACK_CHARS:]
    try:
        return "ok", normalize_outputs(outputs, len(samples), fn_name)
    except RewardFunctionError as error:
        return "bad_return", str(error)


def _worker_main(conn: Any, spec: str, kwargs: dict[str, Any]) -> None:
    """A reward worker: load the function once, then answer (call_id, samples) messages until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it closes the pool
    try:
        fn = load_reward_fn(spec)
    except BaseException as error:
        conn.send(("init_error", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if message is None:
            return
        call_id, samples = message
        try:
            kind, payload = _call(fn, spec, samples, kwargs)
        except BaseException:  # SystemExit and the like from the function: still only this call's samples
            kind, payload = "error", traceback.format_exc()[-_MAX_TRACEBACK_CHARS:]
        conn.send((call_id, kind, payload))


@dataclass
class _Worker:
    process: Any
    conn: Any
    started_at: float
    pid: int | None = None
    """Set once the worker has loaded the function and is ready for calls."""
    call_id: int | None = None
    indices: list[int] = field(default_factory=list)
    """Sample indices of the call in flight."""
    deadline: float = math.inf


@dataclass
class _Outcome:
    """What is known so far about each sample of one `score` call."""

    scores: list[float]
    extras: list[dict[str, float]]
    errors: list[str | None]
    timed_out: list[bool]
    first_traceback: str | None = None


def _plain(value: Any) -> Any:
    """Plain dicts and lists (OmegaConf containers become picklable builtins)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(item) for item in value]
    return value


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send(None)
    for worker in workers:
        worker.process.join(timeout=2.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=5.0)
        worker.conn.close()
    workers.clear()


class RewardRunner:
    """Scores rollout batches with the configured reward function; keeps its worker pool alive across steps.

    Use as a context manager, or call `close()`. The config is expected to have passed `config.check(key)`."""

    def __init__(self, config: RewardConfig):
        self.config = config
        self._spec = absolute_spec(config.fn)
        self._kwargs = _plain(config.kwargs)
        self._fn = load_reward_fn(self._spec) if config.num_workers == 0 else None
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._next_call_id = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._fill_pool()  # start now: the workers import while the first rollout runs

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers that are ready (changes when a worker is replaced)."""
        return [worker.pid for worker in self._workers if worker.pid is not None]

    def wait_ready(self) -> list[int]:
        """Block until every worker has loaded the reward function (raising its load error); return their pids.
        Optional: `score` waits by itself, but a trainer may call this at startup to fail early."""
        if self._closed:
            raise RuntimeError("RewardRunner.wait_ready after close()")
        try:
            self._fill_pool()
            while any(worker.pid is None for worker in self._workers):
                self._wait(deque(), _Outcome([], [], [], []))
        except BaseException:
            _stop_workers(self._workers)
            raise
        return self.worker_pids

    def score(self, samples: Sequence[RewardSample]) -> RewardResult:
        """Score every sample; failures cost only the failing samples (see the module docstring)."""
        if self._closed:
            raise RuntimeError("RewardRunner.score after close()")
        num_samples = len(samples)
        outcome = _Outcome([math.nan] * num_samples, [{} for _ in samples], [None] * num_samples, [False] * num_samples)
        step = self.config.batch_size
        pending = deque(list(range(start, min(start + step, num_samples))) for start in range(0, num_samples, step))
        if self.config.num_workers == 0:
            while pending:
                indices = pending.popleft()
                kind, payload = _call(self._fn, self._spec, [samples[i] for i in indices], self._kwargs)
                self._apply(indices, kind, payload, pending, outcome)
        else:
            try:
                self._score_in_pool(samples, pending, outcome)
            except BaseException:
                _stop_workers(self._workers)  # no half-done calls may answer into the next step
                raise
        return self._result(outcome)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the pool -----------------------------------------------------------------------------------------------

    def _fill_pool(self) -> None:
        while len(self._workers) < self.config.num_workers:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=_worker_main, args=(child_conn, self._spec, self._kwargs), name="megarl-reward", daemon=True
            )
            process.start()
            child_conn.close()  # the parent keeps only its end, so that a dead worker reads as EOF
            self._workers.append(_Worker(process, parent_conn, started_at=time.monotonic()))

    def _remove(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers.remove(worker)

    def _score_in_pool(self, samples: Sequence[RewardSample], pending: deque[list[int]], outcome: _Outcome) -> None:
        while pending or any(worker.call_id is not None for worker in self._workers):
            self._fill_pool()
            for worker in list(self._workers):
                if pending and worker.pid is not None and worker.call_id is None:
                    self._dispatch(worker, pending.popleft(), samples, pending)
            self._wait(pending, outcome)

    def _dispatch(
        self, worker: _Worker, indices: list[int], samples: Sequence[RewardSample], pending: deque[list[int]]
    ) -> None:
        call_id, self._next_call_id = self._next_call_id, self._next_call_id + 1
        try:
            worker.conn.send((call_id, [samples[i] for i in indices]))
        except (BrokenPipeError, ConnectionResetError, EOFError):  # died while idle: not the samples' fault
            self._remove(worker)
            pending.appendleft(indices)
            return
        worker.call_id, worker.indices = call_id, indices
        worker.deadline = time.monotonic() + self.config.timeout_s

    def _wait(self, pending: deque[list[int]], outcome: _Outcome) -> None:
        """Wait for one answer, death or deadline, and handle whatever happened."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers] + [
            w.started_at + STARTUP_TIMEOUT_S for w in self._workers if w.pid is None
        ]
        wait_s = min(max(min(deadlines, default=now) - now, 0.0), _POLL_S)
        handles = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        multiprocessing.connection.wait(handles, timeout=wait_s)
        for worker in list(self._workers):
            if worker.conn.poll():
                self._receive(worker, pending, outcome)
            elif not worker.process.is_alive():
                self._on_death(worker, pending, outcome)
            elif worker.call_id is not None and time.monotonic() > worker.deadline:
                indices = worker.indices
                self._remove(worker)
                reason = f"timeout: the call ran past reward.timeout_s={self.config.timeout_s:g}"
                self._fail(indices, reason, None, pending, outcome, timed_out=True)
            elif worker.pid is None and time.monotonic() > worker.started_at + STARTUP_TIMEOUT_S:
                raise RuntimeError(
                    f"a reward worker did not load reward.fn={self.config.fn!r} within {STARTUP_TIMEOUT_S:.0f} s"
                )

    def _receive(self, worker: _Worker, pending: deque[list[int]], outcome: _Outcome) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._on_death(worker, pending, outcome)
            return
        if message[0] == "ready":
            worker.pid = message[1]
        elif message[0] == "init_error":
            raise UserError(f"reward.fn={self.config.fn!r}: a reward worker could not load it: {message[1]}")
        else:
            call_id, kind, payload = message
            assert call_id == worker.call_id, f"answer to call {call_id}, expected {worker.call_id}"
            indices, worker.call_id, worker.indices, worker.deadline = worker.indices, None, [], math.inf
            self._apply(indices, kind, payload, pending, outcome)

    def _on_death(self, worker: _Worker, pending: deque[list[int]], outcome: _Outcome) -> None:
        worker.process.join(timeout=2.0)  # its pipe closed first: reap it, so that the exit code is known
        exitcode = worker.process.exitcode
        self._remove(worker)
        if worker.pid is None:
            raise RuntimeError(f"a reward worker exited with code {exitcode} while loading reward.fn={self.config.fn}")
        if worker.call_id is not None:
            self._fail(worker.indices, f"the reward worker died (exit code {exitcode})", None, pending, outcome)

    # --- outcomes -----------------------------------------------------------------------------------------------

    def _apply(self, indices: list[int], kind: str, payload: Any, pending: deque[list[int]], outcome: _Outcome) -> None:
        if kind == "bad_return":
            raise RewardFunctionError(payload)
        if kind == "error":
            reason = payload.strip().splitlines()[-1] if payload.strip() else "error"
            self._fail(indices, reason, payload, pending, outcome)
            return
        scores, extras = payload
        for index, score, extra in zip(indices, scores, extras):
            if math.isfinite(score):
                outcome.scores[index], outcome.extras[index] = score, extra
            else:
                outcome.errors[index] = f"score is {score}"

    def _fail(
        self,
        indices: list[int],
        reason: str,
        detail: str | None,
        pending: deque[list[int]],
        outcome: _Outcome,
        timed_out: bool = False,
    ) -> None:
        """A call failed: re-run its samples one by one, or, for a single sample, record it as failed."""
        if len(indices) > 1:
            pending.extendleft([index] for index in reversed(indices))
            return
        outcome.errors[indices[0]] = reason
        outcome.timed_out[indices[0]] = timed_out
        if outcome.first_traceback is None:
            outcome.first_traceback = detail or reason

    def _result(self, outcome: _Outcome) -> RewardResult:
        num_samples = len(outcome.scores)
        failed = [error is not None for error in outcome.errors]
        scores = [self.config.default_reward if bad else score for bad, score in zip(failed, outcome.scores)]
        sums: dict[str, list[float]] = {}
        for extra in outcome.extras:
            for name, value in extra.items():
                if math.isfinite(value):
                    sums.setdefault(name, []).append(value)
        metrics = {name: sum(values) / len(values) for name, values in sums.items()}
        num_timeout = sum(outcome.timed_out)
        metrics.update(
            num_failed=float(sum(failed) - num_timeout),
            num_timeout=float(num_timeout),
            fraction_default=sum(failed) / num_samples if num_samples else 0.0,
        )
        if any(failed):
            logger.warning(
                "reward.fn=%s: %d of %d samples got default_reward=%g (%d failed, %d timed out); first error:\n%s",
                self.config.fn,
                sum(failed),
                num_samples,
                self.config.default_reward,
                sum(failed) - num_timeout,
                num_timeout,
                outcome.first_traceback,
            )
        return RewardResult(scores=scores, metrics=metrics, extras=outcome.extras, errors=outcome.errors)
