"""The one logging interface of a run: per-step scalar metrics and sample texts to `run_dir/metrics.jsonl`,
`run_dir/samples.jsonl`, TensorBoard (`run_dir/tensorboard/`) and optionally Weights & Biases.

The controller reduces its metrics to scalars (Python numbers or 0-d tensors) and calls `log` once per log step;
tensors are brought to the host here, in one transfer per device, so a step has no hidden host syncs
(docs/architecture.md, habit 8). Processes that do not log get a `NullLogger` with the same interface (habit 9).

Metric names are hierarchical with `/`: `reward/mean`, `eval/accuracy`, `actor/pg_loss`, `timing/rollout_s`.
Non-finite values are written as JSON `null` and left out of TensorBoard and W&B.

The JSONL file is the source of truth (plots and `read_metrics` read it): one line per `log` call, flushed and
synced at once so a crash loses nothing. On resume the lines after the checkpoint's step are dropped first, so the
file reads as if the run had never stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

from megarl.errors import UserError
from megarl.trainer.observability.logging_config import LoggingConfig, wandb_missing_message

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""Per-step scalar metrics, one JSON object per line: {"step": N, "time": unix seconds, "<name>": value, ...}."""
SAMPLES_FILE = "samples.jsonl"
"""Sample texts, one JSON object per text: {"step": N, "time": unix seconds, "name": ..., "index": i, "text": ...}."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files, under the run folder."""
WANDB_ID_FILE = "wandb_run_id.txt"
"""The W&B run id, kept so a resumed run continues the same W&B run."""

MetricValue = float | int | bool | torch.Tensor
"""What `log` accepts per metric: a Python number or a one-element tensor on any device."""


class Logger(Protocol):
    """What the trainer calls; `MetricsLogger` and `NullLogger` implement it."""

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> dict[str, float]: ...

    def log_text(self, step: int, name: str, text: str | Sequence[str]) -> None: ...

    def close(self) -> None: ...


def to_floats(metrics: Mapping[str, MetricValue]) -> dict[str, float]:
    """The metrics as Python floats, in the same order. Tensors are moved to the host in one transfer per device
    (this is the log step's one deliberate host sync); integer-valued tensors come back as exact floats."""
    values: dict[str, float] = {}
    tensors_by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"metric names are non-empty strings, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; reduce it to a scalar")
            tensors_by_device.setdefault(value.device, []).append((name, value.detach().reshape(())))
            values[name] = math.nan  # placeholder keeps the caller's order
        elif hasattr(value, "__float__"):  # Python and NumPy numbers
            values[name] = float(value)
        else:
            raise TypeError(f"metric {name!r} has type {type(value).__name__}; give a number or a one-element tensor")
    for named in tensors_by_device.values():
        stacked = torch.stack([tensor.to(torch.float64) for _, tensor in named])
        for (name, _), number in zip(named, stacked.tolist()):  # deliberate host sync: once per device per log step
            values[name] = number
    return values


def _json_number(value: float) -> float | int | None:
    """A JSON-safe value: null for NaN/inf, int for integral values (step counts, token counts read naturally)."""
    if not math.isfinite(value):
        return None
    if value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


