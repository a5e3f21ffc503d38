"""Config machinery: YAML files and `a.b.c=value` overrides into validated trees of component config dataclasses.

Components own their dataclasses (`<package>/config.py`); this package only loads, checks, dumps and hashes them.
The loader and dumper (omegaconf, PyYAML) are imported on first use, so that `megarl.config.suggest` ("did you
mean ...", used by every registry) costs nothing but the standard library. Nothing here imports torch, megatron,
transformers or ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megarl.config.suggest import closest, describe_valid, unknown_choice

if TYPE_CHECKING:
    from megarl.config.dump import config_hash, save_resolved, to_dict, to_yaml
    from megarl.config.loader import load_config, parse_override

__all__ = [
    "closest",
    "config_hash",
    "describe_valid",
    "load_config",
    "parse_override",
    "save_resolved",
    "to_dict",
    "to_yaml",
    "unknown_choice",
]

_LAZY = {
    "config_hash": "megarl.config.dump",
    "save_resolved": "megarl.config.dump",
    "to_dict": "megarl.config.dump",
    "to_yaml": "megarl.config.dump",
    "load_config": "megarl.config.loader",
    "parse_override": "megarl.config.loader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
