"""Math answers: pull the final answer out of a response, and decide whether it equals the ground truth.

Extraction styles (each takes the *last* occurrence, since a response may restate earlier attempts):
- `boxed`: the content of `\\boxed{...}` (or `\\fbox{...}`), braces matched so `\\boxed{\\frac{1}{2}}` works;
- `gsm8k`: the rest of the line after `####`;
- `tag`: the content of `<answer>...</answer>`;
- fallback `last_number`: the last number in the text (`-3`, `1,000`, `0.5`, `3/4`), used only when asked for.

Equivalence, in order, first decisive answer wins:
1. the normalized strings are equal (LaTeX spacing, `$`, `\\text{}`, `\\dfrac`, degrees, a leading `x =` removed);
2. both parse as plain numbers: exact rational comparison (`0.50` == `1/2` == `\\frac{1}{2}`), thousands separators,
   `$` and trailing unit words stripped; `50%` equals both `50` and `0.5`;
3. tuples / intervals `(a, b)`: same brackets and element-wise equal;
4. symbolic, through sympy with a time limit (megarl.rewards.sympy_equiv): `\\frac{\\sqrt{2}}{2}` == `\\sqrt{2}/2`.
Everything is pure and deterministic except that the sympy path may give up (as "not equal") at its time limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Literal

ExtractStyle = Literal["boxed", "gsm8k", "tag", "auto"]
Fallback = Literal["none", "last_number"]
FALLBACKS = ("none", "last_number")

_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
_SIGNED_NUMBER_RE = re.compile(rf"^[-+]?(?:{_NUMBER})$")
# Last-number fallback: an optional sign not glued to a word or closing bracket (so `5-3` gives `3`), and a fraction.
_NUMBER_IN_TEXT_RE = re.compile(rf"(?<![\w.)\]])-?(?:{_NUMBER})(?:/\d+)?")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_UNIT_WORDS_RE = re.compile(r"^(.*?[\d}%])\s+([A-Za-z][A-Za-z .]*)$")
_NOT_UNITS = {"or", "and", "to", "plus", "minus", "times", "over", "divided", "of"}
_FRAC_RE = re.compile(r"^([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$")
_SHORT_FRAC_RE = re.compile(r"^([-+]?)\\frac(\d)(\d)$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
_SLASH_FRAC_RE = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")
_LHS_RE = re.compile(r"^[A-Za-z]\w{0,2}\s*=\s*(?!=)")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces matched), or of `\\boxed 5`; None if
    there is none or its braces are unbalanced."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    position = text.index("\\", start) + 1
    while position < len(text) and text[position].isalpha():
        position += 1
    if text.startswith(" ", position) and not text[position:].lstrip().startswith("{"):
        match = re.match(r"\s+([^\s$]+)", text[position:])  # `\boxed 5`: one token
        return match.group(1) if match else None
    position += len(text[position:]) - len(text[position:].lstrip())
    if position >= len(text) or text[position] != "{":
        return None
    content = braced_content(text, position)
    return content.strip() if content is not None else None


def braced_content(text: str, open_index: int) -> str | None:
    """The text inside the brace group opening at `open_index` (nested groups included), None if unclosed."""
    depth = 0
    for index in range(open_index, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


def extract_hash_answer(text: str) -> str | None:
    """The rest of the line after the last `####` (GSM8K's answer line), None if absent or empty."""
    matches = _HASH_RE.findall(text)
    answer = matches[-1].strip() if matches else ""
    return answer or None


def extract_tag_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`, None if absent or empty."""
    matches = _TAG_RE.findall(text)
    answer = matches[-1].strip() if matches else ""
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (`-3`, `1,000`, `2.5`, `3/4`), None if there is none."""
    matches = _NUMBER_IN_TEXT_RE.findall(text)
    return matches[-1].rstrip(".") if matches else None


_EXTRACTORS = {
    "boxed": (extract_boxed,),
    "gsm8k": (extract_hash_answer,),
    "tag": (extract_tag_answer,),
    "auto": (extract_boxed, extract_tag_answer, extract_hash_answer),
}


def extract_answer(text: str, style: ExtractStyle = "auto", fallback: Fallback = "none") -> tuple[str | None, bool]:
    """(answer, format_ok): the answer in the given style (`auto` tries boxed, then `<answer>` tags, then `####`);
    format_ok says it was found that way. With fallback `last_number`, a response without one gives its last number
    (format_ok False)."""
    for extractor in _EXTRACTORS[style]:
        answer = extractor(text)
        if answer is not None:
            return answer, True
    if fallback == "last_number":
        return extract_last_number(text), False
    return None, False


def label_answers(label: object) -> list[str]:
    """The acceptable answers a dataset label stands for: a number, a string (a GSM8K solution ending in `#### x`
    or one holding `\\boxed{x}` gives x), or a list of either (any may match)."""
    if label is None:
        raise ValueError("sample has no label (ground-truth answer); math verifiers need the dataset's label column")
    if isinstance(label, list | tuple):
        return [answer for item in label for answer in label_answers(item)]
    if isinstance(label, bool):
        raise ValueError(f"label {label!r} is a bool; math verifiers need a number or a string")
    if isinstance(label, int | float | Fraction):
        return [str(label)]
    text = str(label)
    for extractor in (extract_hash_answer, extract_boxed):
        answer = extractor(text)
        if answer is not None:
            return [answer]
    return [text]


def normalize_answer(text: str) -> str:
    """Strip what does not change a math answer's meaning: `$` and `\\( \\)` delimiters, LaTeX spacing and sizing,
    `\\text{}` wrappers (their content is kept), degrees, `\\dfrac`, a trailing period, a leading `x =`."""
    text = text.strip()
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(opener) and text.endswith(closer) and len(text) >= len(opener) + len(closer):
            text = text[len(opener) : len(text) - len(closer)].strip()
    for command in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ "):
        text = text.replace(command, "" if command != "\\ " else " ")
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox|mathbf)\s*\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\^\s*\{?\\circ\}?|°", "", text)
    text = text.replace("\\%", "%").replace("{,}", ",").replace("\\$", "$")
    text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
    text = _LHS_RE.sub("", text, count=1) if text.count("=") == 1 else text
    while text.startswith("{") and braced_content(text, 0) == text[1:-1]:
        text = text[1:-1].strip()
    return text


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """(value, is_percent) when the normalized text is a plain number, else None. Accepts signs, thousands
    separators, decimals, `1e3`, fractions (`3/4`, `\\frac{3}{4}`, `\\frac34`, `1\\frac{1}{2}`), a `$` prefix, a
    `%` suffix and trailing unit words after a space (`42 apples`)."""
    text = text.replace("$", "").strip()
    unit = _UNIT_WORDS_RE.match(text)
    if unit and not _NOT_UNITS & set(unit.group(2).lower().split()):
        text = unit.group(1)
    is_percent = text.endswith("%")
    text = text.removesuffix("%").strip()
    if _SIGNED_NUMBER_RE.match(text):
        return Fraction(text.replace(",", "")), is_percent
    for regex in (_FRAC_RE, _SHORT_FRAC_RE):
        match = regex.match(text)
        if match and int(match.group(3)) != 0:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return (-value if match.group(1) == "-" else value), is_percent
    match = _MIXED_RE.match(text)
    if match and int(match.group(4)) != 0:
        value = int(match.group(2)) + Fraction(int(match.group(3)), int(match.group(4)))
        return (-value if match.group(1) == "-" else value), is_percent
    match = _SLASH_FRAC_RE.match(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2))), is_percent
    return None


def numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool], rel_tol: float = 1e-12) -> bool:
    """Equal values; when exactly one side is a percentage, its value / 100 may match too (`50%` == `0.5`).
    `rel_tol` only absorbs float round-off in labels such as 0.30000000000000004."""
    (value_a, percent_a), (value_b, percent_b) = a, b
    candidates = [(value_a, value_b)]
    if percent_a != percent_b:
        candidates.append((value_a / 100, value_b) if percent_a else (value_a, value_b / 100))
    return any(abs(x - y) <= rel_tol * max(abs(x), abs(y)) for x, y in candidates)


def _split_top_level(text: str) -> tuple[str, list[str], str] | None:
    """`(a, b]` -> ("(", ["a", "b"], "]"): a bracketed list split at its top-level commas, None if not one."""
    if len(text) < 2 or text[0] not in "([" or text[-1] not in ")]":
        return None
    parts, depth, start = [], 0, 1
    for index in range(1, len(text) - 1):
        char = text[index]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif char == "," and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:-1].strip())
    return (text[0], parts, text[-1]) if len(parts) > 1 else None


def is_equivalent(prediction: str | None, answers: str | Iterable[str], sympy_timeout_s: float | None = 2.0) -> bool:
    """Whether `prediction` equals `answers` or any of them (see the module docstring for the rules)."""
    if prediction is None:
        return False
    if isinstance(answers, str):  # one answer, not its characters
        answers = (answers,)
    return any(_equivalent(prediction, answer, sympy_timeout_s) for answer in answers)


def _equivalent(prediction: str, answer: str, sympy_timeout_s: float | None) -> bool:
    pred, gold = normalize_answer(prediction), normalize_answer(answer)
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    pred_number, gold_number = parse_number(pred), parse_number(gold)
    if pred_number is not None and gold_number is not None:
        return numbers_equal(pred_number, gold_number)
    pred_parts, gold_parts = _split_top_level(pred), _split_top_level(gold)
    if pred_parts is not None or gold_parts is not None:
        if pred_parts is None or gold_parts is None:
            return False
        (pred_open, pred_items, pred_close), (gold_open, gold_items, gold_close) = pred_parts, gold_parts
        return (
            (pred_open, pred_close, len(pred_items)) == (gold_open, gold_close, len(gold_items))
            and all(_equivalent(p, g, sympy_timeout_s) for p, g in zip(pred_items, gold_items))
        )  # fmt: skip
    from megarl.rewards.sympy_equiv import symbolic_equal

    # A number that is not plain on one side (e.g. `50%`) enters sympy as its value.
    return symbolic_equal(
        str(pred_number[0]) if pred_number else pred, str(gold_number[0]) if gold_number else gold, sympy_timeout_s
    )
