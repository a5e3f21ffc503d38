"""PNG plots of a run from its `metrics.jsonl`: one figure per group of metrics and an `overview.png`.

Groups are data (`PLOT_GROUPS`): a group takes the metrics whose names match its patterns, so a new metric shows
up in the right figure by following the naming conventions of `megarl/trainer/observability/metrics.py`. Groups
without data are skipped. Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend
switch), so plotting from the trainer process is safe. `megarl plot RUN_DIR` calls `plot_command`.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megarl.errors import UserError
from megarl.trainer.observability.metrics import METRICS_FILE, read_metrics
from megarl.trainer.observability.timing import TIMING_PREFIX

logger = logging.getLogger(__name__)

PLOTS_DIR = "plots"
"""Where the PNG files go, under the run folder."""
MAX_SMOOTH_POINTS = 40
"""Series with more points than this get a smoothed line over the faint raw one."""


@dataclass(frozen=True)
class PlotGroup:
    """One figure: the metrics whose names match any of `patterns` (regular expressions, `re.search`)."""

    name: str
    """File stem of the figure and its name in the overview."""
    title: str
    ylabel: str
    patterns: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    """Patterns of metrics left out even when they match (they have a figure of their own)."""
    kind: Literal["lines", "stacked"] = "lines"
    """lines: one line per metric; stacked: top-level phases stacked under the step time (timing)."""
    smooth: bool = True
    """Draw a moving average over long noisy series."""
    log_y: bool = False
    """Logarithmic y axis when every value is positive and they span more than three decades."""
    second_axis: tuple[str, ...] = ()
    """Patterns of metrics drawn on a y axis of their own, on the right: a quantity of another scale (a ratio about
    1.0 beside differences about 1e-5 would flatten them to a line at zero)."""
    second_ylabel: str = ""


PLOT_GROUPS = (
    PlotGroup(
        "reward",
        "Reward and accuracy",
        "reward / accuracy",
        (r"^eval/(.+/)?accuracy$", r"^reward/(mean|acc)$", r"^reward/"),
        (r"^reward/(num_|fraction_)", r"^reward/std$"),  # counters have a figure of their own; std is a band
    ),
    PlotGroup("reward_failures", "Reward failures", "samples", (r"^reward/(num_|fraction_)",), smooth=False),
    PlotGroup("kl", "KL divergence", "KL", (r"^kl/", r"(^|/)([a-z]+_)*kl(_[a-z]+)*$"), (r"^(mismatch|distill)/",)),
    PlotGroup("entropy", "Policy entropy", "entropy (nats / token)", (r"(^|/)[^/]*entropy[^/]*$",)),
    PlotGroup("response_length", "Response length", "tokens", (r"^(response|prompt)_length/(mean|min|max|std)$",)),
    PlotGroup(
        "mismatch",
        "Training-inference mismatch",
        "|log-prob difference|, KL",
        (r"^mismatch/",),
        second_axis=(r"^mismatch/ratio",),
        second_ylabel="ratio (actor / rollout probability)",
    ),
    PlotGroup(
        "distill",
        "On-policy distillation: the student against its teacher",
        "reverse KL (nats)",
        (r"^distill/reverse_kl$", r"^distill/teacher_logprob$"),
        second_axis=(r"^distill/teacher_logprob$",),
        second_ylabel="teacher's log-prob of the student's tokens",
    ),
    PlotGroup("routing", "MoE routing: engine vs trainer", "fraction", (r"^rollout/routing_(agreement|replayed)",)),
    PlotGroup(
        "agent",
        "Agent episodes: tool use and how episodes end",
        "fraction of episodes",
        (r"^(agent|eval)/tool_use_rate$", r"^agent/(truncated|failed)$"),
    ),
    PlotGroup("timing", "Time per step", "seconds", (rf"^{TIMING_PREFIX}",), kind="stacked", smooth=False),
    PlotGroup("throughput", "Throughput", "tokens / s", (r"^throughput/",)),
    PlotGroup("memory", "Memory at the end of each phase", "GiB", (r"^memory/",), smooth=False),
    PlotGroup("loss", "Losses", "loss", (r"(^|/|_)loss$",)),
    PlotGroup("clipping", "Clipped fractions", "fraction", (r"(^|/)[^/]*clip_?(frac|ratio)[^/]*$",)),
    PlotGroup("grad_norm", "Gradient norm", "grad norm (before clipping)", (r"grad_norm",), log_y=True),
    PlotGroup("lr", "Learning rate", "learning rate", (r"(^|/)(lr|learning_rate)$",), smooth=False),
)
"""The figures `plot_run` draws, in order."""

OVERVIEW_GROUPS = ("reward", "kl", "entropy", "response_length", "timing", "mismatch")
"""The overview's panels, in order; when some have no data, `OVERVIEW_FALLBACK_GROUPS` fill up to six panels."""
OVERVIEW_FALLBACK_GROUPS = ("distill", "loss", "grad_norm", "throughput", "lr", "clipping")


