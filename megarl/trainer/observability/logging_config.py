"""Settings of the run's observability: JSONL metrics (always on), TensorBoard, Weights & Biases, plots and the
console display. Imports nothing heavy (the config loader reads it); the code that uses it lives in
`megarl/trainer/observability/metrics.py`, `plots.py` and `progress.py`.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Literal

from megarl.errors import UserError

WANDB_MODES = ("offline", "online", "disabled")
"""Modes `wandb.init` accepts; `offline` writes under the run folder and needs no network (`wandb sync` later)."""

DEFAULT_PROGRESS_KEYS = [
    "reward/mean",
    "eval/accuracy",
    "actor/kl",
    "actor/entropy",
    "response_length/mean",
    "throughput/tokens_per_s",
    "timing/step_s",
]
"""Metrics shown on the console line by default; keys a run does not log are left out of the line."""


@dataclass
class WandbConfig:
    """Weights & Biases logging (optional: `pip install wandb`; megarl does not depend on it)."""

    enabled: bool = False
    """Also log metrics and samples to Weights & Biases."""
    project: str = "megarl"
    """W&B project name."""
    entity: str | None = None
    """W&B team or user; None uses the account's default entity."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline: write under run_dir/wandb/ with no network (upload later with `wandb sync`); online: stream to the
    server; disabled: W&B calls do nothing."""
    name: str | None = None
    """Display name of the W&B run; None uses the run folder's name."""
    tags: list[str] = field(default_factory=list)
    """Tags attached to the W&B run."""

    def check(self, key: str) -> None:
        if self.mode not in WANDB_MODES:
            raise UserError(f"{key}.mode={self.mode!r} is not known; valid: {', '.join(WANDB_MODES)}")
        if not isinstance(self.project, str) or not self.project.strip():
            raise UserError(f"{key}.project={self.project!r} must be a non-empty W&B project name")
        bad_tags = [tag for tag in self.tags if not isinstance(tag, str) or not tag.strip()]
        if bad_tags:
            raise UserError(f"{key}.tags has empty or non-string entries {bad_tags!r}; tags are non-empty strings")
        if self.enabled and importlib.util.find_spec("wandb") is None:
            raise UserError(wandb_missing_message(key))
        if not self.enabled:
            changed = [name for name in ("entity", "name") if getattr(self, name) is not None] + (
                ["tags"] if self.tags else []
            )
            if changed:
                warnings.warn(f"{key}.{changed[0]} has no effect with {key}.enabled=false", UserWarning, stacklevel=2)


def wandb_missing_message(key: str) -> str:
    """The error text when W&B logging is asked for and the package is not installed."""
    return (
        f"{key}.enabled=true but the 'wandb' package is not installed; install it with `pip install wandb` "
        f"(mode=offline needs no account or network) or set {key}.enabled=false"
    )


@dataclass
class LoggingConfig:
    """Where the trainer's metrics go. `run_dir/metrics.jsonl` is always written; the rest is optional."""

    tensorboard: bool = True
    """Write TensorBoard event files under run_dir/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`)."""
    memory: bool = True
    """Per-phase memory of every worker in each step's metrics (`memory/<phase>/...`,
    trainer/observability/memory_metrics.py)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (off by default)."""
    plots: bool = True
    """Write PNG plots of the metrics to run_dir/plots/ (`megarl plot RUN_DIR` makes them at any time)."""
    plot_every: int = 50
    """Redraw the plots every this many steps (in the background, while training goes on); 0 = only at the end of
    the run."""
    console_every: int = 1
    """Print a metrics line every this many steps when the live display is off (not a terminal, or progress=false);
    the live display refreshes every step."""
    progress: bool = True
    """Show a live progress bar with the latest metrics when the output is a terminal; plain lines otherwise."""
    progress_keys: list[str] = field(default_factory=lambda: list(DEFAULT_PROGRESS_KEYS))
    """Metric keys shown on the console line, in order; keys a run does not log are left out."""

    def check(self, key: str) -> None:
        if self.plot_every < 0:
            raise UserError(f"{key}.plot_every={self.plot_every} must be >= 0 (0 = plot only at the end)")
        if self.console_every < 1:
            raise UserError(f"{key}.console_every={self.console_every} must be >= 1 (1 = a line every step)")
        bad_keys = [name for name in self.progress_keys if not isinstance(name, str) or not name.strip()]
        if bad_keys:
            raise UserError(f"{key}.progress_keys has empty entries {bad_keys!r}; give metric names like 'reward/mean'")
        if not self.plots and self.plot_every != LoggingConfig.plot_every:
            warnings.warn(f"{key}.plot_every has no effect with {key}.plots=false", UserWarning, stacklevel=2)

    def should_plot(self, step: int) -> bool:
        """Whether the trainer redraws the plots after `step` while the run goes on (in the background; they are
        always drawn when the run ends)."""
        return self.plots and self.plot_every > 0 and step % self.plot_every == 0
