"""Tool calls in model text, in the formats models are trained on.

- `hermes` (Hermes, Qwen2.5/Qwen3 chat templates): `<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`;
- `tag` (a plain form tiny models learn quickly): `<tool>calculator(12*34)</tool>`, the argument text as it is.

A call that cannot be read (bad JSON, no name, an unclosed tag) is a `ToolCallError`: the episode goes on with an
error observation the model can learn from, never a crash.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "tag")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_TAG = re.compile(r"<tool>(.*?)(</tool>|$)", re.DOTALL)
_TAG_CALL = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*\((.*)\)\s*", re.DOTALL)


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


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall | ToolCallError]:
    """Every tool call in `text` (a model turn), in order; [] when the turn calls no tool."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r}: valid are {', '.join(FORMATS)}")
    return (
        [_read_hermes(m) for m in _HERMES.finditer(text)]
        if fmt == "hermes"
        else [_read_tag(m) for m in _TAG.finditer(text)]
    )


def _read_hermes(match: re.Match) -> ToolCall | ToolCallError:
    body, closing = match.group(1), match.group(2)
    if not closing:
        return ToolCallError("the tool call is not closed with </tool_call>", match.group(0))
    try:
        call = json.loads(body)
    except ValueError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at char {e.pos})", match.group(0))
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCallError('the tool call needs {"name": ..., "arguments": {...}}', match.group(0))
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments JSON-encoded once more
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ToolCallError("the tool call's arguments are not a JSON object", match.group(0))
    if not isinstance(arguments, dict):
        return ToolCallError("the tool call's arguments are not a JSON object", match.group(0))
    return ToolCall(call["name"], arguments)


def _read_tag(match: re.Match) -> ToolCall | ToolCallError:
    body, closing = match.group(1), match.group(2)
    if not closing:
        return ToolCallError("the tool call is not closed with </tool>", match.group(0))
    call = _TAG_CALL.fullmatch(body)
    if call is None:
        return ToolCallError("write a tool call as <tool>name(input)</tool>", match.group(0))
    return ToolCall(call.group(1), {"input": call.group(2)})
