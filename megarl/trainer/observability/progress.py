"""The run's console display: a live progress bar (step / total, elapsed, ETA) with a line of the latest key
metrics when the output is a terminal, and plain one-line-per-step logging otherwise (CI, log files, Slurm output,
`logging.progress=false`).

The display never stops the run: if the terminal misbehaves, it falls back to plain lines and carries on.
Log lines should go through `RunProgress.message` (or a `rich.logging.RichHandler` on `RunProgress.console`) while
the live display runs, so they print above the bar instead of through it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from megarl.trainer.observability.logging_config import DEFAULT_PROGRESS_KEYS

METRIC_LABELS = {
    "reward/mean": "reward",
    "eval/accuracy": "acc",
    "actor/kl": "kl",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
    "throughput/tokens_per_s": "tok/s",
    "timing/step_s": "step_s",
}
"""Short console labels of common metrics; any other key is shown under its own name."""


def format_number(value: float) -> str:
    """A compact, fixed-meaning rendering: 0.512, 0.0012, 1.2e-05, 12.3, 1,234."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    if magnitude == 0 or magnitude >= 1e-3:
        return f"{value:.4g}"
    return f"{value:.2e}"


def format_duration(seconds: float) -> str:
    """H:MM:SS, or '?' when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):  # closed, replaced or odd streams count as not a terminal
        return False


class RunProgress:
    """Progress of a run of `total_steps` steps that starts after `start_step` (the resumed checkpoint's step, 0
    for a new run); `update(step, metrics)` after each step. `keys` are the metrics shown, in order (default:
    `DEFAULT_PROGRESS_KEYS`); metrics not logged at a step keep their latest value (e.g. eval accuracy).
    Plain lines are printed every `console_every` steps and at the last step."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        keys: Sequence[str] | None = None,
        enabled: bool = True,
        console_every: int = 1,
        stream: TextIO | None = None,
        description: str = "train",
    ) -> None:
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.keys = list(keys) if keys is not None else list(DEFAULT_PROGRESS_KEYS)
        self.console_every = max(1, int(console_every))
        self.description = description
        self.stream = stream if stream is not None else sys.stdout
        self.step = self.start_step
        self.latest: dict[str, float] = {}
        self.console: Any = None  # the rich Console of the live display; None in plain mode
        self._start_time = time.monotonic()
        self._last_update_time = self._start_time
        self._live: Any = None
        self._progress: Any = None
        self._task_id: Any = None
        self._closed = False
        if enabled and _is_terminal(self.stream):
            try:
                self._start_live()
            except Exception as error:
                self._fall_back(error)

    @property
    def live(self) -> bool:
        """Whether the live display is running (False: plain lines)."""
        return self._live is not None

    # -- public interface -------------------------------------------------------------------------------------------

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that `step` finished with `metrics` (numbers or 0-d tensors; only `keys` are read)."""
        if self._closed:
            return
        self.step = int(step)
        self._last_update_time = time.monotonic()
        for key in self.keys:
            if metrics is not None and key in metrics:
                try:
                    self.latest[key] = float(metrics[key])
                except (TypeError, ValueError):
                    continue
        if self._live is not None:
            try:
                self._progress.update(self._task_id, completed=self.step)
                self._live.refresh()
                return
            except Exception as error:
                self._fall_back(error)
        if self._is_print_step():
            self._print(self.status_line())

    def message(self, text: str) -> None:
        """A log line, printed above the live bar (or as a plain line)."""
        if self._live is not None:
            try:
                self.console.print(text, markup=False, highlight=False)
                return
            except Exception as error:
                self._fall_back(error)
        self._print(text)

    def close(self) -> None:
        """Stop the live display, leaving its last frame on screen; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            with contextlib.suppress(Exception):  # the terminal is gone or broken: nothing left to show
                self._live.stop()
            self._live = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------------------------------

    def eta_s(self) -> float:
        """Estimated seconds to the last step: the mean step time of this session times the steps left, counting
        down between updates (inf before the first step)."""
        num_done = self.step - self.start_step
        if num_done <= 0:
            return math.inf
        mean_step_s = (self._last_update_time - self._start_time) / num_done
        since_update_s = time.monotonic() - self._last_update_time
        return max(0.0, mean_step_s * max(0, self.total_steps - self.step) - since_update_s)

    def metrics_line(self) -> str:
        """The latest key metrics, 'reward 0.512 | acc 0.43 | ...' (keys not logged yet are left out)."""
        latest = self.latest
        parts = [f"{METRIC_LABELS.get(key, key)} {format_number(latest[key])}" for key in self.keys if key in latest]
        return " | ".join(parts)

    def status_line(self) -> str:
        """The plain-mode line: step, the key metrics, elapsed time and ETA."""
        width = len(str(self.total_steps))
        percent = 100.0 * self.step / self.total_steps if self.total_steps > 0 else 100.0
        head = f"step {self.step:>{width}}/{self.total_steps} ({percent:3.0f}%)"
        elapsed = format_duration(time.monotonic() - self._start_time)
        tail = f"elapsed {elapsed} | eta {format_duration(self.eta_s())}"
        metrics = self.metrics_line()
        return " | ".join(part for part in (head, metrics, tail) if part)

    # -- internals --------------------------------------------------------------------------------------------------

    def _is_print_step(self) -> bool:
        num_done = self.step - self.start_step
        return num_done == 1 or self.step % self.console_every == 0 or self.step >= self.total_steps

    def _print(self, text: str) -> None:
        # stdout closed or a broken pipe (e.g. `| head`): training goes on without a console.
        with contextlib.suppress(OSError, ValueError):
            print(text, file=self.stream, flush=True)

    def _start_live(self) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        run_progress = self

        class EtaColumn(ProgressColumn):
            """Our ETA (mean step time of the session, counting down), not rich's 30-second speed window, which
            has no samples when a step takes minutes."""

            def render(self, task: Any) -> Text:
                return Text(f"• eta {format_duration(run_progress.eta_s())}")

        self.console = Console(file=self.stream)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps • elapsed"),
            TimeElapsedColumn(),
            EtaColumn(),
            console=self.console,
            auto_refresh=False,
        )
        self._task_id = self._progress.add_task(self.description, total=self.total_steps, completed=self.start_step)
        metrics_renderable = _MetricsLine(self)
        self._live = Live(
            Group(self._progress, metrics_renderable),
            console=self.console,
            refresh_per_second=2,
            # Redirect only streams that are terminals: output going to a file stays in that file.
            redirect_stdout=_is_terminal(sys.stdout),
            redirect_stderr=_is_terminal(sys.stderr),
        )
        self._live.start()

    def _fall_back(self, error: Exception) -> None:
        """Give up on the live display after `error` and continue with plain lines."""
        live, self._live, self.console = self._live, None, None
        if live is not None:
            with contextlib.suppress(Exception):
                live.stop()
        self._print(f"[megarl] live progress display off ({type(error).__name__}: {error}); printing plain lines")


class _MetricsLine:
    """The live display's second line; re-rendered from the progress object's latest values at every refresh."""

    def __init__(self, progress: RunProgress) -> None:
        self.progress = progress

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(self.progress.metrics_line() or "waiting for the first step ...", style="cyan")
