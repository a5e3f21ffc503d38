"""Run plots from a synthetic metrics.jsonl: which figures are drawn, that they are real PNGs, which metrics go in
which group, and the `megarl plot` command's messages."""

from __future__ import annotations

import math
import random
import threading

import pytest

from megarl.errors import UserError
from megarl.trainer.observability.logging_config import LoggingConfig
from megarl.trainer.observability.metrics import METRICS_FILE, MetricsLogger
from megarl.trainer.observability.plots import (
    PLOT_GROUPS,
    BackgroundPlotter,
    group_keys,
    moving_average,
    plot_command,
    plot_run,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_synthetic_run(run_dir, num_steps: int = 60) -> None:
    """A GRPO-like run: rising reward, growing KL, falling entropy, eval every 20 steps, one NaN grad norm."""
    rng = random.Random(0)
    with MetricsLogger(run_dir, LoggingConfig(tensorboard=False)) as logger:
        for step in range(1, num_steps + 1):
            progress = 1 - math.exp(-step / 20)
            metrics = {
                "reward/mean": 0.2 + 0.6 * progress + rng.gauss(0, 0.05),
                "reward/std": 0.3 - 0.1 * progress,
                "actor/kl": 0.002 * step**0.5,
                "actor/entropy": 1.5 - 0.8 * progress,
                "actor/pg_loss": rng.gauss(0, 0.02),
                "actor/grad_norm": math.nan if step == 30 else 1.0 + rng.random(),
                "response_length/mean": 200 + 150 * progress,
                "mismatch/logprob_abs_diff": 0.01 + 0.001 * rng.random(),
                "timing/rollout_s": 6.0,
                "timing/rollout/reward_s": 0.5,
                "timing/update_s": 3.0,
                "timing/step_s": 9.5,
                "throughput/tokens_per_s": 3000.0,
            }
            if step % 20 == 0:
                metrics["eval/accuracy"] = 0.15 + 0.6 * progress
            logger.log(step, metrics)


@pytest.fixture(scope="module")
def plotted_run(tmp_path_factory):
    """A synthetic run plotted once (drawing ten figures takes a few seconds on a busy CPU)."""
    run_dir = tmp_path_factory.mktemp("run")
    write_synthetic_run(run_dir)
    return run_dir, plot_run(run_dir)


def write_small_run(run_dir, num_steps: int = 3) -> None:
    with MetricsLogger(run_dir, LoggingConfig(tensorboard=False)) as logger:
        for step in range(1, num_steps + 1):
            logger.log(step, {"reward/mean": step / 10})


def test_plot_run_draws_each_group_with_data_and_an_overview(plotted_run):
    tmp_path, written = plotted_run
    names = sorted(path.name for path in written)
    assert names == sorted(
        [
            "reward.png",
            "kl.png",
            "entropy.png",
            "response_length.png",
            "mismatch.png",
            "timing.png",
            "throughput.png",
            "loss.png",
            "grad_norm.png",
            "overview.png",
        ]
    )  # no lr or clipping metrics: no lr.png, no clipping.png
    for path in written:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 15_000, path  # a drawn figure, not an empty canvas
    assert (tmp_path / "plots" / "overview.png").stat().st_size > (tmp_path / "plots" / "kl.png").stat().st_size


def test_plot_run_into_another_folder_and_with_no_records(tmp_path):
    write_small_run(tmp_path / "run")
    written = plot_run(tmp_path / "run", out_dir=tmp_path / "elsewhere")
    assert [path.name for path in written] == ["reward.png", "overview.png"]
    assert all(path.parent == tmp_path / "elsewhere" for path in written)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / METRICS_FILE).write_text("")
    assert plot_run(tmp_path / "empty") == []


def test_metrics_land_in_their_groups():
    keys = [
        "reward/mean",
        "eval/accuracy",
        "eval/math/accuracy",
        "actor/kl",
        "actor/approx_kl",
        "actor/kl_loss",
        "mismatch/kl",
        "actor/entropy",
        "actor/pg_loss",
        "critic/vf_loss",
        "actor/grad_norm",
        "actor/lr",
        "actor/clip_frac",
        "response_length/mean",
        "response_length/clip_frac",
        "timing/rollout_s",
        "skill/other",
        "distill/reverse_kl",
        "distill/reverse_kl_per_sample",
        "distill/teacher_logprob",
    ]
    groups = {group.name: group_keys(group, keys) for group in PLOT_GROUPS}
    assert groups["reward"] == ["eval/accuracy", "eval/math/accuracy", "reward/mean"]
    assert groups["kl"] == ["actor/kl", "actor/approx_kl", "actor/kl_loss"]  # mismatch/kl has its own figure
    assert groups["mismatch"] == ["mismatch/kl"]
    assert groups["distill"] == ["distill/reverse_kl", "distill/teacher_logprob"]  # per sample: another scale
    assert groups["loss"] == ["actor/kl_loss", "actor/pg_loss", "critic/vf_loss"]
    assert groups["response_length"] == ["response_length/mean"]
    assert groups["clipping"] == ["actor/clip_frac", "response_length/clip_frac"]
    assert groups["grad_norm"] == ["actor/grad_norm"] and groups["lr"] == ["actor/lr"]
    assert groups["timing"] == ["timing/rollout_s"]
    assert not any("skill/other" in group for group in groups.values())


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_plot_command_reports_what_it_wrote(tmp_path, capsys):
    write_small_run(tmp_path)
    assert plot_command(tmp_path) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote 2 plots to {tmp_path / 'plots'}:",
        f"  {tmp_path / 'plots' / 'reward.png'}",
        f"  {tmp_path / 'plots' / 'overview.png'}",
    ]


