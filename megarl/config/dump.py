"""A built config written back out: plain data, YAML, the copy kept in the run folder, and its hash.

`to_yaml` output loads back with `load_config` into an equal object (strings that would retype are quoted, a literal
`${` is escaped), so the resolved config saved in a run folder is itself a valid config file. `config_hash` is a
digest of the canonical JSON form (keys sorted), the same in every process and for any dict key order; a resumed
run compares it with the one in its checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.config.yaml_io import dump_yaml

__all__ = ["CONFIG_FILE_NAME", "config_hash", "save_resolved", "to_dict", "to_yaml"]

CONFIG_FILE_NAME = "config.yaml"
"""File name of the resolved config inside a run folder."""


def to_dict(config: Any) -> Any:
    """Plain data (dicts in field order, lists, str/int/float/bool/None) for a config dataclass tree.

    Enums become their names and paths strings, so the result is what a YAML file would hold.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, dict):
        return {str(name): to_dict(item) for name, item in config.items()}
    if isinstance(config, list | tuple):
        return [to_dict(item) for item in config]
    if isinstance(config, enum.Enum):
        return config.name
    if isinstance(config, Path):
        return str(config)
    return config


def _escape_interpolations(data: Any) -> Any:
    # A resolved string holding a literal "${" must not be re-read as an interpolation.
    if isinstance(data, str):
        return data.replace("${", "\\${")
    if isinstance(data, dict):
        return {name: _escape_interpolations(item) for name, item in data.items()}
    if isinstance(data, list):
        return [_escape_interpolations(item) for item in data]
    return data


def to_yaml(config: Any) -> str:
    """The config as YAML text that `load_config` reads back to an equal object."""
    return dump_yaml(_escape_interpolations(to_dict(config)))


def _drop_keys(data: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    data = json.loads(json.dumps(data))  # a deep copy of plain data
    for key in keys:
        *parents, last = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return data


def config_hash(config: Any, exclude: Sequence[str] = ()) -> str:
    """A 16-hex-digit digest of the config's values, stable across processes and dict key order.

    `exclude` lists dotted keys left out (settings a resumed run may change, e.g. logging intervals).
    """
    data = to_dict(config)
    if exclude:
        data = _drop_keys(data, exclude)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def save_resolved(config: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (to `path`, or `path/config.yaml` for a folder); return the file written.

    The write is atomic (a temporary file renamed into place), so a crash never leaves half a config behind.
    """
    target = Path(path)
    if target.is_dir():
        target = target / CONFIG_FILE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    text = f"# Resolved megarl config; config_hash: {config_hash(config)}\n{to_yaml(config)}"
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
