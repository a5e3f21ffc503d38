"""Binding the weight table to Megatron models: it agrees with what Megatron itself says about each parameter."""

from __future__ import annotations

import pytest
from helpers import LAYOUTS, as_parallel, layout_id

from megarl.bridge.buckets import BucketBuilder
from megarl.runtime.parallel import ParallelConfig as P
from megarl.testing.tiny_checkpoint import tiny_config


def table_agrees_with_megatron(name: str, layout) -> int:
    """Rank side: every parameter's TP split dim is Megatron's partition_dim, the layer ids the bridge reads from
    the modules are Megatron's own stage offsets, and expert ids are ep_rank * local experts + local id. Returns
    how many parameters were bound."""
    import re

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoConfig

    from megarl.bridge.mappings import VocabInfo, pad_vocab_size
    from megarl.bridge.model_bridge import chunk_layer_ids
    from megarl.models.builder import build_bridge, build_model
    from megarl.models.registry import get_architecture
    from megarl.runtime.distributed import init_model_parallel

    parallel = as_parallel(layout)
    init_model_parallel(parallel)
    raw = tiny_config(name)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    arch = get_architecture(config.model_type)
    vocab = VocabInfo(config.vocab_size, pad_vocab_size(config.vocab_size, 128, parallel.tp))
    chunks = build_model(arch, config, parallel, vocab)
    bridge = build_bridge(arch, config, chunks, vocab)
    for binding in bridge.bindings:  # (ModelBridge checks this too; here it must also have been set at all)
        param = binding.param
        if binding.mapping.tp_dim is not None:
            assert param.tensor_model_parallel and param.partition_dim == binding.mapping.tp_dim, binding.param_name
    local_experts = (arch.moe.num_experts(config) // parallel.ep) if arch.moe else 0
    for binding in (b for b in bridge.bindings if b.expert):
        local = int(re.search(r"local_experts\.(\d+)\.", binding.param_name).group(1))
        expected = ps.get_expert_model_parallel_rank() * local_experts + local
        assert all(f".experts.{expected}." in hf_name for hf_name in binding.hf_names), binding
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


@pytest.mark.parametrize("layout", [P(tp=2, ep=2), P(pp=2, ep=2), P(ep=4), P(tp=2, pp=2, ep=2, etp=1)], ids=layout_id)
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v3-lite"])
def test_moe_weight_table_agrees_with_megatron(ranks4, name, layout):
    counts = ranks4.run(table_agrees_with_megatron, name, layout)
    assert all(count > 0 for count in counts)


def test_skeletons_match_sequential_and_grouped_experts():
    from megarl.bridge.model_bridge import _skeleton, _template_regex

    template = "decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}"
    assert _skeleton(template) == _skeleton("decoder.layers.3.mlp.experts.linear_fc1.weight12")
    assert _skeleton("decoder.layers.0.mlp.linear_fc1.weight") != _skeleton("decoder.layers.0.mlp.linear_fc2.weight")
    match = _template_regex(template).fullmatch("decoder.layers.3.mlp.experts.linear_fc1.weight12")
    assert match.groupdict() == {"layer": "3", "expert": "12"}


def test_bucket_builder_bounds_buckets():
    import torch

    builder = BucketBuilder(max_bytes=100)
    sizes = [40, 40, 40, 200, 10, 10]  # bytes
    buckets = [b for i, n in enumerate(sizes) if (b := builder.add(f"t{i}", torch.zeros(n, dtype=torch.uint8)))]
    buckets.append(builder.flush())
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert builder.flush() is None


def test_travel_groups_keep_fused_tensors_in_one_bucket():
    import torch

    from megarl.bridge.buckets import travel_groups

    names = ["l0.q_a", "l0.other", "l0.kv_a", "l1.q_a", "l1.kv_a", "l2.kv_a"]  # l2 has no q_a: no group there
    together = travel_groups(names, [("q_a", "kv_a")])
    assert together["l0.q_a"] == frozenset({"l0.q_a", "l0.kv_a"}) and "l2.kv_a" not in together
    builder = BucketBuilder(max_bytes=10, together=together)
    buckets = [b for n in names if (b := builder.add(n, torch.zeros(10, dtype=torch.uint8)))]
    buckets.append(builder.flush())
    assert [[name for name, _ in b] for b in buckets] == [
        ["l0.q_a", "l0.other", "l0.kv_a"],  # no cut while l0's group is half-collected
        ["l1.q_a", "l1.kv_a"],
        ["l2.kv_a"],
    ]


def sliced_and_whole_loads(folder: str, layout) -> tuple[int, int, int]:
    """Rank side: load the HF checkpoint with sliced reads and again with whole tensors; every parameter must be
    bit-identical. Returns (bytes read sliced, bytes read whole, parameters compared)."""
    import torch

    from megarl.bridge import mappings
    from megarl.bridge.importer import load_hf_weights
    from megarl.bridge.safetensors_io import HFCheckpoint
    from megarl.checkpoint.model_io import load_model

    parallel = as_parallel(layout)
    from megarl.runtime.distributed import init_model_parallel

    init_model_parallel(parallel)
    model = load_model(folder, parallel, torch.float32)
    sliced = {b.param_name: b.param.detach().clone() for b in model.bridge.bindings}
    checkpoint = HFCheckpoint(folder)
    load_hf_weights(model.bridge, checkpoint)
    sliced_bytes = checkpoint.bytes_read
    whole_reads = HFCheckpoint(folder)
    original = {cls: cls.hf_slices for cls in (mappings.Mapping, mappings.QKV, mappings.GateUp)}
    try:
        for cls in original:
            cls.hf_slices = lambda self, *args: None
        load_hf_weights(model.bridge, whole_reads)
    finally:
        for cls, method in original.items():
            cls.hf_slices = method
    for binding in model.bridge.bindings:
        assert torch.equal(binding.param, sliced[binding.param_name]), binding.param_name
    return sliced_bytes, whole_reads.bytes_read, len(sliced)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama-bias", "tiny-qwen3-moe"])
def test_tensor_parallel_ranks_read_only_their_slices(ranks4, hf_checkpoint, name):
    layout = P(tp=2, ep=2) if "moe" in name else P(tp=2, pp=2)
    results = ranks4.run(sliced_and_whole_loads, str(hf_checkpoint(name)), layout)
    for sliced_bytes, whole_bytes, compared in results:
        assert compared > 0
        # everything split across TP but the vocabulary rows is read by halves (norms and embeddings whole)
        assert sliced_bytes < 0.8 * whole_bytes, (sliced_bytes, whole_bytes)
