"""`load_config`: a YAML file (with its `extends` chain) plus `a.b.c=value` overrides, as validated dataclasses.

Layers, in order: the schema's defaults, each base file named by `extends` (recursively, bases first), the file,
then each override. Every layer is checked against the schema on its own (unknown keys, types, choices), so an error
names the file and line, or the override, that brought the bad value. OmegaConf then merges the layers and resolves
`${...}` interpolations (other keys, `${oc.env:VAR,default}`); the resolved tree is checked strictly once more,
built into the dataclasses, and every nested `check(key)` runs. Every failure is a `UserError` in our words; no
OmegaConf exception or node class reaches the user.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import (
    GrammarParseError,
    InterpolationKeyError,
    InterpolationValidationError,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
)

from megarl.config.paths import anchor_paths
from megarl.config.schema import (
    ConfigKeyError,
    build,
    check_raw,
    describe_type,
    describe_value,
    field_types,
    run_checks,
)
from megarl.config.suggest import close_matches, closest
from megarl.config.yaml_io import parse_value, read_yaml_file
from megarl.errors import UserError

__all__ = ["load_config", "parse_override"]

T = TypeVar("T")

EXTENDS_KEY = "extends"
"""Top-level key of a config file naming the base file(s) it builds on (paths relative to the file)."""

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][\w-]*(?:\.[\w-]+)*$")
_MISSING = "???"
_KEY_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_REFERENCE = re.compile(r"\$\{\s*([A-Za-z_][\w-]*(?:\.[\w-]+|\[\d+\])*)\s*\}")
_ENV_NO_DEFAULT = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}\s]+)\s*\}")
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:")
_LEADING_KEY = re.compile(r"^([A-Za-z_][\w-]*(?:\.[\w-]+|\[\d+\])*)\s*=")
_KNOWN_RESOLVERS = ("oc.env", "oc.select", "oc.decode", "oc.create", "oc.dict.keys", "oc.dict.values")


@dataclass
class _Layer:
    """One source of config data and how to say where a key of it came from."""

    data: dict[str, Any]
    where: Callable[[str], str]


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """The validated config: `schema`'s defaults, then the YAML file at `path` (if any), then `overrides`.

    Overrides are `a.b.c=value` with YAML-typed values (`x=3`, `x=0.5`, `x=[1,2]`, `x=null`, `x=true`, `x="3"`).
    Raises UserError naming the file and line (or the override), the key path and what would be valid.
    """
    layers = _file_layers(Path(path), (), schema) if path is not None else []
    layers += [_override_layer(text) for text in overrides]

    config = OmegaConf.structured(schema)
    sources: dict[str, _Layer] = {}  # key path -> the last layer that set it
    for layer in layers:
        try:
            check_raw(schema, layer.data)
        except ConfigKeyError as error:
            raise UserError(f"{layer.where(error.key)}: {error}") from None
        try:
            config = OmegaConf.merge(config, layer.data)
        except OmegaConfBaseException as error:
            key = error.full_key or ""
            raise UserError(_merge_message(error, key, layer.where(key), _lookup(layer.data, key))) from None
        _record_sources(layer, layer.data, "", sources)

    raw = OmegaConf.to_container(config, resolve=False)
    _check_missing(schema, raw, path)
    resolved = _resolve(config, schema, raw, sources)
    try:
        result = build(schema, resolved)
    except ConfigKeyError as error:
        where = _where(sources, error.key)
        raise UserError(f"{where}: {error}" if where else str(error)) from None
    try:
        run_checks(result)
    except UserError as error:
        # A check names the key first ("actor.parallel.tp=3 does not divide ..."): say where that key was set.
        named = _LEADING_KEY.match(str(error))
        if named and named.group(1) in sources:
            raise UserError(f"{sources[named.group(1)].where(named.group(1))}: {error}") from error
        raise
    return result


def parse_override(text: str) -> tuple[str, Any]:
    """`("a.b.c", value)` for the override `a.b.c=value`, the value typed like YAML; UserError if malformed."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"override {text!r} is not of the form key=value (e.g. actor.parallel.tp=2)")
    if not _OVERRIDE_KEY.match(key):
        raise UserError(
            f"override {text!r}: {key!r} is not a key path (names of letters, digits, _ or -, joined by dots; "
            "a list is set whole, e.g. key=[a, b])"
        )
    return key, parse_value(value, f"override {text!r}")


