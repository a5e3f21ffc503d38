"""Reading and writing config YAML: one set of typing rules for files, overrides and dumps, and line numbers.

PyYAML follows YAML 1.1, whose implicit typing surprises config users: `no`/`on` become booleans, `1e-5` stays a
string, `010` is octal and `2024-01-01` a date. We read with YAML 1.2 core-schema rules instead (true/false, null/~,
decimal/0x/0o integers with optional underscores, floats with or without a dot, .inf/.nan; nothing else is typed),
and the dumper quotes exactly the strings those rules would retype, so `to_yaml` output loads back unchanged.
Duplicate keys are an error (PyYAML silently keeps the last). Every key's line is recorded by dotted path so errors
can point at `file:line`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megarl.errors import UserError

__all__ = ["ConfigDumper", "ConfigLoader", "YamlFile", "dump_yaml", "parse_value", "read_yaml_file"]

_INT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_MERGE = re.compile(r"^(?:<<)$")


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema typing and duplicate-key detection."""

    yaml_implicit_resolvers: dict = {}  # filled below: replaces SafeLoader's rules

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key_node.value!r} (first given on line {seen[key_node.value] + 1})",
                    key_node.start_mark,
                )
            seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_core_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node).replace("_", "")
        unsigned = text.lstrip("+-")
        sign = -1 if text.startswith("-") else 1
        if unsigned[:2] in ("0x", "0o"):
            return sign * int(unsigned, 0)
        return sign * int(unsigned, 10)


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings by the loader's typing rules; block style, keys in field order."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        # Indent list items under their key (the common style in hand-written configs).
        return super().increase_indent(flow, False)


for _tag, _regex, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789.")),
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:merge", _MERGE, ["<"]),
):
    ConfigLoader.add_implicit_resolver(_tag, _regex, _first)
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_core_int)
ConfigDumper.yaml_implicit_resolvers = ConfigLoader.yaml_implicit_resolvers


@dataclass
class YamlFile:
    """One parsed config file: its data and the line (1-based) of every key, by dotted path (`a.b`, `a.list[0]`)."""

    path: Path
    data: dict[str, Any]
    lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str) -> str:
        """`file:line` of `key`, or of its closest enclosing key that the file sets; `file` alone if none."""
        probe = key
        while probe:
            if probe in self.lines:
                return f"{self.path}:{self.lines[probe]}"
            probe = _parent_key(probe)
        return str(self.path)


def _parent_key(key: str) -> str:
    cut = max(key.rfind("."), key.rfind("["))
    return key[:cut] if cut > 0 else ""


def _record_lines(node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines.setdefault(key, key_node.start_mark.line + 1)
            _record_lines(value_node, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            key = f"{prefix}[{index}]"
            lines.setdefault(key, item.start_mark.line + 1)
            _record_lines(item, key, lines)


def _syntax_error(where: str, error: yaml.YAMLError) -> UserError:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return UserError(f"{where}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {error.problem}{context}")
    return UserError(f"{where}: YAML syntax error: {error}")


def read_yaml_file(path: Path) -> YamlFile:
    """Parse one config file; the top level must be a mapping (an empty file is an empty mapping)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"config file not found: {path} (looked for {path.absolute()})") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
        raise UserError(f"config file {path} cannot be read: {error}") from None
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as error:
        raise _syntax_error(str(path), error) from None
    finally:
        loader.dispose()
    if data is None:
        return YamlFile(path, {})
    if not isinstance(data, dict):
        raise UserError(
            f"{path}:{node.start_mark.line + 1}: the top level of a config file must be a mapping of keys "
            f"(e.g. `actor:`), not a {type(data).__name__}"
        )
    lines: dict[str, int] = {}
    _record_lines(node, "", lines)
    return YamlFile(path, data, lines)


def parse_value(text: str, where: str) -> Any:
    """A command-line value, typed like YAML: 3, 0.5, 1e-5, true, null, [1, 2], {a: 1}, "quoted text".

    An empty value is the empty string. A value that YAML cannot read is taken as a plain string, unless it starts
    like a list, mapping or quoted string (then the user meant structure, and gets the syntax error).
    """
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # ConfigLoader is a SafeLoader
    except yaml.YAMLError as error:
        if text.lstrip()[:1] in ("[", "{", "'", '"'):
            problem = getattr(error, "problem", None) or str(error)
            raise UserError(f"{where}: the value is not valid YAML ({problem}); quote it to pass a string") from None
        return text


def dump_yaml(data: Any) -> str:
    """YAML text for plain data (dicts keep their order), readable back by `ConfigLoader` to equal data."""
    return yaml.dump(
        data, Dumper=ConfigDumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120
    )
