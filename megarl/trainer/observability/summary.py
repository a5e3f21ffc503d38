"""The end-of-run summary `megarl train` prints last: what ran, what the held-out metric did, how long it took, where
everything is, and the command that resumes.

    megarl: done in 0:01:36; stages sft (300 steps), grpo (60 steps)
    megarl: eval/accuracy 0.602 -> 0.855 (step 300 -> step 360)
    megarl: plots        runs/quickstart/plots (overview.png and 7 more)
    megarl: metrics      runs/quickstart/metrics.jsonl
    megarl: checkpoints  runs/quickstart/checkpoints (latest: step_360)
    megarl: tensorboard  tensorboard --logdir runs/quickstart/tensorboard
    megarl: resume with  megarl train --config configs/quickstart.yaml

It reads only the run folder (metrics.jsonl and what lies beside it), so it shows what a user would find there.
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.trainer.observability.metrics import METRICS_FILE, TENSORBOARD_DIR, read_metrics
from megarl.trainer.observability.plots import PLOTS_DIR
from megarl.trainer.observability.progress import format_duration

HELD_OUT_METRIC = "eval/accuracy"
"""The held-out metric the summary follows (greedy evaluation on data.eval_files)."""


@dataclass
class RunSummary:
    """What the summary needs from the trainer; everything else it reads from `run_dir`."""

    run_dir: Path
    stages: Sequence[tuple[str, int]]
    """(stage, number of steps) in the order run.stages gives them."""
    seconds: float
    """Wall time of the whole command."""
    command: str
    """The command that resumes the run (the one that ran)."""
    latest_checkpoint: Path | None
    """checkpoints/latest's target, or None when the run wrote no checkpoint."""
    stopped: str | None = None
    """Why the run stopped early (None: every stage finished)."""


def held_out_progress(records: Sequence[dict[str, Any]], key: str = HELD_OUT_METRIC) -> tuple[int, float, int, float]:
    """(first step, first value, last step, last value) of `key` over the run; ValueError when it was never logged."""
    points = [
        (int(record["step"]), float(record[key]))
        for record in records
        if isinstance(record.get(key), int | float) and math.isfinite(record[key])
    ]
    if not points:
        raise ValueError(f"{key} was never logged")
    points.sort()
    return (*points[0], *points[-1])


def summary_lines(summary: RunSummary) -> list[str]:
    """The summary, one line each, every line starting with `megarl: `."""
    run_dir = summary.run_dir
    stages = ", ".join(f"{stage} ({num_steps} steps)" for stage, num_steps in summary.stages)
    outcome = f"stopped ({summary.stopped})" if summary.stopped else "done"
    lines = [f"{outcome} in {format_duration(summary.seconds)}; stages {stages}"]
    records = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    try:
        first_step, first_value, last_step, last_value = held_out_progress(records)
        lines.append(f"{HELD_OUT_METRIC} {first_value:.3f} -> {last_value:.3f} (step {first_step} -> step {last_step})")
    except ValueError:
        lines.append(f"no held-out metric: {HELD_OUT_METRIC} was not logged (data.eval_files sets the prompts)")
    plots = sorted(path.name for path in (run_dir / PLOTS_DIR).glob("*.png"))
    if plots:
        first = "overview.png" if "overview.png" in plots else plots[0]
        more = f" and {len(plots) - 1} more" if len(plots) > 1 else ""
        lines.append(f"plots        {shown(run_dir / PLOTS_DIR)} ({first}{more})")
    if records:
        lines.append(f"metrics      {shown(run_dir / METRICS_FILE)}")
    latest = summary.latest_checkpoint
    if latest is not None:
        lines.append(f"checkpoints  {shown(latest.parent)} (latest: {latest.name})")
    if (run_dir / TENSORBOARD_DIR).is_dir():
        lines.append(f"tensorboard  tensorboard --logdir {shlex.quote(shown(run_dir / TENSORBOARD_DIR))}")
    if latest is not None:
        lines.append(f"resume with  {summary.command}")
    return [f"megarl: {line}" for line in lines]


def shown(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (as a user would type it), else absolute."""
    absolute = path.resolve()
    try:
        return str(absolute.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(absolute)


def resume_command(run_dir: Path, argv: Sequence[str] | None = None) -> str:
    """The `megarl train ...` command that ran (the same command, from the same folder, resumes), read off the
    process's arguments; the run folder's resolved config when the process was not started as `megarl train`."""
    args = list(sys.argv if argv is None else argv)[1:]
    if "train" in args:
        return "megarl " + shlex.join(args)
    return f"megarl train --config {shlex.quote(shown(run_dir / 'config.yaml'))}"


def print_summary(summary: RunSummary) -> None:
    """Print the summary on stdout (the progress display is closed by then)."""
    print("\n".join(summary_lines(summary)), flush=True)


__all__ = ["HELD_OUT_METRIC", "RunSummary", "held_out_progress", "print_summary", "resume_command", "summary_lines"]
