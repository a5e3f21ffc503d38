"""Wall-clock time per phase of an RL step (rollout, reward, logprobs, update, sync, ...) and throughput.

The controller wraps each phase in `with timer.phase("rollout"):` and, on a log step, takes
`timer.step_metrics()`, which also starts the next step's record. Times are host wall seconds: a phase ends when
its blocking call returns (the controller's calls into workers block, docs/architecture.md, habit 5), so the timer never
synchronizes a device itself.

Names: a top-level phase `rollout` gives `timing/rollout_s`; a phase opened inside it, `with timer.phase("reward")`,
gives `timing/rollout/reward_s`. Top-level phases do not overlap, so they add up to at most `timing/step_s` (what
is left is the controller's own time), which is how the plots stack them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

TIMING_PREFIX = "timing/"
"""Prefix of the phase-time metrics; every one ends in `_s` (seconds)."""
THROUGHPUT_PREFIX = "throughput/"
"""Prefix of the tokens-per-second metrics."""
STEP = "step"
"""The name of the whole step in `timing/step_s` and in the `num_tokens` of `step_metrics`."""


def tokens_per_s(num_tokens: float, seconds: float) -> float:
    """Throughput in tokens per second; 0.0 when no time was measured."""
    return float(num_tokens) / seconds if seconds > 0 else 0.0


@dataclass
class _OpenPhase:
    path: str
    """'outer/inner' for a nested phase."""
    start: float
    """Clock reading its time is counted from; moves forward when a step record is taken inside the phase."""


class PhaseTimer:
    """Accumulates wall seconds per named phase over one step; phases may nest and may repeat within a step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._open_phases: list[_OpenPhase] = []  # outermost first
        self._seconds: dict[str, float] = {}
        self._step_start = clock()

    def start_step(self) -> None:
        """Restart the step clock (e.g. after setup, before the first step); phase times so far are dropped."""
        self._seconds = {}
        self._step_start = self._clock()
        for open_phase in self._open_phases:
            open_phase.start = self._step_start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name` (nested inside the phases open now); repeated phases add up."""
        if not name or "/" in name or name == STEP:
            raise ValueError(f"phase name {name!r} must be non-empty, not {STEP!r} and without '/' (nesting adds it)")
        path = f"{self._open_phases[-1].path}/{name}" if self._open_phases else name
        open_phase = _OpenPhase(path, self._clock())
        self._open_phases.append(open_phase)
        try:
            yield
        finally:
            self._seconds[path] = self._seconds.get(path, 0.0) + (self._clock() - open_phase.start)
            self._open_phases.pop()

    def seconds(self, name: str) -> float:
        """Seconds spent so far this step in phase `name` ('outer/inner' for a nested one; 'step' for the step)."""
        if name == STEP:
            return self._clock() - self._step_start
        return self._seconds.get(name, 0.0)

    def step_metrics(self, num_tokens: Mapping[str, float] | None = None) -> dict[str, float]:
        """This step's times as `timing/<phase>_s` plus `timing/step_s`, then a fresh record for the next step.

        `num_tokens` maps a phase (or 'step') to the tokens it processed, adding `throughput/<phase>_tokens_per_s`;
        `throughput/tokens_per_s` for 'step'. Phases still open are measured up to now and keep running.
        """
        now = self._clock()
        seconds = dict(self._seconds)
        for open_phase in self._open_phases:
            # A phase still open (the caller logs from inside it) counts its time so far; the rest is the next step's.
            seconds[open_phase.path] = seconds.get(open_phase.path, 0.0) + (now - open_phase.start)
            open_phase.start = now
        seconds[STEP] = now - self._step_start
        metrics = {f"{TIMING_PREFIX}{path}_s": value for path, value in seconds.items()}
        for path, count in (num_tokens or {}).items():
            if path != STEP and path not in seconds:
                raise KeyError(f"no phase {path!r} was timed this step; timed: {', '.join(sorted(seconds))}")
            name = "tokens_per_s" if path == STEP else f"{path}_tokens_per_s"
            metrics[f"{THROUGHPUT_PREFIX}{name}"] = tokens_per_s(count, seconds[path])
        self._seconds = {}
        self._step_start = now
        return metrics
