"""Per-token log-probs and entropy of a policy pass, from the whole micro-batch's logits or over token chunks.

Unchunked (`micro_batch.logprob_chunk_tokens = 0`), the model's last stage returns the logits of the whole
micro-batch, [tokens x vocab / tp]: at 32k tokens and a 152k vocabulary that is 20 GB in fp32, and the log-softmax,
its gradient and the entropy each take as much again. Chunked, the last stage's output layer returns the final
hidden states instead (entering the tensor-parallel region as Megatron's column-parallel layer does: a gradient
all-reduce at TP > 1, a sequence gather with sequence parallelism), and the LM head projection, the log-softmax,
the gather of the target token and the entropy run on `chunk_tokens` tokens at a time. The update's backward
recomputes each chunk's logits (torch.utils.checkpoint per chunk), so only one chunk's [chunk x vocab / tp]
tensors exist at any time. At TP > 1 each chunk reduces its max and sum-exp over the TP group (Megatron's
vocab-parallel cross entropy and workers/token_stats.py's entropy), so the numbers equal the unchunked ones to float
rounding (docs/long_context.md). With context parallelism both paths compute on this CP rank's tokens, with targets
rolled on the whole sequence, and gather the per-token values (megarl/models/context_parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from megarl.bridge.mappings import VocabInfo
from megarl.models.context_parallel import ContextSplit, context_split
from megarl.workers.token_stats import (
    align_to_tokens,
    position_entropy,
    position_logprobs,
    position_sum_pi_squared,
    prepare_logits,
)

Entropy = Literal["off", "grad", "metric"]
"""off: no entropy; grad: the entropy with its gradient (a loss term); metric: its value only (no gradient)."""


@dataclass
class TokenStats:
    """Per-token values [B, S] aligned with input_ids (workers/token_stats.py)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


def logits_token_stats(
    logits_BSV: torch.Tensor,
    ids_BS: torch.Tensor,
    position_ids_BS: torch.Tensor | None,
    vocab: VocabInfo,
    temperature: float,
    entropy: Entropy = "off",
    sum_pi_squared: bool = False,
    split: ContextSplit | None = None,
) -> TokenStats:
    """Token stats from the logits of a whole micro-batch (this TP rank's vocabulary slice). split: with context
    parallelism, the logits are this CP rank's tokens and the stats are gathered (megarl/models/context_parallel.py)."""
    targets = _targets(ids_BS, split)
    values = _position_stats(prepare_logits(logits_BSV, vocab, temperature), targets, entropy, sum_pi_squared)
    return _aligned(_gathered(values, split), entropy, sum_pi_squared, position_ids_BS)


def chunked_token_stats(
    hidden_BSH: torch.Tensor,
    weight_VH: torch.Tensor,
    ids_BS: torch.Tensor,
    position_ids_BS: torch.Tensor | None,
    vocab: VocabInfo,
    temperature: float,
    chunk_tokens: int,
    entropy: Entropy = "off",
    sum_pi_squared: bool = False,
    split: ContextSplit | None = None,
) -> TokenStats:
    """Token stats from the final hidden states (already in the tensor-parallel region, see `hidden_states_out`)
    and the LM head's weight slice [vocab / tp, hidden], `chunk_tokens` tokens at a time (the last chunk may be
    shorter). With autograd on, each chunk is recomputed in the backward instead of keeping its logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    batch, seq, hidden_size = hidden_BSH.shape
    hidden_NH = hidden_BSH.reshape(batch * seq, hidden_size)
    targets_N = _targets(ids_BS, split).reshape(-1)
    recompute = torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad)
    stats = functools.partial(
        _chunk_stats, vocab=vocab, temperature=temperature, entropy=entropy, sum_pi_squared=sum_pi_squared
    )
    parts = []
    for start in range(0, batch * seq, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if recompute:
            # nothing random in the head: no RNG state to stash and restore per chunk
            chunk = (hidden_NH[rows], weight_VH, targets_N[rows])
            parts.append(checkpoint(stats, *chunk, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(stats(hidden_NH[rows], weight_VH, targets_N[rows]))
    values = [torch.cat(column).view(batch, seq) for column in zip(*parts)]
    return _aligned(_gathered(values, split), entropy, sum_pi_squared, position_ids_BS)


def _chunk_stats(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    vocab: VocabInfo,
    temperature: float,
    entropy: Entropy,
    sum_pi_squared: bool,
) -> tuple[torch.Tensor, ...]:
    logits_1NV = torch.nn.functional.linear(hidden_NH.to(weight_VH.dtype), weight_VH)[None]
    logits_1NV = prepare_logits(logits_1NV, vocab, temperature)
    return tuple(v[0] for v in _position_stats(logits_1NV, targets_N[None], entropy, sum_pi_squared))


def _position_stats(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, entropy: Entropy, sum_pi_squared: bool
) -> list[torch.Tensor]:
    """[logprobs, entropy?, sum_pi_squared?] per position, not aligned."""
    values = [position_logprobs(logits_BSV, targets_BS)]
    if entropy != "off":
        values.append(position_entropy(logits_BSV if entropy == "grad" else logits_BSV.detach()))
    if sum_pi_squared:
        values.append(position_sum_pi_squared(logits_BSV))
    return values


def _aligned(
    values: list[torch.Tensor], entropy: Entropy, sum_pi_squared: bool, position_ids_BS: torch.Tensor | None
) -> TokenStats:
    aligned = iter([align_to_tokens(v, position_ids_BS) for v in values])
    logprobs = next(aligned)
    return TokenStats(logprobs, next(aligned) if entropy != "off" else None, next(aligned) if sum_pi_squared else None)


def _targets(ids_BS: torch.Tensor, split: ContextSplit | None = None) -> torch.Tensor:
    """The next token of every position; with context parallelism rolled on the whole sequence, then this CP rank's
    share (a target at a chunk boundary is the first token of the next chunk, which another rank may hold)."""
    targets = torch.roll(ids_BS, shifts=-1, dims=1)  # logits at t predict t + 1
    return targets if split is None else split.local_tokens(targets)


def _gathered(values: list[torch.Tensor], split: ContextSplit | None) -> list[torch.Tensor]:
    """Per-position values of this CP rank's tokens -> every token's, in the micro-batch's layout."""
    return values if split is None else [split.gather_tokens(v) for v in values]


