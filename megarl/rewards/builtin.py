"""The built-in reward functions, looked up by name from `reward.fn`: math answers and regex format checks.

Each is a plain reward function (`fn(samples, **kwargs) -> list[dict]`) plus a kwargs check that the config runs
before training starts. Scores: 1.0 for a correct answer, `format_score` for a well-formatted wrong one, else 0.0;
`acc` and `format_ok` are reported as metrics.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megarl.errors import UserError
from megarl.rewards.math_answer import FALLBACKS, ExtractStyle, extract_answer, label_answers
from megarl.rewards.math_equiv import is_equivalent
from megarl.rewards.types import RewardFn, RewardSample

_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _math_reward(
    samples: list[RewardSample],
    style: ExtractStyle,
    fallback: str,
    format_score: float,
    sympy_timeout_s: float,
) -> list[dict[str, float]]:
    outputs = []
    for sample in samples:
        answers = label_answers(sample.label)
        prediction, format_ok = extract_answer(sample.response, style, fallback)  # type: ignore[arg-type]
        correct = is_equivalent(prediction, answers, sympy_timeout_s)
        score = 1.0 if correct else (format_score if format_ok else 0.0)
        outputs.append({"score": score, "acc": float(correct), "format_ok": float(format_ok)})
    return outputs


def math_reward(
    samples: list[RewardSample], fallback: str = "last_number", format_score: float = 0.0, sympy_timeout_s: float = 2.0
) -> list[dict[str, float]]:
    """Any common answer format: the last `\\boxed{}`, else `<answer>` tags, else a `####` line; by default the
    last number when none is there (format_ok 0). The label may be a number, a string, or a list of answers."""
    return _math_reward(samples, "auto", fallback, format_score, sympy_timeout_s)


def gsm8k_reward(
    samples: list[RewardSample], fallback: str = "none", format_score: float = 0.0, sympy_timeout_s: float = 2.0
) -> list[dict[str, float]]:
    """GSM8K: the answer is on the last `#### ` line (strict by default: no line, no reward)."""
    return _math_reward(samples, "gsm8k", fallback, format_score, sympy_timeout_s)


def boxed_reward(
    samples: list[RewardSample], fallback: str = "none", format_score: float = 0.0, sympy_timeout_s: float = 2.0
) -> list[dict[str, float]]:
    """MATH-style: the answer is the last `\\boxed{...}` (strict by default)."""
    return _math_reward(samples, "boxed", fallback, format_score, sympy_timeout_s)


def format_reward(
    samples: list[RewardSample], pattern: str = "", flags: str = "s", fullmatch: bool = False
) -> list[dict[str, float]]:
    """1.0 when the response matches the regex `pattern` (searched anywhere, or the whole response with
    `fullmatch`), else 0.0. `flags`: letters of i (ignore case), m (multiline), s (dot matches newline), x."""
    regex = _compile(pattern, flags)
    match = regex.fullmatch if fullmatch else regex.search
    outputs = []
    for sample in samples:
        ok = float(match(sample.response) is not None)
        outputs.append({"score": ok, "format_ok": ok})
    return outputs


def _compile(pattern: str, flags: str) -> re.Pattern[str]:
    value = 0
    for letter in flags:
        value |= _REGEX_FLAGS[letter]
    return re.compile(pattern, value)


def _check_math_kwargs(kwargs: dict[str, Any], key: str) -> None:
    fallback = kwargs.get("fallback", "none")
    if fallback not in FALLBACKS:
        raise UserError(f"{key}.fallback={fallback!r} is not known; valid: {', '.join(FALLBACKS)}")
    timeout = kwargs.get("sympy_timeout_s", 2.0)
    if not isinstance(timeout, int | float) or timeout <= 0:
        raise UserError(f"{key}.sympy_timeout_s={timeout!r} must be a number of seconds > 0")
    if not isinstance(kwargs.get("format_score", 0.0), int | float):
        raise UserError(f"{key}.format_score={kwargs['format_score']!r} must be a number")


def _check_format_kwargs(kwargs: dict[str, Any], key: str) -> None:
    pattern, flags = kwargs.get("pattern", ""), kwargs.get("flags", "s")
    if not isinstance(pattern, str) or not pattern:
        raise UserError(
            f"{key}.pattern is required by reward fn 'format': a regex the response must contain, e.g. "
            "'^#### .+$' with flags 'm', or '<answer>.*?</answer>'"
        )
    if not isinstance(flags, str) or set(flags) - set(_REGEX_FLAGS):
        raise UserError(f"{key}.flags={flags!r}: use letters from {''.join(_REGEX_FLAGS)}")
    try:
        _compile(pattern, flags)
    except re.error as error:
        raise UserError(f"{key}.pattern={pattern!r} is not a valid regex: {error}") from None


@dataclass(frozen=True)
class BuiltinReward:
    """A reward function that `reward.fn` names directly, with the check of its kwargs."""

    fn: RewardFn
    check_kwargs: Callable[[dict[str, Any], str], None]
    """check_kwargs(kwargs, key) raises UserError naming `f"{key}.<name>"`; unknown names are caught elsewhere."""


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    "math": BuiltinReward(math_reward, _check_math_kwargs),
    "gsm8k": BuiltinReward(gsm8k_reward, _check_math_kwargs),
    "boxed": BuiltinReward(boxed_reward, _check_math_kwargs),
    "format": BuiltinReward(format_reward, _check_format_kwargs),
}
