"""Mixture-of-experts models (Mixtral, Qwen3-MoE, DeepSeek-V3 with MLA) through the bridge: the same logits and the
same expert choices as the HF model at every TP/PP/EP layout that fits four ranks, and exact exports."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_parts_rebuild,
    exported_weights_and_parts,
    hf_routing,
    layout_id,
    megatron_logits,
    megatron_routing,
    one_result,
)

from megarl.bridge.safetensors_io import HFCheckpoint
from megarl.runtime.parallel import ParallelConfig as P

MOE_ARCHITECTURES = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v3-lite"]
# (TP, PP, EP): EP=2 with TP=2 and PP=2 needs ETP=1 to fit four ranks (ETP x EP x PP = 4)
MOE_LAYOUTS = [P(), P(ep=2), P(tp=2, ep=2), P(pp=2, ep=2), P(tp=2, pp=2, ep=2, etp=1)]
# Families built from the same parts as the ones above (GLM-4.5: DeepSeek-V3's routing with grouped-query attention,
# partial RoPE, q/k/v biases and qk-norm; Kimi K2: DeepSeek-V3 under its own model_type): two layouts each.
NEWER_FAMILIES = ["tiny-glm4-moe", "tiny-kimi-k2"]


def cases(names: list[str], layouts: list) -> list:
    return [pytest.param(name, layout, id=f"{name}-{layout_id(layout)}") for name in names for layout in layouts]


@pytest.mark.parametrize(
    "name, layout",
    cases(MOE_ARCHITECTURES, MOE_LAYOUTS)
    + cases(NEWER_FAMILIES, [P(tp=2, ep=2), P(pp=2)])
    # gpt-oss: expert biases, which Megatron-Core splits only at etp=1
    + cases(["tiny-gpt-oss"], [P(tp=2, ep=2, etp=1), P(pp=2)]),
)
def test_moe_logits_match_hf(ranks4, hf_reference, name, layout):
    folder, ids, expected = hf_reference(name, batch=4)  # 192 tokens: every expert gets some
    logits = one_result(ranks4.run(megatron_logits, str(folder), layout, ids))
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", [P(), P(tp=2, pp=2, ep=2, etp=1)], ids=layout_id)
@pytest.mark.parametrize("name", [*MOE_ARCHITECTURES, "tiny-gpt-oss", "tiny-qwen3-next"])
def test_routing_chooses_the_same_experts(ranks4, hf_reference, name, layout):
    folder, ids, _ = hf_reference(name, batch=4)
    expected = hf_routing(folder, ids)
    results = [r for r in ranks4.run(megatron_routing, str(folder), layout, ids) if r is not None]
    routed = {layer: routing for stage in results for layer, routing in stage.items()}
    assert sorted(routed) == sorted(expected) and expected, "MoE layers differ"
    for layer, routing in expected.items():
        assert routing.any(dim=0).all(), f"layer {layer}: some expert got no token; use more tokens"
        mismatched = (routed[layer] != routing).any(dim=1).sum().item()
        assert mismatched == 0, f"layer {layer}: {mismatched} tokens routed to other experts than in HF"


@pytest.mark.parametrize("layout", [P(tp=2, ep=2), P(pp=2, ep=2), P(tp=2, pp=2, ep=2, etp=1), P(ep=4)], ids=layout_id)
@pytest.mark.parametrize("name", MOE_ARCHITECTURES)
def test_export_from_live_moe_model_sends_each_expert_once(ranks4, hf_checkpoint, name, layout):
    folder = hf_checkpoint(name, torch.bfloat16)
    results = ranks4.run(exported_weights_and_parts, str(folder), layout, 64 * 1024, "bfloat16")
    sent = [item for tensors, _, _ in results for item in tensors]
    names = [name for name, _ in sent]
    assert len(names) == len(set(names)), "a tensor was sent twice"
    original = HFCheckpoint(folder)
    assert set(names) == set(original.names)
    assert all(
        torch.equal(tensor, original.get(name)) and tensor.dtype == original.spec(name).dtype for name, tensor in sent
    )
    in_parts = assert_parts_rebuild([item for _, _, parts in results for item in parts], dict(sent))
    assert bool(in_parts) == (layout.tp > 1)
    assert any(".experts." in name for name in in_parts) == (layout.tp > 1 and layout.etp is None)  # etp unset: tp
