"""Data: prompt, SFT and preference-pair datasets read from files, their samplers, and the Batch container moved
between controller and workers (with its collation from token lists).

Names are imported on first use, so that `megarl.data.config` stays cheap for the config loader (no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Batch": "batch",
    "EpochSampler": "sampler",
    "PairDataConfig": "config",
    "PairDataset": "pairs",
    "PairExample": "pairs",
    "PromptDataConfig": "config",
    "PromptDataset": "prompts",
    "PromptSample": "prompts",
    "PromptSampler": "prompts",
    "SFTDataConfig": "config",
    "SFTDataset": "sft",
    "SFTExample": "sft",
    "collate_pairs": "pairs",
    "collate_sft": "sft",
    "make_rl_batch": "collate",
    "prompt_tokens": "collate",
    "response_tokens": "collate",
    "response_values": "collate",
}

__all__ = [
    "Batch",
    "EpochSampler",
    "PairDataConfig",
    "PairDataset",
    "PairExample",
    "PromptDataConfig",
    "PromptDataset",
    "PromptSample",
    "PromptSampler",
    "SFTDataConfig",
    "SFTDataset",
    "SFTExample",
    "collate_pairs",
    "collate_sft",
    "make_rl_batch",
    "prompt_tokens",
    "response_tokens",
    "response_values",
]

if TYPE_CHECKING:
    from megarl.data.batch import Batch
    from megarl.data.collate import make_rl_batch, prompt_tokens, response_tokens, response_values
    from megarl.data.config import PairDataConfig, PromptDataConfig, SFTDataConfig
    from megarl.data.pairs import PairDataset, PairExample, collate_pairs
    from megarl.data.prompts import PromptDataset, PromptSample, PromptSampler
    from megarl.data.sampler import EpochSampler
    from megarl.data.sft import SFTDataset, SFTExample, collate_sft


assert set(__all__) == set(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megarl.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megarl.data.{_EXPORTS[name]}"), name)
