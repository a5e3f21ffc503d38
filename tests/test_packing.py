"""Sequence packing's bookkeeping (megarl/data/packing.py) and the CPU attention over packed rows."""

from __future__ import annotations

import pytest
import torch

from megarl.data.packing import pack_groups, pack_rows, packed_attention_index, positions_in_samples, unpacked_index


def test_pack_groups_fill_the_budget_in_order():
    assert pack_groups([5, 3, 4, 9, 2, 2], 10) == [[0, 1], [2], [3], [4, 5]]
    assert pack_groups([12, 1], 10) == [[0], [1]]  # a sample over the budget gets a row of its own
    with pytest.raises(ValueError):
        pack_groups([1], 0)


def test_pack_rows_lays_real_tokens_end_to_end():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    tensors = {"input_ids": ids, "response_mask": (ids > 6).float(), "scores": torch.tensor([1.0, 2.0])}
    packed = pack_rows(tensors, [3, 2])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["response_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 5]
    assert packed["scores"].tolist() == [1.0, 2.0]  # one value per row stays per row
    wide = pack_rows(tensors, [3, 2], width=8)  # fixed shapes: padding at the end, a sample of its own
    assert wide["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert wide["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert wide["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert pack_rows(tensors, [3, 2], multiple=4)["cu_seqlens"].tolist() == [0, 3, 5, 8]
    rows, columns = unpacked_index([7, 2], [3, 2])  # batch rows 7 and 2 packed in that order
    assert rows.tolist() == [7, 7, 7, 2, 2] and columns.tolist() == [0, 1, 2, 0, 1]
    padded = torch.zeros(8, 4)
    padded[rows, columns] = torch.arange(1.0, 9.0)[None][0, :5]
    assert padded[7].tolist() == [1, 2, 3, 0] and padded[2].tolist() == [4, 5, 0, 0]


def test_packed_attention_index_is_sample_by_sample():
    index, samples, longest = packed_attention_index(torch.tensor([0, 3, 5], dtype=torch.int32))
    assert (samples, longest) == (2, 3)
    assert index.tolist() == [0, 1, 2, 3, 4]
    index, _, _ = packed_attention_index(torch.tensor([0, 1, 4], dtype=torch.int32))
    assert index.tolist() == [0, 3, 4, 5]


def test_sdpa_attention_on_a_packed_row_equals_each_sample_alone():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.sdpa_attention import SDPACoreAttention

    class Config:
        context_parallel_size = 1
        attention_dropout = 0.0

    attention = SDPACoreAttention.__new__(SDPACoreAttention)
    torch.nn.Module.__init__(attention)
    attention.attn_mask_type, attention.softmax_scale, attention.dropout = AttnMaskType.causal, None, 0.0
    g = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [4, 1, 6], 4, 2, 8
    q, k, v = (torch.randn(sum(lengths), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    packed = attention(q, k, v, None, packed_seq_params=PackedSeqParams("thd", cu, cu, max_seqlen_q=6, max_seqlen_kv=6))
    assert packed.shape == (11, heads * dim)
    for start, length in zip(cu[:-1].tolist(), lengths):
        part = slice(start, start + length)
        alone = attention(q[part, None], k[part, None], v[part, None], None)  # [s, b=1, h, d] padded layout
        assert torch.allclose(packed[part], alone[:, 0], atol=1e-6)


def test_packed_rope_equals_megatrons_per_sample_loop():
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    from megarl.models import packed_rope

    class Group:  # context-parallel size 1
        def size(self):
            return 1

        def rank(self):
            return 0

    packed_rope.install()
    original, vectorized = packed_rope.megatron_thd, rope_utils._apply_rotary_pos_emb_thd
    assert vectorized is not original
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert positions_in_samples(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    g = torch.Generator().manual_seed(0)
    t = torch.randn(9, 2, 8, generator=g)
    freqs = torch.randn(5, 1, 1, 8, generator=g)
    for interleaved in (False, True):
        ours = vectorized(t, cu, freqs, rotary_interleaved=interleaved, cp_group=Group())
        theirs = original(t, cu, freqs, rotary_interleaved=interleaved, cp_group=Group())
        assert torch.equal(ours, theirs)


def test_packing_is_kept_for_batches_where_padding_would_cost():
    from megarl.data.batch import Batch
    from megarl.workers.schedule import packing_pays

    def batch(lengths: list[int]) -> Batch:
        mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
        return Batch({"input_ids": mask.clone(), "attention_mask": mask})

    # padding share = 1 - real tokens / (rows x longest row)
    assert not packing_pays(batch([14, 15, 15, 15]), 0.1)  # 1/60 of padding: packing would save nothing
    assert packing_pays(batch([14, 15, 15, 15]), 0.0)  # 0: always
    assert packing_pays(batch([4, 15, 6, 5]), 0.1)  # RL's ragged rows: half the tokens would be padding
    assert packing_pays(batch([9, 10]), 0.05) and not packing_pays(batch([9, 10]), 0.06)  # exactly 1/20
