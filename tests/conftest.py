"""Shared fixtures: long-lived gloo rank pools and tiny HF checkpoints built once per session.

Rank-side functions live in the test modules; the pools' spawned processes import them by module name, so this
folder is put on sys.path before any pool starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from megarl.runtime.rank_pool import RankPool
from megarl.testing.tiny_checkpoint import make_hf_checkpoint


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks: enough for TP=2 x PP=2 (smaller layouts use the rest as data parallelism)."""
    with RankPool(4, timeout_s=300) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks1():
    """One rank with Megatron state of its own: offline conversion runs here, outside the pytest process."""
    with RankPool(1, timeout_s=300) as pool:
        yield pool


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, dtype=torch.float32, max_shard_size=None) -> folder of a tiny saved HF model."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("hf")

    def make(name: str, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
        key = (name, dtype, max_shard_size)
        if key not in cache:
            folder = root / f"{name}-{str(dtype).removeprefix('torch.')}-{max_shard_size or 'single'}"
            cache[key] = make_hf_checkpoint(name, folder, dtype=dtype, max_shard_size=max_shard_size)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_reference(hf_checkpoint):
    """hf_reference(name, batch=2) -> (HF folder, token ids [batch, 48], the HF model's fp32 logits on them)."""
    from helpers import hf_logits, sample_ids

    cache: dict = {}

    def get(name: str, batch: int = 2):
        if (name, batch) not in cache:
            folder = hf_checkpoint(name)
            ids = sample_ids(vocab_size=1000, batch=batch, seq=48)
            cache[name, batch] = (folder, ids, hf_logits(folder, ids))
        return cache[name, batch]

    return get