def _override_layer(text: str) -> _Layer:
    key, value = parse_override(text)
    data: Any = value
    for part in reversed(key.split(".")):
        data = {part: data}
    where = f"override {text!r}"
    return _Layer(data, lambda _key: where)


def _file_layers(path: Path, chain: tuple[Path, ...], schema: type | None = None) -> list[_Layer]:
    """The layers of one file: its bases (recursively, in order), then the file itself."""
    resolved = path.resolve()
    if resolved in [p.resolve() for p in chain]:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise UserError(f"config files extend each other in a cycle: {cycle}")
    parsed = read_yaml_file(path)
    bases = parsed.data.pop(EXTENDS_KEY, None)
    layers: list[_Layer] = []
    if bases is not None:
        names = [bases] if isinstance(bases, str) else bases
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(
                f"{parsed.where(EXTENDS_KEY)}: {EXTENDS_KEY} must be a file name or a list of file names "
                f"(relative to {path.parent}); got {describe_value(bases)}"
            )
        for name in names:
            base = path.parent / Path(name).expanduser()
            if not base.is_file():
                raise UserError(
                    f"{parsed.where(EXTENDS_KEY)}: {EXTENDS_KEY}: {name!r} is not a file (looked for {base.absolute()})"
                )
            layers += _file_layers(base, (*chain, path), schema)
    if schema is not None:  # relative paths in a file are relative to its folder (megarl/config/paths.py)
        anchor_paths(schema, parsed.data, path.parent.absolute())
    layers.append(_Layer(parsed.data, parsed.where))
    return layers


def _split_key(key: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _KEY_PART.findall(key)]


def _lookup(data: Any, key: str, default: Any = None) -> Any:
    """The value at dotted `key` (with `[i]` list indices) in plain data, or `default`."""
    for part in _split_key(key):
        found = (isinstance(part, int) and isinstance(data, list) and part < len(data)) or (
            isinstance(part, str) and isinstance(data, dict) and part in data
        )
        if not found:
            return default
        data = data[part]
    return data


def _record_sources(layer: _Layer, data: Any, key: str, sources: dict[str, _Layer]) -> None:
    if key:
        sources[key] = layer
    if isinstance(data, dict):
        for name, item in data.items():
            _record_sources(layer, item, f"{key}.{name}" if key else str(name), sources)
    elif isinstance(data, list):
        for index, item in enumerate(data):
            _record_sources(layer, item, f"{key}[{index}]", sources)


def _where(sources: dict[str, _Layer], key: str) -> str:
    """Where the value at `key` (or its closest enclosing key) was set; "" for a schema default."""
    probe = key
    while probe:
        if probe in sources:
            return sources[probe].where(key)
        cut = max(probe.rfind("."), probe.rfind("["))
        probe = probe[:cut] if cut > 0 else ""
    return ""


def _keys_where(test: Callable[[str], bool], data: Any, key: str = "") -> list[str]:
    """The dotted keys (`a.b[0].c`) of the strings in `data` that pass `test`."""
    if isinstance(data, str) and test(data):
        return [key]
    if isinstance(data, dict):
        return [k for name, item in data.items() for k in _keys_where(test, item, f"{key}.{name}" if key else name)]
    if isinstance(data, list):
        return [k for index, item in enumerate(data) for k in _keys_where(test, item, f"{key}[{index}]")]
    return []


