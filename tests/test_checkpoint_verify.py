"""Pre-flight checks of the starting weights (megarl/checkpoint/verify.py) raise no false alarm: every architecture's
intact checkpoint passes, with the number of tensors compared against config.json (the first four layers, the
embeddings, norms and head, under the names the transformers model shares with the checkpoint)."""

from __future__ import annotations

import pytest

from megarl.checkpoint.verify import check_hf_weights
from megarl.models.hf_config import load_hf_config

COMPARED = {
    "tiny-qwen3": 47,
    "tiny-qwen2": 50,
    "tiny-llama": 39,
    "tiny-llama-bias": 66,
    "tiny-qwen3-moe": 41,
    "tiny-mixtral": 27,
    "tiny-deepseek-v3": 57,
    "tiny-deepseek-v3-lite": 49,
}


@pytest.mark.parametrize("name", sorted(COMPARED))
def test_an_intact_checkpoint_passes(name, hf_checkpoint):
    folder = hf_checkpoint(name)
    assert check_hf_weights(folder, load_hf_config(folder)) == COMPARED[name]
