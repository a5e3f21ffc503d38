"""Math answer extraction and equivalence, and the built-in reward functions, checked against hand-written tables
and the answer set of tests/math_answer_set.py."""

from __future__ import annotations

import threading
import time

import pytest
from math_answer_set import MATH_ANSWER_SET

from megarl.rewards import (
    RewardSample,
    boxed_reward,
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    format_reward,
    gsm8k_reward,
    is_equivalent,
    math_reward,
)
from megarl.rewards.math_answer import label_answers

EXTRACTION = [
    # (text, style, fallback, expected answer, expected format_ok)
    ("so the total is\n#### 1,000", "gsm8k", "none", "1,000", True),
    ("#### -3\n", "gsm8k", "none", "-3", True),
    ("#### 5\nQuestion: next one\n#### 7", "gsm8k", "none", "7", True),
    ("####   ", "gsm8k", "none", None, False),
    ("no answer line here: 12", "gsm8k", "none", None, False),
    ("no answer line here: 12", "gsm8k", "last_number", "12", False),
    ("it costs $1,000.50 in total.", "gsm8k", "last_number", "1000.50", False),
    ("we get 5-3", "gsm8k", "last_number", "5-3", False),
    ("The answer is $\\frac{3}{4}$.", "gsm8k", "last_number", "\\frac{3}{4}", False),  # not the 4
    ("The final answer is 42. Then 7 more", "gsm8k", "last_number", "42", False),
    ("x is -3.", "gsm8k", "last_number", "-3", False),
    ("a ratio of 3/4", "gsm8k", "last_number", "3/4", False),
    ("nothing numeric", "gsm8k", "last_number", None, False),
    ("thus \\boxed{\\frac{1}{2}}.", "boxed", "none", "\\frac{1}{2}", True),
    ("\\boxed{1} then \\boxed{\\frac{\\sqrt{2}}{2}}", "boxed", "none", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{\\left\\{ {a}, {b} \\right\\}}", "boxed", "none", "\\left\\{ {a}, {b} \\right\\}", True),
    ("$\\boxed 5$", "boxed", "none", "5", True),
    ("\\fbox{7}", "boxed", "none", "7", True),
    ("\\boxed{\\frac{1}{2}", "boxed", "none", None, False),  # unbalanced
    ("<answer> 42 </answer>", "tag", "none", "42", True),
    ("<answer>\\boxed{9}</answer>", "auto", "none", "9", True),
    ("<answer>6</answer>\n#### 7", "auto", "none", "6", True),
    ("the answer is 8", "auto", "last_number", "8", False),
]


@pytest.mark.parametrize(("text", "style", "fallback", "answer", "format_ok"), EXTRACTION)
def test_extract_answer(text, style, fallback, answer, format_ok):
    assert extract_answer(text, style, fallback) == (answer, format_ok)


def test_extractors_agree_with_extract_answer():
    assert extract_boxed("a \\boxed{x^{2}} b") == "x^{2}"
    assert extract_hash_answer("#### 12 apples") == "12 apples"
    assert extract_last_number("from 1 to 10.") == "10"


EQUIVALENCE = [
    # (prediction, label, equal)
    ("1,000", "1000", True),
    ("1,000", 1000, True),
    ("-3", "-3", True),
    ("-3", "3", False),
    ("+3", 3, True),
    ("0.50", "1/2", True),
    ("0.50", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", 0.5, True),
    ("\\dfrac12", "0.5", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("3/4", "0.75", True),
    ("0.333", "1/3", False),
    ("1\\frac{1}{2}", "3/2", True),
    ("$1,234.00", "1234", True),
    ("\\$18", 18, True),
    ("42 apples", "42", True),
    ("5\\text{ cm}", "5", True),
    ("90^\\circ", "90", True),
    ("50%", "50", True),
    ("50\\%", "0.5", True),
    ("50", "0.5", False),
    ("1e3", 1000, True),
    ("1000", 1e-05, False),
    ("0.00001", 1e-05, True),
    ("x>3", "x > 3", True),
    ("x \\geq 3", "x\\ge 3", True),
    ("2, 1", "1, 2", True),
    ("7 \\text{ cm}^2", "7", True),
    ("x = 5", "5", True),
    ("5 or 6", "5", False),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", True),
    ("2x+1", "1+2x", True),
    ("2x+1", "2x-1", False),
    ("2x", "2", False),
    ("x^2-1", "(x-1)(x+1)", True),
    ("3\\sqrt{2}", "\\sqrt{18}", True),
    ("\\sqrt[3]{8}", "2", True),
    ("2\\pi r", "2 r \\pi", True),
    ("\\pi", "3.14159", False),
    ("(1, \\frac12)", "(1,0.5)", True),
    ("(1, 2)", "[1,2]", False),
    ("(1, 2)", "(2, 1)", False),
    ("\\text{Monday}", "Monday", True),
    ("dog", "god", False),  # words are not products of symbols
    ("\\infty", "-\\infty", False),
    ("10^{10^{6}}", "1", False),  # refused before evaluation, not computed
    ("__import__('os').system('true')", "0", False),
    (None, "5", False),
    ("", "5", False),
]


@pytest.mark.parametrize(("prediction", "label", "equal"), EQUIVALENCE)
def test_is_equivalent(prediction, label, equal):
    assert is_equivalent(prediction, label_answers(label)) is equal


def test_label_forms():
    assert label_answers(72) == ["72"]
    assert label_answers("Natalia sold 48/2 = 24 clips.\n#### 72") == ["72"]
    assert label_answers("The answer is $\\boxed{\\frac{3}{4}}$.") == ["\\frac{3}{4}"]
    assert label_answers(["3", 3.0]) == ["3", "3.0"]
    with pytest.raises(ValueError, match="no label"):
        label_answers(None)


def test_time_limit_on_adversarial_answers():
    """math-verify parses with sympy: a huge power or a long expansion gives "wrong" within the time limit, on the
    main thread (SIGALRM) and on another thread (no signal there: math-verify runs without its limit)."""
    is_equivalent("1", "1")  # imports outside the timing
    start = time.monotonic()
    assert is_equivalent("(x+y+z)^{40}", "(x+y)^{40}+1", timeout_s=1) is False
    assert is_equivalent("10^{10^{10}}", "1", timeout_s=1) is False
    assert time.monotonic() - start < 6.0
    results = []
    thread = threading.Thread(target=lambda: results.append(is_equivalent("\\frac{1}{2}", "0.5")))
    thread.start()
    thread.join()
    assert results == [True]


def test_math_answer_set():
    """The README's number: every (response, label) pair of tests/math_answer_set.py judged as expected (the bar is
    98% with no false positive); a wrong one lists its row."""
    samples = [RewardSample(prompt="q", response=response, label=label) for response, label, _ in MATH_ANSWER_SET]
    judged = [out["acc"] == 1.0 for out in math_reward(samples)]
    wrong = [row for row, ok in zip(MATH_ANSWER_SET, judged) if ok != row[2]]
    assert len(MATH_ANSWER_SET) >= 100
    assert sum(row[2] for row in MATH_ANSWER_SET) >= 60 and sum(not row[2] for row in MATH_ANSWER_SET) >= 35
    assert wrong == []


def _samples(*pairs):
    return [RewardSample(prompt="q", response=response, label=label) for response, label in pairs]


def test_builtin_math_functions():
    samples = _samples(("#### 1,000", 1000), ("#### 999", "1000"), ("It is 1000.", "1000"), ("\\boxed{1000}", 1000))
    assert gsm8k_reward(samples) == [
        {"score": 1.0, "acc": 1.0, "format_ok": 1.0},
        {"score": 0.0, "acc": 0.0, "format_ok": 1.0},
        {"score": 0.0, "acc": 0.0, "format_ok": 0.0},
        {"score": 0.0, "acc": 0.0, "format_ok": 0.0},
    ]
    assert [out["score"] for out in gsm8k_reward(samples, format_score=0.1)] == [1.0, 0.1, 0.0, 0.0]
    assert [out["acc"] for out in gsm8k_reward(samples, fallback="last_number")] == [1.0, 0.0, 1.0, 1.0]
    assert [out["acc"] for out in boxed_reward(samples)] == [0.0, 0.0, 0.0, 1.0]
    assert [(out["acc"], out["format_ok"]) for out in math_reward(samples)] == [(1, 1), (0, 1), (1, 0), (1, 1)]
    assert [out["acc"] for out in math_reward(samples, fallback="none")] == [1.0, 0.0, 0.0, 1.0]


def test_builtin_format():
    samples = _samples(("think\n#### 5", None), ("<answer>\n5\n</answer>", None), ("5", None))
    assert [out["score"] for out in format_reward(samples, pattern="^#### .+$", flags="m")] == [1.0, 0.0, 0.0]
    assert [out["score"] for out in format_reward(samples, pattern="<answer>.*?</answer>")] == [0.0, 1.0, 0.0]
    assert [out["format_ok"] for out in format_reward(samples, pattern=r"\d", fullmatch=True)] == [0.0, 0.0, 1.0]