class PolicyHead:
    """How a policy pass (log-probs or an update) turns the last stage's output into token stats: the logits as
    the model returns them (chunk_tokens = 0), or the final hidden states projected a chunk at a time (the model's
    output layers return hidden states while `active` is entered)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], vocab: VocabInfo, temperature: float, chunk_tokens: int):
        self.chunks, self.vocab, self.temperature, self.chunk_tokens = chunks, vocab, temperature, chunk_tokens
        self.weight: torch.Tensor | None = None

    @contextmanager
    def active(self) -> Iterator[PolicyHead]:
        if not self.chunk_tokens:
            yield self
            return
        with hidden_states_out(self.chunks, self._record_weight):
            yield self

    def _record_weight(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def token_stats(
        self,
        output: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        entropy: Entropy = "off",
        sum_pi_squared: bool = False,
    ) -> TokenStats:
        """`output`: the last stage's output for micro-batch `tensors` (logits, or hidden states when chunked)."""
        ids, positions = tensors["input_ids"], tensors.get("position_ids")  # position_ids: packed rows
        split = context_split(tensors)
        if not self.chunk_tokens:
            return logits_token_stats(
                output, ids, positions, self.vocab, self.temperature, entropy, sum_pi_squared, split
            )
        assert self.weight is not None, "the output layer did not run: is this the last pipeline stage?"
        return chunked_token_stats(
            output,
            self.weight,
            ids,
            positions,
            self.vocab,
            self.temperature,
            self.chunk_tokens,
            entropy,
            sum_pi_squared,
            split,
        )


@contextmanager
def hidden_states_out(chunks: Sequence[torch.nn.Module], record_weight) -> Iterator[None]:
    """While entered, the output layer of every last-stage chunk (bare Megatron GPT models) returns its input as it
    would multiply it (in the tensor-parallel region) instead of logits, and hands `record_weight` the weight it
    would multiply by (its own, or the embedding's when they are tied)."""
    last = [chunk for chunk in chunks if getattr(chunk, "post_process", False)]
    if any(getattr(chunk.config, "mtp_num_layers", None) for chunk in last):
        raise ValueError("chunked log-probs do not support multi-token prediction layers (mtp_num_layers)")
    layers = [chunk.output_layer for chunk in last]
    for layer in layers:
        layer.forward = functools.partial(_hidden_states_forward, layer, record_weight)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again


def _hidden_states_forward(layer, record_weight, input_SBH, weight=None, runtime_gather_output=None):
    """A column-parallel layer's entry into the tensor-parallel region, without its matrix multiply."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    record_weight(weight if weight is not None else layer.weight)
    if getattr(layer, "sequence_parallel", False):
        # each TP rank holds a slice of the sequence: gather it; the backward sums and scatters the input gradient
        return gather_from_sequence_parallel_region(input_SBH), None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        # each TP rank's vocabulary slice gives a part of the input gradient: the backward all-reduces them
        return copy_to_tensor_model_parallel_region(input_SBH), None
    return input_SBH, None
