"""The config dataclasses as a schema: strict type checks with key paths, building instances, running `check`.

OmegaConf merges and interpolates, but its type checks are lenient in places (a list of lists passes as `list[str]`,
a list as a `dict[str, str]` value) and its errors name its own node classes. So the loader checks every layer of
raw data (a file, an override) against the dataclass annotations here first, and builds the final instances here
too, which lets an error in a `__post_init__` name the section it came from. Interpolation strings (`${...}`) are
left alone in raw data and checked once resolved.

Accepted annotations: int, float, str, bool, pathlib.Path, Enum, Literal[...], nested dataclasses, list[X],
tuple[X, ...], dict[str, X], unions of these (`X | None` among them), Any.

Numbers are checked for what no key accepts: a float must be finite (a NaN learning rate trains nothing and fails
nowhere), an integer must fit in 64 bits (seeds and sizes reach torch and numpy as int64), and a key whose name says
it is an amount (`num_*`, `max_*`, `*_gb`, `*_mb`, `*_bytes`, `*_s`, `*_tokens`, `*_steps`, `*_every`, ...) must
not be negative.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from megarl.config.suggest import close_matches, describe_valid, unknown_choice
from megarl.errors import UserError

__all__ = ["ConfigKeyError", "build", "check_raw", "describe_type", "describe_value", "join_key", "run_checks"]


class ConfigKeyError(UserError):
    """A bad value at a known key path; the loader adds where it came from (file:line or override)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def join_key(key: str, name: object) -> str:
    """`key.name`, or `name` at the top level."""
    return f"{key}.{name}" if key else str(name)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The init fields of a dataclass and their resolved annotations, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "booleans (true/false)", Path: "paths"}


def _plural(tp: Any) -> str:
    if tp in _PLURAL:
        return _PLURAL[tp]
    if _is_dataclass_type(tp):
        return "sections"
    return f"values that are each {describe_type(tp)}"


def describe_type(tp: Any) -> str:
    """What a value of annotation `tp` looks like, in words ("an integer or null", "one of: hf, sglang")."""
    members = _union_members(tp)
    if members is not None:
        others = [describe_type(m) for m in members if m is not type(None)]
        return " or ".join(others + (["null"] if type(None) in members else []))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"one of: {describe_valid(args)}"
    if origin in (list, tuple):
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict:
        return f"a mapping of names to {_plural(args[1])}" if len(args) == 2 else "a mapping"
    if _is_dataclass_type(tp):
        return f"a section (a mapping with keys {describe_valid(field_types(tp), limit=8)})"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of: {describe_valid(m.name for m in tp)}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path"}.get(
        tp, "any value" if tp is Any else getattr(tp, "__name__", str(tp))
    )


def describe_value(value: Any) -> str:
    """A value as the user wrote it, with its YAML kind: `'abc' (a string)`, `3 (an integer)`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}.get(type(value))
    return f"{text} ({kind})" if kind else text


class _TypeMismatch(ConfigKeyError):
    """The value at the key itself has the wrong kind (not something inside it)."""


def _type_error(key: str, tp: Any, value: Any) -> ConfigKeyError:
    return _TypeMismatch(key, f"{key} must be {describe_type(tp)}; got {describe_value(value)}")


def _unknown_key(key: str, name: object, valid: list[str]) -> ConfigKeyError:
    full = join_key(key, name)
    matches = close_matches(str(name), valid, n=1)
    hint = f"did you mean {' or '.join(join_key(key, m) for m in matches)}? " if matches else ""
    under = f"valid keys under {key}" if key else "valid top-level keys"
    return ConfigKeyError(full, f"{full} is not a config key; {hint}{under}: {describe_valid(valid)}")


def _refused_key(cls: type, key: str, name: str, value: Any) -> ConfigKeyError | None:
    """A key the section names in its `REFUSED_KEYS` (one that reads as if it did something, and does not): the
    error names every key the user set under it, and the section's reason."""
    reason = getattr(cls, "REFUSED_KEYS", {}).get(name)
    if reason is None:
        return None
    full = join_key(key, name)
    keys = [join_key(full, inner) for inner in value] if isinstance(value, dict) and value else [full]
    return ConfigKeyError(full, f"{', '.join(keys)}: {full} {reason}")


INT64 = (-(2**63), 2**63 - 1)
AMOUNT_RE = re.compile(
    r"^(num|max|min)_\w+$|_(gb|mb|bytes|s|seconds|tokens|steps|every|len|rounds|restarts|workers|threads|turns|chars)$"
)
"""Key names of amounts: a count, a size, a duration, a cadence (never negative)."""


