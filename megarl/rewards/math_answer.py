r"""Math answers: pull the final answer out of a response (and the acceptable answers out of a dataset label).

Extraction styles (each takes the *last* occurrence, since a response may restate earlier attempts):
- `boxed`: the content of `\boxed{...}` (or `\fbox{...}`), braces matched so `\boxed{\frac{1}{2}}` works;
- `gsm8k`: the rest of the line after `####`;
- `tag`: the content of `<answer>...</answer>`;
- fallback `last_number`: the last number or math expression in the text as math-verify finds it (a "final
  answer is" phrase first, else the last `$...$` expression or number: `$\frac{3}{4}$` gives `\frac{3}{4}`, not
  `4`), used only when asked for.

Whether the answer is right is megarl/rewards/math_equiv.py's (math-verify).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

ExtractStyle = Literal["boxed", "gsm8k", "tag", "auto"]
Fallback = Literal["none", "last_number"]
FALLBACKS = ("none", "last_number")

_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_COMMANDS = ("\\boxed", "\\fbox")


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


def extract_last_number(text: str, timeout_s: float | None = 2.0) -> str | None:
    """The answer math-verify finds in free text: a "final answer is" phrase's, else the last `$...$` expression or
    number (`-3`, `1,000`, `2.5`, `3/4`, `\\frac{3}{4}`); None if there is none."""
    from megarl.rewards.math_equiv import find_answer

    return find_answer(text, timeout_s)


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
