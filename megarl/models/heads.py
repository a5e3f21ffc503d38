"""Output heads of a role's model: the language-model head (vocab-parallel logits) or a scalar value head.

A critic and a reward model are the same decoder with one number per position instead of logits. The value head
replaces Megatron's output layer on the last pipeline stage; it is small and replicated across tensor-parallel
ranks (every TP rank computes the same values from the same final hidden states, so no gradient all-reduce is
needed). In HF checkpoints it is `score.weight` [1, hidden], as `*ForSequenceClassification` models save it.
"""

from __future__ import annotations

from typing import Literal

import torch

from megarl.bridge.mappings import Direct, Mapping

Head = Literal["lm", "value"]
HEADS: tuple[str, ...] = ("lm", "value")

VALUE_HEAD_HF_NAME = "score.weight"
VALUE_HEAD_SEED = 20250101


class ValueHead(torch.nn.Module):
    """hidden [seq, batch, hidden] -> values [seq, batch, 1], called like Megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float, sequence_parallel: bool):
        super().__init__()
        # Every rank must start from the same head (it is replicated and nothing broadcasts it): draw it from a
        # generator of its own, not from a global stream that other layers consumed differently per rank.
        if torch.empty(0).device.type == "meta":  # built for shapes only (conversion planning)
            weight = torch.empty(1, hidden_size)
        else:
            generator = torch.Generator().manual_seed(VALUE_HEAD_SEED)
            weight = torch.randn(1, hidden_size, generator=generator, device="cpu") * init_std
        if weight.device.type != "meta":
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            weight = weight.to(device=device)
        self.weight = torch.nn.Parameter(weight.to(dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # The head's computation is repeated on every TP rank: the backward keeps this rank's slice, no sum.
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def attach_value_head(chunk: torch.nn.Module) -> None:
    """Replace the last pipeline stage's output layer with a value head (no-op on other stages)."""
    if not getattr(chunk, "post_process", False):
        return
    config = chunk.config
    chunk.output_layer = ValueHead(
        config.hidden_size, config.params_dtype, config.init_method_std, config.sequence_parallel
    )


def head_mappings(lm_mapping: Mapping, head: Head) -> list[Mapping]:
    """The output-layer row of the weight table for a head."""
    if head == "lm":
        return [lm_mapping]
    return [Direct("output_layer.weight", (VALUE_HEAD_HF_NAME,))]