def _checked_number(value: int | float, key: str) -> int | float:
    """`value` if a key may hold it (see the module docstring), else a ConfigKeyError naming the key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigKeyError(key, f"{key}={value} is not a finite number; give a real value")
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise ConfigKeyError(key, f"{key}={value} does not fit in a 64-bit integer (at most {INT64[1]})")
    if value < 0 and AMOUNT_RE.search(key.rsplit(".", 1)[-1].split("[", 1)[0]):
        raise ConfigKeyError(key, f"{key}={value} is negative; it is an amount: give 0 or more")
    return value


def _scalar(tp: Any, value: Any, key: str) -> Any:
    """The value converted to annotation `tp` (a leaf type), or a type error."""
    if tp is Any or tp is object:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _checked_number(value, key)
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _checked_number(float(value), key)
    elif tp is str:
        # Numbers are accepted for strings (a revision "1234", a dtype "16"); YAML typed them, the user did not.
        if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)):
            return str(value)
    elif tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
    elif typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice and type(value) is type(choice):
                return choice
        raise ConfigKeyError(key, unknown_choice(key, value, choices, problem="is not one of the choices"))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and value in tp.__members__:
            return tp[value]
        raise ConfigKeyError(key, unknown_choice(key, value, tp.__members__, problem="is not one of the choices"))
    else:
        raise TypeError(f"config annotation {tp!r} at {key or 'the top level'} is not supported")
    raise _type_error(key, tp, value)


def _walk(tp: Any, value: Any, key: str, build_objects: bool) -> Any:
    """Check `value` against `tp` (raising ConfigKeyError at the first problem) and return it converted.

    With build_objects=False the data is one raw layer: partial sections are fine and interpolations are skipped.
    """
    if not build_objects and _is_interpolation(value):
        return value
    members = _union_members(tp)
    if members is not None:
        if value is None:
            if type(None) in members:
                return None
            raise _type_error(key, tp, value)
        candidates = [m for m in members if m is not type(None)]
        if len(candidates) == 1:
            try:
                return _walk(candidates[0], value, key, build_objects)
            except _TypeMismatch as error:
                if error.key != key:
                    raise
                raise _type_error(key, tp, value) from None  # say "... or null"
        for member in candidates:
            try:
                return _walk(member, value, key, build_objects)
            except ConfigKeyError:
                continue
        raise _type_error(key, tp, value)
    if value is None:
        raise ConfigKeyError(key, f"{key} must be {describe_type(tp)}; got null (this key cannot be null)")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_dataclass_type(tp):
        return _walk_section(tp, value, key, build_objects)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise _type_error(key, tp, value)
        item_type = args[0] if args else Any
        items = [_walk(item_type, item, f"{key}[{i}]", build_objects) for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, tp, value)
        value_type = args[1] if len(args) == 2 else Any
        result = {}
        for name, item in value.items():
            if not isinstance(name, str):
                raise ConfigKeyError(
                    key, f"{key}: keys must be strings; got {describe_value(name)} (quote it: '{name}')"
                )
            result[name] = _walk(value_type, item, join_key(key, name), build_objects)
        return result
    return _scalar(tp, value, key)


def _walk_section(cls: type, value: Any, key: str, build_objects: bool) -> Any:
    if build_objects and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise _type_error(key, cls, value)
    fields = field_types(cls)
    kwargs = {}
    for name, item in value.items():
        if name not in fields:
            raise _refused_key(cls, key, name, item) or _unknown_key(key, name, list(fields))
        kwargs[name] = _walk(fields[name], item, join_key(key, name), build_objects)
    if not build_objects:
        return value
    try:
        return cls(**kwargs)
    except ValueError as error:  # UserError included: say which section it is about
        message = str(error)
        if key and not message.startswith(key):
            message = f"{key}: {message}"
        raise ConfigKeyError(key, message) from error


def check_raw(schema: type, data: dict[str, Any]) -> None:
    """Check one layer of raw config data (keys, types, choices) against the schema; raise ConfigKeyError."""
    _walk(schema, data, "", build_objects=False)


def build(schema: type, data: dict[str, Any]) -> Any:
    """The schema instance for complete, resolved data, checked strictly on the way; raise ConfigKeyError."""
    return _walk(schema, data, "", build_objects=True)


def run_checks(obj: Any, key: str = "") -> None:
    """Call `check(key)` on every dataclass in the tree, innermost first, with its dotted key path.

    The top-level dataclass gets key "". A plain ValueError from a `check` becomes a UserError with the same text.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for name in field_types(type(obj)):
            run_checks(getattr(obj, name), join_key(key, name))
        check = getattr(obj, "check", None)
        if callable(check):
            try:
                check(key)
            except UserError:
                raise
            except ValueError as error:
                raise UserError(str(error)) from error
    elif isinstance(obj, list | tuple):
        for index, item in enumerate(obj):
            run_checks(item, f"{key}[{index}]")
    elif isinstance(obj, dict):
        for name, item in obj.items():
            run_checks(item, join_key(key, name))
