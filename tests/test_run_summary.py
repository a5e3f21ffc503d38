"""What a user sees when `megarl train` ends: the end-of-run summary (read from a run folder laid out as the trainer
writes it), and the mismatch plot's two scales. The whole command's summary is checked by the quickstart test
(tests/test_examples.py), which already runs the quickstart end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.trainer.observability.plots import PLOT_GROUPS, group_figure, group_keys
from megarl.trainer.observability.summary import RunSummary, held_out_progress, resume_command, summary_lines


def write_run(run_dir: Path, records: list[dict]) -> Path:
    """A run folder as the trainer leaves it: metrics.jsonl (one JSON object per step), TensorBoard events, a
    checkpoint and `latest`."""
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as file:
        for record in records:
            file.write(json.dumps({"time": 0.0, **record}) + "\n")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_4")
    return run_dir / "checkpoints" / "step_4"


RECORDS = [
    {"step": 1, "sft/loss": 2.0},
    {"step": 2, "sft/loss": 1.5, "eval/accuracy": 0.6015625},
    {"step": 3, "reward/mean": 0.5, "eval/accuracy": float("nan")},
    {"step": 4, "reward/mean": 0.75, "eval/accuracy": 0.85546875},
]


def test_the_summary_names_what_ran_the_held_out_metric_and_where_everything_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    latest = write_run(tmp_path / "runs" / "quickstart", RECORDS)
    (tmp_path / "runs" / "quickstart" / "plots").mkdir()
    for name in ("overview.png", "reward.png", "loss.png"):  # as plot_run names them (drawn by its own tests)
        (tmp_path / "runs" / "quickstart" / "plots" / name).write_bytes(b"")
    summary = RunSummary(
        tmp_path / "runs" / "quickstart",
        [("sft", 2), ("grpo", 2)],
        96.4,
        "megarl train --config configs/quickstart.yaml",
        latest,
    )
    assert summary_lines(summary) == [
        "megarl: done in 0:01:36; stages sft (2 steps), grpo (2 steps)",
        "megarl: eval/accuracy 0.602 -> 0.855 (step 2 -> step 4)",
        "megarl: plots        runs/quickstart/plots (overview.png and 2 more)",
        "megarl: metrics      runs/quickstart/metrics.jsonl",
        "megarl: checkpoints  runs/quickstart/checkpoints (latest: step_4)",
        "megarl: tensorboard  tensorboard --logdir runs/quickstart/tensorboard",
        "megarl: resume with  megarl train --config configs/quickstart.yaml",
    ]


def test_a_stopped_run_without_evaluation_plots_or_checkpoint_says_so(tmp_path, monkeypatch):
    """Only what the run wrote is listed: no eval set, plots off, no TensorBoard, stopped before a checkpoint (so
    there is nothing to resume from). A run folder outside the working directory is shown absolute."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path.parent / f"{tmp_path.name}-elsewhere" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "rm/loss": 0.69}) + "\n")
    summary = RunSummary(run_dir, [("rm", 100)], 3725.0, "megarl train --config rm.yaml", None, stopped="Ctrl-C")
    assert summary_lines(summary) == [
        "megarl: stopped (Ctrl-C) in 1:02:05; stages rm (100 steps)",
        "megarl: no held-out metric: eval/accuracy was not logged (data.eval_files sets the prompts)",
        f"megarl: metrics      {run_dir / 'metrics.jsonl'}",
    ]


def test_held_out_progress_skips_missing_and_non_finite_values():
    assert held_out_progress(RECORDS) == (2, 0.6015625, 4, 0.85546875)
    with pytest.raises(ValueError, match="eval/accuracy was never logged"):
        held_out_progress(RECORDS[:1])


def test_the_resume_command_is_the_command_that_ran(tmp_path, monkeypatch):
    """As typed (`megarl ...`, or `python -m megarl.cli ...`, whose argv[0] is the module's file), quoted for a
    shell; a process not started as `megarl train` gets the run folder's resolved config."""
    argv = ["/env/bin/megarl", "train", "--config", "configs/quickstart.yaml", "run.name=my run"]
    assert resume_command(tmp_path, argv) == "megarl train --config configs/quickstart.yaml 'run.name=my run'"
    argv = ["/repo/megarl/cli.py", "--debug", "train", "--config", "job.yaml"]
    assert resume_command(tmp_path, argv) == "megarl --debug train --config job.yaml"
    monkeypatch.chdir(tmp_path)
    assert resume_command(tmp_path / "runs" / "x", ["python", "-c"]) == "megarl train --config runs/x/config.yaml"


def test_the_mismatch_plot_draws_the_ratio_on_an_axis_of_its_own():
    """The ratio (about 1.0) and the log-prob differences and KL (about 1e-5 and below) on one axis would draw the
    differences as a flat line at zero: the ratio gets the right-hand axis, each axis spans its own values."""
    records = [
        {
            "step": step,
            "mismatch/abs_logprob_diff_mean": 1e-5 * (1 + step / 10),
            "mismatch/abs_logprob_diff_max": 4e-5 * (1 + step / 10),
            "mismatch/ratio_mean": 1 + 2e-6 * step,
            "mismatch/kl": 1e-10 * step,
        }
        for step in range(1, 21)
    ]
    group = next(group for group in PLOT_GROUPS if group.name == "mismatch")
    keys = group_keys(group, list(records[0])[1:])
    figure = group_figure(group, records, keys)
    left, right = figure.axes
    assert [line.get_label() for line in left.get_lines()] == [
        "mismatch/abs_logprob_diff_mean",
        "mismatch/abs_logprob_diff_max",
        "mismatch/kl",
    ]
    assert [line.get_label() for line in right.get_lines()] == ["mismatch/ratio_mean"]
    assert 1.2e-4 <= left.get_ylim()[1] < 1.3e-4  # the differences (up to 1.2e-4) fill their axis
    low, high = right.get_ylim()
    assert 0.99999 < low < 1.000002 and 1.00004 < high < 1.0001  # the ratio's axis spans 1.000002 .. 1.00004
    assert right.get_ylabel() == "ratio (actor / rollout probability)"
    legend = sorted(text.get_text() for text in left.get_legend().get_texts())
    assert legend == sorted(keys)
