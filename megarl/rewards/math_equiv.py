r"""Whether a math answer equals the ground truth: Hugging Face's `math-verify`, behind megarl's extraction.

megarl/rewards/math_answer.py finds the answer (the last `\boxed{}`, the `####` line, `<answer>` tags, ...); here
the answer and each label are parsed as the content of one `\boxed{}`, so that math-verify compares exactly those
strings instead of searching them for other answers (it takes every `\boxed{}` of a text, not the last). math-verify
(pinned in pyproject.toml) knows the forms math datasets produce: exact numbers and fractions, radicals, pi,
percentages, units and degrees, inequalities, intervals and their unions, sets and unordered answer lists, ordered
tuples, matrices, equations such as `x = 5`, and multiple-choice letters.

Parsing uses sympy and may hang on adversarial strings: each parse and each comparison has `timeout_s`, enforced
by SIGALRM where that works (a process's main thread: the reward runner's workers, or an in-process runner on the
driver); on other threads the reward runner's per-call `reward.timeout_s` is the limit.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable
from decimal import Decimal

MAX_ANSWER_CHARS = 512
"""Longer answers are not compared (no dataset answer is this long; a runaway response may be)."""

MAX_TEXT_CHARS = 4096
"""A response's last characters searched for an unmarked answer (the answer is at the end; a runaway response's
length must not cost time)."""

_UNESCAPED_PERCENT_RE = re.compile(r"(?<!\\)%")
_DOLLAR_RE = re.compile(r"\\?\$")
_E_NOTATION_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def is_equivalent(prediction: str | None, answers: str | Iterable[str], timeout_s: float | None = 2.0) -> bool:
    """Whether `prediction` equals `answers` or any of them (each a bare answer string, e.g. `\\frac{3}{4}`,
    `x \\geq 3`, `(-\\infty, 1) \\cup (2, \\infty)`, `1,000`)."""
    if prediction is None:
        return False
    if isinstance(answers, str):  # one answer, not its characters
        answers = (answers,)
    parsed = _parse(prediction, timeout_s)
    if not parsed:
        return False
    from math_verify import verify

    seconds = _alarm_seconds(timeout_s)
    for answer in answers:
        gold = _parse(answer, timeout_s)
        if gold and verify(gold, parsed, timeout_seconds=seconds):
            return True
    return False


def find_answer(text: str, timeout_s: float | None = 2.0) -> str | None:
    """The answer math-verify would take from free text (a "final answer is" phrase's, else the last `$...$`
    expression or number), as the string it found; None if there is none."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    found = parse(
        text[-MAX_TEXT_CHARS:],
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=_alarm_seconds(timeout_s),
    )
    return found[-1] if found else None


def _parse(answer: str, timeout_s: float | None) -> list:
    """math-verify's parse of `answer` as one boxed answer; [] when it has none (empty, too long, not math)."""
    text = _as_latex(answer)
    if not text or len(text) > MAX_ANSWER_CHARS:
        return []
    from math_verify import LatexExtractionConfig, parse

    config = LatexExtractionConfig(boxed_match_priority=0)
    return parse("\\boxed{" + text + "}", extraction_config=[config], parsing_timeout=_alarm_seconds(timeout_s))


def _as_latex(answer: str) -> str:
    """The answer as LaTeX math: currency and math-mode `$` dropped (`$1,080` and `$\\frac12$` as the numbers),
    a bare `%` escaped (in LaTeX it starts a comment: `25%` would lose its closing brace), a number in e-notation
    written out (`1e3`: LaTeX reads e as a symbol)."""
    text = _DOLLAR_RE.sub("", answer.strip()).strip()
    if _E_NOTATION_RE.fullmatch(text):
        text = format(Decimal(text), "f")
    return _UNESCAPED_PERCENT_RE.sub(r"\\%", text)


def _alarm_seconds(timeout_s: float | None) -> int | None:
    """math-verify's time limit (whole seconds of SIGALRM) on the main thread; None elsewhere, where a signal
    cannot be set (math-verify would raise) and the reward runner's limit applies."""
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_s))
