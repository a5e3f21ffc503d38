"""Tool calls in model text, in the formats models are trained on.

- `hermes` (Hermes, Qwen2.5/Qwen3 chat templates): `<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`;
- `tag` (a plain form tiny models learn quickly): `<tool>calculator(12*34)</tool>`, the argument text as it is.

A call that cannot be read (bad JSON, no name, an unclosed tag) is a `ToolCallError`: the episode goes on with an
error observation the model can learn from, never a crash. The text is the policy's, so reading it is bounded: a call
of at most `MAX_CALL_CHARS` characters, JSON nested at most `MAX_JSON_DEPTH` deep, integers of at most
`MAX_INT_DIGITS` digits, a tool name of at most `MAX_NAME_CHARS` characters, valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "tag")
MAX_CALL_CHARS = 100_000
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 1000
MAX_NAME_CHARS = 64

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_TAG = re.compile(r"<tool>(.*?)(</tool>|$)", re.DOTALL)
_TAG_CALL = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*\((.*)\)\s*", re.DOTALL)
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)  # strings (skipped whole) and brackets


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    """hermes: the JSON arguments; tag: {"input": the text between the parentheses}."""


@dataclass(frozen=True)
class ToolCallError:
    message: str
    """What was wrong, as the model will read it."""
    text: str
    """The call as the model wrote it."""


class _Unreadable(ValueError):
    """A call past a bound: the message is what the model reads."""


class _NotJSON(_Unreadable):
    """Text the JSON decoder refuses."""


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall | ToolCallError]:
    """Every tool call in `text` (a model turn), in order; [] when the turn calls no tool."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r}: valid are {', '.join(FORMATS)}")
    pattern, read = (_HERMES, _read_hermes) if fmt == "hermes" else (_TAG, _read_tag)
    calls: list[ToolCall | ToolCallError] = []
    for match in pattern.finditer(text):
        try:
            calls.append(read(match))
        except _Unreadable as e:
            calls.append(ToolCallError(str(e), match.group(0)))
    return calls


def _read_hermes(match: re.Match) -> ToolCall | ToolCallError:
    body, closing = match.group(1), match.group(2)
    if not closing:
        return ToolCallError("the tool call is not closed with </tool_call>", match.group(0))
    call = _loads(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCallError('the tool call needs {"name": ..., "arguments": {...}}', match.group(0))
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
        try:
            arguments = _loads(arguments)
        except _NotJSON:
            return ToolCallError("the tool call's arguments are not a JSON object", match.group(0))
    if not isinstance(arguments, dict):
        return ToolCallError("the tool call's arguments are not a JSON object", match.group(0))
    return ToolCall(_checked_name(call["name"]), _checked_text(arguments))


def _read_tag(match: re.Match) -> ToolCall | ToolCallError:
    body, closing = match.group(1), match.group(2)
    if not closing:
        return ToolCallError("the tool call is not closed with </tool>", match.group(0))
    _check_size(body)
    call = _TAG_CALL.fullmatch(body)
    if call is None:
        return ToolCallError("write a tool call as <tool>name(input)</tool>", match.group(0))
    return ToolCall(_checked_name(call.group(1)), _checked_text({"input": call.group(2)}))


def _check_size(body: str) -> None:
    if len(body) > MAX_CALL_CHARS:
        raise _Unreadable(f"the tool call is longer than {MAX_CALL_CHARS} characters")


def _loads(body: str) -> Any:
    """JSON within the bounds; _Unreadable naming what is wrong."""
    _check_size(body)
    depth = 0
    for token in _JSON_TOKENS.finditer(body):  # nesting counted before the (recursive) decoder sees it
        bracket = token.group(0)
        depth += 1 if bracket in "[{" else -1 if bracket in "]}" else 0
        if depth > MAX_JSON_DEPTH:
            raise _Unreadable(f"the tool call's JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(body, parse_int=_bounded_int)
    except _Unreadable:
        raise
    except json.JSONDecodeError as e:
        raise _NotJSON(f"the tool call is not valid JSON ({e.msg} at char {e.pos})") from None
    except (ValueError, RecursionError) as e:  # what the decoder refuses beyond syntax
        raise _NotJSON(f"the tool call is not valid JSON ({str(e)[:200]})") from None


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Unreadable(f"a number has more than {MAX_INT_DIGITS} digits")
    return int(digits)


def _checked_name(name: str) -> str:
    if len(name) > MAX_NAME_CHARS:
        raise _Unreadable(f"a tool name is at most {MAX_NAME_CHARS} characters")
    return _checked_text(name)


def _checked_text(value: Any) -> Any:
    """`value` when all its text is valid Unicode (JSON's \\ud800 escapes give lone surrogates no file, socket or
    tokenizer takes)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _Unreadable("the tool call has text that is not valid Unicode (a lone surrogate)") from None
    return value
