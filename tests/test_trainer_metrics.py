"""The metrics logger: JSONL records (flushed per step, truncated on resume, NaN as null), TensorBoard events read
back with TensorBoard's own reader, sample texts, W&B handling, the no-op logger and the logging config checks."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
import torch

from megarl.errors import UserError
from megarl.trainer.observability.logging_config import LoggingConfig, WandbConfig
from megarl.trainer.observability.metrics import (
    METRICS_FILE,
    SAMPLES_FILE,
    TENSORBOARD_DIR,
    MetricsLogger,
    NullLogger,
    build_logger,
    read_metrics,
    read_samples,
    to_floats,
)

NO_TENSORBOARD = LoggingConfig(tensorboard=False)


def jsonl_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the run's event files, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def test_jsonl_lines_are_readable_while_the_logger_is_open(tmp_path):
    with MetricsLogger(tmp_path, NO_TENSORBOARD) as logger:
        returned = logger.log(
            1, {"reward/mean": 0.25, "actor/pg_loss": torch.tensor(-0.5), "num_tokens": torch.tensor(1234)}
        )
        lines = jsonl_lines(tmp_path / METRICS_FILE)  # read back before close: every step is flushed
        assert len(lines) == 1
        assert lines[0]["step"] == 1 and lines[0]["time"] > 0
        assert {k: v for k, v in lines[0].items() if k not in ("step", "time")} == {
            "reward/mean": 0.25,
            "actor/pg_loss": -0.5,
            "num_tokens": 1234,
        }
        assert isinstance(lines[0]["num_tokens"], int)
        assert returned == {"reward/mean": 0.25, "actor/pg_loss": -0.5, "num_tokens": 1234.0}
        logger.log(2, {"reward/mean": 0.5})
        assert [line["step"] for line in jsonl_lines(tmp_path / METRICS_FILE)] == [1, 2]
    assert [record["reward/mean"] for record in read_metrics(tmp_path)] == [0.25, 0.5]


def test_non_finite_values_are_null_in_jsonl_and_skipped_in_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"a/nan": math.nan, "a/inf": torch.tensor(math.inf), "a/ok": 1.5})
        logger.log(2, {"a/nan": 2.0, "a/inf": -math.inf, "a/ok": 2.5})
    line = (tmp_path / METRICS_FILE).read_text().splitlines()[0]
    assert '"a/nan": null' in line and '"a/inf": null' in line  # valid JSON: no NaN/Infinity literals
    records = read_metrics(tmp_path)
    assert math.isnan(records[0]["a/nan"]) and math.isnan(records[1]["a/inf"])
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["a/ok"] == [(1, 1.5), (2, 2.5)]
    assert scalars["a/nan"] == [(2, 2.0)]
    assert "a/inf" not in scalars


def test_resume_drops_the_lines_after_the_checkpoint_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward/mean": float(step)})
            logger.log_text(step, "samples/rollout", f"completion {step}")
    with open(tmp_path / METRICS_FILE, "a") as file:
        file.write('{"step": 6, "reward/me')  # a line torn by a crash
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3]
        logger.log(4, {"reward/mean": 40.0})
        logger.log_text(4, "samples/rollout", "completion 4 again")
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert [(s["step"], s["text"]) for s in read_samples(tmp_path)] == [
        (1, "completion 1"),
        (2, "completion 2"),
        (3, "completion 3"),
        (4, "completion 4 again"),
    ]
    # TensorBoard hides the first run's events after step 3 (purge_step), so both records agree.
    assert tensorboard_scalars(tmp_path)["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_a_new_run_starts_a_new_record(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 1.0})
    with MetricsLogger(tmp_path) as logger:
        assert (tmp_path / METRICS_FILE).read_text() == ""
        logger.log(1, {"x": 2.0})
    assert [record["x"] for record in read_metrics(tmp_path)] == [2.0]
    assert tensorboard_scalars(tmp_path)["x"] == [(1, 2.0)]


def test_lines_of_the_same_step_are_merged_on_read(tmp_path):
    with MetricsLogger(tmp_path, NO_TENSORBOARD) as logger:
        logger.log(10, {"reward/mean": 0.5, "x": 1.0})
        logger.log(10, {"eval/accuracy": 0.75, "x": 2.0})
        logger.log(11, {"reward/mean": 0.6})
    records = read_metrics(tmp_path)
    assert [record["step"] for record in records] == [10, 11]
    assert records[0]["reward/mean"] == 0.5 and records[0]["eval/accuracy"] == 0.75 and records[0]["x"] == 2.0


def test_sample_texts_go_to_samples_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = ["The answer is \\boxed{4}.\n  reward=1", "ünïcode ✓"]
    with MetricsLogger(tmp_path) as logger:
        logger.log_text(3, "samples/rollout", texts)
        assert [(s["step"], s["index"], s["text"]) for s in read_samples(tmp_path)] == [
            (3, 0, texts[0]),
            (3, 1, texts[1]),
        ]
    accumulator = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    accumulator.Reload()
    [event] = accumulator.Tensors("samples/rollout/text_summary")
    rendered = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "    The answer is \\boxed{4}." in rendered and "ünïcode ✓" in rendered
    assert (tmp_path / SAMPLES_FILE).read_text().count("\n") == 2


def test_to_floats_transfers_tensors_and_rejects_non_scalars():
    values = to_floats({"a": 1, "b": torch.tensor(2.5, dtype=torch.bfloat16), "c": True, "d": torch.tensor([7])})
    assert values == {"a": 1.0, "b": 2.5, "c": 1.0, "d": 7.0}
    assert list(values) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match=r"'x' is a tensor of shape \(2,\); reduce it"):
        to_floats({"x": torch.ones(2)})
    with pytest.raises(TypeError, match="'x' has type str"):
        to_floats({"x": "high"})


def test_reserved_names_and_closed_logger_are_errors(tmp_path):
    logger = MetricsLogger(tmp_path, NO_TENSORBOARD)
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3.0})
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"x": 1.0})


def test_null_logger_has_the_same_interface_and_does_nothing(tmp_path):
    logger = build_logger(tmp_path / "run", LoggingConfig(), is_logging_process=False)
    assert isinstance(logger, NullLogger)
    with logger:
        assert logger.log(1, {"x": torch.tensor(1.0)}) == {}
        logger.log_text(1, "samples", "text")
    assert not (tmp_path / "run").exists()
    real = build_logger(tmp_path / "run", NO_TENSORBOARD)
    assert isinstance(real, MetricsLogger)
    real.close()
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()


def test_wandb_enabled_without_the_package_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail even where it is installed
    config = LoggingConfig(wandb=WandbConfig(enabled=True))
    with pytest.raises(UserError, match=r"logging.wandb.enabled=true but the 'wandb' package is not installed"):
        MetricsLogger(tmp_path, config)
    assert not (tmp_path / METRICS_FILE).exists()  # failed before touching any file


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_offline_logs_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = LoggingConfig(tensorboard=False, wandb=WandbConfig(enabled=True, mode="offline", tags=["test"]))
    with MetricsLogger(tmp_path, config, run_config={"seed": 1}) as logger:
        logger.log(1, {"reward/mean": 0.5, "bad": math.nan})
        logger.log_text(1, "samples/rollout", ["a completion"])
    run_id = (tmp_path / "wandb_run_id.txt").read_text().strip()
    with MetricsLogger(tmp_path, config, resume_step=1) as logger:  # a resumed run continues the same W&B run
        logger.log(2, {"reward/mean": 0.75})
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == run_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


def test_logging_config_checks_name_the_key():
    LoggingConfig().check("logging")
    with pytest.raises(UserError, match=r"logging.plot_every=-1 must be >= 0"):
        LoggingConfig(plot_every=-1).check("logging")
    with pytest.raises(UserError, match=r"logging.console_every=0 must be >= 1"):
        LoggingConfig(console_every=0).check("logging")
    with pytest.raises(UserError, match=r"logging.progress_keys has empty entries"):
        LoggingConfig(progress_keys=["reward/mean", ""]).check("logging")
    with pytest.raises(UserError, match=r"logging.wandb.mode='cloud' is not known; valid: offline, online, disabled"):
        WandbConfig(mode="cloud").check("logging.wandb")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="logging.plot_every has no effect with logging.plots=false"):
        LoggingConfig(plots=False, plot_every=10).check("logging")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_logging_config_check_catches_missing_wandb_early():
    with pytest.raises(UserError, match="pip install wandb"):
        WandbConfig(enabled=True).check("logging.wandb")


def test_should_plot_every_n_steps_while_the_run_goes_on():
    """Mid-run redraws (the end of the run always draws): every plot_every steps, none with 0 or plots=false."""
    assert [s for s in range(1, 26) if LoggingConfig(plot_every=10).should_plot(s)] == [10, 20]
    assert [s for s in range(1, 26) if LoggingConfig(plot_every=0).should_plot(s)] == []
    assert [s for s in range(1, 26) if LoggingConfig(plots=False).should_plot(s)] == []