def group_keys(group: PlotGroup, keys: Sequence[str]) -> list[str]:
    """The metric names a group plots: by the first pattern they match, then in the order given."""
    ranked = []
    for position, key in enumerate(keys):
        if any(re.search(pattern, key) for pattern in group.exclude):
            continue
        rank = next((index for index, pattern in enumerate(group.patterns) if re.search(pattern, key)), None)
        if rank is not None:
            ranked.append((rank, position, key))
    return [key for _, _, key in sorted(ranked)]


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one metric (missing and non-finite values are left out)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw every group with data and `overview.png` into `out_dir` (default `run_dir/plots/`); returns the files."""
    records = sorted(read_metrics(run_dir), key=lambda record: record["step"])
    out_path = Path(out_dir) if out_dir is not None else Path(run_dir) / PLOTS_DIR
    if not records:
        return []
    out_path.mkdir(parents=True, exist_ok=True)
    keys = _all_keys(records)
    groups = {group.name: (group, group_keys(group, keys)) for group in PLOT_GROUPS}
    groups = {name: entry for name, entry in groups.items() if _has_data(records, entry[1])}
    run_name = Path(run_dir).resolve().name
    written = []
    for group, group_metric_keys in groups.values():
        figure = group_figure(group, records, group_metric_keys)
        figure.suptitle(run_name, fontsize=9, color="0.4", x=0.99, ha="right")
        written.append(_save(figure, out_path / f"{group.name}.png"))
    if groups:
        written.append(_draw_overview(records, groups, out_path / "overview.png", run_name))
    return written


def group_figure(group: PlotGroup, records: Sequence[dict[str, Any]], keys: Sequence[str]) -> Any:
    """One group's figure (a matplotlib Figure, not yet saved): `records` sorted by step, `keys` from group_keys."""
    figure = _new_figure(figsize=(8.0, 4.5))
    _draw_group(figure.add_subplot(), group, records, keys)
    return figure


