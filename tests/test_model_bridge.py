"""Binding the weight table to Megatron models: it agrees with what Megatron itself says about each parameter."""

from __future__ import annotations

import pytest
from helpers import LAYOUTS, layout_id

from megarl.bridge.buckets import BucketBuilder
from megarl.testing.tiny_checkpoint import tiny_config


def table_agrees_with_megatron(name: str, layout: tuple[int, int, int]) -> int:
    """Rank side: every parameter's TP split dim is Megatron's partition_dim, and the layer ids the bridge reads
    from the modules are Megatron's own stage offsets. Returns how many parameters were bound."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoConfig

    from megarl.bridge.mappings import VocabInfo, pad_vocab_size
    from megarl.bridge.model_bridge import ModelBridge, chunk_layer_ids
    from megarl.models.builder import build_model
    from megarl.models.registry import get_architecture
    from megarl.runtime.distributed import init_model_parallel
    from megarl.runtime.parallel import ParallelConfig

    parallel = ParallelConfig(*layout)
    init_model_parallel(parallel)
    raw = tiny_config(name)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    arch = get_architecture(config.model_type)
    vocab = VocabInfo(config.vocab_size, pad_vocab_size(config.vocab_size, 128, parallel.tp))
    chunks = build_model(arch, config, parallel, vocab, meta=True)
    bridge = ModelBridge(arch.mappings(config), chunks, vocab)
    for binding in bridge.bindings:  # (ModelBridge checks this too; here it must also have been set at all)
        param = binding.param
        if binding.mapping.tp_dim is not None:
            assert param.tensor_model_parallel and param.partition_dim == binding.mapping.tp_dim, binding.param_name
    for vp_stage, chunk in enumerate(chunks):
        offset = get_transformer_layer_offset(chunk.config, vp_stage=vp_stage if parallel.vpp > 1 else None)
        ids = chunk_layer_ids(chunk)
        assert ids == list(range(offset, offset + len(ids)))
    return len(bridge.bindings)


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[3], LAYOUTS[5]], ids=layout_id)
@pytest.mark.parametrize("name", ["tiny-llama-bias", "tiny-qwen3"])
def test_weight_table_agrees_with_megatron(ranks4, name, layout):
    counts = ranks4.run(table_agrees_with_megatron, name, layout)
    assert all(count > 0 for count in counts)


def test_bucket_builder_bounds_buckets():
    import torch

    builder = BucketBuilder(max_bytes=100)
    sizes = [40, 40, 40, 200, 10, 10]  # bytes
    buckets = [b for i, n in enumerate(sizes) if (b := builder.add(f"t{i}", torch.zeros(n, dtype=torch.uint8)))]
    buckets.append(builder.flush())
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert builder.flush() is None
