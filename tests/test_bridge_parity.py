"""Megatron-Core models built through the bridge are the HF models: same logits at every parallel layout, and
an export from the live sharded model gives back exactly the HF checkpoint's tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYOUTS, assert_parts_rebuild, exported_weights_and_parts, layout_id, megatron_logits, one_result

from megarl.bridge.safetensors_io import HFCheckpoint

ARCHITECTURES = ["tiny-llama", "tiny-llama-bias", "tiny-qwen2", "tiny-qwen3"]
BUCKET_BYTES = 64 * 1024


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_megatron_logits_match_hf(ranks4, hf_reference, name, layout):
    folder, ids, expected = hf_reference(name)
    logits = one_result(ranks4.run(megatron_logits, str(folder), layout, ids))
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    ("layout", "model_dtype"),
    [((1, 1, 1), "bfloat16"), ((2, 2, 1), "bfloat16"), ((2, 2, 2), "float32"), ((2, 1, 1), "float32")],
    ids=["tp1-pp1-bf16", "tp2-pp2-bf16", "tp2-pp2-vpp2-fp32", "tp2-pp1-fp32"],
)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_export_from_live_model_reproduces_checkpoint(ranks4, hf_checkpoint, name, layout, model_dtype):
    """The export, gathered to one sender per TP group or in parts from every TP rank, gives back the checkpoint's
    tensors bit for bit."""
    folder = hf_checkpoint(name, torch.bfloat16, max_shard_size="100KB")
    results = ranks4.run(exported_weights_and_parts, str(folder), layout, BUCKET_BYTES, model_dtype)

    sent = [item for tensors, _, _ in results for item in tensors]
    names = [name for name, _ in sent]
    assert len(names) == len(set(names)), "a tensor was sent twice"
    original = HFCheckpoint(folder)
    assert set(names) == set(original.names)
    for name, tensor in sent:
        expected = original.get(name)
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(tensor, expected), name
    for _, bucket_sizes, _ in results:
        for sizes in bucket_sizes:
            assert sum(sizes) <= BUCKET_BYTES or len(sizes) == 1
    # into an engine that takes parts, each TP rank sends its own (q/k/v, gate/up, uneven vocabulary rows)
    in_parts = assert_parts_rebuild([item for _, _, parts in results for item in parts], dict(sent))
    assert bool(in_parts) == (layout[0] > 1)