def test_plot_command_errors_name_the_folder(tmp_path, capsys):
    with pytest.raises(UserError, match=r"run folder '.*/missing' does not exist"):
        plot_command(tmp_path / "missing")
    with pytest.raises(UserError, match=r"has no metrics.jsonl: it is not a megarl run folder"):
        plot_command(tmp_path)
    (tmp_path / METRICS_FILE).write_text("")
    assert plot_command(tmp_path) == 1
    assert "holds no metrics yet" in capsys.readouterr().out


def test_background_plotter_draws_off_the_loop_and_once_more_at_close(tmp_path, monkeypatch):
    write_small_run(tmp_path)
    release = threading.Event()
    threads = []

    def slow_plot_run(run_dir, out_dir=None):
        threads.append(threading.current_thread().name)
        if threading.current_thread().name == "megarl-plots":
            release.wait(timeout=10)  # a drawing that is still under way
        return plot_run(run_dir, out_dir)

    monkeypatch.setattr("megarl.trainer.observability.plots.plot_run", slow_plot_run)
    plotter = BackgroundPlotter(tmp_path)
    assert plotter.request()
    assert not plotter.request()  # still drawing: skipped
    release.set()
    written = plotter.close()
    assert threads == ["megarl-plots", "MainThread"]
    assert [path.name for path in written] == ["reward.png", "overview.png"]
    assert (tmp_path / "plots" / "reward.png").exists()


def test_finish_draws_once_more_after_the_redraw_under_way_and_close_waits_for_it(tmp_path, monkeypatch):
    """The end of a run: `finish` (first at shutdown) draws in the background after any mid-run redraw, so the
    last steps are in the plots; `close(final=False)` (last at shutdown) waits for that drawing."""
    write_small_run(tmp_path)
    release = threading.Event()
    calls = []

    def slow_plot_run(run_dir, out_dir=None):
        calls.append(len(calls))
        if len(calls) == 1:
            release.wait(timeout=10)  # the mid-run redraw is still under way when the run ends
        return plot_run(run_dir, out_dir)

    monkeypatch.setattr("megarl.trainer.observability.plots.plot_run", slow_plot_run)
    plotter = BackgroundPlotter(tmp_path)
    assert plotter.request()
    plotter.finish()
    assert calls == [0]  # the final drawing waits for the one under way
    release.set()
    assert plotter.close(final=False) == []
    assert calls == [0, 1] and (tmp_path / "plots" / "overview.png").exists()


def test_background_plotter_logs_a_failure_instead_of_raising(tmp_path, caplog):
    plotter = BackgroundPlotter(tmp_path / "missing")
    assert plotter.close() == []
    assert "drawing the plots of" in caplog.text


def test_a_run_redraws_its_plots_every_plot_every_steps_but_not_after_its_last(tmp_path):
    """logging.plot_every: the step loop (Steps.end) asks the background plotter for a redraw after every
    plot_every-th step; the last step is left to the final drawing at the run's end."""
    from types import SimpleNamespace

    from megarl.trainer.config import CheckpointConfig
    from megarl.trainer.lifecycle.run_checkpoint import TrainerState
    from megarl.trainer.loops.steps import Steps
    from megarl.trainer.observability.logging_config import LoggingConfig
    from megarl.trainer.observability.memory_metrics import MemoryProbe
    from megarl.trainer.observability.metrics import NullLogger

    class CountingPlotter:
        def __init__(self):
            self.requested_at: list[int] = []

        def request(self) -> bool:
            self.requested_at.append(steps.state.global_step)
            return True

    plotter = CountingPlotter()
    steps = Steps(
        TrainerState(),
        NullLogger(),
        SimpleNamespace(update=lambda step, metrics: None),
        checkpointer=None,
        checkpoint=CheckpointConfig(every=0),
        handover=SimpleNamespace(calls=[]),
        memory=MemoryProbe([], enabled=False),
        plots=plotter,
        should_plot=LoggingConfig(plot_every=3).should_plot,
    )
    for _ in range(9):
        steps.end({}, num_steps=9, samplers={})
    assert plotter.requested_at == [3, 6]