def plot_command(run_dir: str | Path) -> int:
    """`megarl plot RUN_DIR`: draw the plots, print where they went; 0 on success, 1 when there is nothing to plot."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"run folder {str(run_dir)!r} does not exist; give the run_dir of a megarl training run")
    if not (path / METRICS_FILE).is_file():
        raise UserError(
            f"{str(run_dir)!r} has no {METRICS_FILE}: it is not a megarl run folder, or the run has not logged a step"
        )
    written = plot_run(path)
    if not written:
        print(f"{path / METRICS_FILE} holds no metrics yet; nothing to plot")
        return 1
    print(f"wrote {len(written)} plots to {written[0].parent}:")
    for file in written:
        print(f"  {file}")
    return 0


class BackgroundPlotter:
    """Redraws a run's plots in a daemon thread, so the training loop does not wait on matplotlib (a second or
    more per figure on a busy CPU). A request while a drawing is under way is skipped: the next one catches up.
    A failed drawing is logged, never raised: plots must not stop a run."""

    def __init__(self, run_dir: str | Path, out_dir: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.out_dir = out_dir
        self._thread: threading.Thread | None = None

    def request(self) -> bool:
        """Start a redraw unless one is running; returns whether one was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._draw, name="megarl-plots", daemon=True)
        self._thread.start()
        return True

    def finish(self) -> None:
        """Draw once more in the background (the run's last steps), after any redraw under way; `close(final=False)`
        waits for it. A run calls this first when it ends, so the drawing overlaps the workers' shutdown."""
        previous = self._thread

        def draw() -> None:
            if previous is not None:
                previous.join()
            self._draw()

        self._thread = threading.Thread(target=draw, name="megarl-plots", daemon=True)
        self._thread.start()

    def close(self, final: bool = True) -> list[Path]:
        """Wait for a running redraw; with `final`, draw once more in this thread (the run's last steps) and return
        the files."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._draw() if final else []

    def _draw(self) -> list[Path]:
        try:
            return plot_run(self.run_dir, self.out_dir)
        except Exception:
            logger.warning("drawing the plots of %s failed", self.run_dir, exc_info=True)
            return []


# -- drawing ---------------------------------------------------------------------------------------------------------


def _all_keys(records: Sequence[dict[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for record in records:
        keys.update(dict.fromkeys(name for name in record if name not in ("step", "time")))
    return list(keys)


def _has_data(records: Sequence[dict[str, Any]], keys: Sequence[str]) -> bool:
    return any(series(records, key)[0] for key in keys)


def _new_figure(figsize: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure  # the object API renders on Agg without touching pyplot's global state

    return Figure(figsize=figsize, dpi=110, layout="constrained")


def _save(figure: Any, path: Path) -> Path:
    figure.savefig(path, format="png")
    return path


def _draw_group(axes: Any, group: PlotGroup, records: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
    second = [key for key in keys if any(re.search(pattern, key) for pattern in group.second_axis)]
    first = [key for key in keys if key not in second]
    if group.kind == "stacked":
        _draw_stacked_timing(axes, records, first)
    else:
        _draw_lines(axes, group, records, first)
    axes.set_title(group.title)
    axes.set_xlabel("step")
    axes.set_ylabel(group.ylabel)
    axes.grid(True, alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if second:  # its own scale, on the right; its lines continue the left axis's colours and share one legend
        right = axes.twinx()
        cycle = _colors()
        right.set_prop_cycle(color=[cycle[(len(axes.get_lines()) + i) % len(cycle)] for i in range(len(cycle))])
        _draw_lines(right, group, records, second)
        right.set_ylabel(group.second_ylabel)
        right.ticklabel_format(axis="y", useOffset=False)
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles and group.kind == "stacked":
        # Stacked areas fill the plot: the legend goes beside it, top to bottom in stacking order reversed.
        axes.legend(handles[::-1], labels[::-1], fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif handles:
        axes.legend(handles, labels, fontsize="small", ncol=2 if len(handles) > 6 else 1, loc="best", framealpha=0.8)


def _colors() -> list[str]:
    from matplotlib import rcParams

    return list(rcParams["axes.prop_cycle"].by_key()["color"])


def _draw_lines(axes: Any, group: PlotGroup, records: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
    num_steps = len(records)
    all_values: list[float] = []
    for key in keys:
        if key.endswith("/std") and key[: -len("std")] + "mean" in keys:
            continue  # drawn as the band around its mean
        steps, values = series(records, key)
        if not steps:
            continue
        all_values.extend(values)
        sparse = len(steps) < max(2, num_steps // 3)  # e.g. eval metrics every N steps: show the points
        if sparse:
            axes.plot(steps, values, marker="o", markersize=4, linewidth=1.5, label=key)
        elif group.smooth and len(steps) > MAX_SMOOTH_POINTS:
            (raw,) = axes.plot(steps, values, linewidth=0.8, alpha=0.3)
            window = max(2, len(steps) // 25)
            axes.plot(steps, moving_average(values, window), color=raw.get_color(), linewidth=1.8, label=key)
        else:
            axes.plot(steps, values, linewidth=1.5, marker="." if len(steps) <= 30 else None, label=key)
        if key.endswith("/mean"):
            _draw_std_band(axes, records, key, steps, values)
    if group.log_y and all_values and min(all_values) > 0 and max(all_values) / min(all_values) > 1e3:
        axes.set_yscale("log")
    if group.name == "lr":
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def _draw_std_band(
    axes: Any, records: Sequence[dict[str, Any]], mean_key: str, steps: list[int], means: list[float]
) -> None:
    std_by_step = dict(zip(*series(records, mean_key[: -len("mean")] + "std")))
    if not std_by_step:
        return
    band = [(step, mean, std_by_step[step]) for step, mean in zip(steps, means) if step in std_by_step]
    color = axes.get_lines()[-1].get_color()
    axes.fill_between(
        [s for s, _, _ in band],
        [m - d for _, m, d in band],
        [m + d for _, m, d in band],
        color=color,
        alpha=0.12,
        linewidth=0,
        label=f"{mean_key[: -len('mean')]}mean ± std",
    )


def _draw_stacked_timing(axes: Any, records: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
    """Top-level phases stacked (they do not overlap), the step time as a line over them; nested phases are
    inside their parent, so they are left out."""
    step_key = f"{TIMING_PREFIX}step_s"
    phase_keys = [key for key in keys if key != step_key and "/" not in key[len(TIMING_PREFIX) :]]
    # Steps with phase times only (an eval-only record, e.g. the baseline at step 0, would read as a zero-time step).
    steps = sorted({step for key in phase_keys for step in series(records, key)[0]})
    if phase_keys:
        layers = []
        for key in phase_keys:
            by_step = dict(zip(*series(records, key)))
            layers.append([by_step.get(step, 0.0) for step in steps])
        labels = [key[len(TIMING_PREFIX) :].removesuffix("_s") for key in phase_keys]
        axes.stackplot(steps, layers, labels=labels, alpha=0.75)
    step_steps, step_values = series(records, step_key)
    if step_steps:
        axes.plot(step_steps, step_values, color="black", linewidth=1.2, label="whole step")
    axes.set_ylim(bottom=0)


def _draw_overview(
    records: Sequence[dict[str, Any]], groups: dict[str, tuple[PlotGroup, list[str]]], path: Path, run_name: str
) -> Path:
    names = [name for name in OVERVIEW_GROUPS if name in groups]
    names += [name for name in OVERVIEW_FALLBACK_GROUPS if name in groups][: max(0, 6 - len(names))]
    num_columns = {1: 1, 2: 2, 3: 3, 4: 2}.get(len(names), 3)
    num_rows = math.ceil(len(names) / num_columns)
    figure = _new_figure(figsize=(5.0 * num_columns, 3.6 * num_rows))
    for index, name in enumerate(names):
        group, keys = groups[name]
        axes = figure.add_subplot(num_rows, num_columns, index + 1)
        _draw_group(axes, group, records, keys)
    last_step = int(records[-1]["step"])
    figure.suptitle(f"{run_name}: overview at step {last_step}", fontsize=13)
    return _save(figure, path)
