"""Megatron's parallel linear layers through `F.linear` where no tensor-parallel communication is asked of them.

Megatron-Core's ColumnParallelLinear and RowParallelLinear run every matrix multiply through a custom autograd
function (`LinearWithGradAccumulationAndAsyncCommunication`, or `LinearWithFrozenWeight` for frozen weights) whose
backward is Python: it exists to overlap the all-reduce of the input gradient (column-parallel at TP > 1), to
gather sequence-parallel inputs, and to accumulate weight gradients straight into `main_grad` with APEX's fused
kernel. When a call needs none of these (TP = 1, row-parallel layers at any TP, experts, no fused accumulation),
the function computes exactly `input @ weight.T + bias` and lets autograd return the weight gradient to Megatron
DDP's hook, which is what `F.linear` does without the Python backward: 17 such backwards per update of the
quickstart-size model cost 4.5 ms of an 80-97 ms update on CPU (A/B-measured, tools/bench/vs_trl.py's model).
Any call that needs communication or fusion goes to Megatron's own function.

Around them, the layers enter and leave the tensor-parallel region (`copy_to_...` before a column-parallel layer,
`reduce_from_...` after a row-parallel one and the vocab-parallel embedding): custom autograd functions that are
the identity over a group of one rank. There they return the input itself (18 autograd nodes fewer per forward
and backward at the quickstart size: 2.9 ms of a 79 ms update, A/B-measured).
"""

from __future__ import annotations

import torch.nn.functional as F

_installed = False


def install() -> None:
    """Route the layers' `_forward_impl` through `F.linear` when nothing else is asked of it (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.tensor_parallel import layers

    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        cls._forward_impl = _plain_when_possible(cls._forward_impl)
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        setattr(layers, name, _identity_over_one_rank(getattr(layers, name)))
    _installed = True


def _plain_when_possible(megatron_impl):
    def forward_impl(self, input, weight, *args, **kwargs):
        # Megatron passes everything but input and weight by keyword (the two functions order them differently)
        needs_megatron = args or any(
            kwargs.get(name) for name in ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel")
        )
        if needs_megatron or kwargs.get("grad_output_buffer") is not None:
            return megatron_impl(self, input, weight, *args, **kwargs)
        return F.linear(input, weight, kwargs.get("bias"))

    return forward_impl


def _identity_over_one_rank(region):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    def enter_or_leave(input_, group=None, *args, **kwargs):
        resolved = group if group is not None else get_tensor_model_parallel_group_if_none(None)
        if resolved is not None and resolved.size() == 1:
            return input_
        return region(input_, group, *args, **kwargs)

    return enter_or_leave
