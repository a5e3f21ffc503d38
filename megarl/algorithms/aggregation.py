"""Loss aggregation as per-token weights: loss = sum(weights_BS * per_token_loss_BS).

The controller computes the weights once per mini-batch (all of it, before the split across data-parallel ranks and
micro-batches); workers only sum. Since the denominators are those of the whole mini-batch, summing the weighted
losses of any split gives the mini-batch aggregate, and gradients summed over micro-batches and ranks are exact.

Sequences with no response tokens get weight 0 and are not counted in num_seqs (they would otherwise dilute the
mean); all-zero masks give all-zero weights, never NaN.

Shapes: B samples, S token positions; mask and weights are [B, S].
"""

from __future__ import annotations

import torch

from megarl.algorithms.registry import AGGREGATIONS


def _num_seqs(mask_BS: torch.Tensor) -> torch.Tensor:
    """Sequences with at least one response token (at least 1, so that an empty batch divides safely)."""
    return (mask_BS.sum(dim=1) > 0).sum().clamp(min=1).to(mask_BS.dtype)


@AGGREGATIONS.register("token-mean")
def token_mean(mask_BS: torch.Tensor, norm_len: int | None = None) -> torch.Tensor:
    """mask / (response tokens in the mini-batch): every token counts the same (DAPO); long sequences weigh more."""
    return mask_BS / mask_BS.sum().clamp(min=1)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(mask_BS: torch.Tensor, norm_len: int | None = None) -> torch.Tensor:
    """mask / num_seqs: the sum over each sequence's tokens, averaged over sequences (no length normalization)."""
    return mask_BS / _num_seqs(mask_BS)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask_BS: torch.Tensor, norm_len: int | None = None) -> torch.Tensor:
    """mask / (len_i * num_seqs): the mean over each sequence's tokens, averaged over sequences (original GRPO);
    a token of a short sequence weighs more than one of a long sequence."""
    lengths_B1 = mask_BS.sum(dim=1, keepdim=True).clamp(min=1)
    return mask_BS / (lengths_B1 * _num_seqs(mask_BS))


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(mask_BS: torch.Tensor, norm_len: int | None = None) -> torch.Tensor:
    """mask / (num_seqs * norm_len) with a constant norm_len (Dr.GRPO: the generation budget): every token counts
    the same whatever its sequence's length, and the scale does not depend on the lengths in this mini-batch."""
    if norm_len is None or norm_len < 1:
        raise ValueError(f"aggregation 'seq-mean-token-sum-norm' needs a constant norm_len >= 1, got {norm_len}")
    return mask_BS / (_num_seqs(mask_BS) * norm_len)


def loss_weights(
    mode: str, response_mask_BS: torch.Tensor, norm_len: int | None = None, key: str = "aggregation"
) -> torch.Tensor:
    """Per-token weights of aggregation `mode` over a whole mini-batch, float32 (or float64 for a float64 mask)."""
    dtype = torch.float64 if response_mask_BS.dtype == torch.float64 else torch.float32
    return AGGREGATIONS.get(mode, key)(response_mask_BS.to(dtype), norm_len)