def _type_at(schema: type, key: str) -> Any:
    tp: Any = schema
    for part in _split_key(key):
        tp = _strip_optional(tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            tp = field_types(tp).get(str(part), Any)
        else:
            args = getattr(tp, "__args__", ())
            tp = args[-1] if args else Any
    return tp


def _strip_optional(tp: Any) -> Any:
    args = getattr(tp, "__args__", ())
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return tp


def _check_missing(schema: type, raw: Any, path: str | Path | None) -> None:
    missing = _keys_where(lambda text: text == _MISSING, raw)
    if not missing:
        return
    listed = ", ".join(f"{key} ({describe_type(_strip_optional(_type_at(schema, key)))})" for key in missing)
    place = f"in {path} or " if path is not None else ""
    plural = len(missing) > 1
    raise UserError(
        f"missing required value{'s' if plural else ''}: {listed}; set {'them' if plural else 'it'} "
        f"{place}on the command line, e.g. {missing[0]}=..."
    )


def _first_line(error: Exception) -> str:
    return str(error).split("\n", 1)[0].strip()


def _merge_message(error: OmegaConfBaseException, key: str, where: str, value: Any) -> str:
    if isinstance(error, GrammarParseError):
        return (
            f"{where}: {key}={value!r} is not a valid interpolation; write ${{other.key}} or ${{oc.env:VAR,default}}, "
            "and escape a literal dollar-brace as \\${"
        )
    return f"{where}: {key}: {_first_line(error)}"


def _dangling_reference(reference: str, raw: Any) -> str | None:
    """ "did you mean" text for a reference that points nowhere, or None when the reference exists."""
    parts = _split_key(reference)
    node = raw
    prefix = ""
    for part in parts:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            node = node[part]
            prefix = f"{prefix}[{part}]"
            continue
        if isinstance(part, str) and isinstance(node, dict) and part in node:
            node = node[part]
            prefix = f"{prefix}.{part}" if prefix else part
            continue
        options = list(node) if isinstance(node, dict) else []
        matches = [f"{prefix}.{m}" if prefix else m for m in close_matches(str(part), options, n=1)]
        return f"; did you mean {' or '.join(matches)}?" if matches else ""
    return None


def _resolve(config: Any, schema: type, raw: Any, sources: dict[str, _Layer]) -> Any:
    """Plain data with every interpolation resolved and converted to its field's type."""
    # One interpolation at a time first: OmegaConf's own error does not always say which key failed.
    for key in _keys_where(lambda text: "${" in text, raw):
        try:
            OmegaConf.select(config, key, throw_on_missing=True)
        except OmegaConfBaseException as error:
            raise UserError(_resolve_message(error, key, schema, raw, sources)) from None
    try:
        return OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        raise UserError(_resolve_message(error, error.full_key or "", schema, raw, sources)) from None


def _resolve_message(
    error: OmegaConfBaseException, key: str, schema: type, raw: Any, sources: dict[str, _Layer]
) -> str:
    value = _lookup(raw, key)
    where = _where(sources, key)
    head = f"{where}: {key}={value!r}" if where else f"{key}={value!r}"
    text = value if isinstance(value, str) else ""
    if isinstance(error, InterpolationKeyError):
        for reference in _REFERENCE.findall(text):
            hint = _dangling_reference(reference, raw)
            if hint is not None:
                return f"{head} refers to {reference}, which is not a config key{hint}"
    if isinstance(error, UnsupportedInterpolationType):
        for name in _RESOLVER.findall(text):
            if not OmegaConf.has_resolver(name):
                hint = closest(name, _KNOWN_RESOLVERS)
                return f"{head} uses the unknown resolver {name!r}{'; ' + hint if hint else ''}"
    for name in _ENV_NO_DEFAULT.findall(text):
        if name not in os.environ:
            return f"{head}: environment variable {name} is not set; set it, or give a default: ${{oc.env:{name},...}}"
    if isinstance(error, InterpolationValidationError):
        expected = describe_type(_type_at(schema, key))
        resolved = error.value
        whole = _REFERENCE.fullmatch(text.strip())
        if resolved is None and whole:  # OmegaConf does not say what a section-typed key resolved to
            resolved = _lookup(raw, whole.group(1))
        if OmegaConf.is_config(resolved):
            resolved = OmegaConf.to_container(resolved, resolve=False)
        return f"{head} resolved to {describe_value(resolved)}, but {key} must be {expected}"
    if isinstance(error, GrammarParseError):
        return f"{head} is not a valid interpolation; write ${{other.key}} or ${{oc.env:VAR,default}}"
    return f"{head} cannot be resolved: {_first_line(error)}"
