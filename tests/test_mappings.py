"""Mapping primitives on hand-made tensors: layouts, TP shards, vocabulary padding, invertibility."""

from __future__ import annotations

import pytest
import torch

from megarl.bridge.mappings import QKV, Direct, GateUp, VocabInfo, VocabRows, pad_vocab_size

VOCAB = VocabInfo(size=5, padded_size=8)


def test_qkv_interleaves_per_query_group():
    # 4 query heads in 2 groups, head_dim 1: Megatron wants [q0 q1 k0 v0 | q2 q3 k1 v1].
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    mapping = QKV("qkv", ("q", "k", "v"), num_heads=4, num_kv_heads=2, head_dim=1)
    full = mapping.hf_to_mcore([q, k, v], VOCAB)
    assert full.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    # TP=2 gives each rank one whole query group.
    assert mapping.shard(full, 1, 2).flatten().tolist() == [12, 13, 21, 31]
    back = mapping.mcore_to_hf(full, VOCAB)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_qkv_bias_and_multi_dim_heads():
    mapping = QKV("qkv", ("q", "k", "v"), num_heads=8, num_kv_heads=2, head_dim=3)
    q, k, v = torch.randn(24), torch.randn(6), torch.randn(6)
    full = mapping.hf_to_mcore([q, k, v], VOCAB)
    assert full.shape == (36,)
    # group 0 = q heads 0..3 (12 values), then k head 0 (3), then v head 0 (3)
    assert torch.equal(full[:12], q[:12]) and torch.equal(full[12:15], k[:3]) and torch.equal(full[15:18], v[:3])
    assert all(torch.equal(a, b) for a, b in zip(mapping.mcore_to_hf(full, VOCAB), [q, k, v]))


def test_gate_up_shards_hold_matching_halves():
    gate = torch.arange(4.0).reshape(4, 1)
    up = torch.arange(10.0, 14.0).reshape(4, 1)
    mapping = GateUp("fc1", ("gate", "up"))
    full = mapping.hf_to_mcore([gate, up], VOCAB)
    assert full.flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert mapping.shard(full, 0, 2).flatten().tolist() == [0, 1, 10, 11]
    assert mapping.shard(full, 1, 2).flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(mapping.unshard([mapping.shard(full, r, 2) for r in range(2)]), full)


def test_vocab_rows_pad_with_zeros_and_strip():
    weight = torch.randn(5, 3)
    mapping = VocabRows("embedding", ("embed",))
    full = mapping.hf_to_mcore([weight], VOCAB)
    assert full.shape == (8, 3) and torch.equal(full[:5], weight) and not full[5:].any()
    assert torch.equal(mapping.mcore_to_hf(full, VOCAB)[0], weight)
    with pytest.raises(ValueError, match="vocab_size is 5"):
        mapping.hf_to_mcore([torch.randn(6, 3)], VOCAB)


@pytest.mark.parametrize(
    ("vocab", "multiple", "tp", "expected"),
    [
        (1000, 128, 1, 1024),
        (1000, 128, 4, 1024),
        (1000, 128, 3, 1152),
        (151936, 128, 8, 152576),
        (32000, 128, 1, 32000),
    ],
)
def test_pad_vocab_size(vocab, multiple, tp, expected):
    assert pad_vocab_size(vocab, multiple, tp) == expected


MAPPINGS = [
    (Direct("w", ("w",), tp_dim=0), [torch.randn(8, 6)]),
    (Direct("w", ("w",), tp_dim=1), [torch.randn(6, 8)]),
    (Direct("w", ("w",)), [torch.randn(6)]),
    (VocabRows("e", ("e",)), [torch.randn(5, 4)]),
    (QKV("qkv", ("q", "k", "v"), num_heads=4, num_kv_heads=4, head_dim=2), [torch.randn(8, 3) for _ in range(3)]),
    (QKV("qkv", ("q", "k", "v"), num_heads=8, num_kv_heads=4, head_dim=2), [torch.randn(n, 3) for n in (16, 8, 8)]),
    (GateUp("fc1", ("g", "u")), [torch.randn(8, 3), torch.randn(8, 3)]),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("mapping", "hf"), MAPPINGS, ids=lambda x: type(x).__name__ if not isinstance(x, list) else "")
def test_every_mapping_round_trips_through_any_tp(mapping, hf, tp):
    full = mapping.hf_to_mcore(hf, VOCAB)
    shards = [mapping.shard(full, rank, tp) for rank in range(tp)]
    if mapping.tp_dim is not None:
        assert all(s.shape[mapping.tp_dim] * tp == full.shape[mapping.tp_dim] for s in shards)
    back = mapping.mcore_to_hf(mapping.unshard(shards), VOCAB)
    assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf))


def test_layer_templates_name_hf_tensors():
    mapping = Direct("decoder.layers.{layer}.x.weight", ("model.layers.{layer}.x.weight",))
    assert mapping.hf_names(layer=7) == ("model.layers.7.x.weight",)
    assert Direct("a.weight", ("b.weight",)).hf_names() == ("b.weight",)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(("mapping", "hf"), MAPPINGS, ids=lambda x: type(x).__name__ if not isinstance(x, list) else "")
def test_parts_cut_from_each_shard_rebuild_the_hf_tensors(mapping, hf, tp):
    """What each TP rank sends without a gather (`hf_parts`: q/k/v per query group, gate/up halves, vocabulary rows
    with the padding on the last ranks): written into their slices, the parts give the HF tensors bit for bit."""
    full = mapping.hf_to_mcore(hf, VOCAB)
    rebuilt = [torch.full_like(t, float("nan")) for t in hf]
    for rank in range(tp):
        parts = mapping.hf_parts(mapping.shard(full, rank, tp), rank, tp, VOCAB)
        if mapping.tp_dim is None:
            assert parts is None  # replicated: sent whole by the group's first rank
            return
        assert len(parts) in (0, len(hf))  # none: a rank holding vocabulary padding only
        for target, ((dim, start, stop), part) in zip(rebuilt, parts):
            target.narrow(dim, start, stop - start).copy_(part)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, hf))
