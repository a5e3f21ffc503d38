"""megarl's replacements of Megatron-Core functions on hot paths (megarl/models/packed_rope.py, plain_linear.py):
each gives Megatron's numbers and hands every case it does not cover to Megatron's own function."""

from __future__ import annotations

import torch


def test_rope_on_padded_rows_equals_megatrons_bit_for_bit_and_caches_per_frequency_tensor():
    """The roll with a signed sine is Megatron's chunk-neg-cat rotation exactly; cosines and sines are reused only
    for the very same frequency tensor, and one made under inference mode is never saved for a backward."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    from megarl.models import packed_rope

    packed_rope.install()
    ours, theirs = rope_utils._apply_rotary_pos_emb_bshd, packed_rope.megatron_bshd
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 4, 8, generator=g)
    first, second = torch.randn(6, 1, 1, 8, generator=g), torch.randn(6, 1, 1, 8, generator=g)
    for interleaved in (False, True):
        for freqs in (first, second, first):  # a new tensor is a new entry, never the last one's numbers
            assert torch.equal(ours(t, freqs, interleaved), theirs(t, freqs, interleaved))
    with torch.inference_mode():
        ours(t, first)
    leaf = t.clone().requires_grad_()
    ours(leaf, first).sum().backward()  # would raise if the inference-mode cosines were reused
    assert leaf.grad is not None and leaf.grad.shape == t.shape


def test_parallel_linear_layers_use_f_linear_only_when_no_communication_is_asked():
    """megarl/models/plain_linear.py: TP = 1, row-parallel and expert layers go through F.linear (no Python
    backward); a call that needs the input-gradient all-reduce, sequence parallelism or fused accumulation goes
    to Megatron's function with its arguments untouched."""
    from megarl.models.plain_linear import _plain_when_possible

    calls = []

    def megatron(self, input, weight, *args, **kwargs):
        calls.append(kwargs)
        return "megatron"

    forward_impl = _plain_when_possible(megatron)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 1, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(4, generator=g)
    plain = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)
    out = forward_impl(None, x, w, bias=b, grad_output_buffer=None, tp_group=None, **plain)
    assert torch.allclose(out, x @ w.T + b) and calls == []
    for name, value in [
        ("allreduce_dgrad", True),
        ("sequence_parallel", True),
        ("gradient_accumulation_fusion", True),
        ("grad_output_buffer", []),
    ]:
        kwargs = plain | {"grad_output_buffer": None, name: value}
        assert forward_impl(None, x, w, bias=b, **kwargs) == "megatron"
        assert calls[-1] == kwargs | {"bias": b}


def test_tensor_parallel_regions_are_the_input_itself_over_one_rank():
    from megarl.models.plain_linear import _identity_over_one_rank

    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

    calls = []
    region = _identity_over_one_rank(lambda input_, group: calls.append(group) or "megatron")
    x = torch.ones(2)
    assert region(x, Group(1)) is x and calls == []
    two = Group(2)
    assert region(x, two) == "megatron" and calls == [two]


def test_rope_positions_of_shared_prompt_samples_continue_after_the_shared_tokens():
    from megarl.data.packing import SharedPrefix
    from megarl.models.packed_rope import rope_positions

    cu = torch.tensor([0, 6, 8, 12], dtype=torch.int32)
    assert rope_positions(cu, 12).tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3]
    cu.shared_prefix = SharedPrefix(torch.tensor([0, 3, 3]), torch.tensor([0, 0, 0]))
    assert rope_positions(cu, 12).tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 3, 4, 5, 6]
