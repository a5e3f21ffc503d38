"""A stage's step bookkeeping: its phases (timed, memory sampled, fault points) and what ends every step (evaluate,
log, checkpoint, stop). The loops (rl_loop, async_loop, sft_loop, rm_loop) read top to bottom and end each step
with `steps.end(...)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megarl.cluster.deadline import PhaseDeadline, phase_deadline
from megarl.data.batch import Batch
from megarl.runtime import faults
from megarl.trainer.config import CheckpointConfig
from megarl.trainer.lifecycle.checkpointer import Checkpointer
from megarl.trainer.lifecycle.handover import Handover
from megarl.trainer.lifecycle.run_checkpoint import TrainerState
from megarl.trainer.loops.deadlines import KEY as DEADLINES_KEY
from megarl.trainer.loops.evaluation import Evaluator
from megarl.trainer.observability.memory_metrics import MemoryProbe
from megarl.trainer.observability.timing import PhaseTimer


class StopRun(Exception):
    """The run stops early (Ctrl-C after a checkpoint), with a reason for the user."""


@dataclass
class Steps:
    state: TrainerState
    """Stage, step, global step, weight version, data positions: what a checkpoint saves."""
    logger: Any
    progress: Any
    checkpointer: Checkpointer
    checkpoint: CheckpointConfig
    handover: Handover
    memory: MemoryProbe
    evaluator: Evaluator | None = None
    """None without eval prompts."""
    num_sample_logs: int = 0
    """Completions of each RL step written to samples.jsonl."""
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    deadlines: dict[str, float] = field(default_factory=dict)
    """Seconds each phase may wait for its workers (run.phase_timeouts and the defaults of
    trainer/lifecycle/deadline_defaults.py); a phase not named has no bound beyond each call's own
    (cluster.call_timeout_s)."""
    stop_requested: bool = False
    """Set by Ctrl-C: the loop finishes the step, saves a checkpoint and returns."""
    plots: Any = None
    """The run's BackgroundPlotter (None: logging.plots=false), asked to redraw when `should_plot` says so."""
    should_plot: Any = None
    """logging.should_plot(global_step)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name`, within its deadline; sample every worker's memory when it ends."""
        faults.hit(f"phase.{name}")  # fault points at every phase of a step (tools/faults/kill_resume.py)
        with self.timer.phase(name), self.deadline(name):
            yield
        self.memory.sample(name)

    @contextmanager
    def deadline(self, name: str) -> Iterator[PhaseDeadline | None]:
        """Bound the body's worker calls by phase `name`'s deadline (megarl/cluster/deadline.py), untimed."""
        with phase_deadline(name, self.deadlines.get(name), f"{DEADLINES_KEY}.{name}") as deadline:
            yield deadline

    def eval_due(self, eval_every: int, num_steps: int) -> bool:
        """Whether the step now running ends with an evaluation: every `eval_every` steps and after the last."""
        step = self.state.step + 1
        return self.evaluator is not None and (step >= num_steps or bool(eval_every and step % eval_every == 0))

    def end(
        self,
        metrics: dict[str, float],
        num_steps: int,
        samplers: dict[str, Any],
        batch: Batch | None = None,
        eval_every: int = 0,
        num_tokens: float = 0.0,
    ) -> None:
        """Count the step; evaluate (the engines must hold the step's weights), log, then checkpoint as configured;
        stop cleanly if asked to. The step is logged before its checkpoint is written: a checkpoint that exists
        always has its steps' metrics on record (a crash in between redoes the step and logs it again); the
        checkpoint's own time counts in the next step's record."""
        evaluate = self.eval_due(eval_every, num_steps)
        self.state.step += 1
        self.state.global_step += 1
        last = self.state.step >= num_steps
        if evaluate:
            with self.phase("eval"):
                metrics.update(self.evaluator.evaluate())
        metrics.update(self.timer.step_metrics({"step": num_tokens} if num_tokens else None))
        metrics.update(self.memory.step_metrics())
        if self.handover.calls:  # what the colocated handover did this step, in order (samples.jsonl)
            self.logger.log_text(self.state.global_step, "handover", " -> ".join(self.handover.calls))
            self.handover.calls.clear()
        self.logger.log(self.state.global_step, metrics)
        if batch is not None and self.num_sample_logs:
            self._log_samples(batch)
        self.progress.update(self.state.global_step, metrics)
        if self.plots is not None and not last and self.should_plot(self.state.global_step):
            self.plots.request()  # skipped while a redraw is still under way
        faults.hit("step.logged")
        self._report_skips(metrics)
        every = self.checkpoint.every
        if ((every and self.state.step % every == 0) or self.stop_requested) and not last:
            with self.phase("checkpoint"):
                self.checkpointer.save(samplers)
        if self.stop_requested and not last:
            raise StopRun(f"interrupted: checkpoint saved at step {self.state.global_step}; rerun to resume")

    def _log_samples(self, batch: Batch) -> None:
        count = min(self.num_sample_logs, len(batch))
        texts = [
            f"[{batch.meta['finish_reason'][i]}] {batch.meta['prompt'][i]}{batch.meta['response'][i]}"
            for i in range(count)
        ]
        self.logger.log_text(self.state.global_step, "samples", texts)

    def _report_skips(self, metrics: dict[str, float]) -> None:
        """A role whose gradient norm was non-finite skipped its update (every rank; weights unchanged): say so.
        Too many in a row stop the run from inside the optimizer (optim.max_consecutive_skips), naming the
        parameter."""
        skipped = [role for role in ("actor", "critic", "sft", "rm") if metrics.get(f"{role}/skipped", 0.0)]
        if skipped:
            self.progress.message(
                f"megarl: step {self.state.global_step}: non-finite loss or gradients in {', '.join(skipped)}; "
                "that update was skipped (weights unchanged)"
            )
