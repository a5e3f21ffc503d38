"""The data a reward function receives and what the runner gives back.

A reward function is any callable `fn(samples: list[RewardSample], **kwargs) -> list[float | dict]` with one entry
per sample: a float, or a dict holding a `score` plus extra numeric metrics (`acc`, `format_ok`, ...) that the
runner averages into the step metrics. `normalize_outputs` is the one place that checks such a return.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.errors import UserError

RewardOutput = float | Mapping[str, float]
RewardFn = Callable[..., Sequence[RewardOutput]]


class RewardFunctionError(UserError):
    """A reward function returned something other than one float (or `{"score": float, ...}`) per sample.

    This is a bug in the function, the same on every step, so it stops the run instead of costing one sample."""


@dataclass
class RewardSample:
    """One rollout to score: the decoded prompt and response, the dataset's ground truth, and per-sample metadata."""

    prompt: str
    """The prompt as the policy saw it (after the chat template)."""
    response: str
    """The decoded response, without the prompt (special tokens removed)."""
    label: Any = None
    """Ground truth from the dataset's label column (number, string, list, ...); None when the dataset has none."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Further dataset columns and rollout facts (e.g. `finish_reason`), passed through untouched."""


@dataclass
class RewardResult:
    """Scores of one batch of samples, in sample order."""

    scores: list[float]
    """One reward per sample; `default_reward` where the call failed, timed out or returned NaN."""
    metrics: dict[str, float]
    """Mean of each extra metric over the samples that reported it, plus `num_failed` (errors and NaN scores),
    `num_timeout` (samples whose own call ran out of time) and `fraction_default` (share given `default_reward`)."""
    extras: list[dict[str, float]]
    """Per sample, the extra metrics its function returned (empty for float returns and failed samples)."""
    errors: list[str | None]
    """Per sample, why it got `default_reward` (exception text, "timeout ...", "score is nan"), else None."""


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real)  # int, float, bool, numpy scalars; not str, not tensors


def normalize_outputs(outputs: object, num_samples: int, fn_name: str) -> tuple[list[float], list[dict[str, float]]]:
    """Check a reward function's return and split it into scores and extra metrics (both one entry per sample).

    Raises RewardFunctionError naming the function, the sample index and what was expected. Non-finite scores are
    passed through (the runner counts them as failed)."""
    expected = "one float or {'score': float, <metric>: number, ...} per sample"
    try:
        entries = list(outputs)  # type: ignore[call-overload]
    except TypeError:
        raise RewardFunctionError(
            f"reward function {fn_name} returned {type(outputs).__name__}; expected a list with {expected}"
        ) from None
    if isinstance(outputs, str | bytes | Mapping):
        raise RewardFunctionError(
            f"reward function {fn_name} returned a {type(outputs).__name__}; expected a list with {expected}"
        )
    if len(entries) != num_samples:
        raise RewardFunctionError(
            f"reward function {fn_name} returned {len(entries)} entries for {num_samples} samples; expected a list "
            f"with {expected}"
        )
    scores: list[float] = []
    extras: list[dict[str, float]] = []
    for index, entry in enumerate(entries):
        if _is_number(entry):
            scores.append(float(entry))
            extras.append({})
            continue
        if not isinstance(entry, Mapping):
            raise RewardFunctionError(
                f"reward function {fn_name} returned {type(entry).__name__} {entry!r:.80} for sample {index}; "
                f"expected {expected}"
            )
        if "score" not in entry:
            raise RewardFunctionError(
                f"reward function {fn_name} returned a dict without 'score' for sample {index} "
                f"(keys: {sorted(entry)}); expected {expected}"
            )
        bad = {key: value for key, value in entry.items() if not (isinstance(key, str) and _is_number(value))}
        if bad:
            raise RewardFunctionError(
                f"reward function {fn_name} returned non-numeric values {bad!r:.120} for sample {index}; every "
                "value of the dict must be a number (metrics are averaged over the batch)"
            )
        scores.append(float(entry["score"]))
        extras.append({key: float(value) for key, value in entry.items() if key != "score"})
    return scores, extras


def is_valid_score(score: float) -> bool:
    """A score the trainer can use: finite (NaN and inf count as a failed sample)."""
    return math.isfinite(score)
