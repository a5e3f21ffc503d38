"""Reward settings: which function scores the rollouts and how the runner calls it. Imports nothing heavy."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from megarl.config.paths import path_field
from megarl.errors import UserError


@dataclass
class RewardConfig:
    """A rule-based or user reward function, called on batches of decoded rollouts in worker processes."""

    fn: str = path_field("spec", "math")
    """Reward function: a built-in (math, gsm8k, boxed, format) or a user function 'module.path:function' or
    'path/to/file.py:function', called as fn(samples: list[RewardSample], **kwargs) -> one float or
    {'score': float, <metric>: number} per sample."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to `fn` on every call (e.g. {pattern: '<answer>.*</answer>'} for format)."""
    batch_size: int = 16
    """Samples per call; a call that fails or times out is re-run one sample at a time."""
    timeout_s: float = 30.0
    """Time limit of one call, in seconds; past it the worker is killed and restarted (needs num_workers >= 1)."""
    default_reward: float = 0.0
    """Reward of a sample whose call raised, timed out or returned NaN."""
    num_workers: int = 2
    """Worker processes calling `fn` in parallel; 0 calls it in the driver process (debugging: no time limit)."""

    def check(self, key: str) -> None:
        if not isinstance(self.fn, str) or not self.fn.strip():
            raise UserError(
                f"{key}.fn={self.fn!r} must name a reward function: math, gsm8k, boxed, format, "
                "'module.path:function' or 'path/to/file.py:function'"
            )
        if self.batch_size < 1:
            raise UserError(f"{key}.batch_size={self.batch_size} must be >= 1")
        if not self.timeout_s > 0:
            raise UserError(f"{key}.timeout_s={self.timeout_s} must be > 0 seconds")
        if not math.isfinite(self.default_reward):
            raise UserError(f"{key}.default_reward={self.default_reward} must be a finite number")
        if self.num_workers < 0:
            raise UserError(f"{key}.num_workers={self.num_workers} must be >= 0 (0 = in the driver process)")
        if self.num_workers == 0 and self.timeout_s != RewardConfig.timeout_s:
            warnings.warn(f"{key}.timeout_s has no effect with {key}.num_workers=0 (no time limit)", stacklevel=2)
        from megarl.rewards.plugins import check_reward_fn  # light: no torch; imports the user's module

        check_reward_fn(self.fn, self.kwargs, key)