class NullLogger:
    """The logger of processes that do not log: every call does nothing."""

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> dict[str, float]:
        return {}

    def log_text(self, step: int, name: str, text: str | Sequence[str]) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MetricsLogger:
    """Writes a run's metrics to JSONL, TensorBoard and (if enabled) W&B.

    `resume_step`: the step of the checkpoint a resumed run starts from; lines and TensorBoard events after it are
    dropped so the resumed run continues the record seamlessly. None starts a new record: an old `metrics.jsonl`
    or `samples.jsonl` in `run_dir` is removed (with a warning) and old TensorBoard events are hidden.
    `run_config`: the job's resolved config as a plain dict, stored with the W&B run.

    A resumed run continues the same W&B run (its id is kept in `run_dir/wandb_run_id.txt`); W&B ignores steps it
    has already seen, so there the steps between the checkpoint and the interruption keep their first values.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: LoggingConfig | None = None,
        resume_step: int | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config if config is not None else LoggingConfig()
        self.resume_step = resume_step
        self._wandb_run: Any = None
        self._tensorboard: Any = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # W&B first: its missing-package error should come before any file is touched.
        if self.config.wandb.enabled:
            self._wandb_run = self._build_wandb(run_config)
        self._truncate_records()
        self._metrics_file = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._samples_file = open(self.run_dir / SAMPLES_FILE, "a", encoding="utf-8")  # noqa: SIM115
        if self.config.tensorboard:
            self._tensorboard = self._build_tensorboard()
        self._closed = False

    # -- construction -----------------------------------------------------------------------------------------------

    def _truncate_records(self) -> None:
        """Drop what a resumed run will write again (everything, for a new run)."""
        keep_up_to = self.resume_step if self.resume_step is not None else -math.inf
        for file_name in (METRICS_FILE, SAMPLES_FILE):
            path = self.run_dir / file_name
            if not path.exists():
                continue
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if _line_step(line, default=math.inf) <= keep_up_to]
            if len(kept) == len(lines):
                continue
            if self.resume_step is None:
                logger.warning("%s holds %d lines of an earlier run; starting a new record", path, len(lines))
            temp_path = path.with_suffix(path.suffix + ".tmp")
            temp_path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in kept), "utf-8")
            os.replace(temp_path, path)

    def _build_tensorboard(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when enabled

        log_dir = self.run_dir / TENSORBOARD_DIR
        has_events = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        # TensorBoard hides earlier events at steps >= purge_step, which is how a resume replaces them.
        purge_step = None
        if has_events:
            purge_step = self.resume_step + 1 if self.resume_step is not None else 0
        return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)

    def _build_wandb(self, run_config: Mapping[str, Any] | None) -> Any:
        try:
            import wandb  # optional: not a dependency of megarl
        except ImportError as error:
            raise UserError(wandb_missing_message("logging.wandb")) from error
        settings = self.config.wandb
        id_path = self.run_dir / WANDB_ID_FILE
        if self.resume_step is not None and id_path.exists():
            run_id = id_path.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(4)  # W&B run ids are short lowercase alphanumeric strings
            id_path.write_text(run_id + "\n", encoding="utf-8")
        return wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or self.run_dir.resolve().name,
            tags=list(settings.tags),
            mode=settings.mode,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            config=dict(run_config) if run_config is not None else None,
        )

    # -- logging ----------------------------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> dict[str, float]:
        """Record the metrics of `step` everywhere; returns them as Python floats (for the console display).
        Call once per log step with all of that step's metrics; a second call for the same step adds a line that
        `read_metrics` merges into the first."""
        self._check_open()
        reserved = sorted({"step", "time"} & set(metrics))
        if reserved:
            raise ValueError(f"metric names {reserved} are reserved for the record's own fields; rename them")
        values = to_floats(metrics)
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        record.update((name, _json_number(value)) for name, value in values.items())
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        self._sync(self._metrics_file)
        finite = {name: value for name, value in values.items() if math.isfinite(value)}
        if self._tensorboard is not None and finite:
            from tensorboard.compat.proto.summary_pb2 import Summary

            # one event of every scalar (add_scalar builds an event per value: 10x the time, 2 ms a step)
            values_proto = [Summary.Value(tag=name, simple_value=value) for name, value in finite.items()]
            self._tensorboard._get_file_writer().add_summary(Summary(value=values_proto), global_step=step)
            self._tensorboard.flush()
        if self._wandb_run is not None and finite:
            self._wandb_run.log(finite, step=step)
        return values

    def log_text(self, step: int, name: str, text: str | Sequence[str]) -> None:
        """Record sample texts (e.g. a few completions with their rewards) of `step` under `name`."""
        self._check_open()
        texts = [text] if isinstance(text, str) else list(text)
        now = round(time.time(), 3)
        for index, item in enumerate(texts):
            record = {"step": int(step), "time": now, "name": name, "index": index, "text": str(item)}
            self._samples_file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._sync(self._samples_file)
        if self._tensorboard is not None:
            # TensorBoard renders Markdown: indenting every line makes a code block that keeps the text as written.
            blocks = [f"**sample {index}**\n\n" + _markdown_code_block(item) for index, item in enumerate(texts)]
            self._tensorboard.add_text(name, "\n\n".join(blocks), global_step=step)
        if self._wandb_run is not None:
            import wandb

            table = wandb.Table(columns=["step", "index", "text"], data=[[step, i, t] for i, t in enumerate(texts)])
            self._wandb_run.log({name: table}, step=step)

    def close(self) -> None:
        """Flush and close every sink; later calls do nothing."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for file in (self._metrics_file, self._samples_file):
            file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the metrics logger of {self.run_dir} is closed")

    @staticmethod
    def _sync(file: Any) -> None:
        """Make the line survive a crash of this process and of the node: one flush and fsync per log call."""
        file.flush()
        os.fsync(file.fileno())


def build_logger(
    run_dir: str | Path,
    config: LoggingConfig | None = None,
    *,
    is_logging_process: bool = True,
    resume_step: int | None = None,
    run_config: Mapping[str, Any] | None = None,
) -> MetricsLogger | NullLogger:
    """The logger for this process: a `MetricsLogger` where `is_logging_process`, a `NullLogger` elsewhere."""
    if not is_logging_process:
        return NullLogger()
    return MetricsLogger(run_dir, config, resume_step=resume_step, run_config=run_config)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics of a run, one dict per step in the order first logged (lines of the same step merged, the later
    value winning); null values come back as NaN. A torn last line (a crash mid-write) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise UserError(f"{path} does not exist; is {run_dir} a megarl run folder?")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                logger.warning("%s:%d is not a metrics record; skipped", path, line_number)
                continue
            merged = by_step.setdefault(step, {})
            merged.update((name, math.nan if value is None else value) for name, value in record.items())
    return list(by_step.values())


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """The sample texts of a run, one dict per text, in the order logged."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def _line_step(line: str, default: float) -> float:
    """The step of a JSONL record line; `default` for a line that cannot be read (dropped on truncation)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return default


def _markdown_code_block(text: str) -> str:
    return "\n".join("    " + line for line in str(text).splitlines() or [""])
