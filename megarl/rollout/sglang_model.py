"""What SGLang makes of a model folder's config.json: its context window and the dtype it serves the weights in,
by SGLang's own rules (sglang 0.5.23; the contract tests compare with SGLang's functions)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megarl.rollout.config import SGLangEngineConfig


def _config_json(model_path: str | os.PathLike) -> dict[str, Any] | None:
    """The model folder's config.json, None when it cannot be read (the server reports that itself)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
"""config.json keys SGLang reads a context window from, in its order (sglang 0.5.23, get_context_length)."""


def context_length_of(model_path: str | os.PathLike) -> int | None:
    """The context window SGLang gives a checkpoint without --context-length, by SGLang's rule: the first of
    CONTEXT_LENGTH_KEYS in config.json, times the RoPE scaling factor unless the scaling names its original length
    (YaRN) or is llama3's; 2048 without any (the contract tests compare with SGLang's own function). None when
    config.json cannot be read: requests are then sent as they are."""
    config = _config_json(model_path)
    return None if config is None else context_window(config)


def context_window(config: dict[str, Any]) -> int:
    """SGLang's context window of a parsed config.json (context_length_of's rule)."""
    config = config.get("text_config", config)
    scaling = config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1)
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        if config.get(key) is not None:
            return int(factor * config[key])
    return 2048


_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}


def served_dtype(config: SGLangEngineConfig, model_path: str | os.PathLike) -> torch.dtype:
    """The dtype SGLang keeps the weights in: --dtype, or with "auto" the checkpoint's, float32 served as float16
    (sglang 0.5.23, model_config._get_and_verify_dtype)."""
    if config.dtype != "auto":
        return getattr(torch, _DTYPES[config.dtype])
    raw = _config_json(model_path) or {}
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), torch.float32)
    return torch.float16 if dtype == torch.float32 else dtype
