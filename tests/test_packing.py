"""Sequence packing's bookkeeping (megarl/data/packing.py) and the CPU attention over packed rows."""

from __future__ import annotations

import pytest
import torch

from megarl.data.packing import (
    pack_groups,
    pack_rows,
    packed_attention_index,
    positions_in_samples,
    shared_prompt_lengths,
    unpacked_index,
)


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
    rows, columns, source = unpacked_index([7, 2], [3, 2])  # batch rows 7 and 2 packed in that order
    assert rows.tolist() == [7, 7, 7, 2, 2] and columns.tolist() == [0, 1, 2, 0, 1]
    padded = torch.zeros(8, 4)
    padded[rows, columns] = torch.arange(1.0, 9.0)[source]
    assert padded[7].tolist() == [1, 2, 3, 0] and padded[2].tolist() == [4, 5, 0, 0]


def test_rows_with_the_prompt_of_the_row_before_lay_it_once():
    """GRPO's samples of a prompt: the second and third row take all but the last prompt token from the first;
    the fourth row's prompt begins with the same two tokens only, so it starts a group of its own (its samples
    would share its whole prompt); unpacking gives every row all its columns back."""
    ids = torch.tensor(
        [
            [1, 2, 3, 4, 10, 11, 0],
            [1, 2, 3, 4, 12, 0, 0],
            [1, 2, 3, 4, 13, 14, 15],
            [1, 2, 9, 16, 17, 0, 0],
        ]
    )
    lengths = [6, 5, 7, 5]
    response = torch.zeros_like(ids, dtype=torch.float)
    for row, (start, length) in enumerate(zip([4, 4, 4, 3], lengths)):
        response[row, start:length] = 1
    shared = shared_prompt_lengths(ids, lengths, response)
    assert shared == [0, 3, 3, 0]  # 4 prompt tokens in common: 3 shared, the last laid again; row 3: a new group
    assert shared_prompt_lengths(ids[[0, 3]], [6, 5], response[[0, 3]]) == [0, 1]  # a common template: shared
    assert shared_prompt_lengths(ids[[3, 0]] * torch.tensor([[1], [2]]), [5, 6], response[[3, 0]]) == [0, 0]
    packed = pack_rows({"input_ids": ids, "response_mask": response}, lengths, shared=shared)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 10, 11, 4, 12, 4, 13, 14, 15, 1, 2, 9, 16, 17]]
    assert packed["cu_seqlens"].tolist() == [0, 6, 8, 12, 17]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4]]
    assert packed["segment_shared"].tolist() == [0, 3, 3, 0] and packed["segment_root"].tolist() == [0, 0, 0, 3]
    # rows after a root that shares only a template with its predecessor: the template chain goes on
    template = torch.tensor([[7, 8, 1, 5], [7, 8, 2, 5], [7, 8, 3, 5]])
    mask = torch.tensor([[0, 0, 0, 1]] * 3).float()
    assert shared_prompt_lengths(template, [4, 4, 4], mask) == [0, 1, 1]
    rows, columns, source = unpacked_index([0, 1, 2, 3], lengths, shared)
    padded = torch.zeros_like(ids)
    padded[rows, columns] = packed["input_ids"][0, source]
    assert torch.equal(padded, ids)  # every column of every row, from its own segment or its root's


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
    attention.window, attention.softmax_offset = None, None  # no sliding window, no sinks
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


def test_sdpa_attention_over_shared_prompts_equals_each_sample_alone():
    """Samples 1 and 2 take their first 3 tokens from sample 0 (a root), sample 3 is a root of its own: each laid
    token's output is the one its whole sample gives alone (queries, keys and values of the shared tokens are the
    root's: the same tokens at the same positions)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.data.packing import SharedPrefix
    from megarl.models.sdpa_attention import SDPACoreAttention

    attention = SDPACoreAttention.__new__(SDPACoreAttention)
    torch.nn.Module.__init__(attention)
    attention.attn_mask_type, attention.softmax_scale, attention.dropout = AttnMaskType.causal, None, 0.0
    attention.window, attention.softmax_offset = None, None  # no sliding window, no sinks
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    full_lengths, shared = [6, 5, 7, 3], [0, 3, 3, 0]
    wholes = [[torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads)] for n in full_lengths]
    for whole in wholes[1:3]:  # the shared tokens are the root's
        for mine, root in zip(whole, wholes[0]):
            mine[:3] = root[:3]
    laid = [[t[k:] for t in whole] for whole, k in zip(wholes, shared)]
    q, k, v = (torch.cat([sample[i] for sample in laid]) for i in range(3))
    sizes = [n - k for n, k in zip(full_lengths, shared)]
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams("thd", cu, cu, max_seqlen_q=7, max_seqlen_kv=7)
    params.shared_prefix = SharedPrefix(torch.tensor(shared), torch.tensor([0, 0, 0, 3]))
    packed = attention(q, k, v, None, packed_seq_params=params)
    for start, size, k_, whole in zip(cu[:-1].tolist(), sizes, shared, wholes):
        alone = attention(*(t[:, None] for t in whole), None)[:, 0]  # the whole sample, padded layout
        assert torch.allclose(packed[start : start + size], alone[k_:], atol=1e-6)


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
    # GRPO rows of one length whose prompts repeat: packing lays each prompt once, so it pays with sharing
    grpo = batch([15, 15, 15, 15])
    grpo.tensors["response_mask"] = (torch.arange(15) >= 7).float().expand(4, 15)
    assert not packing_pays(grpo, 0.1) and not packing_pays(grpo, 0.1, share_prompts=False)
    assert packing_pays(grpo, 0.1, share_prompts=True)  # 3 x 6 of 60 tokens not laid again: 30%
